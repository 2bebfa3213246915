//! Every run is judged, failed requests included, and one decode rank can be judged alone (domain.md §6.4, §12).

use kvrelay::fabric::world::CHUNK_BYTES;
use kvrelay::model::{RankId, Side};
use kvrelay::verify::{self, Observation, RegionKey, Verdicts};

use crate::support::{check_run, scenario};

/// Two requests over MLA TP1 -> TP2: every decode rank holds both requests' pages.
const TWO_REQUESTS: &str = "
model: {layers: 2, kv_lora_rank: 12, qk_rope_head_dim: 4, dtype_bytes: 2}
prefill: {page_size: 4}
decode: {tp: 2, page_size: 4}
requests:
  - {tokens: 10}
  - {tokens: 7}
expect: ok
";

fn failed(ids: &[u32]) -> Verdicts {
    Verdicts { failed: ids.iter().copied().collect(), nothing_sent: false }
}

/// Byte offset of the first byte of `request`'s first decode page in KV region 0 of `rank`.
fn first_page_offset(problem: &kvrelay::model::Problem, rank: RankId, request: usize) -> (RegionKey, usize) {
    let region = &problem.decode.rank(rank).regions[0];
    let page = problem.requests[request].decode_pages[0];
    (RegionKey { side: Side::Decode, rank, region: 0 }, (u64::from(page) * region.item_len) as usize)
}

fn flip(observation: &mut Observation, key: RegionKey, offset: usize) {
    observation.images.get_mut(&key).unwrap()[offset] ^= 0xff;
}

#[test]
fn failed_request_may_leave_bytes_only_in_its_own_items() {
    let outcome = check_run(TWO_REQUESTS);
    let problem = &scenario(TWO_REQUESTS).problem;
    let mut observation = outcome.observation.clone();
    let rank = RankId::new(0, 1);
    // Request 0 failed part-way: whatever it left in its own pages is allowed, garbage included.
    let (key, own) = first_page_offset(problem, rank, 0);
    flip(&mut observation, key, own);
    assert_eq!(verify::check_outcome(problem, &observation, &failed(&[0])), vec![]);
    // The same damage is a violation when request 0 is said to have succeeded.
    assert_eq!(verify::check_outcome(problem, &observation, &failed(&[])).len(), 1);
    // A byte of the succeeded request 1 changed: a violation even though request 0 failed.
    let (key, other) = first_page_offset(problem, rank, 1);
    flip(&mut observation, key, other);
    let violations = verify::check_outcome(problem, &observation, &failed(&[0]));
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(violations[0].to_string().starts_with("decode pp0/tp1, layer 0 kv, row"), "{}", violations[0]);
    // A byte outside every request's items (padding page 0) changed: a violation whatever failed.
    flip(&mut observation, key, 3);
    let violations = verify::check_outcome(problem, &observation, &failed(&[0, 1]));
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(violations[0].to_string().contains("row 0"), "{}", violations[0]);
}

#[test]
fn one_decode_rank_is_judged_from_its_own_memory_alone() {
    let outcome = check_run(TWO_REQUESTS);
    let problem = &scenario(TWO_REQUESTS).problem;
    let mut observation = outcome.observation.clone();
    let broken = RankId::new(0, 1);
    let (key, offset) = first_page_offset(problem, broken, 1);
    flip(&mut observation, key, offset);
    for layout in &problem.decode.ranks {
        let own = Observation {
            images: observation
                .images
                .iter()
                .filter(|(key, _)| key.rank == layout.rank)
                .map(|(k, v)| (*k, v.clone()))
                .collect(),
            writes: observation.writes.iter().filter(|write| write.target.rank == layout.rank).copied().collect(),
            ..Observation::default()
        };
        let alone = verify::check_rank(problem, layout.rank, &own, &Verdicts::all_succeeded());
        let together: Vec<_> =
            verify::check(problem, &observation).into_iter().filter(|v| v.rank == layout.rank).collect();
        assert_eq!(alone, together, "rank {}", layout.rank);
        assert_eq!(alone.is_empty(), layout.rank != broken);
    }
}

/// domain.md §6.4: a request that fails (here request 1's decode prefix is not a whole DCP8 virtual page) does not
/// hold up an unrelated one on the same connections: request 0 ends exactly when it ends with request 1 absent.
#[test]
fn a_failing_request_does_not_delay_an_unrelated_one() {
    let base = "model: {preset: kimi-k3, state: []}\nprefill: {pp: 2, page_size: 64}\ndecode: {tp: 8, dcp: 8, page_size: 64}\nrequests:\n  - {tokens: 1200, chunks: [512, 512, 176]}\n";
    let alone = format!("{base}expect: ok\n");
    let beside =
        format!("{base}  - {{tokens: 900, decode_prefix: 100}}\nexpect: {{error: unaligned_prefix, requests: [1]}}\n");
    let ended = |yaml: &str| {
        let outcome = check_run(yaml);
        let run = outcome.engine.expect("the engines ran");
        run.rooms.values().map(|rooms| rooms[&0].ended_ns.expect("request 0 ended")).max().unwrap()
    };
    let (alone, beside) = (ended(&alone), ended(&beside));
    assert!(beside <= alone, "request 0 ended at {beside} ns beside a failing request, {alone} ns alone");
}

/// The engines run as tokio tasks on a paused clock: two runs give the identical trace, and the same engines
/// stepped by a plain event loop give the same timed events (in any order within one instant), the same room
/// outcomes and the same decode bytes, so the outcome is not an accident of tokio's schedule.
#[rstest::rstest]
#[case::registration_error("scenarios/engines/k3-registration-error-on-one-rank.yaml")]
#[case::legacy_peer("scenarios/engines/legacy-registration.yaml")]
#[case::mixed_outcomes("scenarios/engines/one-request-fails-beside-one.yaml")]
#[case::state_and_heads("scenarios/state/qwen3-next-tp4-to-tp2.yaml")]
fn task_driver_and_stepped_loop_agree(#[case] path: &str) {
    let scenario = kvrelay::scenario::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap();
    let options = kvrelay::engine::sim::SimOptions { trace: true, ..Default::default() };
    let tasks = kvrelay::engine::tasks::run(&scenario.problem, &options).unwrap();
    let again = kvrelay::engine::tasks::run(&scenario.problem, &options).unwrap();
    let stepped = kvrelay::engine::sim::run_stepped(&scenario.problem, &options).unwrap();
    // Engines acting at one instant may be logged in either order by the two drivers; every line carries its time.
    let sorted = |run: &kvrelay::engine::sim::SimRun| {
        let mut lines = run.trace.clone();
        lines.sort();
        lines
    };
    assert_eq!(tasks.trace, again.trace, "two task runs differ");
    assert!(sorted(&tasks) == sorted(&stepped), "the drivers log different events or times");
    assert_eq!(tasks.rooms, stepped.rooms);
    assert_eq!(tasks.messages, stepped.messages);
    assert!(tasks.observation.images == stepped.observation.images, "decode bytes differ between drivers");
}

/// Decode memory handed back sparsely (only the chunks the fabric materialised) holds the same bytes as the whole
/// images and is judged the same, clean or damaged: an absent chunk is untouched sentinel memory.
#[rstest::rstest]
#[case::legacy_peer("scenarios/engines/legacy-registration.yaml")]
#[case::mixed_outcomes("scenarios/engines/one-request-fails-beside-one.yaml")]
#[case::state_and_heads("scenarios/state/qwen3-next-tp4-to-tp2.yaml")]
fn sparse_decode_images_are_judged_like_whole_ones(#[case] path: &str) {
    use kvrelay::engine::sim::SimOptions;
    use kvrelay::engine::tasks::run;
    let scenario = kvrelay::scenario::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap();
    let problem = &scenario.problem;
    let dense = run(problem, &SimOptions::default()).unwrap();
    let sparse = run(problem, &SimOptions { sparse_images: true, ..SimOptions::default() }).unwrap();
    assert!(sparse.observation.images.is_empty());
    assert_eq!(sparse.observation.sparse.len(), dense.observation.images.len());
    let whole = |image: &verify::SparseImage| {
        let mut bytes = vec![0u8; image.len as usize];
        verify::pattern::fill_sentinel(&mut bytes);
        for (start, chunk) in &image.chunks {
            bytes[*start as usize..][..chunk.len()].copy_from_slice(chunk);
        }
        bytes
    };
    for (key, image) in &sparse.observation.sparse {
        assert!(whole(image) == dense.observation.images[key], "{key:?} differs");
    }
    let judge = |observation: &Observation| {
        let ranks: Vec<_> = problem
            .decode
            .ranks
            .iter()
            .map(|layout| (layout.rank, kvrelay::harness::verdicts(&scenario.expect, &dense, layout.rank)))
            .collect();
        verify::check_ranks(problem, observation, &ranks)
    };
    assert_eq!(judge(&sparse.observation), judge(&dense.observation));
    // Damage a byte inside a written chunk and a byte of an untouched chunk the same way on both.
    let (mut damaged_sparse, mut damaged_dense) = (sparse.observation.clone(), dense.observation.clone());
    for (key, image) in damaged_sparse.sparse.iter_mut() {
        let len = image.len;
        let written = image.chunks.keys().next().copied();
        // The first byte no chunk covers, and how far the gap there reaches.
        let mut gap = (0, len);
        for (start, chunk) in &image.chunks {
            if *start > gap.0 {
                gap.1 = *start;
                break;
            }
            gap = (start + chunk.len() as u64, len);
        }
        let untouched = (gap.0 < gap.1).then_some(gap.0);
        for start in written.into_iter().chain(untouched) {
            let chunk = image.chunks.entry(start).or_insert_with(|| {
                let mut bytes = vec![0u8; (gap.1 - start).min(CHUNK_BYTES) as usize];
                verify::pattern::fill_sentinel_at(start, &mut bytes);
                bytes
            });
            let at = chunk.len() / 2;
            chunk[at] ^= 0x5A;
            damaged_dense.images.get_mut(key).unwrap()[start as usize + at] ^= 0x5A;
        }
    }
    let violations = judge(&damaged_sparse);
    assert!(!violations.is_empty());
    assert_eq!(violations, judge(&damaged_dense));
}

/// A decode rank judged in shares (parts of its regions, then its writes, as the harness spreads a rank over cores)
/// gives exactly the whole rank's violations, in the same order, however many parts: damaged regions in every part,
/// and the writes judged once (also through the harness, which queues the shares in another order).
#[rstest::rstest]
fn a_rank_judged_in_parts_reads_as_the_whole_rank(#[values(1, 2, 3, 4, 7)] parts: u32) {
    use kvrelay::engine::sim::SimOptions;
    use kvrelay::engine::tasks::run;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/state/qwen3-next-tp4-to-tp2.yaml");
    let scenario = kvrelay::scenario::load(&path).unwrap();
    let problem = &scenario.problem;
    let mut observation = run(problem, &SimOptions::default()).unwrap().observation;
    // A wrong byte in the middle of every third decode region.
    for (index, image) in observation.images.values_mut().enumerate() {
        if index % 3 == 0 && !image.is_empty() {
            let at = image.len() / 2;
            image[at] ^= 0x5A;
        }
    }
    // On every decode rank a write made twice: an overwrite, which only the rank's writes check sees.
    for layout in &problem.decode.ranks {
        let twice = *observation.writes.iter().find(|write| write.target.rank == layout.rank).unwrap();
        observation.writes.push(twice);
    }
    let ranks: Vec<_> =
        problem.decode.ranks.iter().map(|layout| (layout.rank, verify::Verdicts::all_succeeded())).collect();
    let whole = verify::check_ranks(problem, &observation, &ranks);
    assert!(whole.len() >= 3, "the damage is seen: {whole:?}");
    let overwritten = |list: &[verify::Violation]| {
        list.iter().filter(|violation| matches!(violation.kind, verify::ViolationKind::Overwritten { .. })).count()
    };
    assert_eq!(overwritten(&whole), problem.decode.ranks.len(), "{whole:?}");
    let observation = &observation;
    let sources = verify::Sources::new(problem);
    let in_parts: Vec<_> = ranks
        .iter()
        .flat_map(|(rank, verdicts)| {
            let sources = &sources;
            verify::Share::all(parts)
                .flat_map(move |share| verify::check_rank_share(sources, *rank, observation, verdicts, share))
        })
        .collect();
    assert_eq!(in_parts, whole);
    // The harness queues every rank's region shares before the writes and puts the violations back in order.
    assert_eq!(kvrelay::harness::check_ranks_in_parts(problem, observation, &ranks, parts), whole);
    assert_eq!(kvrelay::harness::check_ranks(problem, observation, &ranks), whole);
}

/// A registration is untrusted input: whatever a (buggy or lying) decode peer puts in the fields the wire accepts,
/// the prefill side's boundary, link and per-chunk planning answer with a plan or an error, never a panic.
mod lying_peers {
    use kvrelay::model::Problem;
    use kvrelay::plan::{self, peer, Local, Plan};
    use kvrelay::wire::{MemoryDesc, Registration};
    use proptest::prelude::*;

    const EDGES: &[u64] = &[0, 1, 7, 8, 64, 1152, 1 << 16, (1 << 31) - 1, 1 << 32, u64::MAX];

    fn problems() -> &'static [Problem] {
        static PROBLEMS: std::sync::OnceLock<Vec<Problem>> = std::sync::OnceLock::new();
        PROBLEMS.get_or_init(|| {
            [
                "state/qwen3-next-tp4-to-tp2",
                "basic/deepseek-v2-lite-dcp1-to-dcp2",
                "draft/kimi-k3-draft-dcp8",
                "basic/mla-tp4-to-tp2",
            ]
            .iter()
            .map(|name| {
                let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("scenarios/{name}.yaml"));
                kvrelay::scenario::load(&path).unwrap().problem
            })
            .collect()
        })
    }

    /// Sets field `field` (by number) of the registration to `value`, as far as the wire allows it.
    fn lie(registration: &mut Registration, field: usize, value: u64, index: usize) {
        let small = u32::try_from(value).unwrap_or(u32::MAX);
        match field % 8 {
            0 => registration.kv_item_len = value.min(1 << 32),
            1 => registration.kv_item_lens = vec![value; index % 4],
            2 => registration.tp_rank = small % 4096,
            3 => registration.attn_tp_size = small.clamp(1, 1024),
            4 => {
                if let Some(dcp) = &mut registration.dcp {
                    dcp.dcp_size = small.clamp(1, 1024);
                    dcp.dcp_rank = (index as u32) % dcp.dcp_size;
                }
            }
            5 => registration.state_item_lens.iter_mut().flatten().for_each(|len| *len = small),
            6 => registration.state_dims.iter_mut().flatten().for_each(|dim| *dim = small),
            _ => {
                if let Some(dcp) = &mut registration.dcp {
                    dcp.kv_layer_ids.iter_mut().skip(index % 3).for_each(|id| *id = small);
                }
            }
        }
    }

    /// Each decode rank's registration (with `lies` applied) through the prefill boundary, link and every chunk;
    /// returns how many chunks were planned without an error.
    fn exercise(problem: &Problem, lies: &[(usize, usize, usize)]) -> usize {
        let mut planned = 0;
        for decode in &problem.decode.ranks {
            let source = plan::prefill_targets(&problem.prefill.topology, &problem.decode.topology, decode.rank, 0)[0];
            let local = Local {
                model: &problem.model,
                topology: &problem.prefill.topology,
                layout: problem.prefill.rank(source),
            };
            let descs: Vec<MemoryDesc> = decode
                .regions
                .iter()
                .map(|region| MemoryDesc { address: 1 << 40, length_bytes: region.len_bytes(), rkey: 1 })
                .collect();
            let mut registration = peer::advertise(problem, decode.rank, &descs);
            for (field, value, index) in lies {
                lie(&mut registration, *field, EDGES[*value], *index);
            }
            // Only what survives the wire reaches the planner.
            let Ok(registration) = Registration::decode(&registration.encode()) else { continue };
            let Ok((peer, _)) = peer::from_registration(local, &registration) else { continue };
            let Ok(link) = plan::link(local, &peer) else { continue };
            for request in &problem.requests {
                for chunk in 0..request.chunks.len() as u32 {
                    if let Ok(groups) = link.chunk_groups(request, chunk) {
                        let _ = Plan { groups, explain: Vec::new() }.copies().count();
                        planned += 1;
                    }
                }
            }
        }
        planned
    }

    /// Without lies every decode rank links and every chunk plans, so the property below reaches the planner.
    #[test]
    fn truthful_registrations_plan_every_chunk() {
        for problem in problems() {
            let chunks: usize = problem.requests.iter().map(|request| request.chunks.len()).sum();
            assert_eq!(exercise(problem, &[]), chunks * problem.decode.ranks.len(), "{}", problem.name);
        }
    }

    proptest! {
        #[test]
        fn lying_registrations_never_panic_the_prefill_side(
            problem in any::<usize>(),
            lies in prop::collection::vec((any::<usize>(), 0..EDGES.len(), any::<usize>()), 1..4),
        ) {
            exercise(&problems()[problem % problems().len()], &lies);
        }
    }
}

/// The verbs engine gathers a batch's entries into work requests within the fabric's `max_sge` (fabric/gather.rs): the DCP
/// relayout's strided rows (domain.md §2.4) land byte for byte as with one write per copy, in far fewer writes.
#[test]
fn gathered_writes_land_the_same_bytes_as_one_write_per_copy() {
    use kvrelay::engine::sim::SimOptions;
    use kvrelay::fabric::verbs::Caps;
    let scenario = scenario(&std::fs::read_to_string("scenarios/engines/dcp-relayout-two-stages.yaml").unwrap());
    let with = |max_sge| {
        let caps = Caps { max_sge, ..SimOptions::default().caps };
        kvrelay::engine::tasks::run(&scenario.problem, &SimOptions { caps, ..SimOptions::default() })
            .expect("the fabric runs")
    };
    let (single, gathered) = (with(1), with(30));
    assert_eq!(gathered.observation.images, single.observation.images);
    assert!(kvrelay::harness::oracle(&scenario, &gathered, &gathered.observation).is_empty());
    let (writes, copies) = (gathered.operations, single.operations);
    assert!(writes * 4 <= copies, "{writes} gathered work requests for {copies} single-entry ones");
    assert_eq!((writes, copies), (80, 944), "the counts tests/it/rdma.rs expects of the verbs fabric too");
    // The write log is what the engines confirmed, continuing targets joined: the same writes either way.
    assert_eq!(gathered.observation.writes.len(), single.observation.writes.len());
}

/// A write record that reaches outside the rank's decode memory (past its region's end, into a region the rank does
/// not have, or with an end past u64) is a violation naming it, never a panic or a record passed over.
#[rstest::rstest]
#[case::past_the_region_end(0, |len| len - 1, "reaches past the region's")]
#[case::a_region_the_rank_lacks(1_000_000, |_| 0, "names a decode region this rank does not have")]
#[case::an_end_past_u64(0, |_| u64::MAX - 8, "reaches past the region's")]
fn a_stray_write_record_is_a_violation(#[case] region: u32, #[case] offset: fn(u64) -> u64, #[case] says: &str) {
    use kvrelay::engine::sim::SimOptions;
    use kvrelay::engine::tasks::run;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/state/qwen3-next-tp4-to-tp2.yaml");
    let scenario = kvrelay::scenario::load(&path).unwrap();
    let problem = &scenario.problem;
    let mut observation = run(problem, &SimOptions::default()).unwrap().observation;
    let rank = problem.decode.ranks[0].rank;
    let ranks = vec![(rank, verify::Verdicts::all_succeeded())];
    assert!(verify::check_ranks(problem, &observation, &ranks).is_empty(), "the run itself is clean");
    // A 64-byte write starting at `offset(the first region's length)`.
    let (offset, length) = (offset(problem.decode.rank(rank).regions[0].len_bytes()), 64);
    let target = verify::RegionKey { side: kvrelay::model::Side::Decode, rank, region };
    observation.writes.push(verify::WriteRecord { target, offset, length });
    let violations = verify::check_ranks(problem, &observation, &ranks);
    let stray: Vec<_> =
        violations.iter().filter(|v| matches!(v.kind, verify::ViolationKind::StrayWrite { .. })).collect();
    assert_eq!(stray.len(), 1, "{violations:?}");
    assert!(stray[0].to_string().contains(says), "{}", stray[0]);
    assert_eq!(kvrelay::harness::check_ranks_in_parts(problem, &observation, &ranks, 2), violations);
}
