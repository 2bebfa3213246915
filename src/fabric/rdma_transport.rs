//! [`RdmaTransport`]: the verbs fabric ([`RdmaEndpoint`], cargo feature `rdma`) as a [`Transport`], on one device
//! (by name, or the first device with an active port).
//!
//! The transport keeps a handle on every endpoint it hands out, so that `step` and `settle` can wait on their
//! completion channels; waiting never takes a completion away from the case (it only moves completions off the
//! device into the endpoint, which hands them out at the next poll).

#![allow(
    clippy::disallowed_methods,
    reason = "waiting for a device is bounded on the wall clock (the certification kit's real-hardware edge)"
)]

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use super::rdma::{RdmaEndpoint, RdmaError};
use super::transport::{Identity, Transport, TransportError};
use super::verbs::{Caps, Endpoint, FabricError, MemoryRegion, NodeId, QpInfo, QpNum, WorkCompletion, WorkRequest};

/// `settle` returns once no endpoint awaits a certain completion and none has taken a new one for this long,
/// counting each wait as at most two slices (a guest that was not scheduled for a while is not quiet)...
const QUIET: Duration = Duration::from_millis(150);
/// ...or after this long in any case (a case's drain settles again while completions are missing).
const SETTLE_LIMIT: Duration = Duration::from_secs(5);
/// How long one blocking wait on a completion channel lasts inside `settle`.
const SLICE: Duration = Duration::from_millis(5);
/// What `step` lets pass.
const STEP: Duration = Duration::from_millis(1);
/// The caps the identity probe asks for (the device's own limits are what it reports).
const PROBE_CAPS: Caps = Caps { max_sge: 1 << 20, max_message: u64::MAX, sq_depth: 1 << 30 };

/// An endpoint and how many completions the case has polled from it.
struct Tracked {
    endpoint: RdmaEndpoint,
    polled: u64,
}

/// The case's handle on a [`Tracked`] endpoint.
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

    fn wait(&mut self, timeout: Duration) -> bool {
        self.0.borrow_mut().endpoint.wait(timeout)
    }
}

/// The verbs fabric on one RDMA device.
pub struct RdmaTransport {
    device: Option<String>,
    identity: Identity,
    endpoints: Vec<Rc<RefCell<Tracked>>>,
}

impl RdmaTransport {
    /// A transport on `device` (`None`: the first device with an active port). Opens the device once to learn
    /// its identity, so a missing device or port is an error here rather than in every case.
    pub fn new(device: Option<&str>) -> Result<RdmaTransport, RdmaError> {
        let probe = RdmaEndpoint::open(NodeId(0), device, PROBE_CAPS)?;
        let identity = identity_of(&probe);
        Ok(RdmaTransport { device: device.map(str::to_owned), identity, endpoints: Vec::new() })
    }

    /// Completions taken off the devices so far (polled by the case, or waiting in an endpoint): grows exactly
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

    fn awaited(&self) -> bool {
        self.endpoints.iter().any(|tracked| tracked.borrow().endpoint.awaits_completions())
    }
}

/// What the device tells of itself: name, port, GID index and its limits.
fn identity_of(endpoint: &RdmaEndpoint) -> Identity {
    let caps = endpoint.caps();
    let gid_index = endpoint.gid_index().map_or_else(|| "none (InfiniBand LID)".to_owned(), |index| index.to_string());
    let facts = [
        ("device", endpoint.device().to_owned()),
        ("port", endpoint.port().to_string()),
        ("gid_index", gid_index),
        ("device_max_sge", caps.max_sge.to_string()),
        ("device_max_message", caps.max_message.to_string()),
        ("device_max_qp_wr", caps.sq_depth.to_string()),
    ];
    let sysfs = format!("/sys/class/infiniband/{}", endpoint.device());
    let read = |file: &str| std::fs::read_to_string(format!("{sysfs}/{file}")).ok().map(|text| text.trim().to_owned());
    let mut facts: Vec<(&str, String)> = facts.into();
    for (name, file) in [("firmware", "fw_ver"), ("hca_type", "hca_type"), ("node_type", "node_type")] {
        if let Some(value) = read(file).filter(|value| !value.is_empty()) {
            facts.push((name, value));
        }
    }
    let driver = std::fs::read_link(format!("{sysfs}/device/driver")).ok();
    if let Some(name) = driver.as_ref().and_then(|path| path.file_name()) {
        facts.push(("driver", name.to_string_lossy().into_owned()));
    } else if endpoint.device().starts_with("rxe") {
        facts.push(("driver", "rdma_rxe (Soft-RoCE, no PCI device)".to_owned()));
    }
    Identity {
        name: "rdma".to_owned(),
        version: format!("kvrelay {} verbs fabric (rdma-sys)", env!("CARGO_PKG_VERSION")),
        facts: facts.into_iter().map(|(name, value)| (name.to_owned(), value)).collect(),
    }
}

impl Transport for RdmaTransport {
    fn identity(&self) -> Identity {
        self.identity.clone()
    }

    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, TransportError> {
        let endpoint = RdmaEndpoint::open(node, self.device.as_deref(), caps)
            .map_err(|error| TransportError::Open(error.to_string()))?;
        let tracked = Rc::new(RefCell::new(Tracked { endpoint, polled: 0 }));
        self.endpoints.push(Rc::clone(&tracked));
        Ok(Box::new(Shared(tracked)))
    }

    fn step(&mut self) {
        self.block(STEP);
    }

    /// Waits until no endpoint awaits a certain completion and none has taken a new one for [`QUIET`] (at most
    /// [`SETTLE_LIMIT`]).
    fn settle(&mut self) {
        let start = Instant::now();
        let mut arrived = self.arrived();
        let mut quiet = Duration::ZERO;
        while start.elapsed() < SETTLE_LIMIT {
            if !self.awaited() && quiet >= QUIET {
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

    /// Drops the transport's handles; an endpoint goes once the case drops its own handle too.
    fn reset(&mut self) {
        self.endpoints.clear();
    }
}
