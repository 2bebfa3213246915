//! kvrelay's in-memory fabric as a [`Transport`]: the baseline every other transport's report is read against.

use super::{Identity, Transport};
use crate::fabric::verbs::{Caps, Endpoint, NodeId};
use crate::fabric::world::SimWorld;

/// The in-memory fabric. Each case gets a fresh world with the caps its first endpoint asks for.
///
/// `eager` endpoints execute every pending delivery before each poll (as if the wire took no time), which is what a
/// real-clock driver needs; otherwise time is simulated and only [`Transport::step`] and [`Transport::settle`]
/// advance it.
#[derive(Default)]
pub struct SimTransport {
    world: Option<SimWorld>,
    eager: bool,
}

impl SimTransport {
    /// Simulated time: deliveries happen when the case steps or settles.
    pub fn timed() -> SimTransport {
        SimTransport { world: None, eager: false }
    }

    /// Deliveries happen before every poll (`kvrelay certify --fabric sim`).
    pub fn eager() -> SimTransport {
        SimTransport { world: None, eager: true }
    }
}

impl Transport for SimTransport {
    fn identity(&self) -> Identity {
        let mut identity =
            Identity { name: "sim".to_owned(), version: env!("CARGO_PKG_VERSION").to_owned(), ..Identity::default() };
        let delivery = if self.eager { "at the next poll" } else { "in simulated time" };
        identity.facts.insert("delivery".to_owned(), delivery.to_owned());
        identity.facts.insert("memory".to_owned(), "in-process, byte-accurate".to_owned());
        identity
    }

    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, String> {
        let world = self.world.get_or_insert_with(|| SimWorld::new(caps));
        let endpoint = if self.eager { world.eager_endpoint(node) } else { world.endpoint(node) };
        Ok(Box::new(endpoint))
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
