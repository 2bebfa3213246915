//! The prefill sender (domain.md §6.1 steps 4-5, §6.3, §6.4): links each registered decode peer from its decoded
//! registration, collects per-request metadata until `required_dst_info_num` peers sent it, plans every chunk for
//! every peer before the first byte, posts writes within the send queue's credits chunk by chunk, and reports a
//! status to each peer once its writes completed (or the reason the room failed).
//!
//! An abort from a decode peer (§6.4) fails the room here (every peer is told), drops its writes not yet posted, and
//! is acknowledged once the room's writes to that peer already on the wire completed, so nothing lands in the
//! decode pages after the acknowledgement. Metadata arriving for a room that already failed is answered with the
//! room's Failed status.

use std::collections::{BTreeMap, VecDeque};

use super::handshake::{classify, Abort, Kind, LinkAck};
use super::seat::{own_copies, own_descriptors, view, LinkQuery, SeatCopy, SeatError, SeatQuery, SharedPlanner};
use super::{Nic, Outbox, CHUNK_COMPUTE_NS, TRANSFER_TIMEOUT_NS};
use crate::fabric::seam::{
    Batch, BatchId, BatchStatus, Cancelled, Completion, ConnId, Entry, Event, Landed, Memory, NodeId, Paging,
    PeerAddress, RemoteMemory, Repeat, SeamLimits,
};
use crate::model::{ModelGeometry, RankId, RankLayout, Request, Topology};
use crate::plan::{self, peer, Link, Local};
use crate::wire::{KvPoll, MemoryDesc, Registration, RequestMeta, Status};

/// How a room ended on a prefill rank (`None`: still going, or never became ready), and why it failed.
pub type PrefillRoom = (Option<KvPoll>, Option<String>);

/// One write the fabric confirmed: `length` bytes at `offset` of region `region` on decode rank `target`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// The request the write belongs to.
    pub room: u64,
    /// The batch that carried it.
    pub batch: BatchId,
    pub target: RankId,
    pub region: u32,
    pub offset: u64,
    pub length: u64,
}

/// Batch `batch` was submitted for request `room`, towards decode rank `target`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Posted {
    pub batch: BatchId,
    pub room: u64,
    pub target: RankId,
}

/// Writes planned for a room and peer (one chunk's, within the engine's limits), not yet confirmed.
#[derive(Debug, Clone)]
struct Pending {
    room: u64,
    peer: NodeId,
    target: RankId,
    entries: Vec<Entry>,
}

/// A connected decode peer: its connection end and the link (or why it cannot be served).
struct PeerState {
    rank: RankId,
    conn: ConnId,
    link: Result<(PeerLink, Vec<MemoryDesc>), String>,
}

/// Who plans for a linked peer.
enum PeerLink {
    /// kvrelay's own planner, linked at registration.
    Own(Link),
    /// The planner in the seat, asked per room with the decoded registration.
    Seat(Registration),
}

/// One request (room) on this prefill rank.
#[derive(Default)]
struct Room {
    infos: BTreeMap<NodeId, RequestMeta>,
    poll: Option<KvPoll>,
    /// Planned writes per chunk, per peer; drained as chunks become ready.
    chunks: Vec<BTreeMap<NodeId, Pending>>,
    next_chunk: usize,
    ready_at: u64,
    /// Per peer, batches queued or in flight.
    outstanding: BTreeMap<NodeId, usize>,
    reported: Vec<NodeId>,
    /// Peers this rank refused at registration, with the reason: their statuses are Failed.
    refused: BTreeMap<NodeId, String>,
    /// Why the room failed on this rank, if it did.
    reason: Option<String>,
    /// When its first metadata arrived: the prefill-side timeout runs from here.
    created_ns: u64,
    /// Peers that aborted the room and wait for its writes to them to drain.
    acks_owed: std::collections::BTreeSet<NodeId>,
}

/// The batches of one connection: waiting for credits (the engine's [`SeamLimits::batches_in_flight`]), and
/// submitted but not yet completed.
#[derive(Default)]
struct SendQueue {
    waiting: VecDeque<Pending>,
    in_flight: BTreeMap<BatchId, Pending>,
}

/// The prefill engine of one rank.
pub struct PrefillEngine {
    rank: RankId,
    model: ModelGeometry,
    topology: Topology,
    layout: RankLayout,
    regions: Vec<Memory>,
    requests: BTreeMap<u64, Request>,
    peers: BTreeMap<NodeId, PeerState>,
    rooms: BTreeMap<u64, Room>,
    queues: BTreeMap<ConnId, (NodeId, SendQueue)>,
    limits: SeamLimits,
    written: Vec<Written>,
    /// Every batch submitted (which room and decode rank each was for).
    posted: Vec<Posted>,
    /// Send cached prefixes early (domain.md §7).
    early_send: bool,
    /// Another planner in the seat (`None`: kvrelay's own).
    seat: Option<SharedPlanner>,
    /// The rank crashed (its endpoint said so, `crash_prefill`): it processes nothing more.
    crashed: bool,
    /// Time a room may stay unfinished on this rank, from its first metadata.
    timeout: u64,
    /// Rooms failed whose submitted batches are still to be cancelled ([`PrefillEngine::cancel_failed`]).
    cancelling: Vec<u64>,
}

impl PrefillEngine {
    /// `regions` are this rank's registered regions in `layout` order; `requests` its view of each request
    /// (its own pages, indices and chunks; room = request id).
    pub fn new(
        rank: RankId,
        model: ModelGeometry,
        topology: Topology,
        layout: RankLayout,
        regions: Vec<Memory>,
        requests: &[Request],
        limits: SeamLimits,
    ) -> PrefillEngine {
        PrefillEngine {
            rank,
            model,
            topology,
            layout,
            regions,
            requests: requests.iter().map(|request| (u64::from(request.id), request.clone())).collect(),
            peers: BTreeMap::new(),
            rooms: BTreeMap::new(),
            queues: BTreeMap::new(),
            limits,
            written: Vec::new(),
            posted: Vec::new(),
            early_send: false,
            seat: None,
            crashed: false,
            timeout: TRANSFER_TIMEOUT_NS,
            cancelling: Vec::new(),
        }
    }

    /// Puts `planner` in the seat: it plans every room for every linked peer (kvrelay's own link checks and the
    /// early send are then off: the planner decides).
    pub fn set_planner(&mut self, planner: Option<SharedPlanner>) {
        self.seat = planner;
    }

    /// Enables the cached-prefix early send (domain.md §7).
    pub fn with_early_send(mut self, enabled: bool) -> PrefillEngine {
        self.early_send = enabled;
        self
    }

    pub fn rank(&self) -> RankId {
        self.rank
    }

    /// Writes confirmed so far (the fabric's log, not the plan's claims).
    pub fn written(&self) -> &[Written] {
        &self.written
    }

    /// Every batch submitted so far, with its room and decode rank.
    pub fn posted(&self) -> &[Posted] {
        &self.posted
    }

    /// How each room ended on this rank (`None`: still going, or never became ready), and why it failed. A crashed
    /// rank's unfinished rooms are Failed with the crash as reason.
    pub fn rooms(&self) -> BTreeMap<u64, PrefillRoom> {
        let ended = |poll: Option<KvPoll>| matches!(poll, Some(KvPoll::Success | KvPoll::Failed));
        self.rooms
            .iter()
            .map(|(id, room)| match self.crashed && !ended(room.poll) {
                true => (*id, (Some(KvPoll::Failed), Some(format!("prefill {} crashed", self.rank)))),
                false => (*id, (room.poll, room.reason.clone())),
            })
            .collect()
    }

    /// Every room that reached this rank ended (Success or Failed), or the rank crashed.
    pub fn done(&self) -> bool {
        self.crashed || self.rooms.values().all(|room| matches!(room.poll, Some(KvPoll::Success | KvPoll::Failed)))
    }

    /// Whether the rank crashed.
    pub fn crashed(&self) -> bool {
        self.crashed
    }

    /// Sets the prefill-side timeout (default [`TRANSFER_TIMEOUT_NS`]).
    pub fn with_timeout(mut self, timeout_ns: u64) -> PrefillEngine {
        self.timeout = timeout_ns;
        self
    }

    /// Notices a crash of this rank's node (from then on every input is ignored) and its restart (the engine starts
    /// afresh, [`PrefillEngine::restart`]); whether the node is down.
    fn down(&mut self, nic: &dyn crate::fabric::seam::TransferEngine, out: &mut Outbox) -> bool {
        match (nic.crashed(), self.crashed) {
            (true, _) => self.crashed = true,
            (false, true) => self.restart(out),
            (false, false) => {}
        }
        self.crashed
    }

    /// Gives the engine a chance to notice that its node crashed or came back (drivers call it whenever the node's
    /// completion queue may have changed).
    pub fn wake(&mut self, nic: Nic<'_>, out: &mut Outbox) {
        self.down(nic, out);
    }

    /// The node came back as a new process (`crash_restart_prefill`): its queue pairs and links are gone; every room it
    /// had not finished fails with the restart as reason, told to its peers (domain.md §6.4: standing in for the
    /// decode side's failed heartbeat); the rooms are kept so that late metadata for them is ignored. Whatever
    /// registers afresh is served.
    fn restart(&mut self, out: &mut Outbox) {
        self.crashed = false;
        let reason = format!("prefill {} crashed and restarted", self.rank);
        out.note(format!(
            "restarted: {} unfinished rooms fail",
            self.rooms.values().filter(|room| !ended(room)).count()
        ));
        let unfinished: Vec<u64> = self.rooms.iter().filter(|(_, room)| !ended(room)).map(|(id, _)| *id).collect();
        for room in unfinished {
            self.fail_room(room, &reason, out);
        }
        self.peers.clear();
        self.queues.clear();
        // The engine below restarted too: nothing of the old process is there to cancel.
        self.cancelling.clear();
    }

    /// `prefill_unique_rank` of domain.md §6.1 with SGLang 0.5.23's CP term (`common/conn.py:1024-1030`):
    /// `attn_tp_rank * (pp * cp) + pp_rank * cp + cp_rank`.
    fn unique_rank(&self) -> u32 {
        let (pp, cp) = (self.topology.pp, self.topology.cp);
        self.rank.tp * (pp * cp) + self.rank.pp * cp + self.rank.cp
    }

    fn local(&self) -> Local<'_> {
        Local { model: &self.model, topology: &self.topology, layout: &self.layout }
    }

    /// A message from `from`.
    pub fn on_message(&mut self, now: u64, from: NodeId, frames: &[Vec<u8>], nic: Nic<'_>, out: &mut Outbox) {
        if self.down(nic, out) {
            return;
        }
        match classify(frames) {
            Kind::Registration => self.on_registration(from, frames, nic, out),
            Kind::RequestMeta => match RequestMeta::decode(frames) {
                Ok(meta) => self.on_meta(now, from, meta, out),
                Err(error) => out.note(format!("dropped metadata from {from}: {error}")),
            },
            Kind::Abort => match Abort::decode(frames) {
                Some(abort) => self.on_abort(now, from, abort.room, out),
                None => out.note(format!("dropped a malformed abort from {from}")),
            },
            _ => out.note(format!("dropped an unexpected message of {} frames from {from}", frames.len())),
        }
        self.cancel_failed(nic);
    }

    fn on_registration(&mut self, from: NodeId, frames: &[Vec<u8>], nic: Nic<'_>, out: &mut Outbox) {
        // A queue pair the NIC cannot give is a refusal like any other: the peer hears why at once and its requests
        // fail with the reason, while the room goes on for every other peer.
        let end = nic.open().map_err(|error| format!("prefill {} cannot open a connection: {error}", self.rank));
        let registration = Registration::decode(frames).map_err(|error| error.to_string());
        let rank = registration.as_ref().ok().and_then(|registration| peer::rank_of_key(&registration.engine.key));
        let rank = rank.unwrap_or(RankId { dp: u32::MAX, cp: u32::MAX, pp: u32::MAX, tp: u32::MAX });
        let linked = end.clone().and_then(|(conn, _)| {
            let registration = registration?;
            if registration.engine.address.is_empty() {
                return Err(format!("engine desc `{}` carries no peer address", registration.engine.key));
            }
            let (peer, descs) = peer::from_registration(self.local(), &registration).map_err(|e| e.to_string())?;
            let remote: Vec<RemoteMemory> = descs
                .iter()
                .map(|desc| RemoteMemory { addr: desc.address, len: desc.length_bytes, key: desc.rkey })
                .collect();
            let address = PeerAddress(registration.engine.address.clone());
            nic.connect(conn, &address, &remote).map_err(|error| error.to_string())?;
            if let Some(seat) = &self.seat {
                let query = LinkQuery { rank: self.rank, local: self.local(), registration: &registration };
                seat.0.borrow_mut().link(&query).map_err(|error| error.to_string())?;
                return Ok((PeerLink::Seat(registration), descs));
            }
            let link = plan::link(self.local(), &peer).map_err(|error| error.to_string())?;
            Ok((PeerLink::Own(link), descs))
        });
        match &linked {
            Ok(_) => out.note(format!("linked decode {rank} ({from})")),
            Err(error) => out.note(format!("cannot serve decode {rank} ({from}): {error}")),
        }
        let (conn, address) = end.clone().unwrap_or((ConnId(u32::MAX), PeerAddress::default()));
        let ack = LinkAck { address: address.0, error: linked.as_ref().err().cloned() };
        out.send(from, ack.encode());
        self.peers.insert(from, PeerState { rank, conn, link: linked });
        if end.is_ok() {
            self.queues.insert(conn, (from, SendQueue::default()));
        }
    }

    fn on_meta(&mut self, now: u64, from: NodeId, meta: RequestMeta, out: &mut Outbox) {
        let room_id = meta.room;
        let required = meta.required_dst_info_num as usize;
        let room = self.rooms.entry(room_id).or_insert_with(|| Room { created_ns: now, ..Room::default() });
        if room.poll == Some(KvPoll::Failed) {
            // The peer would otherwise wait for its timeout: it hears why at once.
            let reason = room.reason.clone().unwrap_or_default();
            out.note(format!("room {room_id}: metadata from {from} for a failed room, answered Failed"));
            let status =
                Status { room: room_id, status: KvPoll::Failed, prefill_unique_rank: self.unique_rank(), reason };
            return out.send(from, status.encode());
        }
        if room.poll.is_some() {
            return out.note(format!("room {room_id}: late metadata from {from} ignored"));
        }
        room.infos.insert(from, meta);
        if room.infos.len() < required {
            return;
        }
        room.poll = Some(KvPoll::Transferring);
        room.ready_at = now;
        out.note(format!("room {room_id}: metadata from {} peers, planning", room.infos.len()));
        match self.prepare(room_id) {
            Ok(Some(note)) => out.note(format!("room {room_id}: {note}")),
            Ok(None) => {}
            Err(reason) => self.fail_room(room_id, &reason, out),
        }
    }

    /// Plans every chunk of the room for every peer before anything is sent (a planning error moves no byte).
    fn prepare(&mut self, room_id: u64) -> Result<Option<String>, String> {
        let Some(request) = self.requests.get(&room_id) else {
            return Err(format!("room {room_id} is unknown to prefill {}", self.rank));
        };
        let room = &self.rooms[&room_id];
        let (request, note) = self.with_early_chunk(request, room);
        let request = &request;
        let mut chunks = vec![BTreeMap::new(); request.chunks.len()];
        let mut refused = BTreeMap::new();
        for (node, meta) in &room.infos {
            let peer = self.peers.get(node).ok_or_else(|| format!("no registration from peer {node}"))?;
            let (link, descs) = match (&peer.link, meta.is_dummy()) {
                // A peer whose registration this rank refused fails on both sides with the refusal's text; the
                // room goes on for the other peers (domain.md §6.4).
                (Err(reason), _) => {
                    refused.insert(*node, reason.clone());
                    continue;
                }
                (Ok(_), true) => continue,
                (Ok((link, descs)), false) => (link, descs),
            };
            let view = view(request, meta, &self.model);
            let planned = match link {
                PeerLink::Own(link) if !link.sends_anything() => continue,
                // An engine that takes strided entries gets the plan's descriptors: one entry per strided run.
                PeerLink::Own(link) if self.limits.strided => {
                    let planned = own_descriptors(link, &view).map_err(|error| error.to_string())?;
                    for (chunk, descriptors) in chunks.iter_mut().zip(planned) {
                        let entries = self.strided_entries(&descriptors, descs)?;
                        chunk.insert(*node, Pending { room: room_id, peer: *node, target: peer.rank, entries });
                    }
                    continue;
                }
                PeerLink::Own(link) => own_copies(link, &view).map_err(|error| error.to_string())?,
                PeerLink::Seat(registration) => {
                    let query = SeatQuery { rank: self.rank, local: self.local(), registration, meta, request: &view };
                    self.seat_copies(&query).map_err(|error| error.to_string())?
                }
            };
            for (chunk, copies) in chunks.iter_mut().zip(planned) {
                let entries = self.entries(&copies, descs)?;
                chunk.insert(*node, Pending { room: room_id, peer: *node, target: peer.rank, entries });
            }
        }
        let room = self.rooms.get_mut(&room_id).expect("room exists");
        room.chunks = chunks;
        room.refused = refused;
        Ok(note)
    }

    /// The request with its cached prefix as an early first chunk (domain.md §7), when early send is on, the cached
    /// end (rounded down to the allocator page) lies inside the send range, and no peer of the room needs DCP
    /// relayout (PR #37358 skips it then: the relayout plan covers the compute chunks).
    fn with_early_chunk(&self, request: &Request, room: &Room) -> (Request, Option<String>) {
        let page = self.topology.virtual_page_size();
        let start =
            room.infos.values().find(|meta| !meta.is_dummy()).map_or(request.decode_prefix, |m| m.decode_prefix_len);
        let cached_end = request.cached_prefix / page * page;
        if !self.early_send || self.seat.is_some() || cached_end <= start || cached_end >= request.tokens {
            return (request.clone(), None);
        }
        for node in room.infos.keys() {
            if let Some(PeerState { link: Ok((PeerLink::Own(link), _)), .. }) = self.peers.get(node) {
                if link.requires_relayout() {
                    return (request.clone(), Some("early send skipped: a peer needs DCP relayout".to_owned()));
                }
            }
        }
        let mut chunks = vec![cached_end - start];
        let mut boundary = start;
        for tokens in &request.chunks {
            let end = boundary + tokens;
            if end > cached_end {
                chunks.push(end - boundary.max(cached_end));
            }
            boundary = end;
        }
        let note = format!("early send of cached positions {start}..{cached_end}, chunks {chunks:?}");
        (Request { chunks, ..request.clone() }, Some(note))
    }

    /// The planner in the seat's copies per chunk, checked to cover every chunk.
    fn seat_copies(&self, query: &SeatQuery<'_>) -> Result<Vec<Vec<SeatCopy>>, SeatError> {
        let seat = self.seat.as_ref().expect("a peer is linked to the seat only when a planner sits there");
        let planned = seat.0.borrow_mut().plan(query)?;
        let chunks = query.request.chunks.len();
        if planned.len() != chunks {
            let answered = planned.len();
            return Err(SeatError::Broken(format!(
                "the planner answered {answered} chunk lists for a request of {chunks} chunks"
            )));
        }
        Ok(planned)
    }

    /// The plan's copies as batch entries between this rank's memory and the peer's advertised memory.
    fn entries(&self, copies: &[SeatCopy], descs: &[MemoryDesc]) -> Result<Vec<Entry>, String> {
        let mut entries = Vec::with_capacity(copies.len());
        for copy in copies {
            let source = self.regions.get(copy.source_region as usize).ok_or("a copy names no local region")?;
            let desc = descs.get(copy.target_region as usize).ok_or("a copy names no peer region")?;
            // The peer's address and the planned offset come from the wire: add them without wrapping.
            if source.addr.checked_add(copy.source_offset).is_none()
                || desc.address.checked_add(copy.target_offset).is_none()
            {
                return Err(format!("a copy to peer region {} leaves the address space", copy.target_region));
            }
            entries.push(Entry::new(
                source.id,
                copy.source_offset,
                copy.target_region,
                copy.target_offset,
                copy.length,
            ));
        }
        Ok(entries)
    }

    /// The plan's strided descriptors as repeated batch entries (for an engine that declares
    /// [`SeamLimits::strided`]).
    fn strided_entries(&self, descriptors: &[plan::Descriptor], descs: &[MemoryDesc]) -> Result<Vec<Entry>, String> {
        let mut entries = Vec::with_capacity(descriptors.len());
        for descriptor in descriptors {
            let source = self.regions.get(descriptor.source_region as usize).ok_or("a copy names no local region")?;
            let region = descriptor.target_region;
            let desc = descs.get(region as usize).ok_or("a copy names no peer region")?;
            let repeat = Repeat {
                count: descriptor.count,
                local_stride: descriptor.source_stride,
                remote_stride: descriptor.target_stride,
            };
            let entry = Entry {
                local: source.id,
                local_offset: descriptor.source_offset,
                remote: region,
                remote_offset: descriptor.target_offset,
                len: descriptor.element_len,
                repeat,
                paging: Paging::NONE,
            };
            // The peer's address comes from the wire: the last element must not wrap.
            if entry.remote_end().and_then(|end| desc.address.checked_add(end)).is_none()
                || entry.local_end().and_then(|end| source.addr.checked_add(end)).is_none()
            {
                return Err(format!("a copy to peer region {region} leaves the address space"));
            }
            entries.push(entry);
        }
        Ok(entries)
    }

    /// The earliest time a chunk becomes ready or an unfinished room times out, if any.
    pub fn next_timer(&self) -> Option<u64> {
        if self.crashed {
            return None;
        }
        let chunks = self
            .rooms
            .values()
            .filter(|room| room.poll == Some(KvPoll::Transferring) && room.next_chunk < room.chunks.len())
            .map(|room| room.ready_at + CHUNK_COMPUTE_NS * (room.next_chunk as u64 + 1));
        let timeouts = self
            .rooms
            .values()
            .filter(|room| matches!(room.poll, None | Some(KvPoll::Transferring)))
            .map(|room| room.created_ns.saturating_add(self.timeout));
        chunks.chain(timeouts).min()
    }

    /// Sends every chunk that is ready by `now`; fails every room unfinished after the timeout (domain.md §6.4: a
    /// bounded prefill-side transfer timeout, so a room whose completions or peers never come still ends).
    pub fn on_tick(&mut self, now: u64, nic: Nic<'_>, out: &mut Outbox) {
        if self.down(nic, out) {
            return;
        }
        let ids: Vec<u64> = self.rooms.keys().copied().collect();
        for room_id in &ids {
            let room = &self.rooms[room_id];
            if matches!(room.poll, None | Some(KvPoll::Transferring))
                && now >= room.created_ns.saturating_add(self.timeout)
            {
                let waiting = if room.poll.is_none() { "waiting for metadata" } else { "transferring" };
                let reason = format!("prefill {} timed out after {} ns {waiting}", self.rank, self.timeout);
                self.fail_room(*room_id, &reason, out);
            }
        }
        for room_id in ids {
            loop {
                let room = self.rooms.get_mut(&room_id).expect("listed");
                let due = room.ready_at + CHUNK_COMPUTE_NS * (room.next_chunk as u64 + 1);
                if room.poll != Some(KvPoll::Transferring) || room.next_chunk >= room.chunks.len() || due > now {
                    break;
                }
                let chunk = std::mem::take(&mut room.chunks[room.next_chunk]);
                room.next_chunk += 1;
                let count: usize = chunk.values().map(|pending| pending.entries.len()).sum();
                out.note(format!("room {room_id}: chunk {} ready, {count} writes", room.next_chunk - 1));
                for (node, pending) in chunk {
                    let batches = split(pending, self.limits);
                    *room.outstanding.entry(node).or_default() += batches.len();
                    let conn = self.peers[&node].conn;
                    self.queues.get_mut(&conn).expect("a queue per peer").1.waiting.extend(batches);
                }
            }
            self.report_finished(room_id, out);
        }
        self.pump(nic, out);
    }

    /// Submits waiting batches on every connection as far as the engine's credits allow, then rings the doorbell.
    fn pump(&mut self, nic: Nic<'_>, out: &mut Outbox) {
        self.cancel_failed(nic);
        let depth = self.limits.batches_in_flight.max(1);
        let mut failures = Vec::new();
        for (conn, (_, queue)) in &mut self.queues {
            while queue.in_flight.len() < depth {
                let Some(pending) = queue.waiting.pop_front() else { break };
                let batch = Batch { entries: pending.entries.clone(), notify: None, tables: Vec::new() };
                match nic.submit(*conn, batch) {
                    Ok(id) => {
                        self.posted.push(Posted { batch: id, room: pending.room, target: pending.target });
                        queue.in_flight.insert(id, pending);
                    }
                    Err(error) => failures.push((pending.room, format!("submitting failed: {error}"))),
                }
            }
        }
        for (room, reason) in failures {
            self.fail_room(room, &reason, out);
        }
        self.cancel_failed(nic);
        nic.flush();
    }

    /// An event of this rank's transfer engine.
    pub fn on_event(&mut self, event: Event, nic: Nic<'_>, out: &mut Outbox) {
        if self.down(nic, out) {
            return;
        }
        match event {
            Event::Completed(completion) => self.on_completion(completion, nic, out),
            Event::Notified { conn, tag } => out.note(format!("notification {tag} on {conn} ignored")),
        }
    }

    /// A batch's completion.
    fn on_completion(&mut self, completion: Completion, nic: Nic<'_>, out: &mut Outbox) {
        let Some((_, queue)) = self.queues.get_mut(&completion.conn) else {
            return out.note(format!("completion for unknown {}", completion.conn));
        };
        let Some(pending) = queue.in_flight.remove(&completion.batch) else {
            return out.note(format!("completion for unknown {} ignored", completion.batch));
        };
        let landed: Vec<std::ops::Range<u32>> = match &completion.landed {
            Landed::All => std::iter::once(0..pending.entries.len() as u32).collect(),
            Landed::Entries(ranges) => ranges.clone(),
            Landed::Unknown => Vec::new(),
        };
        for range in landed {
            for entry in pending.entries.get(range.start as usize..range.end as usize).unwrap_or_default() {
                // A strided entry whose elements follow one another on the target is one range there.
                let whole = entry.repeat.count <= 1 || entry.repeat.remote_stride == entry.len;
                let len = if whole { entry.bytes().unwrap_or(entry.len) } else { entry.len };
                let elements = if whole { 1 } else { entry.repeat.count };
                for k in 0..elements {
                    let offset = entry.remote_offset + k * entry.repeat.remote_stride;
                    self.log_write(&pending, completion.batch, entry.remote, offset, len);
                }
            }
        }
        if completion.status == BatchStatus::Success {
            if let Some(count) =
                self.rooms.get_mut(&pending.room).and_then(|room| room.outstanding.get_mut(&pending.peer))
            {
                *count -= 1;
            }
        } else {
            self.fail_room(pending.room, &completion.detail, out);
        }
        self.report_finished(pending.room, out);
        self.answer_aborts(out);
        self.pump(nic, out);
    }

    /// Logs `length` confirmed bytes at `offset` of peer region `region`: entries whose targets continue one another
    /// are one write in the log (as they were one RDMA WRITE).
    fn log_write(&mut self, pending: &Pending, batch: BatchId, region: u32, offset: u64, length: u64) {
        let continues = self.written.last_mut().filter(|last| {
            (last.batch, last.region) == (batch, region) && last.offset.checked_add(last.length) == Some(offset)
        });
        match continues {
            Some(last) => last.length += length,
            None => {
                self.written.push(Written { room: pending.room, batch, target: pending.target, region, offset, length })
            }
        }
    }

    /// An abort of `room_id` from decode peer `from` (module docs): the room fails here unless it already ended; the
    /// acknowledgement waits for the room's writes to `from` still on the wire.
    fn on_abort(&mut self, now: u64, from: NodeId, room_id: u64, out: &mut Outbox) {
        let by = self.peers.get(&from).map_or_else(|| format!("peer {from}"), |peer| format!("decode {}", peer.rank));
        let room = self.rooms.entry(room_id).or_insert_with(|| Room { created_ns: now, ..Room::default() });
        room.acks_owed.insert(from);
        if !ended(room) {
            self.fail_room(room_id, &format!("aborted by {by}"), out);
        }
        self.answer_aborts(out);
    }

    /// Acknowledges every abort whose room has no write to the aborting peer on the wire any more.
    fn answer_aborts(&mut self, out: &mut Outbox) {
        for (room_id, room) in &mut self.rooms {
            if room.acks_owed.is_empty() {
                continue;
            }
            let busy = |node: &NodeId| {
                self.queues.values().any(|(peer, queue)| {
                    peer == node && queue.in_flight.iter().any(|(_, pending)| pending.room == *room_id)
                })
            };
            let drained: Vec<NodeId> = room.acks_owed.iter().filter(|node| !busy(node)).copied().collect();
            for node in drained {
                room.acks_owed.remove(&node);
                out.note(format!("room {room_id}: abort from {node} acknowledged, its writes drained"));
                out.send(node, Abort { room: *room_id, ack: true }.encode());
            }
        }
    }

    /// Sends Success to every peer whose writes for the room all completed after the last chunk.
    fn report_finished(&mut self, room_id: u64, out: &mut Outbox) {
        let unique = self.unique_rank();
        let Some(room) = self.rooms.get_mut(&room_id) else { return };
        if room.poll != Some(KvPoll::Transferring) || room.next_chunk < room.chunks.len() {
            return;
        }
        let peers: Vec<NodeId> = room.infos.keys().copied().collect();
        for node in peers {
            if room.reported.contains(&node) || room.outstanding.get(&node).is_some_and(|count| *count > 0) {
                continue;
            }
            room.reported.push(node);
            let (status, reason) = match room.refused.get(&node) {
                Some(reason) => (KvPoll::Failed, reason.clone()),
                None => (KvPoll::Success, String::new()),
            };
            out.send(node, Status { room: room_id, status, prefill_unique_rank: unique, reason }.encode());
        }
        if room.reported.len() == room.infos.len() {
            let failed = room.refused.values().next().cloned();
            room.poll = Some(if failed.is_some() { KvPoll::Failed } else { KvPoll::Success });
            match &failed {
                Some(reason) => {
                    out.note(format!("room {room_id}: Failed for {} refused peers: {reason}", room.refused.len()))
                }
                None => out.note(format!("room {room_id}: Success")),
            }
            room.reason = failed;
        }
    }

    /// Marks the room Failed and tells every peer of it, once (domain.md §6.4).
    fn fail_room(&mut self, room_id: u64, reason: &str, out: &mut Outbox) {
        let unique = self.unique_rank();
        let Some(room) = self.rooms.get_mut(&room_id) else { return };
        if matches!(room.poll, Some(KvPoll::Failed)) {
            return;
        }
        room.poll = Some(KvPoll::Failed);
        room.reason = Some(reason.to_owned());
        room.chunks.clear();
        out.note(format!("room {room_id}: Failed: {reason}"));
        for node in room.infos.keys() {
            if !room.reported.contains(node) {
                let status = Status {
                    room: room_id,
                    status: KvPoll::Failed,
                    prefill_unique_rank: unique,
                    reason: reason.to_owned(),
                };
                out.send(*node, status.encode());
            }
        }
        room.reported = room.infos.keys().copied().collect();
        for (_, queue) in self.queues.values_mut() {
            queue.waiting.retain(|pending| pending.room != room_id);
        }
        self.cancelling.push(room_id);
    }

    /// Cancels the submitted batches of every room failed since the last call (what is already on the wire drains;
    /// what the engine has not started never runs). Called before the engine may start anything more.
    fn cancel_failed(&mut self, nic: Nic<'_>) {
        for room_id in std::mem::take(&mut self.cancelling) {
            for (_, queue) in self.queues.values_mut() {
                let batches: Vec<BatchId> =
                    queue.in_flight.iter().filter(|(_, pending)| pending.room == room_id).map(|(id, _)| *id).collect();
                for batch in batches {
                    if nic.cancel(batch) == Cancelled::Whole {
                        queue.in_flight.remove(&batch);
                    }
                }
            }
        }
    }
}

/// `pending` as batches within `limits` (entries and bytes; an entry larger than a batch may carry is cut); none
/// when it has no entry.
fn split(pending: Pending, limits: SeamLimits) -> Vec<Pending> {
    if pending.entries.is_empty() {
        return Vec::new(); // nothing to write to this peer in this chunk: no batch
    }
    let max_entries = limits.max_entries.max(1);
    let max_bytes = limits.max_batch_bytes.max(1);
    let fits = pending.entries.len() <= max_entries
        && pending
            .entries
            .iter()
            .try_fold(0u64, |sum, entry| sum.checked_add(entry.bytes()?))
            .is_some_and(|b| b <= max_bytes);
    if fits {
        return vec![pending];
    }
    let mut batches = Vec::new();
    let (mut entries, mut bytes) = (Vec::new(), 0u64);
    // Cut element by element: a strided entry over the limits becomes its elements.
    for entry in pending.entries.iter().flat_map(Entry::elements) {
        let mut done = 0;
        while done < entry.len {
            if entries.len() == max_entries || bytes == max_bytes {
                batches.push(Pending { entries: std::mem::take(&mut entries), ..pending.clone_empty() });
                bytes = 0;
            }
            let len = (entry.len - done).min(max_bytes - bytes);
            entries.push(Entry::new(
                entry.local,
                entry.local_offset + done,
                entry.remote,
                entry.remote_offset + done,
                len,
            ));
            bytes += len;
            done += len;
        }
    }
    if !entries.is_empty() {
        batches.push(Pending { entries, ..pending.clone_empty() });
    }
    batches
}

impl Pending {
    fn clone_empty(&self) -> Pending {
        Pending { room: self.room, peer: self.peer, target: self.target, entries: Vec::new() }
    }
}

/// Whether the room ended on this rank (Success or Failed).
fn ended(room: &Room) -> bool {
    matches!(room.poll, Some(KvPoll::Success | KvPoll::Failed))
}
