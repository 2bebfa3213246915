//! [`SimTransport`]: the in-memory fabric ([`SimWorld`]) as a [`Transport`], kvrelay's reference transport and the
//! one the conformance suite's own tests run on.

use super::transport::{Identity, Transport, TransportError};
use super::verbs::{Caps, Endpoint, NodeId};
use super::world::SimWorld;

/// The in-memory fabric: one [`SimWorld`] per case, created at the first [`Transport::open`] after a reset with the
/// smaller of the caps asked and the caps this transport grants; `step` executes the next delivery and `settle`
/// runs the world until idle (simulated time, so both return at once).
///
/// [`SimTransport::eager`] endpoints instead execute every pending delivery before each poll, as if the wire took no
/// time: what a real-clock driver needs (the scenario cases of `kvrelay certify --fabric sim`).
#[derive(Debug, Clone)]
pub struct SimTransport {
    grants: Caps,
    world: Option<SimWorld>,
    eager: bool,
}

/// What [`SimTransport::eager`] grants: more than any case asks for.
pub const EAGER_GRANTS: Caps = Caps { max_sge: 16, max_message: 1 << 31, sq_depth: 4096 };

impl SimTransport {
    /// A transport whose endpoints grant at most `grants` (less when a case asks for less), in simulated time.
    pub fn new(grants: Caps) -> SimTransport {
        SimTransport { grants, world: None, eager: false }
    }

    /// A transport granting [`EAGER_GRANTS`] whose endpoints deliver before every poll.
    pub fn eager() -> SimTransport {
        SimTransport { grants: EAGER_GRANTS, world: None, eager: true }
    }

    /// The world of the endpoints opened since the last reset (`None` before the first open), for cases about
    /// simulated time.
    pub fn world(&self) -> Option<&SimWorld> {
        self.world.as_ref()
    }
}

/// The smaller of two caps, limit by limit.
fn smaller(first: Caps, second: Caps) -> Caps {
    Caps {
        max_sge: first.max_sge.min(second.max_sge),
        max_message: first.max_message.min(second.max_message),
        sq_depth: first.sq_depth.min(second.sq_depth),
    }
}

impl Transport for SimTransport {
    fn identity(&self) -> Identity {
        let mut identity =
            Identity { name: "sim".to_owned(), version: env!("CARGO_PKG_VERSION").to_owned(), ..Identity::default() };
        let grants = self.grants;
        let delivery = if self.eager {
            "in-memory SimWorld, delivering before every poll"
        } else {
            "in-memory SimWorld, simulated time"
        };
        identity.facts.insert("fabric".to_owned(), delivery.to_owned());
        identity.facts.insert("max_sge".to_owned(), grants.max_sge.to_string());
        identity.facts.insert("max_message".to_owned(), grants.max_message.to_string());
        identity.facts.insert("sq_depth".to_owned(), grants.sq_depth.to_string());
        identity
    }

    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, TransportError> {
        let grants = smaller(self.grants, caps);
        let world = self.world.get_or_insert_with(|| SimWorld::new(grants));
        Ok(Box::new(if self.eager { world.eager_endpoint(node) } else { world.endpoint(node) }))
    }

    fn step(&mut self) {
        if let Some(world) = &self.world {
            if let Some(time_ns) = world.next_event() {
                world.advance_to(time_ns);
            }
        }
    }

    fn settle(&mut self) {
        if let Some(world) = &self.world {
            world.run_until_idle();
        }
    }

    fn reset(&mut self) {
        self.world = None;
    }
}
