//! A prefill rank's planned copies lowered to gather-list writes within the fabric's limits: the rules of
//! `plan::lowering` applied to addresses, so they hold for any planner in the seat.
//!
//! Consecutive copies whose targets continue one another on the same peer region become one RDMA WRITE: a source
//! that continues the last entry extends it, another source opens a new scatter/gather entry while the work request
//! has fewer than `max_sge`; the message never exceeds `max_message`. A copy larger than `max_message` was cut
//! before it gets here. The order of the bytes on the target is the copies' order, so nothing moves differently
//! from one write per copy: only the number of work requests changes (domain.md §6.1 step 5 fixes what lands where,
//! not how many writes carry it).

use super::verbs::{Caps, RemoteAddr, Sge};

/// One piece of a copy: `sge.len` bytes from local `sge` to `remote`, `offset` bytes into peer region `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub sge: Sge,
    pub remote: RemoteAddr,
    pub region: u32,
    pub offset: u64,
    /// The index of the batch entry this piece is of.
    pub entry: u32,
}

/// One work request's worth: a gather list landing contiguously at `remote` (`offset` into peer region `region`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Gathered {
    pub sges: Vec<Sge>,
    pub remote: RemoteAddr,
    pub region: u32,
    pub offset: u64,
    pub len: u64,
    /// The batch entries it carries (bytes of), in order.
    pub entries: std::ops::Range<u32>,
}

impl Gathered {
    fn open(piece: Piece) -> Gathered {
        Gathered {
            sges: vec![piece.sge],
            remote: piece.remote,
            region: piece.region,
            offset: piece.offset,
            len: piece.sge.len,
            entries: piece.entry..piece.entry + 1,
        }
    }

    /// Takes `piece` in if its target continues this write and the limits allow; false leaves both unchanged.
    fn absorb(&mut self, piece: &Piece, caps: Caps) -> bool {
        let continues = piece.region == self.region
            && piece.remote.rkey == self.remote.rkey
            && self.remote.addr.checked_add(self.len) == Some(piece.remote.addr);
        let Some(len) = self.len.checked_add(piece.sge.len) else { return false };
        if !continues || len > caps.max_message {
            return false;
        }
        let last = self.sges.last_mut().expect("a gathered write has an entry");
        if last.lkey == piece.sge.lkey && last.addr.checked_add(last.len) == Some(piece.sge.addr) {
            last.len += piece.sge.len;
        } else if self.sges.len() < caps.max_sge.max(1) {
            self.sges.push(piece.sge);
        } else {
            return false;
        }
        self.len = len;
        self.entries.end = self.entries.end.max(piece.entry + 1);
        true
    }
}

/// `pieces` (in plan order, each at most `max_message` bytes) as gather-list writes within `caps`.
pub(crate) fn gather(pieces: impl IntoIterator<Item = Piece>, caps: Caps) -> Vec<Gathered> {
    let mut res: Vec<Gathered> = Vec::new();
    for piece in pieces {
        if !res.last_mut().is_some_and(|open| open.absorb(&piece, caps)) {
            res.push(Gathered::open(piece));
        }
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    const CAPS: Caps = Caps { max_sge: 2, max_message: 1000, sq_depth: 16 };

    fn piece(source: u64, target: u64, len: u64) -> Piece {
        Piece {
            sge: Sge { addr: 0x1000 + source, len, lkey: 7 },
            remote: RemoteAddr { addr: 0x9000 + target, rkey: 9 },
            region: 0,
            offset: target,
            entry: 0,
        }
    }

    /// Rows of one decode rank (every 8th source row into consecutive target rows, domain.md §2.4) gather up to
    /// `max_sge` rows per write; a source that continues the last entry extends it instead.
    #[test]
    fn strided_sources_gather_up_to_max_sge_and_adjacent_sources_extend() {
        let rows: Vec<Piece> = (0..5).map(|k| piece(8 * 64 * k, 64 * k, 64)).collect();
        let writes = gather(rows, CAPS);
        let shape: Vec<(usize, u64, u64)> = writes.iter().map(|w| (w.sges.len(), w.offset, w.len)).collect();
        assert_eq!(shape, [(2, 0, 128), (2, 128, 128), (1, 256, 64)]);
        let contiguous: Vec<Piece> = (0..5).map(|k| piece(64 * k, 64 * k, 64)).collect();
        let writes = gather(contiguous, CAPS);
        assert_eq!(writes.len(), 1);
        assert_eq!(writes[0].sges, [Sge { addr: 0x1000, len: 320, lkey: 7 }]);
    }

    /// A gap on the target, another region or key, or a message over `max_message` starts a new write.
    #[test]
    fn a_break_in_the_target_the_key_or_the_message_limit_starts_a_new_write() {
        let mut other_key = piece(64, 64, 64);
        other_key.remote.rkey = 10;
        let mut other_region = piece(128, 128, 64);
        other_region.region = 1;
        let pieces = [piece(0, 0, 64), other_key, other_region, piece(0, 500, 600), piece(600, 1100, 500)];
        let lens: Vec<u64> = gather(pieces, CAPS).iter().map(|write| write.len).collect();
        assert_eq!(lens, [64, 64, 64, 600, 500]);
    }
}
