//! Seeded faults injected: what each fault kind does on a work request or a control message, and the [`Injector`]
//! that draws them. The rules as data ([`FaultKind`], [`FaultRule`], [`FaultPlan`]) live below the scenario parser,
//! in [`crate::faults`], and are re-exported here.
//!
//! A [`FaultPlan`] is a list of [`FaultRule`]s and a seed. For every work request delivered (per queue pair) and
//! every control message sent (per ordered pair of nodes), an [`Injector`] consults each rule that applies to it, in
//! the plan's order, and every such rule draws exactly once from its own named stream
//! (`faults.rule<i>.qp<node>.<qpn>` or `faults.rule<i>.link<from>.<to>`, [`crate::seed`]): adding or removing a
//! rule, or another queue pair's traffic, never shifts the draws of the others. The first rule that fires decides.
//!
//! The fault kinds and what the fabric or the network does ([I] kvrelay's model, after what verbs and TCP can do):
//! - `wr_error` (`remote_access` or `retry_exceeded`): the work request moves no byte and completes in error; the
//!   queue pair enters the error state and flushes what follows (`IBV_WC_WR_FLUSH_ERR`).
//! - `torn_write`: the first half of the message lands, then the work request completes `retry_exceeded`.
//! - `corrupt`: every byte lands, then one byte of the target (the message's middle) is flipped, and the work
//!   request completes successfully: silent corruption no engine can see; the oracle must.
//! - `drop_completion` / `duplicate_completion`: the sender's completion is lost (its send-queue slots are never
//!   freed) or delivered twice.
//! - `drop_message` / `duplicate_message`: a control message is lost or delivered twice (in order).
//! - `crash_prefill`: drawn per work request delivered on a prefill rank's queue pairs (the only ones that post),
//!   from that queue pair's stream: the rank dies just before the work request goes on the wire. Its bytes never
//!   land; every queue pair of the node enters the error state, so what is still queued flushes; its completion
//!   queue is lost; its engine processes nothing more (no message, completion or timer reaches it and it sends
//!   nothing: the drivers ask [`crate::fabric::verbs::Endpoint::crashed`]). No restart: a crashed rank stays down,
//!   and the decode ranks waiting for it end their rooms Failed at their waiting timeout (domain.md §6.4).
//! - `crash_restart_prefill`: as `crash_prefill`, and the rank comes back [`RESTART_NS`] later as a new process: the
//!   work requests its old incarnation posted are gone, its old queue pairs stay in the error state, and its engine
//!   starts afresh (no peers, no queues). [I] It fails every room it had not finished with the reason "prefill R
//!   crashed and restarted" and tells their decode peers, standing in for the decode side's heartbeat to the
//!   prefill's bootstrap server (domain.md §6.4: a failed heartbeat fails every room of that prefill); it writes
//!   nothing for them, and serves whatever registers with it afresh.
//! - `notify_before_data`: the sender's completion of the work request (Success) is queued at delivery, but its
//!   bytes land [`NOTIFY_LEAD_NS`] later. [I] RC forbids this on one queue pair (a WRITE completes only once the
//!   responder acknowledged the placement, and kvrelay's prefill sends a Success status only after the completions
//!   of all its writes), so no engine on RC verbs can see or defend against it: it is what a fabric without
//!   completion-after-placement does (an unordered transport, or GPUDirect writes not yet visible without a flush),
//!   and the status control message then overtakes the data. Like `corrupt` it is a fault only the guarantee can
//!   find: the in-memory world records when each write's bytes landed, and a decode room reported Success before
//!   all of its writes landed is flagged ([`crate::harness::guarantee()`]): "detected" when this fault was injected,
//!   a harness failure (an engine that reports Success too early) otherwise.
//! - `delay_message`: a control message arrives [`MESSAGE_DELAY_NS`] late; messages sent after it on the same link
//!   (ordered pair of nodes) wait behind it, as on one TCP connection.
//! - `reorder_message`: a control message arrives [`REORDER_NS`] late without holding its link, so a message sent
//!   just after it on the same link overtakes it. [I] One ZMQ socket keeps order, but SGLang's decode and prefill
//!   reach each other over several sockets (and reconnect), so kvrelay's engines must not rely on cross-message order.
//! - `delay_completion`: the sender's completion reaches its completion queue [`COMPLETION_DELAY_NS`] late; the later
//!   completions of the same queue pair wait behind it (verbs keeps one queue pair's completions in order).
//! - `reorder_completion`: the completion waits [`REORDER_NS`], so completions of the node's other queue pairs overtake
//!   it ([I] a completion queue shared by several queue pairs interleaves them in any order; one queue pair's stay
//!   in order).
//! - `timeout`: the queue pair hangs: this work request and every later one on it neither land nor complete (a
//!   responder that stopped answering, before any transport timeout fires). Only the engines' own timeouts end the
//!   rooms behind it (domain.md §6.4).
//! - `read_after_release`: the prefill page under the work request was released and reused before the NIC read it:
//!   the work request completes successfully, but the first [`RELEASED_BYTES`] bytes (at most) of its message land as
//!   [`RELEASED_FILL`] (the reuse's bytes) instead of the source's. Silent, like `corrupt`: only the oracle sees it.

use std::collections::BTreeMap;

use rand::RngExt as _;

use super::verbs::{NodeId, QpNum, WcStatus};
pub use crate::faults::{FaultKind, FaultPlan, FaultRule, WrErrorStatus};
use crate::seed::{Seed, SimRng, StreamId};

/// The bits a `corrupt` fault flips in its byte.
pub const CORRUPTION_MASK: u8 = 0x5A;

/// How long after its completion the bytes of a `notify_before_data` work request land: ten control-message
/// latencies, so the Success status usually overtakes them.
pub const NOTIFY_LEAD_NS: u64 = 200_000;

/// How long a `crash_restart_prefill` rank stays down before its new process runs.
pub const RESTART_NS: u64 = 1_000_000;

/// How late a `delay_message` control message arrives: fifty control-message latencies.
pub const MESSAGE_DELAY_NS: u64 = 1_000_000;

/// How late a `delay_completion` completion reaches its completion queue.
pub const COMPLETION_DELAY_NS: u64 = 500_000;

/// How long a `reorder_message` message or `reorder_completion` completion waits: long enough for what follows it
/// closely to overtake it, short against every timeout.
pub const REORDER_NS: u64 = 10_000;

/// Bytes of a `read_after_release` message that land as the reused page's, at most.
pub const RELEASED_BYTES: u64 = 4096;

/// What a released and reused prefill page holds when a `read_after_release` work request reads it.
pub const RELEASED_FILL: u8 = 0xEE;

impl From<WrErrorStatus> for WcStatus {
    fn from(status: WrErrorStatus) -> WcStatus {
        match status {
            WrErrorStatus::RemoteAccess => WcStatus::RemoteAccess,
            WrErrorStatus::RetryExceeded => WcStatus::RetryExceeded,
        }
    }
}

/// Draws the plan's faults, stream by stream, and counts what it injected.
#[derive(Debug)]
pub struct Injector {
    seed: Seed,
    rules: Vec<FaultRule>,
    streams: BTreeMap<(usize, String), SimRng>,
    injected: BTreeMap<&'static str, u64>,
}

impl Injector {
    pub fn new(plan: &FaultPlan) -> Injector {
        Injector {
            seed: Seed(plan.seed),
            rules: plan.rules.clone(),
            streams: BTreeMap::new(),
            injected: BTreeMap::new(),
        }
    }

    /// The fault of the next work request delivered on `qp` of `node`, if one fires.
    pub fn on_work_request(&mut self, node: NodeId, qp: QpNum) -> Option<FaultKind> {
        self.draw(&format!("qp{}.{}", node.0, qp.0), FaultKind::on_work_request)
    }

    /// The fault of the next control message from `from` to `to`, if one fires.
    pub fn on_message(&mut self, from: NodeId, to: NodeId) -> Option<FaultKind> {
        self.draw(&format!("link{}.{}", from.0, to.0), |kind| !kind.on_work_request())
    }

    /// Faults injected so far, by kind name.
    pub fn injected(&self) -> &BTreeMap<&'static str, u64> {
        &self.injected
    }

    fn draw(&mut self, scope: &str, applies: impl Fn(FaultKind) -> bool) -> Option<FaultKind> {
        let mut fired = None;
        for (index, rule) in self.rules.iter().enumerate() {
            if !applies(rule.kind) {
                continue;
            }
            let seed = self.seed;
            let rng = self
                .streams
                .entry((index, scope.to_owned()))
                .or_insert_with(|| seed.stream_of(StreamId::named(&format!("faults.rule{index}.{scope}"))));
            let hit = rng.random_bool(rule.probability.clamp(0.0, 1.0));
            if hit && fired.is_none() {
                fired = Some(rule.kind);
            }
        }
        if let Some(kind) = fired {
            *self.injected.entry(kind.name()).or_default() += 1;
        }
        fired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(rules: &[(FaultKind, f64)]) -> FaultPlan {
        FaultPlan { seed: 9, rules: rules.iter().map(|&(kind, probability)| FaultRule { kind, probability }).collect() }
    }

    fn fired(injector: &mut Injector, count: usize) -> Vec<Option<FaultKind>> {
        (0..count).map(|_| injector.on_work_request(NodeId(1), QpNum(2))).collect()
    }

    /// A rule added after another (or one for messages) leaves the first rule's draws where they were.
    #[test]
    fn adding_a_rule_does_not_shift_the_draws_of_the_others() {
        let alone = fired(&mut Injector::new(&plan(&[(FaultKind::TornWrite, 0.3)])), 200);
        let more = plan(&[(FaultKind::TornWrite, 0.3), (FaultKind::DropMessage, 0.5), (FaultKind::Corrupt, 0.9)]);
        let with_more = fired(&mut Injector::new(&more), 200);
        for (one, other) in alone.iter().zip(&with_more) {
            if *one == Some(FaultKind::TornWrite) {
                assert_eq!(*other, Some(FaultKind::TornWrite));
            } else {
                assert_ne!(*other, Some(FaultKind::TornWrite));
            }
        }
        assert!(alone.iter().flatten().count() > 30, "about 60 of 200 fire");
        assert_eq!(fired(&mut Injector::new(&plan(&[(FaultKind::TornWrite, 0.3)])), 200), alone);
    }
}
