//! The decode receiver (domain.md §6.1 steps 2-4 and 6, §6.4): gates the prefill topology, resolves the rank
//! mapping (§3.1), registers with every target prefill rank, sends each request's metadata once every link is
//! acknowledged, and counts Success from distinct prefill ranks up to the expected number. Requests are rooms with
//! the `KVPoll` states of §6.1 and its monotonic update rule; a room still waiting at the deadline fails.
//!
//! A room that fails here (a Failed status, the waiting timeout) is aborted (§6.4, [I] decisions): every prefill rank
//! that was sent real metadata for it and has not reported Success gets an abort, and the room's pages are released
//! (`released_ns`) only once each acknowledged it, that is once its writes into the room drained, or after the
//! waiting timeout once more (a prefill rank that died or hung never answers; its queue pairs are then presumed
//! flushed). A room whose metadata never went out (a refused link, a gate) has nothing in flight and is released at
//! once.

use std::collections::{BTreeMap, BTreeSet};

use super::handshake::{classify, Abort, Kind, LinkAck};
use super::{Nic, Outbox, WAITING_TIMEOUT_NS};
use crate::fabric::seam::{ConnId, NodeId, PeerAddress};
use crate::model::{ModelGeometry, RankId, Request, StateKind, Topology};
use crate::plan;
use crate::wire::{KvPoll, Registration, RequestMeta, Status};

/// One prefill rank this decode rank contacts.
#[derive(Debug, Clone)]
struct Target {
    rank: RankId,
    node: NodeId,
    conn: ConnId,
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
    /// Simulated time at which a Failed room's pages were released: every aborted prefill rank acknowledged (or the
    /// wait for them timed out). No write may land in the room after it.
    pub released_ns: Option<u64>,
    successes: BTreeSet<u32>,
    /// Prefill ranks that reported Success for the room (they write nothing more into it).
    succeeded_from: BTreeSet<NodeId>,
    /// Aborted prefill ranks that have not acknowledged yet.
    aborting: BTreeSet<NodeId>,
    /// When the room is released even without every acknowledgement.
    release_deadline: Option<u64>,
}

impl RoomState {
    fn new() -> RoomState {
        RoomState {
            poll: KvPoll::Bootstrapping,
            reason: None,
            ended_ns: None,
            released_ns: None,
            successes: BTreeSet::new(),
            succeeded_from: BTreeSet::new(),
            aborting: BTreeSet::new(),
            release_deadline: None,
        }
    }

    /// Ended, and if Failed, released.
    fn settled(&self) -> bool {
        match self.poll {
            KvPoll::Success => true,
            KvPoll::Failed => self.released_ns.is_some(),
            _ => false,
        }
    }
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
    /// Time the rooms may wait for the prefill side, from `start` (and, once aborted, for the acknowledgements).
    timeout: u64,
    /// Real metadata went to the targets: they may write.
    metadata_sent: bool,
}

impl DecodeEngine {
    /// `registration` is what this rank advertises (its regions as memory descs, `plan::peer::advertise`);
    /// `requests` carry its pages, slot, state pages, aux row and prefix. Only the requests dispatched to this rank's
    /// DP group are its own: the other groups' ranks never see the rest.
    pub fn new(
        rank: RankId,
        model: ModelGeometry,
        topology: Topology,
        registration: Registration,
        requests: &[Request],
    ) -> DecodeEngine {
        let requests: Vec<Request> = requests.iter().filter(|request| request.decode_dp == rank.dp).cloned().collect();
        let rooms = requests.iter().map(|request| (u64::from(request.id), RoomState::new())).collect();
        DecodeEngine {
            rank,
            model,
            topology,
            prefill: topology,
            registration,
            requests,
            targets: Vec::new(),
            rooms,
            expected: 1,
            deadline: WAITING_TIMEOUT_NS,
            timeout: WAITING_TIMEOUT_NS,
            metadata_sent: false,
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

    /// All rooms ended (Success or Failed), and every Failed one released its pages.
    pub fn done(&self) -> bool {
        self.rooms.values().all(RoomState::settled)
    }

    /// All rooms ended (Success or Failed), released or not.
    fn ended(&self) -> bool {
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
        // Every prefill DP group that computes one of this rank's requests (`room % dp` unless routed otherwise,
        // SGLang `decode.py:879-897`); the rank mapping applies inside each.
        let groups: BTreeSet<u32> = self.requests.iter().map(|request| request.prefill_dp).collect();
        let targets =
            groups.into_iter().flat_map(|group| plan::prefill_targets(prefill, &self.topology, self.rank, group));
        for rank in targets.collect::<Vec<_>>() {
            let Some(node) = directory.get(&rank).copied() else {
                return self.fail_all(now, &format!("prefill {rank} is not in the bootstrap directory"), out);
            };
            let (conn, address) = match nic.open() {
                Ok(end) => end,
                Err(error) => return self.fail_all(now, &error.to_string(), out),
            };
            let offset = rank.tp.saturating_sub(self.rank.tp * ratio);
            let dummy = plan::mla_dummy(&self.model, prefill, &self.topology, offset);
            let mut registration = self.registration.clone();
            registration.engine.address = address.0;
            out.send(node, registration.encode());
            self.targets.push(Target { rank, node, conn, dummy, linked: None });
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
            Kind::AbortAck => match Abort::decode(frames) {
                Some(abort) => self.on_abort_ack(now, from, abort.room, out),
                None => out.note(format!("dropped a malformed abort acknowledgement from {from}")),
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
            None => nic.connect(target.conn, &PeerAddress(ack.address), &[]).map_err(|error| error.to_string()),
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
        self.metadata_sent = refused.is_none();
    }

    /// Per request, metadata to every target prefill rank (domain.md §6.1 step 4); all dummies when `withdrawn`.
    fn send_metadata(&mut self, withdrawn: bool, out: &mut Outbox) {
        let required = plan::required_dst_info_num(&self.prefill, &self.topology);
        for request in &self.requests {
            let room = u64::from(request.id);
            for target in self.targets.iter().filter(|target| target.rank.dp == request.prefill_dp) {
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
            // A HiSparse decode's KV entries are its host pool's: host pages (decode.py:1643-1658).
            kv_indices: if dummy { Vec::new() } else { request.decode_kv_pages().to_vec() },
            aux_index: (!dummy).then_some(request.decode_state.aux),
            state_indices,
            required_dst_info_num: required,
            decode_prefix_len: if dummy { 0 } else { request.decode_prefix },
            // ... and with a draft pool, its device-resident draft lands at the logical pages (decode.py:1787-1806).
            device_kv_indices: if dummy || request.decode_host_pages.is_empty() || self.model.draft.is_none() {
                Vec::new()
            } else {
                request.decode_pages.clone()
            },
            // Where each chunk's image goes in this rank's staging ring, when it registered one.
            staging_offsets: if dummy || self.registration.staging_descs.is_empty() {
                Vec::new()
            } else {
                request.staging_offsets.clone()
            },
        }
    }

    fn on_status(&mut self, now: u64, from: NodeId, status: Status, out: &mut Outbox) {
        let dummy = self.targets.iter().any(|target| target.node == from && target.dummy);
        let expected = self.expected as usize;
        let Some(room) = self.rooms.get_mut(&status.room) else {
            return out.note(format!("status for unknown room {} from {from}", status.room));
        };
        match status.status {
            // A Failed status does not mean the sender's writes into the room drained: it is aborted too.
            KvPoll::Failed => self.fail_room(now, status.room, &status.reason, out),
            KvPoll::Success if !dummy => {
                room.successes.insert(status.prefill_unique_rank);
                room.succeeded_from.insert(from);
                if room.successes.len() >= expected && room.poll != KvPoll::Failed {
                    room.poll = room.poll.update(KvPoll::Success);
                    room.ended_ns.get_or_insert(now);
                    out.note(format!("room {}: Success ({} prefill ranks)", status.room, room.successes.len()));
                }
            }
            _ => {}
        }
    }

    /// The deadline of the waiting rooms, if any is still waiting, or the earliest release deadline of an aborted
    /// room.
    pub fn next_timer(&self) -> Option<u64> {
        let waiting = (!self.ended()).then_some(self.deadline);
        let releases = self.rooms.values().filter(|room| room.released_ns.is_none()).filter_map(|r| r.release_deadline);
        waiting.into_iter().chain(releases).min()
    }

    /// Fails every room still waiting at the deadline (domain.md §6.4 waiting timeout); releases every aborted room
    /// whose acknowledgements did not come in time.
    pub fn on_tick(&mut self, now: u64, out: &mut Outbox) {
        if now >= self.deadline && !self.ended() {
            self.fail_all(now, &format!("timed out after {} ns waiting for the prefill side", self.timeout), out);
        }
        for (id, room) in &mut self.rooms {
            if room.released_ns.is_none() && room.release_deadline.is_some_and(|deadline| now >= deadline) {
                let silent: Vec<String> = room.aborting.iter().map(ToString::to_string).collect();
                out.note(format!("room {id}: released without an abort acknowledgement from {}", silent.join(", ")));
                room.aborting.clear();
                room.released_ns = Some(now);
            }
        }
    }

    fn fail_all(&mut self, now: u64, reason: &str, out: &mut Outbox) {
        let ids: Vec<u64> = self.rooms.keys().copied().collect();
        for room in ids {
            self.fail_room(now, room, reason, out);
        }
    }

    /// Fails `room` with `reason` unless it already ended, and aborts it on every prefill rank that may still write
    /// into it (module docs); a room with none is released at once.
    fn fail_room(&mut self, now: u64, room_id: u64, reason: &str, out: &mut Outbox) {
        let timeout = self.timeout;
        let Some(room) = self.rooms.get_mut(&room_id) else { return };
        if matches!(room.poll, KvPoll::Success | KvPoll::Failed) {
            return;
        }
        out.note(format!("room {room_id}: Failed: {reason}"));
        room.poll = KvPoll::Failed;
        room.reason = Some(reason.to_owned());
        room.ended_ns = Some(now);
        if self.metadata_sent {
            // Only the room's own prefill DP group heard of it.
            let group = self.requests.iter().find(|request| u64::from(request.id) == room_id).map(|r| r.prefill_dp);
            let writers = self.targets.iter().filter(|target| Some(target.rank.dp) == group);
            let writers = writers.filter(|target| !target.dummy && matches!(target.linked, Some(Ok(()))));
            room.aborting =
                writers.map(|target| target.node).filter(|node| !room.succeeded_from.contains(node)).collect();
        }
        for node in &room.aborting {
            out.send(*node, Abort { room: room_id, ack: false }.encode());
        }
        match room.aborting.is_empty() {
            true => room.released_ns = Some(now),
            false => room.release_deadline = Some(now.saturating_add(timeout)),
        }
    }

    /// A prefill rank's writes into an aborted room drained; the room is released once every one said so.
    fn on_abort_ack(&mut self, now: u64, from: NodeId, room_id: u64, out: &mut Outbox) {
        let Some(room) = self.rooms.get_mut(&room_id).filter(|room| room.aborting.contains(&from)) else {
            return out.note(format!("abort acknowledgement for room {room_id} from {from} ignored (not awaited)"));
        };
        room.aborting.remove(&from);
        if room.aborting.is_empty() && room.released_ns.is_none() {
            room.released_ns = Some(now);
            out.note(format!("room {room_id}: released (every aborted prefill rank acknowledged)"));
        }
    }
}
