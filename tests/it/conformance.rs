//! The transport conformance suite on kvrelay's own transports: every case of the library registry
//! (`kvrelay::certify::conformance::cases`, the contract of `kvrelay::fabric::verbs::Endpoint`) on every backend,
//! proof that the cases can fail (deliberately broken transports), and what stays test-only: the random-posts
//! property over any `Transport` and the cases about simulated time (`SimWorld` directly, at the end).
//!
//! Backends: the in-memory `SimTransport` always, and with the cargo feature `rdma` the verbs fabric on a real
//! device (`RdmaTransport`; `KVRELAY_RDMA_DEVICE` names it, default the first device with an active port). Run the
//! RDMA ones in the test guest (ci/rdma.sh does) with `KVRELAY_VM_SHARE=$PWD
//! CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=$PWD/ci/rdma/run-in-guest.sh cargo test --features rdma --test it --
//! conformance rdma`.

use kvrelay::certify::conformance::{
    cases, expected_target, on_qp, read_all, CaseError, Group, Link, SENTINEL, SUITE_CAPS, TARGET_LEN,
};
use kvrelay::certify::{Identity, SimTransport, Transport, TransportError};
use kvrelay::fabric::verbs::{
    Caps, Endpoint, FabricError, MemoryRegion, NodeId, QpInfo, QpNum, RemoteAddr, Sge, WcStatus, WorkCompletion,
    WorkRequest,
};
use kvrelay::fabric::world::{self, SimWorld};
use proptest::prelude::*;
use rstest::rstest;

/// What every backend is asked for (the suite's caps).
const CAPS: Caps = SUITE_CAPS;

/// Every transport the suite runs on.
#[derive(Debug, Clone, Copy)]
enum Backend {
    Sim,
    #[cfg(feature = "rdma")]
    Rdma,
}

impl Backend {
    fn transport(self) -> Box<dyn Transport> {
        match self {
            Backend::Sim => Box::new(SimTransport::new(CAPS)),
            #[cfg(feature = "rdma")]
            Backend::Rdma => Box::new(rdma::transport()),
        }
    }
}

/// Runs every registered case on `transport`: the id and error of each that did not pass.
fn run_suite(transport: &mut dyn Transport) -> Vec<(&'static str, CaseError)> {
    cases().iter().filter_map(|case| (case.run)(transport).err().map(|error| (case.id, error))).collect()
}

/// Each failing case's id and error, one a line.
fn listing(failures: &[(&'static str, CaseError)]) -> String {
    failures.iter().map(|(id, error)| format!("  {id}: {error}\n")).collect()
}

/// Every case of the registry passes on the backend: none fails, none is unsupported with the suite's caps.
#[cfg_attr(not(feature = "rdma"), rstest(backend => [Backend::Sim]))]
#[cfg_attr(feature = "rdma", rstest(backend => [Backend::Sim, Backend::Rdma]))]
fn every_conformance_case_passes(backend: Backend) {
    let failures = run_suite(&mut *backend.transport());
    assert!(failures.is_empty(), "{} of {} cases did not pass:\n{}", failures.len(), cases().len(), listing(&failures));
}

/// One named test per case on the in-memory fabric, so a failure names its case (the list is checked against the
/// registry by `the_named_sim_tests_cover_the_registry`).
macro_rules! sim_cases {
    ($($id:ident),* $(,)?) => {
        const SIM_CASE_IDS: &[&str] = &[$(stringify!($id)),*];

        mod sim_case {
            $(
                #[test]
                fn $id() {
                    super::passes_on_the_sim(stringify!($id));
                }
            )*
        }
    };
}

sim_cases![
    completions_of_one_qp_arrive_in_post_order,
    only_signalled_work_requests_complete_and_free_the_slots_before_them,
    posts_that_leave_a_full_queue_unsignalled_are_refused,
    posting_past_the_send_queue_depth_is_refused_until_completions_are_polled,
    out_of_bounds_remote_range_completes_remote_access_and_writes_nothing_past_the_end,
    out_of_bounds_remote_range_completes_remote_access_and_writes_nothing_before_the_start,
    out_of_bounds_remote_range_completes_remote_access_and_writes_nothing_one_byte_past_the_end,
    out_of_bounds_remote_range_completes_remote_access_and_writes_nothing_wrapping_the_address_space,
    bad_local_range_or_lkey_completes_local_protection_past_the_end,
    bad_local_range_or_lkey_completes_local_protection_before_the_start,
    bad_local_range_or_lkey_completes_local_protection_revoked_lkey,
    after_an_error_later_work_requests_flush_and_other_qps_continue,
    work_requests_posted_on_a_failing_qp_all_flush,
    misuse_of_qps_and_regions_is_an_error_not_a_panic,
    regions_are_owned_by_their_endpoint,
    a_wrong_rkey_completes_remote_access_revoked_rkey,
    a_wrong_rkey_completes_remote_access_rkey_of_another_region,
    guard_bytes_around_a_refused_write_stay_unchanged_past_the_end,
    guard_bytes_around_a_refused_write_stay_unchanged_unknown_rkey,
    a_peer_that_is_not_connected_back_exceeds_retries,
    duplicate_wr_ids_are_reported_as_given,
    write_with_imm_notifies_the_receiver_after_the_data_landed,
    multi_sge_writes_land_as_the_gathered_bytes,
    deregister_returns_the_bytes_and_revokes_the_keys,
    a_zero_byte_write_completes_and_changes_nothing,
    many_qp_pairs_each_deliver_their_writes,
    an_empty_region_takes_zero_byte_writes_only,
];

#[track_caller]
fn passes_on_the_sim(id: &str) {
    let case = kvrelay::certify::conformance::case_by_id(id).unwrap_or_else(|| panic!("no case {id}"));
    let result = (case.run)(&mut SimTransport::new(CAPS));
    assert_eq!(result, Ok(()), "{id}: {}", case.claim);
}

#[test]
fn the_named_sim_tests_cover_the_registry() {
    let registered: Vec<&str> = cases().iter().map(|case| case.id).collect();
    assert_eq!(SIM_CASE_IDS, registered, "sim_cases! lists the registry's ids in its order");
}

/// Ids are the report's keys: unique and snake_case; claims are one line; the error paths are their own group.
#[test]
fn registry_ids_are_unique_snake_case_and_claims_are_one_line() {
    let mut ids: Vec<&str> = cases().iter().map(|case| case.id).collect();
    for id in &ids {
        let snake = id.bytes().all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || byte == b'_');
        assert!(snake && id.starts_with(|first: char| first.is_ascii_lowercase()) && !id.contains("__"), "{id}");
    }
    ids.sort_unstable();
    let count = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), count, "duplicate case ids");
    for case in cases() {
        assert!(!case.claim.is_empty() && !case.claim.contains('\n'), "{}: {:?}", case.id, case.claim);
        let error_path =
            ["out_of_bounds", "local_protection", "flush", "misuse", "owned", "rkey", "guard", "not_connected"]
                .iter()
                .any(|word| case.id.contains(word));
        assert_eq!(case.group == Group::ErrorPath, error_path, "{} is in {}", case.id, case.group.as_str());
    }
}

/// A transport granting less than a case needs gets Unsupported naming the limit, and the other cases still pass.
#[test]
fn a_transport_granting_one_sge_makes_the_gather_case_unsupported() {
    let mut transport = SimTransport::new(Caps { max_sge: 1, ..CAPS });
    let failures = run_suite(&mut transport);
    let expected = CaseError::Unsupported("needs max_sge >= 3, the transport grants 1".to_owned());
    assert_eq!(failures, [("multi_sge_writes_land_as_the_gathered_bytes", expected)], "{}", listing(&failures));
}

// ---------------------------------------------------------------------------------------------------------------
// The cases can fail: deliberately broken transports.

/// What a broken transport's endpoints get wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sabotage {
    /// `poll_cq` takes completions off the fabric and hands out none.
    DropCompletions,
    /// Every WRITE lands one byte after its remote address.
    ShiftWrites,
    /// Every completion reports Success, whatever happened.
    ReportSuccess,
    /// Refused calls claim success: posts, connects, reads and deregistrations never return an error.
    HideErrors,
}

/// The in-memory fabric with one sabotage in every endpoint it opens.
pub(crate) struct Broken {
    pub(crate) inner: SimTransport,
    pub(crate) sabotage: Sabotage,
}

struct BrokenEndpoint {
    inner: Box<dyn Endpoint>,
    sabotage: Sabotage,
}

impl Transport for Broken {
    fn identity(&self) -> Identity {
        Identity { name: format!("broken-{:?}", self.sabotage), ..self.inner.identity() }
    }

    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, TransportError> {
        let inner = self.inner.open(node, caps)?;
        Ok(Box::new(BrokenEndpoint { inner, sabotage: self.sabotage }))
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

impl BrokenEndpoint {
    /// With [`Sabotage::HideErrors`], any outcome becomes success.
    fn hide<T>(&self, res: Result<T, FabricError>) -> Result<(), FabricError> {
        match res {
            Err(_) if self.sabotage == Sabotage::HideErrors => Ok(()),
            other => other.map(drop),
        }
    }
}

impl Endpoint for BrokenEndpoint {
    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn node(&self) -> NodeId {
        self.inner.node()
    }

    fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
        self.inner.register(bytes)
    }

    fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
        let res = self.inner.deregister(region);
        self.hide(res.clone()).map(|()| res.unwrap_or_default())
    }

    fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
        self.hide(self.inner.read_local(region, offset, out))
    }

    fn create_qp(&mut self) -> Result<QpInfo, FabricError> {
        self.inner.create_qp()
    }

    fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        let res = self.inner.connect_qp(local, remote);
        self.hide(res)
    }

    fn post_send(&mut self, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        if self.sabotage != Sabotage::ShiftWrites {
            let res = self.inner.post_send(qp, wrs);
            return self.hide(res);
        }
        let shifted: Vec<WorkRequest> = wrs
            .iter()
            .map(|wr| WorkRequest {
                remote: RemoteAddr { addr: wr.remote.addr.wrapping_add(1), ..wr.remote },
                ..wr.clone()
            })
            .collect();
        self.inner.post_send(qp, &shifted)
    }

    fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let mut taken = Vec::new();
        let count = self.inner.poll_cq(&mut taken, max);
        match self.sabotage {
            Sabotage::DropCompletions => return 0,
            Sabotage::ShiftWrites | Sabotage::HideErrors => {}
            Sabotage::ReportSuccess => taken.iter_mut().for_each(|wc| wc.status = WcStatus::Success),
        }
        out.extend(taken);
        count
    }
}

/// The ids of the cases that fail, and of those that pass, on a transport with `sabotage` (none may be
/// unsupported).
fn outcome(sabotage: Sabotage) -> (Vec<&'static str>, Vec<&'static str>) {
    let mut transport = Broken { inner: SimTransport::new(CAPS), sabotage };
    let failures = run_suite(&mut transport);
    let unsupported: Vec<_> = failures.iter().filter(|(_, error)| matches!(error, CaseError::Unsupported(_))).collect();
    assert!(unsupported.is_empty(), "{unsupported:?}");
    let failed: Vec<&str> = failures.iter().map(|(id, _)| *id).collect();
    let passed = cases().iter().map(|case| case.id).filter(|id| !failed.contains(id)).collect();
    (failed, passed)
}

/// Dropping completions fails every case except the two that expect none (ownership and refused posts).
#[test]
fn a_transport_that_drops_completions_fails_every_case_that_awaits_one() {
    let (failed, passed) = outcome(Sabotage::DropCompletions);
    assert_eq!(passed, ["misuse_of_qps_and_regions_is_an_error_not_a_panic", "regions_are_owned_by_their_endpoint"]);
    assert_eq!(failed.len(), cases().len() - 2);
}

/// Writes landing one byte late fail every case that checks where a successful write's bytes land.
#[test]
fn a_transport_that_misplaces_writes_fails_every_case_that_checks_landed_bytes() {
    let (failed, _) = outcome(Sabotage::ShiftWrites);
    let expected = [
        "only_signalled_work_requests_complete_and_free_the_slots_before_them",
        "posts_that_leave_a_full_queue_unsignalled_are_refused",
        "posting_past_the_send_queue_depth_is_refused_until_completions_are_polled",
        "after_an_error_later_work_requests_flush_and_other_qps_continue",
        "duplicate_wr_ids_are_reported_as_given",
        "write_with_imm_notifies_the_receiver_after_the_data_landed",
        "multi_sge_writes_land_as_the_gathered_bytes",
        "deregister_returns_the_bytes_and_revokes_the_keys",
        "many_qp_pairs_each_deliver_their_writes",
        "an_empty_region_takes_zero_byte_writes_only",
    ];
    assert_eq!(failed, expected);
}

/// Completions that always claim Success fail every case that expects an error completion: every error-path case
/// but the two that expect none, and the two contract cases that write to a revoked or empty region.
#[test]
fn a_transport_that_reports_every_completion_successful_fails_every_case_expecting_an_error_status() {
    let (failed, _) = outcome(Sabotage::ReportSuccess);
    let quiet = ["misuse_of_qps_and_regions_is_an_error_not_a_panic", "regions_are_owned_by_their_endpoint"];
    let contract = ["deregister_returns_the_bytes_and_revokes_the_keys", "an_empty_region_takes_zero_byte_writes_only"];
    let expected: Vec<&str> = cases()
        .iter()
        .filter(|case| (case.group == Group::ErrorPath && !quiet.contains(&case.id)) || contract.contains(&case.id))
        .map(|case| case.id)
        .collect();
    assert_eq!(failed, expected);
}

/// Hiding refusals fails the cases that expect a typed error from an endpoint call.
#[test]
fn a_transport_that_hides_refusals_fails_every_case_expecting_a_typed_error() {
    let (failed, _) = outcome(Sabotage::HideErrors);
    let expected = [
        "posts_that_leave_a_full_queue_unsignalled_are_refused",
        "posting_past_the_send_queue_depth_is_refused_until_completions_are_polled",
        "misuse_of_qps_and_regions_is_an_error_not_a_panic",
        "regions_are_owned_by_their_endpoint",
        "deregister_returns_the_bytes_and_revokes_the_keys",
        "an_empty_region_takes_zero_byte_writes_only",
    ];
    assert_eq!(failed, expected);
}

/// Every case fails on at least one of the broken transports: none is a test that cannot fail.
#[test]
fn every_case_fails_on_some_broken_transport() {
    let sabotages = [Sabotage::DropCompletions, Sabotage::ShiftWrites, Sabotage::ReportSuccess, Sabotage::HideErrors];
    let failed: Vec<&str> = sabotages.into_iter().flat_map(|sabotage| outcome(sabotage).0).collect();
    let never: Vec<&str> = cases().iter().map(|case| case.id).filter(|id| !failed.contains(id)).collect();
    assert!(never.is_empty(), "no broken transport fails {never:?}");
}

/// The verbs fabric on a real device: the transport, and what only `RdmaEndpoint` itself can be asked.
#[cfg(feature = "rdma")]
mod rdma {
    use std::time::{Duration, Instant};

    use kvrelay::certify::{RdmaTransport, Transport};
    use kvrelay::fabric::rdma::{write_bandwidth, RdmaEndpoint, RdmaError};
    use kvrelay::fabric::verbs::{Caps, Endpoint, NodeId, RemoteAddr, Sge, WcKind, WcStatus, WorkRequest};

    use super::CAPS;

    fn device() -> Option<String> {
        std::env::var("KVRELAY_RDMA_DEVICE").ok().filter(|name| !name.is_empty())
    }

    /// The suite's transport on the device, or a panic that says what was found and how to fix it.
    pub(super) fn transport() -> RdmaTransport {
        RdmaTransport::new(device().as_deref()).unwrap_or_else(|error| panic!("{error}"))
    }

    /// An endpoint on the suite's device, or a panic that says what was found and how to fix it.
    fn open(node: u32, caps: Caps) -> RdmaEndpoint {
        RdmaEndpoint::open(NodeId(node), device().as_deref(), caps).unwrap_or_else(|error| panic!("{error}"))
    }

    /// The transport's identity names the device, port and GID index an endpoint of it reports.
    #[test]
    fn rdma_transport_identity_names_its_device_port_and_gid_index() {
        let mut transport = transport();
        let identity = transport.identity();
        let endpoint = open(0, CAPS);
        assert_eq!(identity.name, "rdma");
        assert_eq!(identity.facts.get("device").map(String::as_str), Some(endpoint.device()), "{identity:?}");
        assert_eq!(identity.facts.get("port"), Some(&endpoint.port().to_string()), "{identity:?}");
        let gid_index = endpoint.gid_index().map(|index| index.to_string());
        assert!(gid_index.is_none_or(|index| identity.facts.get("gid_index") == Some(&index)), "{identity:?}");
        let opened = transport.open(NodeId(3), CAPS).unwrap_or_else(|error| panic!("{error}"));
        assert_eq!((opened.node(), opened.caps()), (NodeId(3), CAPS), "the device grants the suite's caps");
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
    fn new(transport: &mut dyn Transport) -> RandomRun {
        let mut link = Link::open(transport, RANDOM_QPS, CAPS).unwrap_or_else(|error| panic!("{error}"));
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

fn random_posts_keep_the_contract(transport: &mut dyn Transport, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut run = RandomRun::new(transport);
    for op in ops {
        match op {
            Op::Post { qp, wrs } => run.post(*qp, wrs)?,
            Op::Poll => run.poll(),
            Op::Step => transport.step(),
        }
    }
    transport.settle();
    run.poll();
    check_completions(&run)?;
    check_target_bytes(&run)?;
    for (region, bytes) in &run.sources[..2] {
        prop_assert_eq!(&read_all(&*run.link.sender, region).unwrap(), bytes, "source memory changed");
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
        let bytes = read_all(&*run.link.receiver, target).unwrap();
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
        random_posts_keep_the_contract(&mut *Backend::Sim.transport(), &ops)?;
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
        random_posts_keep_the_contract(&mut *Backend::Rdma.transport(), &ops)?;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Simulated time (SimWorld only).

/// A world with a sender and a receiver, one connected QP pair and the usual regions.
fn sim_link() -> (SimWorld, Link) {
    let mut transport = SimTransport::new(CAPS);
    let link = Link::open(&mut transport, 2, CAPS).unwrap_or_else(|error| panic!("{error}"));
    (transport.world().expect("Link::open opened the world").clone(), link)
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
    assert_eq!(link.target_bytes().unwrap(), vec![SENTINEL; TARGET_LEN], "no byte lands before delivery");
    world.advance_to(delivery_ns);
    assert_eq!(link.sender.poll_cq(&mut completions, usize::MAX), 1);
    assert_eq!(link.target_bytes().unwrap(), expected_target(&[(0, 0, 100)]));
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
