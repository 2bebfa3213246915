//! Strided entries through the seam: a rank engine hands an engine that declares `SeamLimits::strided` the plan's
//! descriptors as repeated entries (one per strided run, `fabric::seam::Repeat`), and the bytes land exactly as the
//! per-row entries' do. Checked on every machine with an engine that takes strided entries and lowers them to
//! their elements on the in-memory fabric (the `cuda` fabric executes them natively: `tests/it/device.rs`).

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use kvrelay::certify::{Identity, Transport, TransportError};
use kvrelay::fabric::seam::{
    Batch, BatchId, Cancelled, ConnId, Entry, Event, Fill, Image, Kept, Memory, MemoryKind, NodeId, PageTable, Paging,
    Pattern, PeerAddress, RemoteMemory, Repeat, SeamError, SeamErrorKind, SeamLimits, TransferEngine,
};
use kvrelay::fabric::verbs::Caps;
use kvrelay::harness::{self, Budget, Fabric};
use rstest::rstest;

/// An engine that takes strided and paged entries and submits their elements, at physical offsets, to the engine
/// below; counts the repeated and the paged entries it was handed, so a test can tell they really came.
struct Expanding {
    inner: Box<dyn TransferEngine>,
    repeated: Rc<Cell<u64>>,
    paged: Rc<Cell<u64>>,
}

impl TransferEngine for Expanding {
    fn node(&self) -> NodeId {
        self.inner.node()
    }
    fn limits(&self) -> SeamLimits {
        SeamLimits { strided: true, paged: true, ..self.inner.limits() }
    }
    fn register(&mut self, kind: MemoryKind, len: u64, item_len: u64, fill: Fill) -> Result<Memory, SeamError> {
        self.inner.register(kind, len, item_len, fill)
    }
    fn register_pattern(
        &mut self,
        kind: MemoryKind,
        len: u64,
        item: u64,
        pattern: Pattern,
    ) -> Result<Memory, SeamError> {
        self.inner.register_pattern(kind, len, item, pattern)
    }
    fn memory_kind(&self) -> MemoryKind {
        self.inner.memory_kind()
    }
    fn resident(&mut self, memory: &Memory) -> Option<Kept> {
        self.inner.resident(memory)
    }
    fn read(&self, memory: &Memory, offset: u64, out: &mut [u8]) -> Result<(), SeamError> {
        self.inner.read(memory, offset, out)
    }
    fn release(&mut self, memory: &Memory, sparse: bool) -> Result<Image, SeamError> {
        self.inner.release(memory, sparse)
    }
    fn open(&mut self) -> Result<(ConnId, PeerAddress), SeamError> {
        self.inner.open()
    }
    fn connect(&mut self, conn: ConnId, peer: &PeerAddress, remote: &[RemoteMemory]) -> Result<(), SeamError> {
        self.inner.connect(conn, peer, remote)
    }
    fn submit(&mut self, conn: ConnId, batch: Batch) -> Result<BatchId, SeamError> {
        SeamError::check_limits(&batch, self.limits())?;
        let repeated = batch.entries.iter().filter(|entry| entry.repeat.count > 1).count() as u64;
        self.repeated.set(self.repeated.get() + repeated);
        let paged = batch.entries.iter().filter(|entry| entry.paging != Paging::NONE).count() as u64;
        self.paged.set(self.paged.get() + paged);
        let entries = batch.physical_elements().ok_or(SeamError::Exhausted("page table entries"))?;
        self.inner.submit(conn, Batch { entries, notify: batch.notify, tables: Vec::new() })
    }
    fn flush(&mut self) {
        self.inner.flush();
    }
    fn cancel(&mut self, batch: BatchId) -> Cancelled {
        self.inner.cancel(batch)
    }
    fn poll(&mut self, out: &mut Vec<Event>, max: usize) -> usize {
        self.inner.poll(out, max)
    }
    fn wait(&mut self, timeout: Duration) -> bool {
        self.inner.wait(timeout)
    }
}

/// The in-memory fabric (live driver) with every engine wrapped in [`Expanding`].
struct StridedTransport {
    inner: Box<dyn Transport>,
    repeated: Rc<Cell<u64>>,
    paged: Rc<Cell<u64>>,
}

impl Transport for StridedTransport {
    fn identity(&self) -> Identity {
        self.inner.identity()
    }
    fn verbs(&self) -> bool {
        false
    }
    fn engine(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn TransferEngine>, TransportError> {
        let inner = self.inner.engine(node, caps)?;
        Ok(Box::new(Expanding { inner, repeated: self.repeated.clone(), paged: self.paged.clone() }))
    }
    fn step(&mut self) {
        self.inner.step();
    }
    fn settle(&mut self) {
        self.inner.settle();
    }
    fn reset(&mut self) {
        self.inner.reset();
    }
}

/// The DCP relayout (every DCP-th row of a prefill page to a decode rank, domain.md §2.4), TP head slices (§3.2),
/// PP stages, Mamba and KDA state slices (§5) and draft KV, each run with strided entries and judged by the oracle:
/// every byte lands where it must, and the engines really were handed repeated entries.
#[rstest]
#[case::kimi_k3_dcp8("basic/kimi-k3-pp8-tp1-to-tp8-dcp8.yaml")]
#[case::mla_dcp1_to_dcp2("basic/deepseek-v2-lite-dcp1-to-dcp2.yaml")]
#[case::mha_head_slices("mha/llama-3-70b-tp4-to-tp8.yaml")]
#[case::qwen3_next_state("state/qwen3-next-tp1-to-tp4.yaml")]
#[case::kimi_linear_state("state/kimi-linear-tp4-to-tp2.yaml")]
#[case::draft_dcp8("draft/kimi-k3-draft-dcp8.yaml")]
fn strided_entries_land_every_byte_where_per_row_entries_do(#[case] file: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios").join(file);
    let scenario = kvrelay::scenario::load(&path).unwrap_or_else(|error| panic!("{error}"));
    let repeated = Rc::new(Cell::new(0));
    let inner = Fabric::LiveSim.transport().expect("the in-memory fabric opens");
    let mut transport = StridedTransport { inner, repeated: repeated.clone(), paged: Rc::default() };
    let budget = Budget::unbounded("a corpus scenario");
    let outcome = harness::Run::new(&scenario, &budget).on_transport(&mut transport).execute().expect("runs");
    assert!(outcome.passed(), "{file}: {}", outcome.failure_text("\n"));
    assert!(repeated.get() > 0, "{file}: no strided entry reached the engine");
}

/// An engine that does not declare strided entries refuses one with a typed error naming the entry and the fix,
/// and runs nothing of the batch.
#[test]
fn an_engine_without_strided_entries_refuses_one_by_kind() {
    let limits = SeamLimits { strided: false, ..SeamLimits::UNLIMITED };
    let plain = Entry::new(0, 0, 0, 0, 64);
    let repeated = Entry { repeat: Repeat { count: 4, local_stride: 512, remote_stride: 64 }, ..plain };
    let batch = Batch { entries: vec![plain, repeated], notify: None, tables: Vec::new() };
    let error = SeamError::check_limits(&batch, limits).expect_err("refused");
    assert_eq!(error.kind(), SeamErrorKind::Strided);
    let text = error.to_string();
    assert!(text.contains("entry 1 repeats 4 times") && text.contains("submit each element"), "{text}");
    assert!(SeamError::check_limits(&batch, SeamLimits { strided: true, ..limits }).is_ok());
}

/// A repeated entry's extent and elements: the last element's end on each side, overflow as `None`.
#[test]
fn a_repeated_entry_spans_its_last_element_on_each_side() {
    let entry =
        Entry { repeat: Repeat { count: 3, local_stride: 512, remote_stride: 64 }, ..Entry::new(0, 8, 1, 16, 64) };
    assert_eq!(
        (entry.local_end(), entry.remote_end(), entry.bytes()),
        (Some(8 + 1024 + 64), Some(16 + 128 + 64), Some(192))
    );
    let offsets: Vec<(u64, u64)> = entry.elements().map(|e| (e.local_offset, e.remote_offset)).collect();
    assert_eq!(offsets, [(8, 16), (520, 80), (1032, 144)]);
    let huge = Entry { repeat: Repeat { count: u64::MAX, local_stride: u64::MAX, remote_stride: 1 }, ..entry };
    assert_eq!(huge.local_end(), None);
}

/// The plan executed straight through engines (`engine::direct`, what `bench` times as a fabric's writes and
/// completions): every byte judged by the oracle, through engines that take strided and paged entries (the
/// relayout through the requests' page tables, `plan::paged`) and through engines that get their elements.
#[rstest]
#[case::strided(true)]
#[case::elements(false)]
fn the_plan_executed_directly_through_engines_passes_the_oracle(#[case] strided: bool) {
    use kvrelay::engine::direct::Direct;

    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/basic/kimi-k3-pp8-tp1-to-tp8-dcp8.yaml");
    let scenario = kvrelay::scenario::load(&path).unwrap_or_else(|error| panic!("{error}"));
    let problem = &scenario.problem;
    let descriptors = kvrelay::plan::plan(problem).expect("plans").descriptors();
    let mut transport = Fabric::LiveSim.transport().expect("the in-memory fabric opens");
    let (repeated, paged) = (Rc::new(Cell::new(0)), Rc::new(Cell::new(0)));
    let direct = Direct::prepare(problem, &descriptors, |node| {
        let inner = transport
            .engine(NodeId(node as u32), kvrelay::fabric::registry::RDMA_CAPS)
            .map_err(|error| SeamError::Engine { call: "open", message: error.to_string() })?;
        if !strided {
            return Ok(inner);
        }
        Ok(Box::new(Expanding { inner, repeated: repeated.clone(), paged: paged.clone() }) as Box<dyn TransferEngine>)
    })
    .expect("prepared");
    let planned: u64 = descriptors.iter().map(|descriptor| descriptor.bytes()).sum();
    assert_eq!(direct.bytes(), planned);
    executes_and_passes_the_oracle(problem, direct);
    assert_eq!((repeated.get() > 0, paged.get() > 0), (strided, strided));
}

/// Executes `direct`'s batches and judges every decode rank: no violation. The observation judged.
fn executes_and_passes_the_oracle<N: TransferEngine>(
    problem: &kvrelay::model::Problem,
    mut direct: kvrelay::engine::direct::Direct<N>,
) -> kvrelay::verify::Observation {
    direct.execute(Duration::from_secs(10)).expect("every batch completes");
    let observation = direct.observe().expect("observed");
    let ranks: Vec<_> =
        problem.decode.ranks.iter().map(|layout| (layout.rank, kvrelay::verify::Verdicts::all_succeeded())).collect();
    let violations = harness::check_ranks(problem, &observation, &ranks);
    assert!(violations.is_empty(), "{}", violations.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n"));
    observation
}

/// A wave of several requests planned request by request on threads (`Lowered::per_request`, as `kvrelay replay
/// --direct` plans its waves) moves exactly the whole plan's bytes and lands every decode byte where the oracle wants
/// it, through engines that take paged entries and through engines that take physical offsets. The writes recorded
/// for the oracle on the planning thread (`Lowered::record_writes`) are the ones the engines' batches make.
#[rstest]
#[case::paged(true)]
#[case::physical(false)]
fn a_wave_planned_request_by_request_lands_as_the_whole_plan_does(#[case] paged: bool) {
    use kvrelay::engine::direct::{Direct, Lowered};

    let text = "model: {preset: kimi-k3}\nprefill: {tp: 1, pp: 8, page_size: 64}\ndecode: {tp: 8, dcp: 8, page_size: 64}\nrequests: [{tokens: 700}, {tokens: 129}, {tokens: 1000}]\nexpect: ok\n";
    let scenario = kvrelay::scenario::parse_seeded(text, "<wave>", "wave", Some(3)).expect("parses");
    let problem = &scenario.problem;
    let whole: u64 = kvrelay::plan::plan(problem).expect("plans").descriptors().iter().map(|d| d.bytes()).sum();
    let (lowered, bytes) = Lowered::per_request(problem, paged, 2).expect("plans request by request");
    assert_eq!(bytes, whole, "the parts move the whole plan's bytes");
    let mut transport = Fabric::LiveSim.transport().expect("the in-memory fabric opens");
    // Engines that take paged entries (Expanding), or the in-memory engines as they are (physical offsets).
    let mut open = |node: usize| -> Result<Box<dyn TransferEngine>, SeamError> {
        let inner = transport
            .engine(NodeId(node as u32), kvrelay::fabric::registry::RDMA_CAPS)
            .map_err(|error| SeamError::Engine { call: "open", message: error.to_string() })?;
        if !paged {
            return Ok(inner);
        }
        let (repeated, paged) = (Rc::new(Cell::new(0)), Rc::new(Cell::new(0)));
        Ok(Box::new(Expanding { inner, repeated, paged }) as Box<dyn TransferEngine>)
    };
    let direct = Direct::prepare_lowered(problem, Some(lowered), &[], &mut open).expect("prepared");
    assert_eq!(direct.bytes(), whole);
    let observation = executes_and_passes_the_oracle(problem, direct);
    let (mut recorded, _) = Lowered::per_request(problem, paged, 2).expect("plans request by request");
    recorded.record_writes().expect("records");
    let direct = Direct::prepare_lowered(problem, Some(recorded), &[], &mut open).expect("prepared");
    let early = direct.observe().expect("observed").writes;
    assert!(!early.is_empty());
    assert_eq!(early, observation.writes, "the writes recorded before the engines are the batches' writes");
}

/// A plan lowered for the other kind of engine, with no descriptors to lower again, is refused naming the fix; a
/// problem with a decode staging ring (offsets handed out across requests) is not planned request by request.
#[test]
fn a_plan_lowered_for_other_engines_or_across_a_staging_ring_is_refused() {
    use kvrelay::engine::direct::{Direct, Lowered};

    let text = "model: {preset: kimi-k3}\nprefill: {tp: 1, pp: 8, page_size: 64}\ndecode: {tp: 8, dcp: 8, page_size: 64}\nrequests: [{tokens: 129}, {tokens: 64}]\nexpect: ok\n";
    let scenario = kvrelay::scenario::parse_seeded(text, "<wave>", "wave", Some(3)).expect("parses");
    let problem = &scenario.problem;
    let (lowered, _) = Lowered::per_request(problem, true, 2).expect("plans");
    let mut transport = Fabric::LiveSim.transport().expect("the in-memory fabric opens");
    let refused = Direct::prepare_lowered(problem, Some(lowered), &[], |node| {
        transport
            .engine(NodeId(node as u32), kvrelay::fabric::registry::RDMA_CAPS)
            .map_err(|error| SeamError::Engine { call: "open", message: error.to_string() })
    })
    .err()
    .expect("refused");
    assert!(refused.to_string().contains("pass its descriptors"), "{refused}");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/mha/gqa-staging-tp4-to-tp2.yaml");
    let staging = kvrelay::scenario::load(&path).unwrap_or_else(|error| panic!("{error}"));
    let why = Lowered::per_request(&staging.problem, true, 2).err().expect("refused");
    assert!(why.contains("staging ring"), "{why}");
}

/// Paged entries: offsets through a page table resolve to the items it lists; an engine that does not declare
/// them, a table the batch lacks, an offset past the table and an element across an item are refused by kind,
/// naming the entry.
#[test]
fn paged_entries_resolve_through_their_tables_and_bad_ones_are_refused() {
    // Items of 64 bytes listed as pages [3, 0, 7]: rows of 16 bytes every 32 bytes, 6 of them.
    let table = PageTable { item_len: 64, pages: vec![3, 0, 7] };
    let entry = Entry {
        repeat: Repeat { count: 6, local_stride: 32, remote_stride: 16 },
        paging: Paging { local: Some(0), remote: None },
        ..Entry::new(0, 0, 0, 0, 16)
    };
    let batch = Batch { entries: vec![entry], notify: None, tables: vec![table.clone()] };
    let physical: Vec<(u64, u64)> =
        batch.physical_elements().expect("inside").iter().map(|e| (e.local_offset, e.remote_offset)).collect();
    assert_eq!(physical, [(192, 0), (224, 16), (0, 32), (32, 48), (448, 64), (480, 80)]);
    let limits = SeamLimits { strided: true, paged: true, ..SeamLimits::UNLIMITED };
    assert!(SeamError::check_limits(&batch, limits).is_ok());
    let refused = |batch: &Batch, limits: SeamLimits, words: &str| {
        let error = SeamError::check_limits(batch, limits).expect_err("refused");
        assert_eq!(error.kind(), SeamErrorKind::Strided);
        assert!(error.to_string().contains(words) && error.to_string().contains("entry 0"), "{error}");
    };
    refused(&batch, SeamLimits { paged: false, ..limits }, "takes no paged entries");
    refused(&Batch { tables: Vec::new(), ..batch.clone() }, limits, "names table 0 of 0");
    let past = Entry { repeat: Repeat { count: 7, ..entry.repeat }, ..entry };
    refused(&Batch { entries: vec![past], ..batch.clone() }, limits, "reaches past table 0");
    let across = Entry { local_offset: 56, repeat: Repeat { count: 1, ..entry.repeat }, ..entry };
    refused(&Batch { entries: vec![across], ..batch.clone() }, limits, "crosses an item");
}

/// Ranges that continue one another in the same region, merged: the canonical form of a sequence of writes.
fn merged(ranges: impl IntoIterator<Item = (u32, u64, u64)>) -> Vec<(u32, u64, u64)> {
    let mut out: Vec<(u32, u64, u64)> = Vec::new();
    for (region, offset, len) in ranges {
        match out.last_mut() {
            Some(last) if last.0 == region && last.1 + last.2 == offset => last.2 += len,
            _ => out.push((region, offset, len)),
        }
    }
    out
}

proptest::proptest! {
    /// `Batch::remote_spans` names the same remote bytes in the same order as the batch's physical elements (what
    /// `engine::direct` records as the writes the oracle checks for overlaps), paged or not, strided or not.
    #[test]
    fn remote_spans_cover_the_physical_elements_remote_bytes(
        entries in proptest::collection::vec(
            (0u32..2, 0u64..200, 1u64..40, 0u64..6, 0u64..64, proptest::bool::ANY),
            1..4,
        ),
        item_len in 16u64..96,
        pages in proptest::collection::vec(0u32..12, 24),
    ) {
        let table = PageTable { item_len, pages };
        let entries: Vec<Entry> = entries
            .into_iter()
            .map(|(remote, offset, len, count, gap, paged)| Entry {
                repeat: Repeat { count, local_stride: len, remote_stride: len + gap },
                paging: Paging { local: None, remote: paged.then_some(0) },
                ..Entry::new(0, 0, remote, offset, len)
            })
            .collect();
        let batch = Batch { entries, notify: None, tables: vec![table] };
        let elements = batch.physical_elements();
        let mut spans = Vec::new();
        let walked = batch.remote_spans(|region, offset, len| spans.push((region, offset, len)));
        proptest::prop_assert_eq!(walked.is_some(), elements.is_some());
        if let Some(elements) = elements {
            let expected = merged(elements.iter().map(|e| (e.remote, e.remote_offset, e.len)));
            proptest::prop_assert_eq!(merged(spans), expected);
        }
    }
}
