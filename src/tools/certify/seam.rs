//! The transfer-engine seam's contract ([`crate::fabric::seam::TransferEngine`]) as library cases, run on every
//! transport through [`Transport::engine`]: verbs-shaped or not (a NIXL- or Mooncake-shaped engine is held to these
//! and to the scenarios, not to the verbs cases).
//!
//! Each case opens two engines (node 0 sends, node 1 receives), registers a patterned source and a zeroed target
//! of host memory, connects both ends both ways through the addresses the engines advertise, and drives the
//! transport ([`Transport::settle`]) while polling, within a bounded number of rounds.

use std::sync::Arc;

use super::conformance::{CaseError, ConformanceCase, Group};
use super::Transport;
use crate::fabric::seam::{
    Batch, BatchId, BatchStatus, Completion, ConnId, Entry, Event, Landed, Memory, NodeId, SeamErrorKind,
    TransferEngine,
};
use crate::fabric::verbs::Caps;

/// Settle-and-poll rounds before a case gives up waiting for a completion.
const ROUNDS: usize = 200;
/// How many polls (each followed by a transport step, about a millisecond on hardware) a case polling without
/// settling makes before it gives up waiting for a completion or notification.
const FAST_POLLS: usize = 20_000;
/// The source and target sizes of every case.
const REGION: u64 = 64 << 10;
/// What a case asks a verbs-shaped transport for below the seam.
const ASK: Caps = Caps { max_sge: 4, max_message: 1 << 20, sq_depth: 64 };

/// The source byte at `offset`: never zero, so a landed byte is told from an untouched one.
fn source_byte(offset: u64) -> u8 {
    (offset % 251) as u8 + 1
}

/// The completions seen, in order, and every notification node 1 got with whether the batch's bytes were there.
type Driven = (Vec<Completion>, Vec<(u32, bool)>);

struct Pair {
    sender: Box<dyn TransferEngine>,
    receiver: Box<dyn TransferEngine>,
    source: Memory,
    target: Memory,
    conn: ConnId,
    receiver_conn: ConnId,
}

fn failed(what: &str, error: impl std::fmt::Display) -> CaseError {
    CaseError::Failed(format!("{what}: {error}"))
}

fn pair(transport: &mut dyn Transport) -> Result<Pair, CaseError> {
    pair_advertising(transport, REGION)
}

/// [`pair`], with the receiver's target advertised to the sender as `advertised` bytes long (more than it
/// registered, for cases about the engine's own checks).
fn pair_advertising(transport: &mut dyn Transport, advertised: u64) -> Result<Pair, CaseError> {
    let mut sender = transport.engine(NodeId(0), ASK).map_err(|e| failed("opening the engine of node 0", e))?;
    let mut receiver = transport.engine(NodeId(1), ASK).map_err(|e| failed("opening the engine of node 1", e))?;
    let fill = Arc::new(|offset: u64, out: &mut [u8]| {
        for (index, byte) in out.iter_mut().enumerate() {
            *byte = source_byte(offset + index as u64);
        }
    });
    let source =
        sender.register(sender.memory_kind(), REGION, 0, fill).map_err(|e| failed("registering the source", e))?;
    let zero = Arc::new(|_: u64, out: &mut [u8]| out.fill(0));
    let target =
        receiver.register(receiver.memory_kind(), REGION, 0, zero).map_err(|e| failed("registering the target", e))?;
    let (conn, sender_address) = sender.open().map_err(|e| failed("opening a connection on node 0", e))?;
    let (receiver_conn, receiver_address) = receiver.open().map_err(|e| failed("opening a connection on node 1", e))?;
    let remote = crate::fabric::seam::RemoteMemory { len: advertised, ..target.remote() };
    sender.connect(conn, &receiver_address, &[remote]).map_err(|e| failed("connecting node 0 to 1", e))?;
    receiver.connect(receiver_conn, &sender_address, &[]).map_err(|e| failed("connecting node 1 to 0", e))?;
    Ok(Pair { sender, receiver, source, target, conn, receiver_conn })
}

impl Pair {
    fn entry(&self, source_offset: u64, target_offset: u64, len: u64) -> Entry {
        Entry::new(self.source.id, source_offset, 0, target_offset, len)
    }

    /// Polls both engines (settling the transport between rounds) until `batches` all completed: the completions
    /// in the order seen, and every notification node 1 got, each with whether the batch's bytes were there.
    fn drive(
        &mut self,
        transport: &mut dyn Transport,
        batches: &[BatchId],
        expect_landed: &[(u64, u64, u64)],
    ) -> Result<Driven, CaseError> {
        let (mut completions, mut notified, mut events) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            self.sender.flush();
            transport.settle();
            self.sender.poll(&mut events, usize::MAX);
            for event in events.drain(..) {
                if let Event::Completed(completion) = event {
                    completions.push(completion);
                }
            }
            self.receiver.poll(&mut events, usize::MAX);
            for event in events.drain(..) {
                if let Event::Notified { conn, tag } = event {
                    if conn != self.receiver_conn {
                        return Err(CaseError::Failed(format!(
                            "a notification came on {conn}, not on the receiving end"
                        )));
                    }
                    let bytes = self.target_bytes()?;
                    notified.push((tag, landed(&bytes, expect_landed)));
                }
            }
            if batches.iter().all(|id| completions.iter().any(|completion| completion.batch == *id)) {
                return Ok((completions, notified));
            }
            transport.step();
        }
        Err(CaseError::Failed(format!("no completion for some of {batches:?} after {ROUNDS} rounds")))
    }

    fn target_bytes(&self) -> Result<Vec<u8>, CaseError> {
        let mut bytes = vec![0u8; REGION as usize];
        self.receiver.read(&self.target, 0, &mut bytes).map_err(|e| failed("reading the target", e))?;
        Ok(bytes)
    }
}

/// Whether every (source, target, length) copy is in `bytes`.
fn landed(bytes: &[u8], copies: &[(u64, u64, u64)]) -> bool {
    copies.iter().all(|&(source, target, len)| {
        (0..len).all(|index| bytes[(target + index) as usize] == source_byte(source + index))
    })
}

/// The first byte of `bytes` outside every target range of `copies` that is not zero.
fn stray(bytes: &[u8], copies: &[(u64, u64, u64)]) -> Option<usize> {
    let inside = |offset: u64| copies.iter().any(|&(_, target, len)| (target..target + len).contains(&offset));
    (0..bytes.len()).find(|&offset| bytes[offset] != 0 && !inside(offset as u64))
}

/// Scattered copies: 40 pieces of 100 bytes, every other 256-byte slot of the target, read backwards.
fn scattered() -> Vec<(u64, u64, u64)> {
    (0..40u64).map(|k| (1000 * (39 - k), 512 * k + 7, 100)).collect()
}

fn batch_lands_exactly(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut pair = pair(transport)?;
    let copies = scattered();
    let entries = copies.iter().map(|&(s, t, l)| pair.entry(s, t, l)).collect();
    let id = pair
        .sender
        .submit(pair.conn, Batch { entries, notify: Some(77), tables: Vec::new() })
        .map_err(|e| failed("submitting", e))?;
    let (completions, notified) = pair.drive(transport, &[id], &copies)?;
    let completion = &completions[0];
    if completion.status != BatchStatus::Success || completion.landed != Landed::All {
        return Err(CaseError::Failed(format!(
            "the batch completed {completion:?}, expected success with every entry"
        )));
    }
    let bytes = pair.target_bytes()?;
    if !landed(&bytes, &copies) {
        return Err(CaseError::Failed("a completed batch's bytes are not all at their targets".to_owned()));
    }
    if let Some(offset) = stray(&bytes, &copies) {
        return Err(CaseError::Failed(format!("target byte {offset} changed outside every entry")));
    }
    if notified != [(77, true)] {
        return Err(CaseError::Failed(format!(
            "expected one notification 77 with every byte landed, saw {notified:?} (tag, bytes landed)"
        )));
    }
    Ok(())
}

fn one_completion_per_batch(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut pair = pair(transport)?;
    let mut ids = Vec::new();
    for k in 0..12u64 {
        let batch = Batch { entries: vec![pair.entry(64 * k, 4096 * k, 64)], notify: None, tables: Vec::new() };
        ids.push(pair.sender.submit(pair.conn, batch).map_err(|e| failed("submitting", e))?);
        if ids.len() >= pair.sender.limits().batches_in_flight.min(4) {
            let (completions, _) = pair.drive(transport, &ids, &[])?;
            check_once(&completions, &ids)?;
            ids.clear();
        }
    }
    let (completions, _) = pair.drive(transport, &ids, &[])?;
    check_once(&completions, &ids)?;
    let copies: Vec<(u64, u64, u64)> = (0..12u64).map(|k| (64 * k, 4096 * k, 64)).collect();
    if !landed(&pair.target_bytes()?, &copies) {
        return Err(CaseError::Failed("completed batches' bytes are not all at their targets".to_owned()));
    }
    Ok(())
}

fn check_once(completions: &[Completion], ids: &[BatchId]) -> Result<(), CaseError> {
    let mut seen: Vec<BatchId> = completions.iter().map(|completion| completion.batch).collect();
    seen.sort_unstable();
    let mut expected = ids.to_vec();
    expected.sort_unstable();
    if seen != expected {
        return Err(CaseError::Failed(format!("expected one completion each for {expected:?}, saw {seen:?}")));
    }
    match completions.iter().find(|completion| completion.status != BatchStatus::Success) {
        Some(completion) => Err(CaseError::Failed(format!("a valid batch completed {completion:?}"))),
        None => Ok(()),
    }
}

fn out_of_range_touches_nothing_outside(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut pair = pair(transport)?;
    let good = [(0, 100, 50), (200, 300, 50)];
    let entries = vec![pair.entry(0, 100, 50), pair.entry(0, REGION - 10, 20), pair.entry(200, 300, 50)];
    match pair.sender.submit(pair.conn, Batch { entries, notify: None, tables: Vec::new() }) {
        // Refused at submit (NIXL's way): nothing ran.
        Err(error) if error.kind() == SeamErrorKind::OutOfRange || error.kind() == SeamErrorKind::Engine => {
            transport.settle();
            if let Some(offset) = stray(&pair.target_bytes()?, &[]) {
                return Err(CaseError::Failed(format!("a refused batch changed target byte {offset}")));
            }
            Ok(())
        }
        Err(error) => Err(failed("a batch past the peer's memory was refused with the wrong kind", error)),
        Ok(id) => {
            let (completions, _) = pair.drive(transport, &[id], &[])?;
            let completion = &completions[0];
            if completion.status == BatchStatus::Success {
                return Err(CaseError::Failed("a batch past the peer's memory completed successfully".to_owned()));
            }
            let bytes = pair.target_bytes()?;
            // Entries the engine says landed must be there; no byte outside the entries' ranges may change.
            if let Landed::Entries(ranges) = &completion.landed {
                let claimed: Vec<(u64, u64, u64)> = ranges
                    .iter()
                    .flat_map(|range| range.clone())
                    .filter_map(|index| [Some(good[0]), None, Some(good[1])].get(index as usize).copied().flatten())
                    .collect();
                if !landed(&bytes, &claimed) {
                    return Err(CaseError::Failed(format!("entries {ranges:?} are reported landed but are not")));
                }
            }
            match stray(&bytes, &[good[0], good[1], (0, REGION - 10, 10)]) {
                Some(offset) => Err(CaseError::Failed(format!("target byte {offset} changed outside every entry"))),
                None => Ok(()),
            }
        }
    }
}

fn unknown_connection_is_refused(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut pair = pair(transport)?;
    let entries = vec![pair.entry(0, 0, 8)];
    let bogus = ConnId(pair.conn.0.wrapping_add(1000));
    match pair.sender.submit(bogus, Batch { entries, notify: None, tables: Vec::new() }) {
        Err(error) if error.kind() == SeamErrorKind::UnknownConnection => Ok(()),
        Err(error) => Err(failed("a batch on a connection never opened was refused with the wrong kind", error)),
        Ok(id) => Err(CaseError::Failed(format!("a batch on a connection never opened was accepted as {id}"))),
    }
}

fn over_limits_is_refused(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut pair = pair(transport)?;
    let limits = pair.sender.limits();
    let entries = limits.max_entries.checked_add(1).filter(|count| *count <= 1 << 16);
    let Some(count) = entries else {
        return Ok(()); // no entry limit a batch of this size could pass
    };
    let entries = (0..count).map(|k| pair.entry((k % 1024) as u64, (k % 1024) as u64, 1)).collect();
    match pair.sender.submit(pair.conn, Batch { entries, notify: None, tables: Vec::new() }) {
        Err(error) if error.kind() == SeamErrorKind::OverLimits => Ok(()),
        Err(error) => Err(failed("a batch over the declared entry limit was refused with the wrong kind", error)),
        Ok(id) => {
            Err(CaseError::Failed(format!("a batch of {count} entries, over the declared limit, was accepted as {id}")))
        }
    }
}

/// One entry past the peer's *registered* memory though within what it advertised (a peer that advertised more
/// than it registered): the engine, not kvrelay's range check, meets it. The batch is refused, or fails without
/// notifying the peer, claims only entries that landed, and changes nothing outside its good entries. (Whether the
/// good entries landed is the engine's business, and reported: a failed batch's target bytes are undefined except
/// what its `Landed` names.)
fn one_bad_entry_fails_and_claims_only_what_landed(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut pair = pair_advertising(transport, 2 * REGION)?;
    let good = [(0, 100, 50), (200, 300, 50)];
    let entries = vec![pair.entry(0, 100, 50), pair.entry(0, REGION + 4096, 64), pair.entry(200, 300, 50)];
    let id = match pair.sender.submit(pair.conn, Batch { entries, notify: Some(5), tables: Vec::new() }) {
        Err(_) => {
            transport.settle();
            return match stray(&pair.target_bytes()?, &[]) {
                Some(offset) => Err(CaseError::Failed(format!("a refused batch changed target byte {offset}"))),
                None => Ok(()),
            };
        }
        Ok(id) => id,
    };
    let (completions, notified) = pair.drive(transport, &[id], &[])?;
    let completion = &completions[0];
    if completion.status == BatchStatus::Success {
        return Err(CaseError::Failed(
            "a batch with an entry past the peer's registered memory completed successfully".to_owned(),
        ));
    }
    if !notified.is_empty() {
        return Err(CaseError::Failed(format!("a failed batch notified the peer: {notified:?}")));
    }
    let bytes = pair.target_bytes()?;
    let claimed: Vec<usize> = match &completion.landed {
        Landed::All => vec![0, 1],
        Landed::Unknown => Vec::new(),
        Landed::Entries(ranges) => [0u32, 2]
            .iter()
            .enumerate()
            .filter(|(_, index)| ranges.iter().any(|range| range.contains(index)))
            .map(|(good, _)| good)
            .collect(),
    };
    if let Some(&missing) = claimed.iter().find(|&&index| !landed(&bytes, &[good[index]])) {
        return Err(CaseError::Failed(format!(
            "the failed batch reports {:?} landed, but good entry {} did not",
            completion.landed,
            2 * missing
        )));
    }
    match stray(&bytes, &good) {
        Some(offset) => Err(CaseError::Failed(format!("target byte {offset} changed outside every good entry"))),
        None => Ok(()),
    }
}

/// A source that is not (or no longer) registered: memory released before the batch, or a range past the
/// registration. Refused at submit, or failed with nothing written.
fn unregistered_source_is_refused(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut pair = pair(transport)?;
    let fill = Arc::new(|_: u64, out: &mut [u8]| out.fill(0xAB));
    let gone = pair
        .sender
        .register(pair.sender.memory_kind(), 4096, 0, fill)
        .map_err(|e| failed("registering a second source", e))?;
    pair.sender.release(&gone, false).map_err(|e| failed("releasing the second source", e))?;
    let released = Entry::new(gone.id, 0, 0, 0, 64);
    let past = pair.entry(REGION - 32, 1024, 64);
    for (what, entry) in [("a released source", released), ("a source range past its registration", past)] {
        match pair.sender.submit(pair.conn, Batch { entries: vec![entry], notify: None, tables: Vec::new() }) {
            Err(_) => {}
            Ok(id) => {
                let (completions, _) = pair.drive(transport, &[id], &[])?;
                if completions[0].status == BatchStatus::Success {
                    return Err(CaseError::Failed(format!("a batch from {what} completed successfully")));
                }
            }
        }
        transport.settle();
        if let Some(offset) = stray(&pair.target_bytes()?, &[]) {
            return Err(CaseError::Failed(format!("a batch from {what} changed target byte {offset}")));
        }
    }
    Ok(())
}

/// A large batch with a notification, the receiver polled as fast as it can without the transport settling
/// first: at the moment the notification is seen, every byte of the batch is there.
fn notification_never_precedes_its_data(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut pair = pair(transport)?;
    let copies: Vec<(u64, u64, u64)> = (0..256u64).map(|k| (256 * ((k * 97) % 256), 256 * k, 256)).collect();
    for round in 0..4u32 {
        let entries = copies.iter().map(|&(s, t, l)| pair.entry(s, t, l)).collect();
        let batch = Batch { entries, notify: Some(100 + round), tables: Vec::new() };
        let id = pair.sender.submit(pair.conn, batch).map_err(|e| failed("submitting", e))?;
        pair.sender.flush();
        let (mut completed, mut notified, mut events) = (false, false, Vec::new());
        let mut polls = 0;
        while !(completed && notified) {
            polls += 1;
            if polls > FAST_POLLS {
                return Err(CaseError::Failed(format!(
                    "round {round}: no {} after {FAST_POLLS} polls",
                    if completed { "notification" } else { "completion" }
                )));
            }
            pair.receiver.poll(&mut events, usize::MAX);
            for event in events.drain(..) {
                if let Event::Notified { tag, .. } = event {
                    if tag != 100 + round {
                        return Err(CaseError::Failed(format!(
                            "round {round}: notification {tag} is not this batch's"
                        )));
                    }
                    if !landed(&pair.target_bytes()?, &copies) {
                        return Err(CaseError::Failed(format!(
                            "round {round}: the notification arrived before every byte of its batch"
                        )));
                    }
                    notified = true;
                }
            }
            pair.sender.poll(&mut events, usize::MAX);
            for event in events.drain(..) {
                if let Event::Completed(completion) = event {
                    if completion.batch == id && completion.status != BatchStatus::Success {
                        return Err(CaseError::Failed(format!("round {round}: the batch completed {completion:?}")));
                    }
                    completed |= completion.batch == id;
                }
            }
            transport.step();
        }
        // The next round overwrites the same bytes: clear them through a batch-free path (a fresh pair).
        pair = self::pair(transport)?;
    }
    Ok(())
}

/// More batches than the engine queues, submitted without polling: the engine refuses some at submit or fails
/// them, and afterwards a batch to the same peer succeeds and lands (the peer is not wedged).
fn queue_full_leaves_the_peer_usable(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let mut pair = pair(transport)?;
    let limits = pair.sender.limits();
    let width = limits.max_entries.clamp(1, 8192);
    let flood = limits.batches_in_flight.saturating_add(1).min(64);
    let mut accepted = Vec::new();
    for k in 0..flood {
        let entries = (0..width).map(|i| pair.entry((i % 4096) as u64, (i % 4096) as u64, 8)).collect();
        match pair.sender.submit(pair.conn, Batch { entries, notify: None, tables: Vec::new() }) {
            Ok(id) => accepted.push(id),
            Err(error) if error.kind() == SeamErrorKind::OverLimits => break,
            Err(error) => return Err(failed(&format!("flood batch {k} was refused with the wrong kind"), error)),
        }
    }
    pair.drive(transport, &accepted, &[])?;
    let after = [(1000, 60000, 512)];
    let entries = vec![pair.entry(1000, 60000, 512)];
    let id = pair
        .sender
        .submit(pair.conn, Batch { entries, notify: Some(9), tables: Vec::new() })
        .map_err(|e| failed("after a flood of batches, a batch to the same peer", e))?;
    let (completions, _) = pair.drive(transport, &[id], &after)?;
    let completion = completions.iter().find(|completion| completion.batch == id).expect("driven");
    if completion.status != BatchStatus::Success || !landed(&pair.target_bytes()?, &after) {
        return Err(CaseError::Failed(format!(
            "after a flood of {} batches of {width} entries, a batch to the same peer completed {:?} ({}): the peer is wedged",
            accepted.len(),
            completion.status.name(),
            completion.detail
        )));
    }
    Ok(())
}

/// Polls `sender` alone (settling the transport between rounds) until `batch` completes: its completion, or `None`
/// after [`ROUNDS`] rounds.
fn complete_alone(
    transport: &mut dyn Transport,
    sender: &mut dyn TransferEngine,
    batch: BatchId,
) -> Option<crate::fabric::seam::Completion> {
    let mut events = Vec::new();
    for _ in 0..ROUNDS {
        sender.flush();
        transport.settle();
        sender.poll(&mut events, usize::MAX);
        let done = events.drain(..).find_map(|event| match event {
            Event::Completed(completion) if completion.batch == batch => Some(completion),
            _ => None,
        });
        if done.is_some() {
            return done;
        }
        transport.step();
    }
    None
}

/// A peer that dies mid-transfer: the receiver's engine is dropped (its memory with it) right after a batch of many
/// entries to it was submitted. The sender's batch must complete within the deadline, whatever its status (bytes may
/// have landed before the death), never hang; a batch to the dead peer must be refused or fail, never report Success
/// (its memory is gone: nothing can land there); and the sender stays usable: a new peer takes a batch that lands.
fn a_peer_that_dies_mid_transfer_fails_within_the_deadline(transport: &mut dyn Transport) -> Result<(), CaseError> {
    let Pair { mut sender, receiver, source, conn, .. } = pair(transport)?;
    let width = sender.limits().max_entries.clamp(1, 4096);
    let entry = |i: u64| Entry::new(source.id, i * 16 % 60000, 0, i * 16 % 60000, 16);
    let entries = (0..width as u64).map(entry).collect();
    let id = sender
        .submit(conn, Batch { entries, notify: Some(5), tables: Vec::new() })
        .map_err(|e| failed("the batch before the death", e))?;
    sender.flush();
    drop(receiver);
    if complete_alone(transport, sender.as_mut(), id).is_none() {
        return Err(CaseError::Failed(format!(
            "a batch of {width} entries to a peer that died after the submit never completed ({ROUNDS} rounds): a hang"
        )));
    }
    match sender.submit(conn, Batch { entries: vec![entry(1)], notify: None, tables: Vec::new() }) {
        Err(_) => {}
        Ok(late) => match complete_alone(transport, sender.as_mut(), late) {
            None => return Err(CaseError::Failed("a batch to a dead peer never completed: a hang".to_owned())),
            Some(completion) if completion.status == BatchStatus::Success => {
                return Err(CaseError::Failed(
                    "a batch to a peer whose engine and memory are gone completed Success".to_owned(),
                ))
            }
            Some(_) => {}
        },
    }
    let mut fresh = transport.engine(NodeId(2), ASK).map_err(|e| failed("opening a new peer after the death", e))?;
    let zero = Arc::new(|_: u64, out: &mut [u8]| out.fill(0));
    let target =
        fresh.register(fresh.memory_kind(), REGION, 0, zero).map_err(|e| failed("registering the new peer", e))?;
    let (next, next_address) = sender.open().map_err(|e| failed("opening a connection to the new peer", e))?;
    let (back, address) = fresh.open().map_err(|e| failed("opening the new peer's end", e))?;
    sender.connect(next, &address, &[target.remote()]).map_err(|e| failed("connecting to the new peer", e))?;
    fresh.connect(back, &next_address, &[]).map_err(|e| failed("connecting the new peer back", e))?;
    let copy = [(2048, 4096, 1024)];
    let batch = Batch::of(vec![Entry::new(source.id, 2048, 0, 4096, 1024)]);
    let after = sender.submit(next, batch).map_err(|e| failed("a batch to a new peer after the death", e))?;
    let completion = complete_alone(transport, sender.as_mut(), after)
        .ok_or_else(|| CaseError::Failed("after a peer died, a batch to a new peer never completed".to_owned()))?;
    let mut bytes = vec![0u8; REGION as usize];
    fresh.read(&target, 0, &mut bytes).map_err(|e| failed("reading the new peer", e))?;
    if completion.status != BatchStatus::Success || !landed(&bytes, &copy) {
        return Err(CaseError::Failed(format!(
            "after a peer died, a batch to a new peer completed {} ({}) or did not land: the sender is wedged",
            completion.status.name(),
            completion.detail
        )));
    }
    Ok(())
}

/// Caps these cases need below the seam (none: a verbs transport lowers within what it grants).
const ANY: Caps = Caps { max_sge: 1, max_message: 1, sq_depth: 1 };

fn case(
    id: &'static str,
    group: Group,
    claim: &'static str,
    run: fn(&mut dyn Transport) -> Result<(), CaseError>,
) -> ConformanceCase {
    ConformanceCase { id, group, claim, caps: ANY, run }
}

static CASES: std::sync::LazyLock<Vec<ConformanceCase>> = std::sync::LazyLock::new(|| {
    use Group::{Contract, ErrorPath};
    vec![
        case(
            "batch_lands_exactly_and_notifies_after_its_bytes",
            Contract,
            "a batch of scattered entries lands byte for byte, completes once with every entry, changes nothing else, and its notification arrives after its bytes",
            batch_lands_exactly,
        ),
        case(
            "one_completion_per_batch",
            Contract,
            "every submitted batch completes exactly once, successfully, within the engine's declared batches in flight",
            one_completion_per_batch,
        ),
        case(
            "out_of_range_touches_nothing_outside",
            ErrorPath,
            "a batch past the peer's memory is refused or fails, reports only entries that landed, and changes no byte outside its entries",
            out_of_range_touches_nothing_outside,
        ),
        case(
            "unknown_connection_is_refused",
            ErrorPath,
            "a batch on a connection never opened is refused at submit",
            unknown_connection_is_refused,
        ),
        case(
            "one_bad_entry_fails_and_claims_only_what_landed",
            ErrorPath,
            "a batch with one entry past the peer's registered memory (within what the peer advertised) is refused, or fails without notifying, claims only entries that landed and changes nothing outside its good entries",
            one_bad_entry_fails_and_claims_only_what_landed,
        ),
        case(
            "unregistered_source_is_refused",
            ErrorPath,
            "a batch from a released source, or from a range past its registration, is refused or fails, and writes nothing",
            unregistered_source_is_refused,
        ),
        case(
            "notification_never_precedes_its_data",
            Contract,
            "polled as fast as it can be, the receiver never sees a batch's notification before every byte of the batch",
            notification_never_precedes_its_data,
        ),
        case(
            "queue_full_leaves_the_peer_usable",
            ErrorPath,
            "after more batches than the engine queues (refused at submit or failed), a batch to the same peer succeeds and lands",
            queue_full_leaves_the_peer_usable,
        ),
        case(
            "a_peer_that_dies_mid_transfer_fails_within_the_deadline",
            ErrorPath,
            "a batch to a peer whose engine dies right after the submit completes within the deadline, a later batch to it never reports Success, and a new peer then takes a batch that lands",
            a_peer_that_dies_mid_transfer_fails_within_the_deadline,
        ),
        case(
            "over_limits_is_refused",
            ErrorPath,
            "a batch over the engine's declared entry limit is refused at submit",
            over_limits_is_refused,
        ),
    ]
});

/// Every seam case, in a fixed order (ids are stable across versions).
pub fn cases() -> &'static [ConformanceCase] {
    &CASES
}
