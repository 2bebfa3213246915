//! The live driver (real clock) and the control plane of ranks as processes: the same engines over a real-time
//! loop land the same bytes as the simulation; `diff` decodes a planted difference into coordinates; the bootstrap
//! hub routes, starts without a rank that never connects, notices a rank that dies, and survives garbage.
//! The RDMA side of these paths runs in the guest (ci/rdma.sh).

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use kvrelay::control::{Client, ControlFrame, FrameKind, Hub, HubPlan, HubReport, HUB};
use kvrelay::engine::live::{Control, Received};
use kvrelay::engine::Envelope;
use kvrelay::fabric::verbs::{FabricError, NodeId};
use kvrelay::harness::{self, Budget, Fabric};
use kvrelay::model::Side;
use kvrelay::verify::{self, RegionKey};
use proptest::prelude::*;
use rstest::rstest;

fn load(path: &str) -> kvrelay::scenario::Scenario {
    kvrelay::scenario::load(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

#[rstest]
#[case("scenarios/basic/baseline-tp1-to-tp1.yaml")]
#[case("scenarios/basic/deepseek-v2-lite-dcp1-to-dcp2.yaml")]
#[case("scenarios/state/qwen3-next-tp4-to-tp2.yaml")]
#[case("scenarios/engines/legacy-registration.yaml")]
#[case("scenarios/rejections/too-few-decode-pages.yaml")]
fn the_live_driver_lands_the_same_bytes_as_the_simulation(#[case] path: &str) {
    let scenario = load(path);
    let report = harness::diff(&scenario, &Budget::bytes(1 << 31), &Fabric::LiveSim).unwrap();
    assert!(report.reference.passed(), "sim: {:?}", report.reference.failures);
    assert!(report.other.passed(), "live: {:?}", report.other.failures);
    assert!(report.differences.is_empty(), "{}", report.differences[0]);
    assert!(report.bytes > 0);
}

#[test]
fn compare_images_decodes_a_planted_difference_into_coordinates() {
    let scenario = load("scenarios/basic/mla-tp2-to-tp4.yaml");
    let outcome = harness::run(&scenario).unwrap();
    let mut other = outcome.observation.clone();
    let rank = scenario.problem.decode.ranks[1].rank;
    let key = RegionKey { side: Side::Decode, rank, region: 2 };
    let row_len = scenario.problem.decode.rank(rank).regions[2].row_len() as usize;
    // The first written row takes the bytes of the next written one: the difference names the row, and decodes
    // both contents (as a misplaced page would read).
    let image = other.images.get_mut(&key).unwrap();
    let written: Vec<usize> = (0..image.len() / row_len)
        .filter(|row| !verify::pattern::matches_sentinel((row * row_len) as u64, &image[row * row_len..][..row_len]))
        .take(2)
        .collect();
    let [first, second] = written[..] else { panic!("region has fewer than two written rows") };
    let moved = image[second * row_len..][..row_len].to_vec();
    image[first * row_len..][..row_len].copy_from_slice(&moved);
    let differences = verify::compare_images(&scenario.problem, &outcome.observation, &other);
    assert_eq!(differences.len(), 1, "{differences:?}");
    let text = differences[0].to_string();
    assert!(text.starts_with(&format!("decode {rank}, layer ")), "{text}");
    assert!(text.contains(&format!(" row {first}: ")), "{text}");
    assert!(matches!(differences[0].other, verify::Content::From(_)), "{text}");
    assert_ne!(differences[0].reference, differences[0].other);
    assert_eq!(verify::compare_images(&scenario.problem, &outcome.observation, &outcome.observation), vec![]);
}

/// A hub for `nodes` nodes whose last `decode` are decode nodes, run on a thread.
fn hub(nodes: u32, decode: u32, connect: Duration) -> (String, std::thread::JoinHandle<HubReport>) {
    let hub = Hub::bind("127.0.0.1:0").unwrap();
    let addr = hub.local_addr().unwrap().to_string();
    let plan = HubPlan {
        nodes: (0..nodes).map(|node| (NodeId(node), format!("node {node}"))).collect(),
        decode: (nodes - decode..nodes).map(NodeId).collect(),
        connect_timeout: connect,
        time_limit: Duration::from_secs(20),
        faults: None,
        started: None,
    };
    (addr, std::thread::spawn(move || hub.run(&plan)))
}

fn client(addr: &str, node: u32, parts: Vec<Vec<u8>>) -> Client {
    Client::connect(addr, NodeId(node), parts, Duration::from_secs(5)).unwrap()
}

/// The next control event within a bounded wait (about 5 s).
fn next(client: &mut Client) -> Received {
    for _ in 0..2500 {
        match client.try_recv() {
            Received::Idle => std::thread::sleep(Duration::from_millis(2)),
            other => return other,
        }
    }
    Received::Idle
}

#[test]
fn the_hub_starts_routes_and_stops_a_run() {
    let (addr, hub) = hub(2, 1, Duration::from_secs(10));
    let published = vec![b"topology".to_vec()];
    let mut prefill = client(&addr, 0, published.clone());
    let mut decode = client(&addr, 1, Vec::new());
    assert_eq!(prefill.wait_start(Duration::from_secs(5)).unwrap(), published);
    assert_eq!(decode.wait_start(Duration::from_secs(5)).unwrap(), published);
    decode.send(NodeId(1), Envelope { to: NodeId(0), frames: vec![b"registration".to_vec()] });
    match next(&mut prefill) {
        Received::Message(from, envelope) => {
            assert_eq!((from, envelope.frames), (NodeId(1), vec![b"registration".to_vec()]));
        }
        other => panic!("expected the registration, got {other:?}"),
    }
    decode.finished(NodeId(1));
    assert!(matches!(next(&mut prefill), Received::Stop));
    assert!(matches!(next(&mut decode), Received::Stop));
    let report = hub.join().unwrap();
    assert_eq!((report.routed, report.dropped, report.missing.len(), report.lost.len()), (1, 0, 0, 0));
}

#[test]
fn a_rank_that_never_connects_is_reported_and_the_run_starts_without_it() {
    let (addr, hub) = hub(2, 1, Duration::from_millis(300));
    let mut decode = client(&addr, 1, Vec::new());
    // Nobody published a topology: the start carries none.
    assert_eq!(decode.wait_start(Duration::from_secs(5)).unwrap(), Vec::<Vec<u8>>::new());
    decode.send(NodeId(1), Envelope { to: NodeId(0), frames: vec![b"lost".to_vec()] });
    decode.finished(NodeId(1));
    assert!(matches!(next(&mut decode), Received::Stop));
    let report = hub.join().unwrap();
    assert_eq!(report.missing, vec![NodeId(0)]);
    assert_eq!(report.dropped, 1);
}

#[test]
fn a_decode_rank_that_dies_ends_the_run_instead_of_hanging_it() {
    let (addr, hub) = hub(2, 1, Duration::from_secs(10));
    let mut prefill = client(&addr, 0, Vec::new());
    let decode = client(&addr, 1, Vec::new());
    prefill.wait_start(Duration::from_secs(5)).unwrap();
    drop(decode);
    assert!(matches!(next(&mut prefill), Received::Stop));
    let report = hub.join().unwrap();
    assert_eq!(report.lost, vec![NodeId(1)]);
    assert!(!report.timed_out);
}

#[test]
fn garbage_on_the_control_port_closes_that_connection_only() {
    let (addr, hub) = hub(2, 1, Duration::from_secs(10));
    let mut garbage = TcpStream::connect(&addr).unwrap();
    garbage.write_all(&u32::MAX.to_le_bytes()).unwrap();
    let mut impostor = TcpStream::connect(&addr).unwrap();
    impostor.write_all(&ControlFrame::new(FrameKind::Hello, NodeId(7), HUB, Vec::new()).encode()).unwrap();
    for stream in [&mut garbage, &mut impostor] {
        assert_closed_by_peer(stream);
    }
    let mut prefill = client(&addr, 0, Vec::new());
    let mut decode = client(&addr, 1, Vec::new());
    prefill.wait_start(Duration::from_secs(5)).unwrap();
    decode.wait_start(Duration::from_secs(5)).unwrap();
    decode.finished(NodeId(1));
    assert!(matches!(next(&mut prefill), Received::Stop));
    let report = hub.join().unwrap();
    assert!(report.log.iter().any(|line| line.contains("refused a hello from node 7")), "{:?}", report.log);
}

/// The hub closed `stream`: a read ends (EOF or reset) instead of timing out.
fn assert_closed_by_peer(stream: &mut TcpStream) {
    use std::io::Read;
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut byte = [0u8; 1];
    match stream.read(&mut byte) {
        Ok(0) => {}
        Err(error) => assert_eq!(error.kind(), std::io::ErrorKind::ConnectionReset, "{error}"),
        Ok(_) => panic!("the hub sent bytes to a connection it should have closed"),
    }
}

proptest! {
    #[test]
    fn control_frames_round_trip(kind in 1u8..=5, from: u32, to: u32, parts in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..40), 0..6)) {
        let kind = [FrameKind::Hello, FrameKind::Start, FrameKind::Message, FrameKind::Done, FrameKind::Stop][kind as usize - 1];
        let frame = ControlFrame::new(kind, NodeId(from), NodeId(to), parts);
        let bytes = frame.encode();
        prop_assert_eq!(kvrelay::control::frame::decode(&bytes[4..]), Ok(frame));
    }

    #[test]
    fn control_frame_decoding_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        let _ = kvrelay::control::frame::decode(&bytes);
    }
}

/// An endpoint whose NIC runs out of queue pairs after `left` (as a real device's CQ or QP table can); it sets
/// `dropped` when it is torn down.
struct FewQps {
    inner: kvrelay::fabric::world::SimEndpoint,
    left: usize,
    dropped: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

impl Drop for FewQps {
    fn drop(&mut self) {
        if let Some(dropped) = &self.dropped {
            dropped.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

impl kvrelay::fabric::verbs::Endpoint for FewQps {
    fn caps(&self) -> kvrelay::fabric::verbs::Caps {
        self.inner.caps()
    }
    fn node(&self) -> NodeId {
        self.inner.node()
    }
    fn register(&mut self, bytes: Vec<u8>) -> Result<kvrelay::fabric::verbs::MemoryRegion, FabricError> {
        self.inner.register(bytes)
    }
    fn deregister(&mut self, region: &kvrelay::fabric::verbs::MemoryRegion) -> Result<Vec<u8>, FabricError> {
        self.inner.deregister(region)
    }
    fn read_local(
        &self,
        region: &kvrelay::fabric::verbs::MemoryRegion,
        offset: u64,
        out: &mut [u8],
    ) -> Result<(), FabricError> {
        self.inner.read_local(region, offset, out)
    }
    fn create_qp(&mut self) -> Result<kvrelay::fabric::verbs::QpInfo, FabricError> {
        self.left = self.left.checked_sub(1).ok_or(FabricError::Exhausted("queue pairs"))?;
        self.inner.create_qp()
    }
    fn connect_qp(
        &mut self,
        local: kvrelay::fabric::verbs::QpNum,
        remote: kvrelay::fabric::verbs::QpInfo,
    ) -> Result<(), FabricError> {
        self.inner.connect_qp(local, remote)
    }
    fn post_send(
        &mut self,
        qp: kvrelay::fabric::verbs::QpNum,
        wrs: &[kvrelay::fabric::verbs::WorkRequest],
    ) -> Result<(), FabricError> {
        self.inner.post_send(qp, wrs)
    }
    fn poll_cq(&mut self, out: &mut Vec<kvrelay::fabric::verbs::WorkCompletion>, max: usize) -> usize {
        self.inner.poll_cq(out, max)
    }
}

/// Found on Soft-RoCE: a prefill rank serving 16 decode ranks ran out of completion-queue entries at the 16th
/// queue pair and never answered that registration, so every room waited for the timeout. A queue pair the NIC
/// cannot give is now a refusal: that decode rank fails at once with the reason, the other 15 are served.
#[test]
fn a_prefill_rank_out_of_queue_pairs_refuses_that_peer_and_serves_the_others() {
    let scenario = load("scenarios/mha/gqa-replication-tp1-to-tp16.yaml");
    let world = kvrelay::fabric::world::SimWorld::new(kvrelay::engine::sim::SimOptions::default().caps);
    let options = kvrelay::engine::live::LiveOptions { waiting_timeout_ns: 30_000_000_000, ..Default::default() };
    let run = kvrelay::engine::live::run_local(&scenario.problem, &options, |node| {
        // Node 0 is the one prefill rank; decode ranks need one queue pair each.
        let left = if node == NodeId(0) { 15 } else { 1 };
        Ok(kvrelay::fabric::verbs_engine::VerbsEngine::new(FewQps {
            inner: world.eager_endpoint(node),
            left,
            dropped: None,
        }))
    })
    .unwrap();
    let failures = run.failures();
    assert_eq!(failures.len(), 1, "{failures:?}");
    let (rank, _, reason) = &failures[0];
    assert_eq!(rank.tp, 15);
    assert!(
        reason.starts_with("prefill pp0/tp0 cannot open a connection: the engine ran out of queue pairs"),
        "{reason}"
    );
    // Nothing waited for a timeout: the refusal is answered at once.
    assert!(run.run_ns < 10_000_000_000, "{} ns", run.run_ns);
    for layout in &scenario.problem.decode.ranks {
        let verdicts = run.verdicts(layout.rank);
        assert_eq!(verify::check_rank(&scenario.problem, layout.rank, &run.observation, &verdicts), vec![]);
    }
}

/// A control whose run is over at once.
struct StopAtOnce;

impl Control for StopAtOnce {
    fn send(&mut self, _from: NodeId, _envelope: Envelope) {}
    fn try_recv(&mut self) -> Received {
        Received::Stop
    }
}

/// Found in CI: a decode process whose prefill peer was SIGKILLed mid-transfer died in its engine's teardown
/// (SIGABRT) and took its verdict with it. A rank's outcome is now judged while its engine is still open.
#[test]
fn a_served_rank_is_judged_before_its_engine_is_torn_down() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let scenario = load("scenarios/basic/mla-tp2-to-tp4.yaml");
    let world = kvrelay::fabric::world::SimWorld::new(kvrelay::engine::sim::SimOptions::default().caps);
    let dropped = std::sync::Arc::new(AtomicBool::new(false));
    let decode = NodeId(scenario.problem.prefill.ranks.len() as u32);
    let endpoint = FewQps { inner: world.eager_endpoint(decode), left: 64, dropped: Some(dropped.clone()) };
    let engine = kvrelay::fabric::verbs_engine::VerbsEngine::new(endpoint);
    let options = kvrelay::engine::live::LiveOptions::default();
    let open_when_judged =
        kvrelay::engine::live::serve(&scenario.problem, decode, engine, StopAtOnce, None, &options, |run| {
            let rooms = run.rooms.values().map(|rooms| rooms.len()).sum::<usize>();
            assert_eq!(rooms, scenario.problem.requests.len(), "every request's room is in the decode rank's outcome");
            !dropped.load(Ordering::SeqCst)
        })
        .unwrap();
    assert!(open_when_judged, "the engine was torn down before the outcome was judged");
    assert!(dropped.load(Ordering::SeqCst), "the engine is torn down once judged");
}
