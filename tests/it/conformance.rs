//! The transport conformance suite: the contract of `kvrelay::fabric::verbs::Endpoint`, written once over a
//! [`Harness`] so every fabric runs the same bodies (house style 33).
//!
//! Backends: the in-memory `SimWorld` always, and with the cargo feature `rdma` the verbs fabric on a real device
//! (`RdmaEndpoint`; `KVRELAY_RDMA_DEVICE` names it, default the first device with an active port). Every case over
//! [`Backend`] runs on each; run the RDMA ones in the test guest (ci/rdma.sh does) with
//! `KVRELAY_VM_SHARE=$PWD CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=$PWD/ci/rdma/run-in-guest.sh cargo test
//! --features rdma --test it -- conformance rdma`. Cases about simulated time use `SimWorld` directly and sit at the end. Messages stay
//! well within one MTU, so "a failed write changes no byte" holds on hardware too.

use kvrelay::fabric::verbs::{
    Caps, Endpoint, FabricError, MemoryRegion, NodeId, QpNum, RemoteAddr, Sge, WcKind, WcStatus, WorkCompletion,
    WorkRequest,
};
use kvrelay::fabric::world::{self, SimWorld};
use proptest::prelude::*;
use rstest::rstest;

/// What every backend is asked for: a shallow send queue keeps the credit cases short.
const CAPS: Caps = Caps { max_sge: 3, max_message: 1 << 16, sq_depth: 4 };
/// What unwritten target memory holds.
const SENTINEL: u8 = 0xEE;
const SOURCE_LEN: usize = 256;
const TARGET_LEN: usize = 256;
/// Bounds every wait, so a backend that never delivers fails instead of hanging.
const SETTLE_ROUNDS: usize = 100;

/// A fabric under test.
trait Harness {
    /// `count` fresh endpoints, each on its own node.
    fn endpoints(&mut self, count: usize) -> Vec<Box<dyn Endpoint>>;
    /// Lets a little time pass (the sim executes its next pending delivery).
    fn step(&mut self);
    /// Lets every work request posted so far execute and its completions become pollable (the sim runs until
    /// idle; hardware waits a bounded time).
    fn settle(&mut self);
}

/// The in-memory fabric.
struct Sim {
    world: SimWorld,
    nodes: u32,
}

impl Harness for Sim {
    fn endpoints(&mut self, count: usize) -> Vec<Box<dyn Endpoint>> {
        let first = self.nodes;
        self.nodes += count as u32;
        (first..self.nodes).map(|node| Box::new(self.world.endpoint(NodeId(node))) as Box<dyn Endpoint>).collect()
    }

    fn step(&mut self) {
        if let Some(time_ns) = self.world.next_event() {
            self.world.advance_to(time_ns);
        }
    }

    fn settle(&mut self) {
        self.world.run_until_idle();
    }
}

/// Every fabric the suite runs on.
#[derive(Debug, Clone, Copy)]
enum Backend {
    Sim,
    #[cfg(feature = "rdma")]
    Rdma,
}

impl Backend {
    fn harness(self) -> Box<dyn Harness> {
        match self {
            Backend::Sim => Box::new(Sim { world: SimWorld::new(CAPS), nodes: 0 }),
            #[cfg(feature = "rdma")]
            Backend::Rdma => Box::new(rdma::Rdma::default()),
        }
    }
}

/// The verbs fabric on a real device. The harness keeps a handle on every endpoint it hands out, so that `step` and
/// `settle` can wait on their completion channels; waiting never takes a completion away from the test.
#[cfg(feature = "rdma")]
mod rdma {
    use std::cell::RefCell;
    use std::rc::Rc;
    use std::time::{Duration, Instant};

    use kvrelay::fabric::rdma::{write_bandwidth, RdmaEndpoint, RdmaError};
    use kvrelay::fabric::verbs::{
        Caps, Endpoint, FabricError, MemoryRegion, NodeId, QpInfo, QpNum, RemoteAddr, Sge, WcKind, WcStatus,
        WorkCompletion, WorkRequest,
    };

    use super::{Harness, CAPS};

    /// `settle` returns once no endpoint awaits a certain completion and none has taken a new one for this long,
    /// counting each wait as at most two slices (a guest that was not scheduled for a while is not quiet)...
    const QUIET: Duration = Duration::from_millis(150);
    /// ...or after this long in any case (`drain` settles again while completions are missing).
    const SETTLE_LIMIT: Duration = Duration::from_secs(5);
    /// How long one blocking wait on a completion channel lasts inside `settle`.
    const SLICE: Duration = Duration::from_millis(5);
    /// What `step` lets pass.
    const STEP: Duration = Duration::from_millis(1);

    /// An endpoint and how many completions the test has polled from it.
    struct Tracked {
        endpoint: RdmaEndpoint,
        polled: u64,
    }

    /// The test's handle on a [`Tracked`] endpoint.
    struct Shared(Rc<RefCell<Tracked>>);

    impl Endpoint for Shared {
        fn caps(&self) -> Caps {
            self.0.borrow().endpoint.caps()
        }

        fn node(&self) -> NodeId {
            self.0.borrow().endpoint.node()
        }

        fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
            self.0.borrow_mut().endpoint.register(bytes)
        }

        fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
            self.0.borrow_mut().endpoint.deregister(region)
        }

        fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
            self.0.borrow().endpoint.read_local(region, offset, out)
        }

        fn create_qp(&mut self) -> Result<QpInfo, FabricError> {
            self.0.borrow_mut().endpoint.create_qp()
        }

        fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
            self.0.borrow_mut().endpoint.connect_qp(local, remote)
        }

        fn post_send(&mut self, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
            self.0.borrow_mut().endpoint.post_send(qp, wrs)
        }

        fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
            let mut tracked = self.0.borrow_mut();
            let count = tracked.endpoint.poll_cq(out, max);
            tracked.polled += count as u64;
            count
        }
    }

    #[derive(Default)]
    pub(super) struct Rdma {
        endpoints: Vec<Rc<RefCell<Tracked>>>,
        nodes: u32,
    }

    impl Rdma {
        /// Completions taken off the devices so far (polled by the test, or waiting in an endpoint): grows exactly
        /// when a new completion arrives.
        fn arrived(&self) -> u64 {
            let mut total = 0;
            for tracked in &self.endpoints {
                let mut tracked = tracked.borrow_mut();
                tracked.endpoint.wait(Duration::ZERO);
                total += tracked.polled + tracked.endpoint.ready() as u64;
            }
            total
        }

        /// Sleeps up to `slice` on the completion channel of an endpoint with nothing ready (or plainly, if all have
        /// something ready: their channels would not block).
        fn block(&self, slice: Duration) {
            match self.endpoints.iter().find(|tracked| tracked.borrow().endpoint.ready() == 0) {
                Some(tracked) => {
                    tracked.borrow_mut().endpoint.wait(slice);
                }
                None => std::thread::sleep(slice),
            }
        }
    }

    impl Harness for Rdma {
        fn endpoints(&mut self, count: usize) -> Vec<Box<dyn Endpoint>> {
            let mut res: Vec<Box<dyn Endpoint>> = Vec::new();
            for _ in 0..count {
                let node = NodeId(self.nodes);
                self.nodes += 1;
                let endpoint = open(node.0, CAPS);
                assert_eq!(endpoint.caps(), CAPS, "{} cannot give the suite its caps", endpoint.device());
                let tracked = Rc::new(RefCell::new(Tracked { endpoint, polled: 0 }));
                self.endpoints.push(Rc::clone(&tracked));
                res.push(Box::new(Shared(tracked)));
            }
            res
        }

        fn step(&mut self) {
            self.block(STEP);
        }

        /// Waits until no endpoint awaits a certain completion and none has taken a new one for [`QUIET`] (at most
        /// [`SETTLE_LIMIT`]).
        #[allow(clippy::disallowed_methods, reason = "waiting for a device is bounded on the wall clock")]
        fn settle(&mut self) {
            let start = Instant::now();
            let mut arrived = self.arrived();
            let mut quiet = Duration::ZERO;
            while start.elapsed() < SETTLE_LIMIT {
                let awaited = self.endpoints.iter().any(|tracked| tracked.borrow().endpoint.awaits_completions());
                if !awaited && quiet >= QUIET {
                    return;
                }
                let slice_start = Instant::now();
                self.block(SLICE);
                quiet += slice_start.elapsed().min(2 * SLICE);
                let now = self.arrived();
                if now != arrived {
                    arrived = now;
                    quiet = Duration::ZERO;
                }
            }
        }
    }

    fn device() -> Option<String> {
        std::env::var("KVRELAY_RDMA_DEVICE").ok().filter(|name| !name.is_empty())
    }

    /// An endpoint on the suite's device, or a panic that says what was found and how to fix it.
    fn open(node: u32, caps: Caps) -> RdmaEndpoint {
        RdmaEndpoint::open(NodeId(node), device().as_deref(), caps).unwrap_or_else(|error| panic!("{error}"))
    }

    /// Open failures say what was found and how to fix it.
    #[test]
    fn an_unknown_device_name_lists_the_available_devices() {
        match RdmaEndpoint::open(NodeId(0), Some("no-such-device"), CAPS) {
            Err(RdmaError::UnknownDevice { name, available }) => {
                assert_eq!(name, "no-such-device");
                assert!(!available.is_empty() && !available.contains(&name), "available: {available:?}");
            }
            // A machine without RDMA (the host, outside the test guest).
            Err(error @ RdmaError::NoDevices) => assert!(error.to_string().contains("rdma link add")),
            other => panic!("expected UnknownDevice, got {other:?}"),
        }
    }

    /// Asked caps beyond the device are clamped to it; the QPs still work at the clamped depth.
    #[test]
    fn caps_are_clamped_to_the_device() {
        let asked = Caps { max_sge: 1 << 20, max_message: u64::MAX, sq_depth: 1 << 30 };
        let endpoint = open(0, asked);
        let caps = endpoint.caps();
        assert!(caps.max_sge >= 1 && caps.max_sge < asked.max_sge, "{caps:?}");
        assert!(caps.max_message >= 1 << 16 && caps.max_message <= u64::from(u32::MAX), "{caps:?}");
        assert!(caps.sq_depth >= 1 && caps.sq_depth < asked.sq_depth, "{caps:?}");
        assert!(endpoint.gid_index().is_none_or(|index| index > 0 || endpoint.device() != "rxe0"));
    }

    /// `wait` returns false after its timeout when nothing is posted, and true once a completion is ready (which
    /// `poll_cq` then hands out); `awaits_completions` says when one is certain to come.
    #[test]
    #[allow(clippy::disallowed_methods, reason = "measures that a wait is bounded")]
    fn wait_blocks_until_a_completion_or_the_timeout() {
        let (mut sender, mut receiver) = (open(0, CAPS), open(1, CAPS));
        let start = Instant::now();
        assert!(!sender.wait(Duration::from_millis(50)), "nothing was posted");
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(45) && waited < Duration::from_secs(2), "waited {waited:?}");
        let source = sender.register(vec![7; 64]).unwrap();
        let target = receiver.register(vec![0; 64]).unwrap();
        let (local, remote) = (sender.create_qp().unwrap(), receiver.create_qp().unwrap());
        sender.connect_qp(local.qpn, remote).unwrap();
        receiver.connect_qp(remote.qpn, local).unwrap();
        let wr = WorkRequest {
            wr_id: 5,
            sges: vec![Sge { addr: source.addr, len: 64, lkey: source.lkey }],
            remote: RemoteAddr { addr: target.addr, rkey: target.rkey },
            imm: Some(9),
            signaled: true,
        };
        assert!(!sender.awaits_completions());
        sender.post_send(local.qpn, &[wr]).unwrap();
        assert!(sender.awaits_completions(), "a signalled write is posted");
        assert!(sender.wait(Duration::from_secs(10)), "the write completes");
        assert!(!sender.awaits_completions(), "its completion was taken off the device");
        assert!(receiver.wait(Duration::from_secs(10)), "the immediate arrives");
        assert_eq!(sender.ready(), 1);
        let mut completions = Vec::new();
        assert_eq!(sender.poll_cq(&mut completions, usize::MAX), 1);
        assert_eq!((completions[0].wr_id, completions[0].status), (5, WcStatus::Success));
        assert_eq!(receiver.poll_cq(&mut completions, usize::MAX), 1);
        assert_eq!(
            (completions[1].kind, completions[1].imm, completions[1].qp),
            (WcKind::RecvImm, Some(9), remote.qpn)
        );
        assert_eq!(receiver.deregister(&target).unwrap(), vec![7; 64]);
    }

    /// The benchmark's loop moves every byte it reports, with selective signalling and a deep queue.
    #[test]
    fn write_bandwidth_completes_every_write() {
        let run = write_bandwidth(device().as_deref(), 4096, 300, 32).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!((run.bytes, run.work_requests), (4096 * 300, 300));
        assert!(run.seconds > 0.0 && run.bytes_per_second() > 0.0, "{run:?}");
    }
}

/// A sender and a receiver with a patterned source region, a sentinel target region and connected QP pairs.
struct Link {
    sender: Box<dyn Endpoint>,
    receiver: Box<dyn Endpoint>,
    /// (sender QP, receiver QP), connected both ways.
    qps: Vec<(QpNum, QpNum)>,
    source: MemoryRegion,
    target: MemoryRegion,
}

fn link(harness: &mut dyn Harness, qp_count: usize) -> Link {
    let mut endpoints = harness.endpoints(2);
    let mut receiver = endpoints.pop().unwrap();
    let mut sender = endpoints.pop().unwrap();
    let source = sender.register(pattern(SOURCE_LEN)).unwrap();
    let target = receiver.register(vec![SENTINEL; TARGET_LEN]).unwrap();
    let qps = (0..qp_count).map(|_| connect(&mut *sender, &mut *receiver)).collect();
    Link { sender, receiver, qps, source, target }
}

/// Creates a QP on each side and connects them to each other (the bootstrap's job).
fn connect(first: &mut dyn Endpoint, second: &mut dyn Endpoint) -> (QpNum, QpNum) {
    let first_info = first.create_qp().unwrap();
    let second_info = second.create_qp().unwrap();
    first.connect_qp(first_info.qpn, second_info).unwrap();
    second.connect_qp(second_info.qpn, first_info).unwrap();
    (first_info.qpn, second_info.qpn)
}

/// Source bytes: distinct from their neighbours and never equal to the sentinel.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|index| (index % 251) as u8).collect()
}

impl Link {
    /// A signalled WRITE of `len` source bytes from `source_offset` to `target_offset`.
    fn write(&self, wr_id: u64, source_offset: u64, target_offset: u64, len: u64) -> WorkRequest {
        WorkRequest {
            wr_id,
            sges: vec![Sge { addr: self.source.addr + source_offset, len, lkey: self.source.lkey }],
            remote: RemoteAddr { addr: self.target.addr + target_offset, rkey: self.target.rkey },
            imm: None,
            signaled: true,
        }
    }

    /// The sender's QP of pair `index`.
    fn qp(&self, index: usize) -> QpNum {
        self.qps[index].0
    }

    fn target_bytes(&self) -> Vec<u8> {
        read_all(&*self.receiver, &self.target)
    }
}

fn unsignaled(wr: WorkRequest) -> WorkRequest {
    WorkRequest { signaled: false, ..wr }
}

fn read_all(endpoint: &dyn Endpoint, region: &MemoryRegion) -> Vec<u8> {
    let mut res = vec![0; region.len as usize];
    endpoint.read_local(region, 0, &mut res).unwrap();
    res
}

/// The target image after the given `(source_offset, target_offset, len)` writes of the source pattern.
fn expected_target(writes: &[(usize, usize, usize)]) -> Vec<u8> {
    let source = pattern(SOURCE_LEN);
    let mut res = vec![SENTINEL; TARGET_LEN];
    for &(source_offset, target_offset, len) in writes {
        res[target_offset..target_offset + len].copy_from_slice(&source[source_offset..source_offset + len]);
    }
    res
}

/// Polls `endpoint` until exactly `count` completions have arrived (settling in between), then checks no more come.
#[track_caller]
fn drain(harness: &mut dyn Harness, endpoint: &mut dyn Endpoint, count: usize) -> Vec<WorkCompletion> {
    let mut res = Vec::new();
    for _ in 0..SETTLE_ROUNDS {
        endpoint.poll_cq(&mut res, usize::MAX);
        if res.len() >= count {
            break;
        }
        harness.settle();
    }
    harness.settle();
    endpoint.poll_cq(&mut res, usize::MAX);
    assert_eq!(res.len(), count, "expected {count} completions, got:\n{res:#?}");
    res
}

/// `(wr_id, status)` of the completions of `qp`, in arrival order.
fn on_qp(completions: &[WorkCompletion], qp: QpNum) -> Vec<(u64, WcStatus)> {
    completions.iter().filter(|wc| wc.qp == qp).map(|wc| (wc.wr_id, wc.status)).collect()
}

#[track_caller]
fn assert_depth_at_least(link: &Link, depth: usize) {
    assert!(link.sender.caps().sq_depth >= depth, "this case needs a send queue of at least {depth}");
}

/// Completions of one QP follow post order even when a large write precedes a small one; two QPs interleave.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn completions_of_one_qp_arrive_in_post_order(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 2);
    assert_depth_at_least(&link, 3);
    let (first, second) = (link.qp(0), link.qp(1));
    for (index, len) in [200u64, 1, 50].into_iter().enumerate() {
        let index = index as u64;
        let wr = link.write(1 + index, 0, 0, len);
        link.sender.post_send(first, &[wr]).unwrap();
        let wr = link.write(11 + index, 0, 200, 50 - 20 * index);
        link.sender.post_send(second, &[wr]).unwrap();
    }
    let completions = drain(&mut *harness, &mut *link.sender, 6);
    let success = WcStatus::Success;
    assert_eq!(on_qp(&completions, first), [(1, success), (2, success), (3, success)]);
    assert_eq!(on_qp(&completions, second), [(11, success), (12, success), (13, success)]);
    let lens: Vec<u64> = completions.iter().filter(|wc| wc.qp == first).map(|wc| wc.byte_len).collect();
    assert_eq!(lens, [200, 1, 50], "byte_len reports each write's length");
}

/// Unsignalled writes execute without completing; the signalled one behind them frees all their slots.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn only_signalled_work_requests_complete_and_free_the_slots_before_them(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let depth = link.sender.caps().sq_depth;
    let qp = link.qp(0);
    let mut batch: Vec<WorkRequest> =
        (0..depth as u64 - 1).map(|index| unsignaled(link.write(index, index, index, 1))).collect();
    batch.push(link.write(99, 50, 50, 1));
    link.sender.post_send(qp, &batch).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 1);
    assert_eq!(on_qp(&completions, qp), [(99, WcStatus::Success)]);
    let mut writes: Vec<(usize, usize, usize)> = (0..depth - 1).map(|index| (index, index, 1)).collect();
    writes.push((50, 50, 1));
    assert_eq!(link.target_bytes(), expected_target(&writes), "unsignalled writes executed too");
    // A full queue's worth of new posts is accepted only if polling the one completion freed every slot.
    let batch: Vec<WorkRequest> = (0..depth as u64).map(|index| link.write(200 + index, 0, 100, 1)).collect();
    link.sender.post_send(qp, &batch).unwrap();
    drain(&mut *harness, &mut *link.sender, depth);
}

/// A send queue holding only unsignalled work requests would never free a slot, so such a post is refused.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn posts_that_leave_a_full_queue_unsignalled_are_refused(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let depth = link.sender.caps().sq_depth;
    let qp = link.qp(0);
    let batch: Vec<WorkRequest> = (0..depth as u64).map(|index| unsignaled(link.write(index, 0, 0, 8))).collect();
    assert_eq!(link.sender.post_send(qp, &batch), Err(FabricError::SignalRequired { qp, depth }));
    link.sender.post_send(qp, &batch[1..]).unwrap();
    let one_more = unsignaled(link.write(50, 0, 100, 8));
    assert_eq!(link.sender.post_send(qp, &[one_more]), Err(FabricError::SignalRequired { qp, depth }));
    link.sender.post_send(qp, &[link.write(51, 0, 100, 8)]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 1);
    assert_eq!(on_qp(&completions, qp), [(51, WcStatus::Success)], "the refused unsignalled writes never ran");
    assert_eq!(link.target_bytes(), expected_target(&[(0, 0, 8), (0, 100, 8)]));
}

/// Posting past the depth fails with QueueFull and posts nothing, even the part of a batch that would fit;
/// polling completions returns the credits.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn posting_past_the_send_queue_depth_is_refused_until_completions_are_polled(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let depth = link.sender.caps().sq_depth;
    let qp = link.qp(0);
    for index in 0..depth as u64 - 1 {
        link.sender.post_send(qp, &[link.write(index, 0, 0, 4)]).unwrap();
    }
    let straddling = [link.write(100, 0, 100, 4), link.write(101, 0, 110, 4)];
    assert_eq!(link.sender.post_send(qp, &straddling), Err(FabricError::QueueFull { qp, depth }));
    link.sender.post_send(qp, &[link.write(depth as u64, 0, 0, 4)]).unwrap();
    assert_eq!(link.sender.post_send(qp, &[link.write(102, 0, 120, 4)]), Err(FabricError::QueueFull { qp, depth }));
    let completions = drain(&mut *harness, &mut *link.sender, depth);
    assert!(completions.iter().all(|wc| wc.wr_id < 100), "a refused batch must not run: {completions:#?}");
    assert_eq!(link.target_bytes(), expected_target(&[(0, 0, 4)]), "the refused writes left no byte");
    link.sender.post_send(qp, &straddling).unwrap();
    drain(&mut *harness, &mut *link.sender, 2);
}

/// A remote range that leaves the rkey's region completes RemoteAccess and changes no byte of the target, of its
/// neighbours or of the source.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
#[case::past_the_end(|addr| addr + TARGET_LEN as u64 - 4, 8)]
#[case::before_the_start(|addr| addr - 4, 8)]
#[case::one_byte_past_the_end(|addr| addr + TARGET_LEN as u64, 1)]
#[case::wrapping_the_address_space(|_| u64::MAX - 8, 16)]
fn out_of_bounds_remote_range_completes_remote_access_and_writes_nothing(
    backend: Backend,
    #[case] remote_addr: fn(u64) -> u64,
    #[case] len: u64,
) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let neighbours =
        [link.receiver.register(vec![SENTINEL; 64]).unwrap(), link.receiver.register(vec![SENTINEL; 64]).unwrap()];
    let mut wr = link.write(1, 0, 0, len);
    wr.remote.addr = remote_addr(link.target.addr);
    link.sender.post_send(link.qp(0), &[wr]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 1);
    assert_eq!(on_qp(&completions, link.qp(0)), [(1, WcStatus::RemoteAccess)]);
    assert_eq!(completions[0].byte_len, 0);
    assert_eq!(link.target_bytes(), vec![SENTINEL; TARGET_LEN]);
    for neighbour in &neighbours {
        assert_eq!(read_all(&*link.receiver, neighbour), vec![SENTINEL; 64], "a neighbouring region changed");
    }
    assert_eq!(read_all(&*link.sender, &link.source), pattern(SOURCE_LEN));
}

/// An SGE outside the region of its lkey (or with a revoked lkey) completes LocalProtection and writes nothing.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
#[case::past_the_end(|addr| addr + SOURCE_LEN as u64 - 4, false)]
#[case::before_the_start(|addr| addr - 4, false)]
#[case::revoked_lkey(|addr| addr, true)]
fn bad_local_range_or_lkey_completes_local_protection(
    backend: Backend,
    #[case] source_addr: fn(u64) -> u64,
    #[case] revoked: bool,
) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let mut wr = link.write(1, 0, 0, 8);
    wr.sges[0].addr = source_addr(link.source.addr);
    if revoked {
        let stale = link.sender.register(pattern(64)).unwrap();
        link.sender.deregister(&stale).unwrap();
        wr.sges[0] = Sge { addr: stale.addr, len: 8, lkey: stale.lkey };
    }
    link.sender.post_send(link.qp(0), &[wr]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 1);
    assert_eq!(on_qp(&completions, link.qp(0)), [(1, WcStatus::LocalProtection)]);
    assert_eq!(link.target_bytes(), vec![SENTINEL; TARGET_LEN]);
}

/// The first failure moves its QP to the error state: every later work request on it, queued or posted later,
/// completes Flushed (unsignalled ones too) and writes nothing; another QP keeps working.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn after_an_error_later_work_requests_flush_and_other_qps_continue(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 2);
    assert_depth_at_least(&link, 4);
    let (broken, healthy) = (link.qp(0), link.qp(1));
    let out_of_bounds = link.write(2, 0, TARGET_LEN as u64, 8);
    let batch = [link.write(1, 0, 0, 8), out_of_bounds, unsignaled(link.write(3, 0, 20, 8)), link.write(4, 0, 30, 8)];
    link.sender.post_send(broken, &batch).unwrap();
    link.sender.post_send(healthy, &[link.write(11, 0, 100, 8)]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 5);
    let flushed = WcStatus::Flushed;
    assert_eq!(
        on_qp(&completions, broken),
        [(1, WcStatus::Success), (2, WcStatus::RemoteAccess), (3, flushed), (4, flushed)]
    );
    assert_eq!(on_qp(&completions, healthy), [(11, WcStatus::Success)]);
    link.sender.post_send(broken, &[unsignaled(link.write(5, 0, 40, 8))]).unwrap();
    link.sender.post_send(healthy, &[link.write(12, 0, 110, 8)]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 2);
    assert_eq!(on_qp(&completions, broken), [(5, flushed)], "posting on a QP in error flushes, signalled or not");
    assert_eq!(on_qp(&completions, healthy), [(12, WcStatus::Success)]);
    assert_eq!(link.target_bytes(), expected_target(&[(0, 0, 8), (0, 100, 8), (0, 110, 8)]));
}

/// Work requests posted while their QP is failing, and after its failure was polled, all complete Flushed in post
/// order, signalled or not (Soft-RoCE before Linux 6.9 needs the verbs fabric's help for this).
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn work_requests_posted_on_a_failing_qp_all_flush(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    assert_depth_at_least(&link, 4);
    let qp = link.qp(0);
    let mut bad_lkey = unsignaled(link.write(0, 0, 0, 8));
    bad_lkey.sges[0].lkey = link.source.lkey ^ 0x8000_0000;
    link.sender.post_send(qp, &[bad_lkey]).unwrap();
    link.sender
        .post_send(qp, &[link.write(1, 0, 8, 8), link.write(2, 0, 16, 8), unsignaled(link.write(3, 0, 24, 8))])
        .unwrap();
    let flushed = WcStatus::Flushed;
    let completions = drain(&mut *harness, &mut *link.sender, 4);
    assert_eq!(on_qp(&completions, qp), [(0, WcStatus::LocalProtection), (1, flushed), (2, flushed), (3, flushed)]);
    let batch = [unsignaled(link.write(4, 0, 32, 8)), unsignaled(link.write(5, 0, 40, 8)), link.write(6, 0, 48, 8)];
    link.sender.post_send(qp, &batch).unwrap();
    link.sender.post_send(qp, &[link.write(7, 0, 56, 8)]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 4);
    assert_eq!(on_qp(&completions, qp), [(4, flushed), (5, flushed), (6, flushed), (7, flushed)]);
    assert_eq!(link.target_bytes(), vec![SENTINEL; TARGET_LEN]);
}

/// Misuse is a typed error, never a panic, and a refused batch posts nothing.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn misuse_of_qps_and_regions_is_an_error_not_a_panic(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let wr = link.write(1, 0, 0, 8);
    let never_created = QpNum(0xdead_beef);
    assert_eq!(
        link.sender.post_send(never_created, std::slice::from_ref(&wr)),
        Err(FabricError::UnknownQp(never_created))
    );
    let lonely = link.sender.create_qp().unwrap();
    assert_eq!(link.sender.connect_qp(never_created, lonely), Err(FabricError::UnknownQp(never_created)));
    assert_eq!(
        link.sender.post_send(lonely.qpn, std::slice::from_ref(&wr)),
        Err(FabricError::NotConnected(lonely.qpn))
    );
    let peer = link.receiver.create_qp().unwrap();
    assert_eq!(link.sender.connect_qp(link.qp(0), peer), Err(FabricError::AlreadyConnected(link.qp(0))));
    let too_many = WorkRequest { sges: vec![wr.sges[0]; link.sender.caps().max_sge + 1], ..wr.clone() };
    assert!(matches!(
        link.sender.post_send(link.qp(0), &[wr.clone(), too_many]),
        Err(FabricError::TooManySges { wr_id: 1, .. })
    ));
    let max = link.sender.caps().max_message;
    let huge = WorkRequest { sges: vec![Sge { len: max + 1, ..wr.sges[0] }], ..wr.clone() };
    assert!(matches!(link.sender.post_send(link.qp(0), &[wr, huge]), Err(FabricError::MessageTooLarge { .. })));
    // The valid first halves of the refused batches never ran.
    harness.settle();
    assert_eq!(link.sender.poll_cq(&mut Vec::new(), usize::MAX), 0);
    assert_eq!(link.target_bytes(), vec![SENTINEL; TARGET_LEN]);
}

/// Regions belong to their endpoint: another endpoint cannot read or deregister them, and reads stay inside.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn regions_are_owned_by_their_endpoint(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let target = link.target;
    assert_eq!(link.sender.read_local(&target, 0, &mut [0; 4]), Err(FabricError::UnknownRegion { addr: target.addr }));
    assert_eq!(link.sender.deregister(&target), Err(FabricError::UnknownRegion { addr: target.addr }));
    let forged = MemoryRegion { len: target.len + 1, ..target };
    assert_eq!(
        link.receiver.read_local(&forged, 0, &mut [0; 4]),
        Err(FabricError::UnknownRegion { addr: target.addr })
    );
    let out_of_region = link.receiver.read_local(&target, target.len - 2, &mut [0; 4]);
    assert_eq!(out_of_region, Err(FabricError::OutOfRegion { offset: target.len - 2, len: 4, region_len: target.len }));
    let mut tail = [0; 2];
    link.receiver.read_local(&target, target.len - 2, &mut tail).unwrap();
    assert_eq!(tail, [SENTINEL; 2]);
}

/// An rkey reaches only its own region: a revoked rkey, or a valid rkey with another region's address, completes
/// RemoteAccess and writes nothing.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
#[case::revoked_rkey(true)]
#[case::rkey_of_another_region(false)]
fn a_wrong_rkey_completes_remote_access(backend: Backend, #[case] revoked: bool) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let other = link.receiver.register(vec![SENTINEL; 64]).unwrap();
    let mut wr = link.write(1, 0, 0, 8);
    if revoked {
        wr.remote = RemoteAddr { addr: other.addr, rkey: other.rkey };
        link.receiver.deregister(&other).unwrap();
    } else {
        wr.remote.addr = other.addr;
    }
    link.sender.post_send(link.qp(0), &[wr]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 1);
    assert_eq!(on_qp(&completions, link.qp(0)), [(1, WcStatus::RemoteAccess)]);
    assert_eq!(link.target_bytes(), vec![SENTINEL; TARGET_LEN]);
    if !revoked {
        assert_eq!(read_all(&*link.receiver, &other), vec![SENTINEL; 64]);
    }
}

/// A write that runs past the end of its region, or carries an rkey no region has, completes RemoteAccess: the
/// target region's bytes outside the write's range, a region registered right after it and the source keep their
/// bytes (the range itself is undefined by the contract; within one MTU hardware writes none of it either). The QP
/// is then in the error state: a valid write behind it flushes.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
#[case::past_the_end(false, TARGET_LEN as u64 - 16, 32)]
#[case::unknown_rkey(true, 96, 32)]
fn guard_bytes_around_a_refused_write_stay_unchanged(
    backend: Backend,
    #[case] unknown_rkey: bool,
    #[case] target_offset: u64,
    #[case] len: u64,
) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let neighbour = link.receiver.register(vec![SENTINEL; TARGET_LEN]).unwrap();
    let mut wr = link.write(1, 8, target_offset, len);
    if unknown_rkey {
        wr.remote.rkey = link.target.rkey ^ 0x8000_0000;
        assert!(![link.target.rkey, neighbour.rkey].contains(&wr.remote.rkey));
    }
    let behind = link.write(2, 0, 0, 8);
    link.sender.post_send(link.qp(0), &[wr, behind]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 2);
    assert_eq!(on_qp(&completions, link.qp(0)), [(1, WcStatus::RemoteAccess), (2, WcStatus::Flushed)]);
    assert_eq!(completions[0].byte_len, 0);
    let target = link.target_bytes();
    let (start, end) = (target_offset as usize, (target_offset + len).min(TARGET_LEN as u64) as usize);
    assert_eq!(target[..start], [SENTINEL; TARGET_LEN][..start], "bytes before the refused write changed");
    assert_eq!(target[end..], [SENTINEL; TARGET_LEN][end..], "bytes after the refused write changed");
    assert_eq!(read_all(&*link.receiver, &neighbour), vec![SENTINEL; TARGET_LEN], "the neighbouring region changed");
    assert_eq!(read_all(&*link.sender, &link.source), pattern(SOURCE_LEN), "the source changed");
}

/// An RC QP answers only the QP it is connected to: a peer that never connected back makes writes time out.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn a_peer_that_is_not_connected_back_exceeds_retries(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 0);
    let local = link.sender.create_qp().unwrap();
    let remote = link.receiver.create_qp().unwrap();
    link.sender.connect_qp(local.qpn, remote).unwrap();
    link.sender.post_send(local.qpn, &[link.write(1, 0, 0, 8), link.write(2, 0, 8, 8)]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 2);
    assert_eq!(on_qp(&completions, local.qpn), [(1, WcStatus::RetryExceeded), (2, WcStatus::Flushed)]);
    assert_eq!(link.target_bytes(), vec![SENTINEL; TARGET_LEN]);
}

/// The fabric neither interprets nor deduplicates wr_ids.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn duplicate_wr_ids_are_reported_as_given(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    assert_depth_at_least(&link, 3);
    let batch = [link.write(7, 0, 0, 4), link.write(7, 4, 4, 4), link.write(7, 8, 8, 4)];
    link.sender.post_send(link.qp(0), &batch).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 3);
    assert_eq!(on_qp(&completions, link.qp(0)), [(7, WcStatus::Success); 3]);
    assert_eq!(link.target_bytes(), expected_target(&[(0, 0, 12)]));
}

/// WRITE_WITH_IMM: the receiver's RecvImm carries the immediate and, when polled, the data of that write and of
/// every earlier write on the QP has landed.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn write_with_imm_notifies_the_receiver_after_the_data_landed(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let (qp, receiver_qp) = link.qps[0];
    let with_imm = WorkRequest { imm: Some(0xC0FFEE), ..link.write(2, 16, 64, 32) };
    link.sender.post_send(qp, &[unsignaled(link.write(1, 0, 0, 16)), with_imm]).unwrap();
    let notes = drain(&mut *harness, &mut *link.receiver, 1);
    let note = notes[0];
    assert_eq!(
        (note.kind, note.status, note.imm, note.qp),
        (WcKind::RecvImm, WcStatus::Success, Some(0xC0FFEE), receiver_qp)
    );
    assert_eq!(note.byte_len, 32);
    assert_eq!(link.target_bytes(), expected_target(&[(0, 0, 16), (16, 64, 32)]));
    let completions = drain(&mut *harness, &mut *link.sender, 1);
    assert_eq!((completions[0].wr_id, completions[0].kind, completions[0].imm), (2, WcKind::Write, None));
}

/// The bytes that land are the SGEs gathered in order, across regions, contiguously at the remote address.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn multi_sge_writes_land_as_the_gathered_bytes(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    assert!(link.sender.caps().max_sge >= 3, "this case needs three SGEs per work request");
    let second: Vec<u8> = (0..32).map(|index| 200 - index).collect();
    let second_region = link.sender.register(second.clone()).unwrap();
    let sges = vec![
        Sge { addr: link.source.addr + 3, len: 5, lkey: link.source.lkey },
        Sge { addr: second_region.addr + 10, len: 7, lkey: second_region.lkey },
        Sge { addr: link.source.addr + 100, len: 2, lkey: link.source.lkey },
    ];
    let wr = WorkRequest { sges, ..link.write(1, 0, 40, 0) };
    link.sender.post_send(link.qp(0), &[wr]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 1);
    assert_eq!((completions[0].status, completions[0].byte_len), (WcStatus::Success, 14));
    let source = pattern(SOURCE_LEN);
    let gathered = [&source[3..8], &second[10..17], &source[100..102]].concat();
    let mut expected = vec![SENTINEL; TARGET_LEN];
    expected[40..54].copy_from_slice(&gathered);
    assert_eq!(link.target_bytes(), expected);
}

/// Deregistering hands back the current bytes and revokes the keys.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn deregister_returns_the_bytes_and_revokes_the_keys(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    link.sender.post_send(link.qp(0), &[link.write(1, 10, 20, 30)]).unwrap();
    drain(&mut *harness, &mut *link.sender, 1);
    let target = link.target;
    assert_eq!(link.receiver.deregister(&target).unwrap(), expected_target(&[(10, 20, 30)]));
    assert_eq!(link.receiver.deregister(&target), Err(FabricError::UnknownRegion { addr: target.addr }));
    assert_eq!(
        link.receiver.read_local(&target, 0, &mut [0; 1]),
        Err(FabricError::UnknownRegion { addr: target.addr })
    );
    link.sender.post_send(link.qp(0), &[link.write(2, 0, 0, 8)]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 1);
    assert_eq!(on_qp(&completions, link.qp(0)), [(2, WcStatus::RemoteAccess)]);
}

/// A zero-byte write is a valid message: it completes with byte_len 0 and changes nothing.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn a_zero_byte_write_completes_and_changes_nothing(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 1);
    let wr = WorkRequest { sges: Vec::new(), ..link.write(1, 0, 0, 0) };
    link.sender.post_send(link.qp(0), &[wr]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 1);
    assert_eq!((completions[0].status, completions[0].byte_len), (WcStatus::Success, 0));
    assert_eq!(link.target_bytes(), vec![SENTINEL; TARGET_LEN]);
}

/// Many QP pairs between two endpoints each carry their own writes and notifications (on hardware the shared CQ
/// grows as QPs are created).
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn many_qp_pairs_each_deliver_their_writes(backend: Backend) {
    const PAIRS: usize = 12;
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, PAIRS);
    for index in 0..PAIRS {
        let offset = 16 * index as u64;
        let wr = WorkRequest { imm: Some(index as u32), ..link.write(index as u64, offset, offset, 16) };
        link.sender.post_send(link.qp(index), &[wr]).unwrap();
    }
    let completions = drain(&mut *harness, &mut *link.sender, PAIRS);
    for index in 0..PAIRS {
        assert_eq!(on_qp(&completions, link.qp(index)), [(index as u64, WcStatus::Success)]);
    }
    let mut notes = drain(&mut *harness, &mut *link.receiver, PAIRS);
    notes.sort_by_key(|note| note.imm);
    let expected: Vec<(QpNum, Option<u32>)> = (0..PAIRS).map(|index| (link.qps[index].1, Some(index as u32))).collect();
    assert_eq!(notes.iter().map(|note| (note.qp, note.imm)).collect::<Vec<_>>(), expected);
    assert_eq!(link.target_bytes(), expected_target(&[(0, 0, 16 * PAIRS)]));
}

/// An empty region is a real registration: it has an address and keys, a zero-byte write to it completes, a
/// one-byte write does not, and deregistering hands back the same (empty) vector.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn an_empty_region_takes_zero_byte_writes_only(backend: Backend) {
    let mut harness = backend.harness();
    let mut link = link(&mut *harness, 2);
    let empty = link.receiver.register(Vec::with_capacity(64)).unwrap();
    assert_eq!(empty.len, 0);
    assert_ne!(empty.addr, 0);
    link.receiver.read_local(&empty, 0, &mut []).unwrap();
    assert_eq!(
        link.receiver.read_local(&empty, 0, &mut [0]),
        Err(FabricError::OutOfRegion { offset: 0, len: 1, region_len: 0 })
    );
    let remote = RemoteAddr { addr: empty.addr, rkey: empty.rkey };
    let zero_bytes = WorkRequest { sges: Vec::new(), remote, ..link.write(1, 0, 0, 0) };
    link.sender.post_send(link.qp(0), &[zero_bytes]).unwrap();
    let one_byte = WorkRequest { remote, ..link.write(2, 0, 0, 1) };
    link.sender.post_send(link.qp(1), &[one_byte]).unwrap();
    let completions = drain(&mut *harness, &mut *link.sender, 2);
    assert_eq!(on_qp(&completions, link.qp(0)), [(1, WcStatus::Success)]);
    assert_eq!(on_qp(&completions, link.qp(1)), [(2, WcStatus::RemoteAccess)]);
    let bytes = link.receiver.deregister(&empty).unwrap();
    assert!(bytes.is_empty() && bytes.capacity() >= 64, "the registered vector comes back as it was");
    assert_eq!(link.target_bytes(), vec![SENTINEL; TARGET_LEN]);
}

// ---------------------------------------------------------------------------------------------------------------
// Random sequences of posts, polls and time steps.

/// One scatter-gather entry: region 0 or 1 of the sender, or its revoked region (2).
#[derive(Debug, Clone)]
struct SgeShape {
    region: usize,
    offset: u64,
    len: u64,
}

#[derive(Debug, Clone)]
struct WrShape {
    sges: Vec<SgeShape>,
    /// Region 0 or 1 of the receiver, or its revoked region (2).
    target: usize,
    target_offset: u64,
    signaled: bool,
    imm: bool,
}

/// What makes a work request fail; drawn rarely, so QPs live long enough for flushes and credits to matter.
#[derive(Debug, Clone, Copy)]
enum Fault {
    RevokedLkey,
    LocalRange,
    RevokedRkey,
    RemoteRange,
    TooManySges,
}

#[derive(Debug, Clone)]
enum Op {
    Post { qp: usize, wrs: Vec<WrShape> },
    Poll,
    Step,
}

const RANDOM_QPS: usize = 3;
const RANDOM_REGION_LEN: u64 = 48;

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        4 => (0..RANDOM_QPS, prop::collection::vec(wr_shapes(), 1..=3)).prop_map(|(qp, wrs)| Op::Post { qp, wrs }),
        2 => Just(Op::Poll),
        2 => Just(Op::Step),
    ];
    prop::collection::vec(op, 1..40)
}

/// Valid work requests (at most 3 SGEs of at most 15 bytes, landing inside a 48-byte target), one in 13 faulted.
fn wr_shapes() -> impl Strategy<Value = WrShape> {
    let sge = (0..2usize, 0..=32u64, 0..16u64).prop_map(|(region, offset, len)| SgeShape { region, offset, len });
    let fault = prop_oneof![
        Just(Fault::RevokedLkey),
        Just(Fault::LocalRange),
        Just(Fault::RevokedRkey),
        Just(Fault::RemoteRange),
        Just(Fault::TooManySges)
    ];
    let fault = prop_oneof![12 => Just(None), 1 => fault.prop_map(Some)];
    (prop::collection::vec(sge, 0..=3), 0..2usize, 0..=RANDOM_REGION_LEN, any::<bool>(), any::<bool>(), fault).prop_map(
        |(sges, target, target_offset, signaled, imm, fault)| {
            let total: u64 = sges.iter().map(|sge| sge.len).sum();
            let target_offset = target_offset.min(RANDOM_REGION_LEN - total);
            with_fault(WrShape { sges, target, target_offset, signaled, imm }, fault, total)
        },
    )
}

fn with_fault(mut shape: WrShape, fault: Option<Fault>, total: u64) -> WrShape {
    if matches!(fault, Some(Fault::RevokedLkey | Fault::LocalRange)) && shape.sges.is_empty() {
        shape.sges.push(SgeShape { region: 0, offset: 0, len: 0 });
    }
    match fault {
        None => {}
        Some(Fault::RevokedLkey) => shape.sges[0].region = 2,
        Some(Fault::LocalRange) => shape.sges[0].offset = RANDOM_REGION_LEN + 1 - shape.sges[0].len,
        Some(Fault::RevokedRkey) => shape.target = 2,
        Some(Fault::RemoteRange) => shape.target_offset = RANDOM_REGION_LEN + 1 - total,
        Some(Fault::TooManySges) => shape.sges.resize(CAPS.max_sge + 1, SgeShape { region: 0, offset: 0, len: 1 }),
    }
    shape
}

/// Everything the random run needs: endpoints, QP pairs, the sender's and receiver's regions (the third of each
/// is registered and then deregistered, so its keys are revoked) and what was accepted.
struct RandomRun {
    link: Link,
    sources: Vec<(MemoryRegion, Vec<u8>)>,
    targets: Vec<MemoryRegion>,
    accepted: Vec<Accepted>,
    completions: Vec<WorkCompletion>,
    notes: Vec<WorkCompletion>,
}

/// An accepted work request: its QP, signalling, immediate and, if its SGEs were valid, the bytes it carries.
#[derive(Debug)]
struct Accepted {
    qp: QpNum,
    signaled: bool,
    imm: bool,
    target: usize,
    target_offset: u64,
    bytes: Option<Vec<u8>>,
}

impl RandomRun {
    fn new(harness: &mut dyn Harness) -> RandomRun {
        let mut link = link(harness, RANDOM_QPS);
        let mut sources = Vec::new();
        let mut targets = Vec::new();
        for index in 0..3u8 {
            let bytes: Vec<u8> =
                (0..RANDOM_REGION_LEN as u8).map(|byte| byte.wrapping_mul(7).wrapping_add(index * 64)).collect();
            sources.push((link.sender.register(bytes.clone()).unwrap(), bytes));
            targets.push(link.receiver.register(vec![SENTINEL; RANDOM_REGION_LEN as usize]).unwrap());
        }
        link.sender.deregister(&sources[2].0).unwrap();
        link.receiver.deregister(&targets[2]).unwrap();
        RandomRun { link, sources, targets, accepted: Vec::new(), completions: Vec::new(), notes: Vec::new() }
    }

    fn work_request(&self, wr_id: u64, shape: &WrShape) -> WorkRequest {
        let sges = shape.sges.iter().map(|sge| {
            let region = self.sources[sge.region].0;
            Sge { addr: region.addr + sge.offset, len: sge.len, lkey: region.lkey }
        });
        let target = self.targets[shape.target];
        WorkRequest {
            wr_id,
            sges: sges.collect(),
            remote: RemoteAddr { addr: target.addr + shape.target_offset, rkey: target.rkey },
            imm: shape.imm.then_some(wr_id as u32),
            signaled: shape.signaled,
        }
    }

    /// The bytes the SGEs gather, or `None` if one leaves its region or uses the revoked key. An empty SGE carries
    /// nothing whatever its key and address: hardware does not check it (the contract's Protection rule).
    fn gathered(&self, shape: &WrShape) -> Option<Vec<u8>> {
        let mut res = Vec::new();
        for sge in shape.sges.iter().filter(|sge| sge.len > 0) {
            let bytes = &self.sources.get(sge.region).filter(|_| sge.region < 2)?.1;
            res.extend_from_slice(bytes.get(sge.offset as usize..(sge.offset + sge.len) as usize)?);
        }
        Some(res)
    }

    fn post(&mut self, qp_index: usize, shapes: &[WrShape]) -> Result<(), TestCaseError> {
        let first_id = self.accepted.len() as u64;
        let wrs: Vec<WorkRequest> =
            shapes.iter().enumerate().map(|(index, shape)| self.work_request(first_id + index as u64, shape)).collect();
        let qp = self.link.qp(qp_index);
        let too_many_sges = shapes.iter().any(|shape| shape.sges.len() > CAPS.max_sge);
        match self.link.sender.post_send(qp, &wrs) {
            Ok(()) => prop_assert!(!too_many_sges, "a work request with too many SGEs was accepted"),
            Err(FabricError::TooManySges { .. }) if too_many_sges => return Ok(()),
            Err(FabricError::QueueFull { .. } | FabricError::SignalRequired { .. }) if !too_many_sges => return Ok(()),
            Err(error) => return Err(TestCaseError::fail(format!("unexpected refusal: {error}"))),
        }
        for shape in shapes {
            let accepted = Accepted {
                qp,
                signaled: shape.signaled,
                imm: shape.imm,
                target: shape.target,
                target_offset: shape.target_offset,
                bytes: self.gathered(shape),
            };
            self.accepted.push(accepted);
        }
        Ok(())
    }

    fn poll(&mut self) {
        self.link.sender.poll_cq(&mut self.completions, usize::MAX);
        self.link.receiver.poll_cq(&mut self.notes, usize::MAX);
    }

    /// Whether work request `wr_id` wrote its bytes: a Success completion, or unsignalled and no completion at all
    /// (failures always complete).
    fn succeeded(&self, wr_id: usize) -> bool {
        match self.completions.iter().find(|wc| wc.wr_id == wr_id as u64) {
            Some(wc) => wc.status == WcStatus::Success,
            None => !self.accepted[wr_id].signaled,
        }
    }
}

fn random_posts_keep_the_contract(harness: &mut dyn Harness, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut run = RandomRun::new(harness);
    for op in ops {
        match op {
            Op::Post { qp, wrs } => run.post(*qp, wrs)?,
            Op::Poll => run.poll(),
            Op::Step => harness.step(),
        }
    }
    harness.settle();
    run.poll();
    check_completions(&run)?;
    check_target_bytes(&run)?;
    for (region, bytes) in &run.sources[..2] {
        prop_assert_eq!(&read_all(&*run.link.sender, region), bytes, "source memory changed");
    }
    Ok(())
}

/// Each signalled work request completes exactly once, an unsignalled one only in error, per QP in post order,
/// and after a QP's first failure everything behind it is flushed. One RecvImm per successful immediate.
fn check_completions(run: &RandomRun) -> Result<(), TestCaseError> {
    for (wr_id, accepted) in run.accepted.iter().enumerate() {
        let mine: Vec<&WorkCompletion> = run.completions.iter().filter(|wc| wc.wr_id == wr_id as u64).collect();
        prop_assert!(mine.len() <= 1, "wr {} completed {} times", wr_id, mine.len());
        prop_assert!(!accepted.signaled || mine.len() == 1, "signalled wr {} never completed", wr_id);
        if let Some(wc) = mine.first() {
            prop_assert_eq!(wc.qp, accepted.qp);
            prop_assert!(accepted.signaled || wc.status != WcStatus::Success, "unsignalled wr {} completed", wr_id);
        }
    }
    prop_assert!(run.completions.iter().all(|wc| (wc.wr_id as usize) < run.accepted.len()), "a refused batch ran");
    for qp in run.link.qps.iter().map(|&(qp, _)| qp) {
        let statuses = on_qp(&run.completions, qp);
        prop_assert!(statuses.windows(2).all(|pair| pair[0].0 < pair[1].0), "{} out of post order: {:?}", qp, statuses);
        let first_failure = statuses.iter().position(|&(_, status)| status != WcStatus::Success);
        if let Some(first) = first_failure {
            prop_assert!(
                statuses[first + 1..].iter().all(|&(_, status)| status == WcStatus::Flushed),
                "{:?}",
                statuses
            );
        }
    }
    let imm_successes =
        (0..run.accepted.len()).filter(|&wr_id| run.accepted[wr_id].imm && run.succeeded(wr_id)).count();
    prop_assert_eq!(run.notes.len(), imm_successes, "one RecvImm per successful WRITE_WITH_IMM");
    Ok(())
}

/// Every target byte is the sentinel unless a successful write covered it, and then it is a byte one of those
/// writes carried there; a successful write had valid SGEs.
fn check_target_bytes(run: &RandomRun) -> Result<(), TestCaseError> {
    for (target_index, target) in run.targets[..2].iter().enumerate() {
        let bytes = read_all(&*run.link.receiver, target);
        for (offset, &byte) in bytes.iter().enumerate() {
            let mut candidates = vec![];
            for (wr_id, accepted) in run.accepted.iter().enumerate() {
                if accepted.target != target_index || !run.succeeded(wr_id) {
                    continue;
                }
                let carried = accepted.bytes.as_ref();
                prop_assert!(carried.is_some(), "wr {} succeeded with an invalid SGE", wr_id);
                let index = (offset as u64).checked_sub(accepted.target_offset);
                candidates.extend(index.and_then(|index| carried.and_then(|it| it.get(index as usize))));
            }
            let allowed = if candidates.is_empty() { byte == SENTINEL } else { candidates.contains(&byte) };
            prop_assert!(allowed, "target {} byte {} is {:#x}, allowed {:?}", target_index, offset, byte, candidates);
        }
    }
    Ok(())
}

fn random_config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|it| it.parse().ok()).unwrap_or(256);
    ProptestConfig { cases, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(random_config())]

    /// Random posts (in and out of bounds, revoked keys, random signalling and immediates), polls and time steps on
    /// three QPs never panic, complete every signalled work request exactly once and never change a byte outside
    /// every successful write's target range.
    #[test]
    fn random_posts_keep_the_contract_on_the_sim(ops in ops()) {
        random_posts_keep_the_contract(&mut *Backend::Sim.harness(), &ops)?;
    }
}

/// Few cases on hardware (the test guest emulates its CPU): `KVRELAY_RDMA_CASES`, default 16.
#[cfg(feature = "rdma")]
fn rdma_random_config() -> ProptestConfig {
    let cases = std::env::var("KVRELAY_RDMA_CASES").ok().and_then(|it| it.parse().ok()).unwrap_or(16);
    ProptestConfig { cases, max_shrink_iters: 64, ..ProptestConfig::default() }
}

#[cfg(feature = "rdma")]
proptest! {
    #![proptest_config(rdma_random_config())]

    /// The same random sequences on the verbs fabric.
    #[test]
    fn random_posts_keep_the_contract_on_rdma(ops in ops()) {
        random_posts_keep_the_contract(&mut *Backend::Rdma.harness(), &ops)?;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Simulated time (SimWorld only).

/// A world with a sender and a receiver, one connected QP pair and the usual regions.
fn sim_link() -> (SimWorld, Link) {
    let mut harness = Sim { world: SimWorld::new(CAPS), nodes: 0 };
    let link = link(&mut harness, 2);
    (harness.world, link)
}

/// Posting executes nothing: bytes and completions appear exactly at the delivery time.
#[test]
fn completions_wait_for_the_world_to_reach_the_delivery_time() {
    let (world, mut link) = sim_link();
    link.sender.post_send(link.qp(0), &[link.write(1, 0, 0, 100)]).unwrap();
    let delivery_ns = world::LATENCY_NS + world::wire_time_ns(100);
    assert_eq!(world.next_event(), Some(delivery_ns));
    let mut completions = Vec::new();
    assert_eq!(link.sender.poll_cq(&mut completions, usize::MAX), 0, "nothing completes at post time");
    world.advance_to(delivery_ns - 1);
    assert_eq!(link.sender.poll_cq(&mut completions, usize::MAX), 0, "nothing completes before delivery");
    assert_eq!(link.target_bytes(), vec![SENTINEL; TARGET_LEN], "no byte lands before delivery");
    world.advance_to(delivery_ns);
    assert_eq!(link.sender.poll_cq(&mut completions, usize::MAX), 1);
    assert_eq!(link.target_bytes(), expected_target(&[(0, 0, 100)]));
    assert_eq!((world.now(), world.next_event()), (delivery_ns, None));
}

/// Delivery = the QP's wire free again (FIFO, pipelined) + latency; QPs do not wait for each other; a later post
/// starts from the current time.
#[test]
fn delivery_times_follow_the_wire_and_latency_model() {
    let (world, mut link) = sim_link();
    let (wire, latency) = (world::wire_time_ns, world::LATENCY_NS);
    link.sender.post_send(link.qp(0), &[link.write(1, 0, 0, 250), link.write(2, 0, 0, 25)]).unwrap();
    link.sender.post_send(link.qp(1), &[link.write(3, 0, 0, 50)]).unwrap();
    let mut times = Vec::new();
    while let Some(time_ns) = world.next_event() {
        times.push(time_ns);
        world.advance_to(time_ns);
    }
    assert_eq!(times, [wire(50) + latency, wire(250) + latency, wire(250) + wire(25) + latency]);
    world.advance_to(1_000_000);
    link.sender.post_send(link.qp(0), &[link.write(4, 0, 0, 25)]).unwrap();
    assert_eq!(world.next_event(), Some(1_000_000 + wire(25) + latency), "an idle wire starts at the post time");
    world.run_until_idle();
    assert_eq!(world.now(), 1_000_000 + wire(25) + latency);
    let mut completions = Vec::new();
    link.sender.poll_cq(&mut completions, usize::MAX);
    let order: Vec<u64> = completions.iter().map(|wc| wc.wr_id).collect();
    assert_eq!(order, [3, 1, 2, 4], "across QPs completions follow delivery time, not post order");
}

/// Polling frees slots, not delivery: a delivered but unpolled completion still holds its credit.
#[test]
fn send_queue_slots_are_freed_by_polling_not_by_delivery() {
    let (world, mut link) = sim_link();
    let depth = CAPS.sq_depth;
    let qp = link.qp(0);
    let batch: Vec<WorkRequest> = (0..depth as u64).map(|index| link.write(index, 0, 0, 4)).collect();
    link.sender.post_send(qp, &batch).unwrap();
    world.run_until_idle();
    assert_eq!(link.sender.post_send(qp, &[link.write(9, 0, 0, 4)]), Err(FabricError::QueueFull { qp, depth }));
    let mut completions = Vec::new();
    assert_eq!(link.sender.poll_cq(&mut completions, 1), 1, "poll_cq honours max");
    link.sender.post_send(qp, &[link.write(9, 0, 0, 4)]).unwrap();
    assert_eq!(link.sender.post_send(qp, &[link.write(10, 0, 0, 4)]), Err(FabricError::QueueFull { qp, depth }));
}
