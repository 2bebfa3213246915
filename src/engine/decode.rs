//! The decode receiver (domain.md §6.1 steps 2-4 and 6, §6.4): gates the prefill topology, resolves the rank
//! mapping (§3.1), registers with every target prefill rank, sends each request's metadata once every link is
//! acknowledged, and counts Success from distinct prefill ranks up to the expected number. Requests are rooms with
//! the `KVPoll` states of §6.1 and its monotonic update rule; a room still waiting at the deadline fails.

use std::collections::{BTreeMap, BTreeSet};

use super::handshake::{classify, Kind, LinkAck};
use super::{Nic, Outbox, WAITING_TIMEOUT_NS};
use crate::fabric::verbs::{NodeId, QpNum};
use crate::model::{ModelGeometry, PoolKind, RankId, Request, StateKind, Topology};
use crate::plan;
use crate::wire::{KvPoll, Registration, RequestMeta, Status};

/// One prefill rank this decode rank contacts.
#[derive(Debug, Clone)]
struct Target {
    rank: RankId,
    node: NodeId,
    qp: QpNum,
    /// A pure-MLA dummy (domain.md §3.1): metadata without indices; its status does not count.
    dummy: bool,
    /// The prefill rank's answer to the registration.
    linked: Option<Result<(), String>>,
}

/// What a decode rank knows of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomState {
    pub poll: KvPoll,
    pub reason: Option<String>,
    /// Simulated time at which the room ended (Success or Failed).
    pub ended_ns: Option<u64>,
    successes: BTreeSet<u32>,
}

/// The decode engine of one rank.
pub struct DecodeEngine {
    rank: RankId,
    model: ModelGeometry,
    topology: Topology,
    /// The prefill topology published at bootstrap.
    prefill: Topology,
    registration: Registration,
    requests: Vec<Request>,
    targets: Vec<Target>,
    rooms: BTreeMap<u64, RoomState>,
    expected: u32,
    deadline: u64,
    /// Time the rooms may wait for the prefill side, from `start`.
    timeout: u64,
}

impl DecodeEngine {
    /// `registration` is what this rank advertises (its regions as memory descs, `plan::peer::advertise`);
    /// `requests` carry its pages, slot, state pages, aux row and prefix.
    pub fn new(
        rank: RankId,
        model: ModelGeometry,
        topology: Topology,
        registration: Registration,
        requests: &[Request],
    ) -> DecodeEngine {
        let rooms = requests
            .iter()
            .map(|request| {
                let state =
                    RoomState { poll: KvPoll::Bootstrapping, reason: None, ended_ns: None, successes: BTreeSet::new() };
                (u64::from(request.id), state)
            })
            .collect();
        DecodeEngine {
            rank,
            model,
            topology,
            prefill: topology,
            registration,
            requests: requests.to_vec(),
            targets: Vec::new(),
            rooms,
            expected: 1,
            deadline: WAITING_TIMEOUT_NS,
            timeout: WAITING_TIMEOUT_NS,
        }
    }

    /// Sets the waiting timeout (default [`WAITING_TIMEOUT_NS`]): real fabrics and emulated devices need longer.
    pub fn with_timeout(mut self, timeout_ns: u64) -> DecodeEngine {
        self.timeout = timeout_ns;
        self.deadline = timeout_ns;
        self
    }

    /// Fails every room still waiting with `reason` (a driver's verdict: the bootstrap never completed).
    pub fn abandon(&mut self, now: u64, reason: &str, out: &mut Outbox) {
        self.fail_all(now, reason, out);
    }

    pub fn rank(&self) -> RankId {
        self.rank
    }

    /// Every room's state, by request id.
    pub fn rooms(&self) -> &BTreeMap<u64, RoomState> {
        &self.rooms
    }

    /// All rooms ended (Success or Failed).
    pub fn done(&self) -> bool {
        self.rooms.values().all(|room| matches!(room.poll, KvPoll::Success | KvPoll::Failed))
    }

    /// Bootstrap (domain.md §6.1 step 2-3): `prefill` is the topology the prefill ranks published and `directory`
    /// where each prefill rank listens.
    pub fn start(
        &mut self,
        now: u64,
        prefill: &Topology,
        directory: &BTreeMap<RankId, NodeId>,
        nic: Nic<'_>,
        out: &mut Outbox,
    ) {
        self.deadline = now.saturating_add(self.timeout);
        self.prefill = *prefill;
        if let Err(error) = plan::decode_gates(&self.model, prefill, &self.topology) {
            return self.fail_all(now, &error.to_string(), out);
        }
        self.expected = plan::expected_responses(&self.model, prefill, &self.topology);
        let ratio = (prefill.tp / self.topology.tp).max(1);
        for rank in plan::prefill_targets(prefill, &self.topology, self.rank) {
            let Some(node) = directory.get(&rank).copied() else {
                return self.fail_all(now, &format!("prefill {rank} is not in the bootstrap directory"), out);
            };
            let qp = match nic.create_qp() {
                Ok(qp) => qp,
                Err(error) => return self.fail_all(now, &error.to_string(), out),
            };
            let offset = rank.tp.saturating_sub(self.rank.tp * ratio);
            let dummy = self.model.pool_kind() == PoolKind::Mla && self.topology.tp < prefill.tp && offset > 0;
            let mut registration = self.registration.clone();
            registration.engine.key = format!("{}-{}", registration.engine.key, qp.to_text());
            out.send(node, registration.encode());
            self.targets.push(Target { rank, node, qp: qp.qpn, dummy, linked: None });
        }
    }

    /// A message from `from`.
    pub fn on_message(&mut self, now: u64, from: NodeId, frames: &[Vec<u8>], nic: Nic<'_>, out: &mut Outbox) {
        match classify(frames) {
            Kind::Link => match LinkAck::decode(frames) {
                Some(ack) => self.on_link(now, from, ack, nic, out),
                None => out.note(format!("dropped a malformed link answer from {from}")),
            },
            Kind::Status => match Status::decode(frames) {
                Ok(status) => self.on_status(now, from, status, out),
                Err(error) => out.note(format!("dropped a status from {from}: {error}")),
            },
            _ => out.note(format!("dropped an unexpected message of {} frames from {from}", frames.len())),
        }
    }

    fn on_link(&mut self, now: u64, from: NodeId, ack: LinkAck, nic: Nic<'_>, out: &mut Outbox) {
        let Some(target) = self.targets.iter_mut().find(|target| target.node == from && target.linked.is_none()) else {
            return out.note(format!("unexpected link answer from {from}"));
        };
        // A refused link is not connected: the answer's queue pair may be a placeholder.
        target.linked = Some(match ack.error {
            Some(error) => {
                out.note(format!("prefill {} refused the link: {error}", target.rank));
                Err(error)
            }
            None => nic.connect_qp(target.qp, ack.qp).map_err(|error| error.to_string()),
        });
        if self.targets.iter().any(|target| target.linked.is_none()) {
            return;
        }
        // Every target answered. A registration error fails this rank's requests with its text; the targets still
        // get metadata, as dummies (nothing to write here), so the prefill ranks' rooms reach their
        // `required_dst_info_num` and the other decode ranks are served (domain.md §6.4).
        let refused = self.targets.iter().find_map(|target| target.linked.clone().filter(Result::is_err));
        if let Some(Err(error)) = &refused {
            self.fail_all(now, error, out);
        }
        self.send_metadata(refused.is_some(), out);
    }

    /// Per request, metadata to every target prefill rank (domain.md §6.1 step 4); all dummies when `withdrawn`.
    fn send_metadata(&mut self, withdrawn: bool, out: &mut Outbox) {
        let required = plan::required_dst_info_num(&self.prefill, &self.topology);
        for request in &self.requests {
            let room = u64::from(request.id);
            for target in &self.targets {
                let meta = self.metadata(request, required, target.dummy || withdrawn);
                out.send(target.node, meta.encode());
            }
            if let Some(state) = self.rooms.get_mut(&room) {
                state.poll = state.poll.update(KvPoll::WaitingForInput);
            }
        }
        out.note(format!("metadata for {} requests sent to {} prefill ranks", self.requests.len(), self.targets.len()));
    }

    fn metadata(&self, request: &Request, required: u32, dummy: bool) -> RequestMeta {
        let state_indices = if dummy {
            Vec::new()
        } else {
            self.model
                .state
                .iter()
                .enumerate()
                .map(|(index, component)| match component.kind {
                    StateKind::Mamba => vec![request.decode_state.slot],
                    _ => request.decode_state.pages.get(index).cloned().unwrap_or_default(),
                })
                .collect()
        };
        RequestMeta {
            room: u64::from(request.id),
            ip: self.registration.ip.clone(),
            port: self.registration.port,
            engine_key: self.registration.engine.key.clone(),
            kv_indices: if dummy { Vec::new() } else { request.decode_pages.clone() },
            aux_index: (!dummy).then_some(request.decode_state.aux),
            state_indices,
            required_dst_info_num: required,
            decode_prefix_len: if dummy { 0 } else { request.decode_prefix },
        }
    }

    fn on_status(&mut self, now: u64, from: NodeId, status: Status, out: &mut Outbox) {
        let dummy = self.targets.iter().any(|target| target.node == from && target.dummy);
        let expected = self.expected as usize;
        let Some(room) = self.rooms.get_mut(&status.room) else {
            return out.note(format!("status for unknown room {} from {from}", status.room));
        };
        match status.status {
            KvPoll::Failed => {
                if room.poll != KvPoll::Failed {
                    out.note(format!("room {}: Failed: {}", status.room, status.reason));
                    room.reason = Some(status.reason);
                    room.ended_ns = Some(now);
                }
                room.poll = room.poll.update(KvPoll::Failed);
            }
            KvPoll::Success if !dummy => {
                room.successes.insert(status.prefill_unique_rank);
                if room.successes.len() >= expected && room.poll != KvPoll::Failed {
                    room.poll = room.poll.update(KvPoll::Success);
                    room.ended_ns.get_or_insert(now);
                    out.note(format!("room {}: Success ({} prefill ranks)", status.room, room.successes.len()));
                }
            }
            _ => {}
        }
    }

    /// The deadline of the waiting rooms, if any is still waiting.
    pub fn next_timer(&self) -> Option<u64> {
        (!self.done()).then_some(self.deadline)
    }

    /// Fails every room still waiting at the deadline (domain.md §6.4 waiting timeout).
    pub fn on_tick(&mut self, now: u64, out: &mut Outbox) {
        if now >= self.deadline && !self.done() {
            self.fail_all(now, &format!("timed out after {} ns waiting for the prefill side", self.timeout), out);
        }
    }

    fn fail_all(&mut self, now: u64, reason: &str, out: &mut Outbox) {
        for (room, state) in &mut self.rooms {
            if !matches!(state.poll, KvPoll::Success | KvPoll::Failed) {
                out.note(format!("room {room}: Failed: {reason}"));
                state.poll = KvPoll::Failed;
                state.reason = Some(reason.to_owned());
                state.ended_ns = Some(now);
            }
        }
    }
}
