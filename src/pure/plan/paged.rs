//! Paged descriptors: strided descriptors addressed through the request's page tables, so a relayout over the
//! allocator's shuffled pages is as compact as one over contiguous pages.
//!
//! The tables are what the peers already exchange (domain.md §2.3, §5.2): the prefill rank's own KV pages, the
//! decode's `dst_kv_indices`, and per paged state component the state pages of both sides. One side of a
//! [`PagedDescriptor`] addresses either physical region bytes ([`Table::Physical`]) or *logical* bytes of a table:
//! logical byte `l` of a region of `item_len`-byte items lies at `table[l / item_len] * item_len + l % item_len`.
//!
//! [`compact`] cuts every plan descriptor's elements at item boundaries, rewrites each piece into logical
//! addresses where its item is in the request's table, and merges pieces that continue there at one stride. The
//! DCP relayout of a whole request (domain.md §2.4) then becomes one descriptor per decode rank, layer and chunk,
//! whatever the page order. [`PagedDescriptor::segments`] translates back; a proptest (tests/it/props.rs) holds
//! the translation to the plan's per-row expansion over every transfer kind.
//!
//! [I] When cutting at items and merging in logical space gives more descriptors than the plan's own (physically
//! adjacent pages whose table order differs), [`compact`] keeps the plan's descriptors, all physical: the paged
//! form is never longer than the strided one.

use std::collections::BTreeMap;
use std::rc::Rc;

use super::{Descriptor, TransferKind};
use crate::model::{Problem, RankId, Request, Side};

/// How one side of a paged descriptor addresses its region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Table {
    /// Offsets are region bytes.
    Physical,
    /// Offsets are logical bytes of the request's KV pages on this side.
    KvPages,
    /// Offsets are logical bytes of the request's pages of this state component on this side.
    StatePages { component: u32 },
}

impl std::fmt::Display for Table {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Table::Physical => f.write_str("physical"),
            Table::KvPages => f.write_str("kv_pages"),
            Table::StatePages { component } => write!(f, "state_pages:{component}"),
        }
    }
}

/// `count` elements of `element_len` bytes: the k-th from `source_offset + k * source_stride` to `target_offset +
/// k * target_stride`, each offset read through its side's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedDescriptor {
    pub request: u32,
    pub chunk: u32,
    pub kind: TransferKind,
    pub source: RankId,
    pub source_region: u32,
    pub source_table: Table,
    pub source_offset: u64,
    pub source_stride: u64,
    pub target: RankId,
    pub target_region: u32,
    pub target_table: Table,
    pub target_offset: u64,
    pub target_stride: u64,
    pub element_len: u64,
    pub count: u64,
}

/// Physical bytes `[source, source + length)` of the source region move to `[target, target + length)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Segment {
    pub source: u64,
    pub target: u64,
    pub length: u64,
}

/// The items of `table` on `side` for `request`, or `None` for physical addressing.
pub fn items(request: &Request, side: Side, table: Table) -> Option<&[u32]> {
    let (kv, state) = match side {
        Side::Prefill => (request.prefill_pages.as_slice(), &request.prefill_state),
        // A HiSparse decode's KV pages are its host pages.
        Side::Decode => (request.decode_kv_pages(), &request.decode_state),
    };
    match table {
        Table::Physical => None,
        Table::KvPages => Some(kv),
        Table::StatePages { component } => state.pages.get(component as usize).map(Vec::as_slice),
    }
}

/// The table a transfer kind's items are listed in.
fn table_of(kind: TransferKind) -> Table {
    match kind {
        TransferKind::Kv => Table::KvPages,
        TransferKind::State { component } => Table::StatePages { component },
        TransferKind::Draft | TransferKind::Aux | TransferKind::Staging { .. } => Table::Physical,
    }
}

/// One side's addressing while compacting: the table, its item length, and item → first ordinal (shared by every
/// region addressed through the same table; `u64::MAX` for an item not listed).
struct Addressing {
    table: Table,
    item_len: u64,
    ordinals: Rc<Vec<u64>>,
}

/// Item → first ordinal, per request, side and table (`None`: a table naming an item past [`MAX_ITEM`]).
type Ordinals = BTreeMap<(u32, Side, Table), Option<Rc<Vec<u64>>>>;

/// Tables naming larger items are not used for addressing (the item → ordinal index is dense).
const MAX_ITEM: u32 = 1 << 24;

impl Addressing {
    fn new(
        problem: &Problem,
        request: Option<&Request>,
        at: (Side, RankId, u32),
        kind: TransferKind,
        known: &mut Ordinals,
    ) -> Self {
        let (side, rank, region) = at;
        let regions = &problem.side(side).rank(rank).regions;
        let item_len = regions.get(region as usize).map_or(0, |region| region.item_len);
        let table = table_of(kind);
        let listed = request.and_then(|request| Some((request.id, items(request, side, table)?)));
        let Some((id, listed)) = listed.filter(|_| item_len > 0) else {
            return Addressing { table: Table::Physical, item_len: u64::MAX, ordinals: Rc::default() };
        };
        let ordinals = known.entry((id, side, table)).or_insert_with(|| {
            let last = listed.iter().copied().max().unwrap_or(0);
            (last < MAX_ITEM).then(|| {
                let mut ordinals = vec![u64::MAX; last as usize + 1];
                for (ordinal, item) in listed.iter().enumerate().rev() {
                    ordinals[*item as usize] = ordinal as u64;
                }
                Rc::new(ordinals)
            })
        });
        match ordinals {
            Some(ordinals) => Addressing { table, item_len, ordinals: Rc::clone(ordinals) },
            None => Addressing { table: Table::Physical, item_len: u64::MAX, ordinals: Rc::default() },
        }
    }

    /// Bytes left in the item holding physical byte `at`.
    fn room(&self, at: u64) -> u64 {
        self.item_len - at % self.item_len
    }

    /// The address of physical byte `at`: logical when its item is listed.
    fn address(&self, at: u64) -> (Table, u64) {
        if self.table == Table::Physical {
            return (Table::Physical, at);
        }
        let ordinal = usize::try_from(at / self.item_len).ok().and_then(|item| self.ordinals.get(item));
        match ordinal.filter(|ordinal| **ordinal != u64::MAX) {
            Some(ordinal) => (self.table, ordinal * self.item_len + at % self.item_len),
            None => (Table::Physical, at),
        }
    }
}

/// Request, chunk, kind, and each side's rank, region and table.
type Key = (u32, u32, TransferKind, (RankId, u32, Table), (RankId, u32, Table));

/// The paged form of `descriptors` (a plan's, for `problem`'s requests), per the module doc.
pub fn compact(problem: &Problem, descriptors: &[Descriptor]) -> Vec<PagedDescriptor> {
    let mut out = Vec::new();
    let mut open = Open::default();
    let mut known = Ordinals::new();
    // The addressing of the last descriptor's request, kind and regions (descriptors come region pair by pair).
    let mut sides: Option<(SidesKey, Addressing, Addressing)> = None;
    for descriptor in descriptors {
        let &Descriptor { request, kind, source, source_region, target, target_region, .. } = descriptor;
        let key = (request, kind, source, source_region, target, target_region);
        if sides.as_ref().is_none_or(|(last, ..)| *last != key) {
            let listed = problem.requests.iter().find(|listed| listed.id == request);
            let from = Addressing::new(problem, listed, (Side::Prefill, source, source_region), kind, &mut known);
            let to = Addressing::new(problem, listed, (Side::Decode, target, target_region), kind, &mut known);
            sides = Some((key, from, to));
        }
        let (_, from, to) = sides.as_ref().expect("just set");
        readdress(descriptor, from, to, &mut open, &mut out);
    }
    open.close(&mut out);
    if out.len() > descriptors.len() {
        return descriptors.iter().map(physical).collect();
    }
    out
}

/// Feeds `descriptor` to the open descriptor: whole runs of elements that stay inside one item on both sides, and
/// an element that crosses an item boundary cut there.
fn readdress(
    descriptor: &Descriptor,
    from: &Addressing,
    to: &Addressing,
    open: &mut Open,
    out: &mut Vec<PagedDescriptor>,
) {
    let mut k = 0;
    while k < descriptor.count {
        let run = within_items(descriptor, k, from, to);
        let (source_at, target_at) = descriptor_at(descriptor, k);
        if run > 0 {
            let whole = PagedDescriptor {
                count: run,
                source_stride: descriptor.source_stride,
                target_stride: descriptor.target_stride,
                ..piece(descriptor, from.address(source_at), to.address(target_at), descriptor.element_len)
            };
            open.push(out, whole);
            k += run;
            continue;
        }
        let mut done = 0;
        while done < descriptor.element_len {
            let (source_at, target_at) = (source_at + done, target_at + done);
            let length = (descriptor.element_len - done).min(from.room(source_at)).min(to.room(target_at));
            open.push(out, piece(descriptor, from.address(source_at), to.address(target_at), length));
            done += length;
        }
        k += 1;
    }
}

/// Which request, kind and region pair a side's addressing belongs to.
type SidesKey = (u32, TransferKind, RankId, u32, RankId, u32);

/// Where element `k` of `descriptor` starts on each side.
fn descriptor_at(descriptor: &Descriptor, k: u64) -> (u64, u64) {
    let element = descriptor.element(k);
    (element.source_offset, element.target_offset)
}

/// How many elements from the k-th on lie, each whole, inside the item where the k-th starts on both sides (the
/// strides then hold in logical bytes too); 0 when the k-th itself crosses an item boundary.
fn within_items(descriptor: &Descriptor, k: u64, from: &Addressing, to: &Addressing) -> u64 {
    let (source, target) = descriptor_at(descriptor, k);
    let fit = |side: &Addressing, at: u64, stride: u64| {
        let room = side.room(at);
        match room.checked_sub(descriptor.element_len) {
            None => 0,
            Some(_) if stride == 0 => u64::MAX,
            Some(spare) => spare / stride + 1,
        }
    };
    fit(from, source, descriptor.source_stride).min(fit(to, target, descriptor.target_stride)).min(descriptor.count - k)
}

/// One element of `length` bytes of `descriptor`, at the given addresses.
fn piece(descriptor: &Descriptor, source: (Table, u64), target: (Table, u64), length: u64) -> PagedDescriptor {
    PagedDescriptor {
        source_table: source.0,
        source_offset: source.1,
        source_stride: 0,
        target_table: target.0,
        target_offset: target.1,
        target_stride: 0,
        element_len: length,
        count: 1,
        ..physical(descriptor)
    }
}

/// `descriptor` as a paged descriptor addressing region bytes on both sides ([`Table::Physical`]).
pub fn physical(descriptor: &Descriptor) -> PagedDescriptor {
    PagedDescriptor {
        request: descriptor.request,
        chunk: descriptor.chunk,
        kind: descriptor.kind,
        source: descriptor.source,
        source_region: descriptor.source_region,
        source_table: Table::Physical,
        source_offset: descriptor.source_offset,
        source_stride: descriptor.source_stride,
        target: descriptor.target,
        target_region: descriptor.target_region,
        target_table: Table::Physical,
        target_offset: descriptor.target_offset,
        target_stride: descriptor.target_stride,
        element_len: descriptor.element_len,
        count: descriptor.count,
    }
}

/// The descriptor still growing. The plan's descriptors come group by group, entry by entry (`Plan::descriptors`),
/// so what can merge arrives consecutively; the paged form keeps the plan's order.
#[derive(Default)]
struct Open {
    current: Option<PagedDescriptor>,
}

impl Open {
    /// Adds `piece` to the open descriptor when it shares its key and continues it; otherwise closes that one and
    /// opens `piece`.
    fn push(&mut self, out: &mut Vec<PagedDescriptor>, piece: PagedDescriptor) {
        let Some(current) = &mut self.current else {
            self.current = Some(piece);
            return;
        };
        if current.key() != piece.key() || !current.extend(&piece) {
            out.push(std::mem::replace(current, piece));
        }
    }

    /// Emits the open descriptor.
    fn close(self, out: &mut Vec<PagedDescriptor>) {
        out.extend(self.current);
    }
}

impl PagedDescriptor {
    /// What must agree for two pieces to share a descriptor.
    fn key(&self) -> Key {
        let (source, target) = (
            (self.source, self.source_region, self.source_table),
            (self.target, self.target_region, self.target_table),
        );
        (self.request, self.chunk, self.kind, source, target)
    }

    /// Takes in `piece` (same key) when it continues this descriptor: a longer single element where both sides
    /// continue the bytes of single elements, or more elements at one pair of increasing strides.
    fn extend(&mut self, piece: &PagedDescriptor) -> bool {
        if self.count == 1
            && piece.count == 1
            && Some(piece.source_offset) == self.source_offset.checked_add(self.element_len)
            && Some(piece.target_offset) == self.target_offset.checked_add(self.element_len)
        {
            self.element_len += piece.element_len;
            return true;
        }
        if piece.element_len != self.element_len {
            return false;
        }
        let strides = if self.count > 1 {
            (self.source_stride, self.target_stride)
        } else if piece.count > 1 {
            (piece.source_stride, piece.target_stride)
        } else {
            match (
                piece.source_offset.checked_sub(self.source_offset),
                piece.target_offset.checked_sub(self.target_offset),
            ) {
                (Some(source), Some(target)) => (source, target),
                _ => return false,
            }
        };
        let next = |offset: u64, stride: u64| stride.checked_mul(self.count).and_then(|step| offset.checked_add(step));
        let continues = strides.0 > 0
            && strides.1 > 0
            && (piece.count == 1 || (piece.source_stride, piece.target_stride) == strides)
            && next(self.source_offset, strides.0) == Some(piece.source_offset)
            && next(self.target_offset, strides.1) == Some(piece.target_offset);
        if continues {
            (self.source_stride, self.target_stride) = strides;
            self.count += piece.count;
        }
        continues
    }

    /// The physical byte moves, element by element, cut where either side's item ends; `None` when an offset lies
    /// outside its table or region.
    pub fn segments(&self, problem: &Problem) -> Option<Vec<Segment>> {
        let request = problem.requests.iter().find(|request| request.id == self.request);
        let side = |side: Side, rank: RankId, region: u32, table: Table| {
            let item_len = problem.side(side).rank(rank).regions.get(region as usize)?.item_len;
            let listed = match table {
                Table::Physical => None,
                _ => Some(items(request?, side, table)?),
            };
            Some((item_len, listed))
        };
        let from = side(Side::Prefill, self.source, self.source_region, self.source_table)?;
        let to = side(Side::Decode, self.target, self.target_region, self.target_table)?;
        let mut out = Vec::new();
        for k in 0..self.count {
            let source = self.source_offset.checked_add(self.source_stride.checked_mul(k)?)?;
            let target = self.target_offset.checked_add(self.target_stride.checked_mul(k)?)?;
            let mut done = 0;
            while done < self.element_len {
                let (source_at, target_at) = (source + done, target + done);
                let length = (self.element_len - done).min(room(from, source_at)).min(room(to, target_at));
                let segment =
                    Segment { source: physical_byte(from, source_at)?, target: physical_byte(to, target_at)?, length };
                out.push(segment);
                done += length;
            }
        }
        Some(out)
    }
}

/// Bytes left at `at` before the addressing of a side must be looked up again.
fn room((item_len, listed): (u64, Option<&[u32]>), at: u64) -> u64 {
    match listed {
        Some(_) if item_len > 0 => item_len - at % item_len,
        _ => u64::MAX,
    }
}

/// The physical byte at address `at` of a side.
fn physical_byte((item_len, listed): (u64, Option<&[u32]>), at: u64) -> Option<u64> {
    let Some(listed) = listed else { return Some(at) };
    let ordinal = usize::try_from(at.checked_div(item_len)?).ok()?;
    u64::from(*listed.get(ordinal)?).checked_mul(item_len)?.checked_add(at % item_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `count` elements of 8 bytes at the given logical offsets and strides, on one region pair.
    fn at(source: u64, target: u64, strides: (u64, u64), count: u64) -> PagedDescriptor {
        let rank = RankId::new(0, 0);
        PagedDescriptor {
            request: 0,
            chunk: 0,
            kind: TransferKind::Kv,
            source: rank,
            source_region: 0,
            source_table: Table::KvPages,
            source_offset: source,
            source_stride: strides.0,
            target: rank,
            target_region: 0,
            target_table: Table::KvPages,
            target_offset: target,
            target_stride: strides.1,
            element_len: 8,
            count,
        }
    }

    #[test]
    fn single_elements_continuing_on_both_sides_grow_into_one() {
        let mut grown = at(0, 100, (0, 0), 1);
        assert!(grown.extend(&at(8, 108, (0, 0), 1)));
        assert_eq!((grown.element_len, grown.count), (16, 1));
    }

    #[test]
    fn the_second_element_sets_the_strides_and_later_ones_must_keep_both() {
        let mut strided = at(0, 100, (0, 0), 1);
        assert!(strided.extend(&at(64, 108, (0, 0), 1)));
        assert_eq!((strided.source_stride, strided.target_stride, strided.count), (64, 8, 2));
        assert!(strided.extend(&at(128, 116, (0, 0), 1)));
        // The source continues at its stride, the target does not; and the other way round.
        assert!(!strided.extend(&at(192, 200, (0, 0), 1)));
        assert!(!strided.extend(&at(200, 124, (0, 0), 1)));
        // A run of elements joins only at the same strides.
        assert!(!strided.extend(&at(192, 124, (64, 16), 2)));
        assert!(strided.extend(&at(192, 124, (64, 8), 2)));
        assert_eq!(strided.count, 5);
    }

    #[test]
    fn elements_going_backwards_or_of_another_length_are_refused() {
        let mut first = at(64, 100, (0, 0), 1);
        assert!(!first.extend(&at(0, 108, (0, 0), 1)));
        assert!(!first.extend(&at(128, 100, (0, 0), 1)));
        assert!(!first.extend(&PagedDescriptor { element_len: 16, ..at(128, 116, (0, 0), 1) }));
        assert_eq!(first, at(64, 100, (0, 0), 1));
    }
}
