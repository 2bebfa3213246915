//! The bookkeeping every real fabric shares ([`Shell`]): what a backend over a device (`rdma.rs`) or a C ABI
//! plug-in (`plugin.rs`) keeps of its QPs on this side of the foreign calls, held once, in safe code.
//!
//! A backend owns its device calls (posting, polling, receives, QP state changes, its contract checks); the shell
//! owns the rest of the [`super::verbs::Endpoint`] contract:
//!
//! - **QPs.** One [`QpBook`] per QP: connected or not, its send-queue credits (the same [`SendQueue`] accounting
//!   as every fabric) and a ring of `sq_depth` slots by position holding the caller's `wr_id`, message length and
//!   signalling. The device sees positions, never `wr_id`s, so duplicate `wr_id`s are harmless.
//! - **Posting.** [`Shell::check_post`] refuses what the contract refuses (unknown or unconnected QP, SGE count,
//!   message size, credits) before the device sees anything; [`Shell::record`] takes slots for what the device
//!   accepted, or, on a failed QP, for work requests it never sees.
//! - **Completions.** [`Shell::complete`] turns the device's completion of a position into the caller's (a
//!   successful unsignalled work request gives none); they wait in one queue, in arrival order, and
//!   [`Shell::hand_out`] frees the slots a completion frees when it is handed out, the contract's moment.
//! - **Failure.** A failed QP ([`Shell::fail`]: the device reported an error; [`Shell::take_over`]: the backend
//!   stopped trusting the device from a position on) is completed here from its device end on: after the device's
//!   last completion, each later work request completes in error, the first [`WcStatus::LocalProtection`] unless
//!   the device already reported an error, every other [`WcStatus::Flushed`], in post order.
//! - **Polling.** [`poll_cq`] hands out ready completions and asks the backend ([`Backend::fetch`]) for more until
//!   `max` are handed out or the device has none left.
//!
//! A third real backend implements [`Backend`] and makes only its own calls.

use std::collections::{BTreeMap, VecDeque};

use super::verbs::{Caps, FabricError, QpNum, SendQueue, WcKind, WcStatus, WorkCompletion, WorkRequest};

/// What the caller posted at one position of a QP.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) wr_id: u64,
    /// The message length.
    pub(super) byte_len: u64,
    pub(super) signaled: bool,
}

/// One QP's bookkeeping (see the module docs).
#[derive(Debug, Clone)]
pub(super) struct QpBook {
    connected: bool,
    queue: SendQueue,
    /// Indexed by position modulo its length (`sq_depth`, at least 1): at most that many are outstanding.
    slots: Box<[Slot]>,
    /// One past the position of the last work request handed to the device (later ones are completed here).
    device_end: u64,
    /// One past the position of the last send completion the device gave.
    completed_end: u64,
    /// The QP failed: work requests from `device_end` on are completed here.
    failed: bool,
    /// A work request of this QP has completed in error here, or the device's error made it fail ([`Shell::fail`]).
    error_given: bool,
    /// One past the position of the last work request completed here.
    released_end: u64,
}

impl QpBook {
    fn new(sq_depth: usize) -> QpBook {
        QpBook {
            connected: false,
            queue: SendQueue::default(),
            slots: vec![Slot::default(); sq_depth.max(1)].into_boxed_slice(),
            device_end: 0,
            completed_end: 0,
            failed: false,
            error_given: false,
            released_end: 0,
        }
    }

    /// The send-queue credits.
    pub(super) fn queue(&self) -> &SendQueue {
        &self.queue
    }

    /// One past the position of the last send completion the device gave.
    pub(super) fn completed_end(&self) -> u64 {
        self.completed_end
    }

    /// Whether the QP failed ([`Shell::fail`] or [`Shell::take_over`]): work requests are completed here.
    pub(super) fn failed(&self) -> bool {
        self.failed
    }

    /// What was posted at `position`, if it still holds a slot.
    pub(super) fn slot(&self, position: u64) -> Option<Slot> {
        let freed = self.queue.posted() - self.queue.outstanding();
        (freed..self.queue.posted()).contains(&position).then(|| self.slot_at(position))
    }

    /// Whether a send completion is certain to come from the device that it has not given yet: a signalled work
    /// request is behind its last completion, or the QP failed and the device still holds work requests.
    pub(super) fn awaits_completion(&self) -> bool {
        let end = if self.failed { self.device_end } else { self.queue.signaled_end() };
        end > self.completed_end
    }

    fn slot_at(&self, position: u64) -> Slot {
        self.slots[(position % self.slots.len() as u64) as usize]
    }

    fn completion(&self, qpn: QpNum, position: u64, status: WcStatus) -> Ready {
        let slot = self.slot_at(position);
        let byte_len = if status == WcStatus::Success { slot.byte_len } else { 0 };
        let wc = WorkCompletion { wr_id: slot.wr_id, qp: qpn, status, kind: WcKind::Write, imm: None, byte_len };
        Ready { wc, frees_through: Some(position + 1) }
    }

    /// Once the device has completed everything it was given, appends the completions of the failed QP's later
    /// work requests to `ready`, in post order: the first in error unless one already was, the rest flushed.
    fn release(&mut self, qpn: QpNum, ready: &mut VecDeque<Ready>) {
        if !self.failed || self.completed_end < self.device_end {
            return;
        }
        for position in self.released_end.max(self.device_end)..self.queue.posted() {
            let status = if self.error_given { WcStatus::Flushed } else { WcStatus::LocalProtection };
            self.error_given = true;
            ready.push_back(self.completion(qpn, position, status));
        }
        self.released_end = self.queue.posted();
    }
}

/// A completion waiting to be handed out; handing out a sender's frees its QP's slots before `frees_through`.
#[derive(Debug, Clone, Copy)]
struct Ready {
    wc: WorkCompletion,
    frees_through: Option<u64>,
}

/// One endpoint's QP books and ready completions (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Shell {
    qps: BTreeMap<QpNum, QpBook>,
    /// Completions from the device (or made here) not handed out yet, in arrival order.
    ready: VecDeque<Ready>,
}

impl Shell {
    /// Starts the book of a new QP with `sq_depth` slots (at least 1).
    pub(super) fn add_qp(&mut self, qpn: QpNum, sq_depth: usize) {
        self.qps.insert(qpn, QpBook::new(sq_depth));
    }

    /// The book of `qpn`, if the endpoint has it.
    pub(super) fn qp(&self, qpn: QpNum) -> Option<&QpBook> {
        self.qps.get(&qpn)
    }

    /// Every QP's book, by number.
    pub(super) fn qps(&self) -> impl Iterator<Item = (QpNum, &QpBook)> {
        self.qps.iter().map(|(qpn, book)| (*qpn, book))
    }

    /// Whether `qpn` may be connected now: it exists and is not connected yet.
    pub(super) fn check_connect(&self, qpn: QpNum) -> Result<(), FabricError> {
        let book = self.qps.get(&qpn).ok_or(FabricError::UnknownQp(qpn))?;
        if book.connected {
            return Err(FabricError::AlreadyConnected(qpn));
        }
        Ok(())
    }

    /// Marks `qpn` connected (the device call succeeded).
    pub(super) fn connect(&mut self, qpn: QpNum) {
        self.book_mut(qpn).connected = true;
    }

    /// Whether `wrs` may be posted on `qpn` now: the QP exists and is connected, and [`SendQueue::check_post`]
    /// allows them. Checks only.
    pub(super) fn check_post(&self, qpn: QpNum, caps: Caps, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        let book = self.qps.get(&qpn).ok_or(FabricError::UnknownQp(qpn))?;
        if !book.connected {
            return Err(FabricError::NotConnected(qpn));
        }
        book.queue.check_post(qpn, caps, wrs)
    }

    /// Takes send-queue slots for posted work requests (checked by [`Shell::check_post`]). On a healthy QP the
    /// device took them; on a failed one it never sees them, and they complete here after its last completion.
    pub(super) fn record(&mut self, qpn: QpNum, wrs: &[WorkRequest]) {
        let Self { qps, ready } = self;
        let book = qps.get_mut(&qpn).expect("a QP of this endpoint");
        for wr in wrs {
            let position = book.queue.push(wr.signaled);
            let byte_len = wr.byte_len().expect("checked by check_post");
            let index = (position % book.slots.len() as u64) as usize;
            book.slots[index] = Slot { wr_id: wr.wr_id, byte_len, signaled: wr.signaled };
        }
        if book.failed {
            book.release(qpn, ready);
        } else {
            book.device_end = book.queue.posted();
        }
    }

    /// The device completed the work request at `position` of `qpn` (in post order) with `status`: queues the
    /// caller's completion (none for a successful unsignalled one) and, on a failed QP, what is completed here
    /// once this was the device's last.
    pub(super) fn complete(&mut self, qpn: QpNum, position: u64, status: WcStatus) {
        let Self { qps, ready } = self;
        let book = qps.get_mut(&qpn).expect("a QP of this endpoint");
        book.completed_end = book.completed_end.max(position + 1);
        if status != WcStatus::Success || book.slot_at(position).signaled {
            ready.push_back(book.completion(qpn, position, status));
        }
        book.release(qpn, ready);
    }

    /// The device reported a failure of `qpn`: from now on its work requests are completed here, flushed, after
    /// the device's last completion. Whether the QP was healthy until now.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code, reason = "only the RDMA fabric sees device errors"))]
    pub(super) fn fail(&mut self, qpn: QpNum) -> bool {
        let Self { qps, ready } = self;
        let book = qps.get_mut(&qpn).expect("a QP of this endpoint");
        let newly = !book.failed;
        book.failed = true;
        book.error_given = true;
        book.release(qpn, ready);
        newly
    }

    /// The backend stops trusting the device for `qpn` from `position` on (`None`: from its first work request not
    /// completed yet; never before that): everything outstanding from there, and everything posted later, is
    /// completed here, the first in error ([`WcStatus::LocalProtection`]) unless one already was, the rest
    /// flushed. Completions the device gives for the QP afterwards must be dropped by the backend.
    pub(super) fn take_over(&mut self, qpn: QpNum, position: Option<u64>) {
        let Self { qps, ready } = self;
        let book = qps.get_mut(&qpn).expect("a QP of this endpoint");
        let from = position.unwrap_or(book.completed_end).max(book.completed_end);
        book.failed = true;
        book.device_end = from;
        book.completed_end = from;
        book.release(qpn, ready);
    }

    /// Queues a completion that frees no send-queue slot (a receiver's notification).
    pub(super) fn push_notification(&mut self, wc: WorkCompletion) {
        self.ready.push_back(Ready { wc, frees_through: None });
    }

    /// Completions waiting to be handed out.
    pub(super) fn ready(&self) -> usize {
        self.ready.len()
    }

    /// The next completion for the caller, freeing its QP's send-queue slots (the contract's moment of freeing).
    pub(super) fn hand_out(&mut self) -> Option<WorkCompletion> {
        let ready = self.ready.pop_front()?;
        if let (Some(end), Some(book)) = (ready.frees_through, self.qps.get_mut(&ready.wc.qp)) {
            book.queue.free_through(end);
        }
        Some(ready.wc)
    }

    /// Whether a send completion is certain to come from the device on some QP ([`QpBook::awaits_completion`]).
    pub(super) fn awaits_completions(&self) -> bool {
        self.qps.values().any(QpBook::awaits_completion)
    }

    /// Drops every book and ready completion.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code, reason = "the RDMA fabric clears it on drop"))]
    pub(super) fn clear(&mut self) {
        self.qps.clear();
        self.ready.clear();
    }

    fn book_mut(&mut self, qpn: QpNum) -> &mut QpBook {
        self.qps.get_mut(&qpn).expect("a QP of this endpoint")
    }
}

/// A real fabric's own half: its shell and the call that takes completions off its device.
pub(super) trait Backend {
    /// The endpoint's shell.
    fn shell(&mut self) -> &mut Shell;
    /// Takes up to `want` (at least 1; fewer if the backend's batch is smaller) completions off the device into
    /// the shell; `false` when the device had fewer than asked for (nothing more to fetch now).
    fn fetch(&mut self, want: usize) -> bool;
}

/// [`super::verbs::Endpoint::poll_cq`] of a real fabric: hands out ready completions and fetches more from the
/// device until `max` are handed out or the device has none left; how many were appended to `out`.
pub(super) fn poll_cq<B: Backend + ?Sized>(backend: &mut B, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
    let (mut count, mut device_empty) = (0, false);
    while count < max {
        if let Some(wc) = backend.shell().hand_out() {
            out.push(wc);
            count += 1;
        } else if device_empty {
            break;
        } else {
            device_empty = !backend.fetch(max - count);
        }
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::verbs::{RemoteAddr, Sge};

    const QP: QpNum = QpNum(7);
    const CAPS: Caps = Caps { max_sge: 1, max_message: 1 << 20, sq_depth: 4 };

    fn write(wr_id: u64, len: u64, signaled: bool) -> WorkRequest {
        WorkRequest {
            wr_id,
            sges: vec![Sge { addr: 0x1000, len, lkey: 1 }],
            remote: RemoteAddr { addr: 0x2000, rkey: 2 },
            imm: None,
            signaled,
        }
    }

    fn connected() -> Shell {
        let mut shell = Shell::default();
        shell.add_qp(QP, CAPS.sq_depth);
        shell.connect(QP);
        shell
    }

    fn post(shell: &mut Shell, wrs: &[WorkRequest]) {
        shell.check_post(QP, CAPS, wrs).expect("allowed");
        shell.record(QP, wrs);
    }

    fn drain(shell: &mut Shell) -> Vec<(u64, WcStatus, u64)> {
        std::iter::from_fn(|| shell.hand_out()).map(|wc| (wc.wr_id, wc.status, wc.byte_len)).collect()
    }

    /// A device that gives the completions queued in it, a batch of at most `batch` per fetch.
    struct Scripted {
        shell: Shell,
        device: VecDeque<(u64, WcStatus)>,
        batch: usize,
        fetches: usize,
    }

    impl Backend for Scripted {
        fn shell(&mut self) -> &mut Shell {
            &mut self.shell
        }

        fn fetch(&mut self, want: usize) -> bool {
            self.fetches += 1;
            let want = want.min(self.batch);
            let mut taken = 0;
            while taken < want {
                let Some((position, status)) = self.device.pop_front() else { break };
                self.shell.complete(QP, position, status);
                taken += 1;
            }
            taken == want
        }
    }

    #[test]
    fn unknown_unconnected_and_full_queues_are_refused_with_the_contracts_errors() {
        let mut shell = Shell::default();
        let wrs = [write(1, 8, true)];
        assert_eq!(shell.check_post(QP, CAPS, &wrs), Err(FabricError::UnknownQp(QP)));
        assert_eq!(shell.check_connect(QP), Err(FabricError::UnknownQp(QP)));
        shell.add_qp(QP, CAPS.sq_depth);
        assert_eq!(shell.check_post(QP, CAPS, &wrs), Err(FabricError::NotConnected(QP)));
        assert_eq!(shell.check_connect(QP), Ok(()));
        shell.connect(QP);
        assert_eq!(shell.check_connect(QP), Err(FabricError::AlreadyConnected(QP)));
        let four: Vec<_> = (0..4).map(|id| write(id, 8, true)).collect();
        post(&mut shell, &four);
        assert_eq!(shell.check_post(QP, CAPS, &wrs), Err(FabricError::QueueFull { qp: QP, depth: 4 }));
    }

    #[test]
    fn credits_are_freed_when_a_completion_is_handed_out_not_when_it_arrives() {
        let mut shell = connected();
        let four: Vec<_> = (0..4).map(|id| write(10 + id, 8, true)).collect();
        post(&mut shell, &four);
        shell.complete(QP, 0, WcStatus::Success);
        shell.complete(QP, 1, WcStatus::Success);
        assert_eq!(shell.ready(), 2);
        assert_eq!(shell.qp(QP).unwrap().queue().outstanding(), 4, "arrived, not handed out: no slot freed");
        assert!(shell.check_post(QP, CAPS, &[write(1, 8, true)]).is_err());
        assert_eq!(shell.hand_out().map(|wc| (wc.wr_id, wc.byte_len)), Some((10, 8)));
        assert_eq!(shell.qp(QP).unwrap().queue().outstanding(), 3);
        assert_eq!(shell.qp(QP).unwrap().slot(0), None, "a freed slot is gone");
        assert_eq!(shell.qp(QP).unwrap().slot(1), Some(Slot { wr_id: 11, byte_len: 8, signaled: true }));
        assert_eq!(shell.check_post(QP, CAPS, &[write(1, 8, true)]), Ok(()));
    }

    #[test]
    fn an_unsignalled_success_gives_nothing_and_a_later_completion_frees_its_slot() {
        let mut shell = connected();
        post(&mut shell, &[write(1, 8, false), write(2, 8, false), write(3, 16, true)]);
        shell.complete(QP, 0, WcStatus::Success);
        assert_eq!(shell.ready(), 0, "an unsignalled success completes nothing");
        shell.complete(QP, 2, WcStatus::Success);
        assert_eq!(shell.qp(QP).unwrap().queue().outstanding(), 3);
        assert_eq!(drain(&mut shell), [(3, WcStatus::Success, 16)]);
        assert_eq!(shell.qp(QP).unwrap().queue().outstanding(), 0, "the signalled one freed every slot before it");
        assert!(!shell.awaits_completions());
    }

    #[test]
    fn a_failed_qps_later_posts_are_flushed_here_after_the_devices_last_completion() {
        let mut shell = connected();
        post(&mut shell, &[write(1, 8, true), write(2, 8, true)]);
        shell.complete(QP, 0, WcStatus::RemoteAccess);
        assert!(shell.fail(QP), "healthy until now");
        assert!(!shell.fail(QP), "failed once");
        post(&mut shell, &[write(3, 8, false)]);
        assert!(shell.awaits_completions(), "the device still holds position 1");
        assert_eq!(drain(&mut shell), [(1, WcStatus::RemoteAccess, 0)], "position 2 waits for the device's flush");
        shell.complete(QP, 1, WcStatus::Flushed);
        assert!(!shell.awaits_completions());
        assert_eq!(drain(&mut shell), [(2, WcStatus::Flushed, 0), (3, WcStatus::Flushed, 0)]);
        post(&mut shell, &[write(4, 8, true)]);
        assert_eq!(drain(&mut shell), [(4, WcStatus::Flushed, 0)], "posted after: flushed at once");
        assert_eq!(shell.qp(QP).unwrap().queue().outstanding(), 0);
    }

    #[test]
    fn taking_over_completes_a_range_first_in_error_then_flushed() {
        let mut shell = connected();
        post(&mut shell, &[write(1, 8, true), write(2, 8, false), write(3, 8, true)]);
        shell.complete(QP, 0, WcStatus::Success);
        shell.take_over(QP, Some(1));
        let book = shell.qp(QP).unwrap();
        assert!(book.failed() && !book.awaits_completion());
        assert_eq!(
            drain(&mut shell),
            [(1, WcStatus::Success, 8), (2, WcStatus::LocalProtection, 0), (3, WcStatus::Flushed, 0)]
        );
        post(&mut shell, &[write(4, 8, false)]);
        assert_eq!(drain(&mut shell), [(4, WcStatus::Flushed, 0)]);

        // Taken over with nothing outstanding: the next work request posted is the one in error.
        let mut shell = connected();
        shell.take_over(QP, None);
        post(&mut shell, &[write(5, 8, false), write(6, 8, true)]);
        assert_eq!(drain(&mut shell), [(5, WcStatus::LocalProtection, 0), (6, WcStatus::Flushed, 0)]);

        // Never before the device's last completion.
        let mut shell = connected();
        post(&mut shell, &[write(7, 8, true), write(8, 8, true)]);
        shell.complete(QP, 0, WcStatus::Success);
        shell.take_over(QP, Some(0));
        assert_eq!(drain(&mut shell), [(7, WcStatus::Success, 8), (8, WcStatus::LocalProtection, 0)]);
    }

    #[test]
    fn poll_hands_out_ready_ones_then_fetches_until_max_or_the_device_is_empty() {
        let mut backend = Scripted { shell: connected(), device: VecDeque::new(), batch: 2, fetches: 0 };
        let four: Vec<_> = (0..4).map(|id| write(id, 8, true)).collect();
        post(&mut backend.shell, &four);
        backend.shell.complete(QP, 0, WcStatus::Success);
        backend.device.extend([(1, WcStatus::Success), (2, WcStatus::Success), (3, WcStatus::Success)]);
        let mut out = Vec::new();
        assert_eq!(poll_cq(&mut backend, &mut out, 3), 3);
        assert_eq!(out.iter().map(|wc| wc.wr_id).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(backend.fetches, 1, "the ready one first, then one batch of two");
        assert_eq!(poll_cq(&mut backend, &mut out, 8), 1);
        assert_eq!(backend.fetches, 2, "a short batch ends the poll");
        assert_eq!(poll_cq(&mut backend, &mut out, 0), 0);
        assert_eq!(backend.shell.qp(QP).unwrap().queue().outstanding(), 0);
    }
}
