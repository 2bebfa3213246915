//! Device allocations no region holds, kept for the next region of the same size ([`Spares`]): a replay's waves
//! register the same regions again, and `cuMemAlloc` plus `cuMemFree` of a wave's gigabytes cost more than its
//! writes. Pure bookkeeping: the synchronisation it asks for is its owner's (`Device::reuse`).

use std::collections::BTreeMap;

use crate::fabric::seam::Pattern;

/// One spare allocation: its device address, and the pattern it holds where that is known (`holds`: a prefill
/// region's source pattern where no peer was told of it, the sentinel a kept decode region is reset to when the
/// oracle hands it back), so a region asking for that pattern takes it as it is instead of generating it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Spare {
    pub(super) ptr: u64,
    pub(super) holds: Option<Pattern>,
}

/// The spares of one GPU, by size: `idle` ones nothing on the GPU can still use (handed back after their last use
/// was waited for, or since a `cuCtxSynchronize`), `busy` ones whose last kernel may still run (a freed
/// allocation's `cuMemFree` would have waited for it). Every spare is counted in `bytes` until it is taken.
#[derive(Debug, Default)]
pub(super) struct Spares {
    idle: BTreeMap<usize, Vec<Spare>>,
    busy: BTreeMap<usize, Vec<Spare>>,
    bytes: u64,
}

/// What [`Spares::take`] found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Found {
    /// An idle spare; `filled`: it holds the pattern asked for.
    Spare { ptr: u64, filled: bool },
    /// No idle spare of the size, but busy ones: here are every size's busy spares, handed to the caller to
    /// synchronise the context once for all of them and give back through [`Spares::settled`].
    Busy(BTreeMap<usize, Vec<Spare>>),
    /// No spare of the size.
    None,
}

impl Spares {
    /// Bytes of every spare not taken.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps `spare` of `size` bytes; `idle`: nothing on the GPU can still use it.
    pub(super) fn keep(&mut self, size: usize, spare: Spare, idle: bool) {
        let into = if idle { &mut self.idle } else { &mut self.busy };
        into.entry(size).or_default().push(spare);
        self.bytes += size as u64;
    }

    /// An idle spare of `size` bytes, one that holds pattern `want` first, else one holding no pattern (those
    /// holding one are kept for the regions that ask for it), else any.
    pub(super) fn take(&mut self, size: usize, want: Option<Pattern>) -> Found {
        if let Some(list) = self.idle.get_mut(&size).filter(|list| !list.is_empty()) {
            let at = list
                .iter()
                .rposition(|spare| spare.holds == want)
                .or_else(|| list.iter().rposition(|spare| spare.holds.is_none()))
                .unwrap_or(list.len() - 1);
            let spare = list.swap_remove(at);
            self.bytes -= size as u64;
            return Found::Spare { ptr: spare.ptr, filled: want.is_some() && spare.holds == want };
        }
        if self.busy.get(&size).is_some_and(|list| !list.is_empty()) {
            return Found::Busy(std::mem::take(&mut self.busy));
        }
        Found::None
    }

    /// Gives back the busy spares [`Spares::take`] handed out: idle once the context was synchronised
    /// (`synchronised`), busy again where that failed.
    pub(super) fn settled(&mut self, busy: BTreeMap<usize, Vec<Spare>>, synchronised: bool) {
        let into = if synchronised { &mut self.idle } else { &mut self.busy };
        for (size, list) in busy {
            into.entry(size).or_default().extend(list);
        }
    }

    /// Every spare's address and the bytes they hold, leaving none (to free them).
    pub(super) fn drain(&mut self) -> (Vec<u64>, u64) {
        let Spares { idle, busy, bytes } = std::mem::take(self);
        let ptrs = idle.into_values().chain(busy.into_values()).flatten().map(|spare| spare.ptr).collect();
        (ptrs, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::{Found, Spare, Spares};
    use crate::fabric::seam::Pattern;

    fn spare(ptr: u64, holds: Option<u32>) -> Spare {
        Spare { ptr, holds: source(holds) }
    }

    /// Source pattern `number` (`u32::MAX`: the sentinel).
    fn source(number: Option<u32>) -> Option<Pattern> {
        number.map(|number| if number == u32::MAX { Pattern::Sentinel } else { Pattern::Source { number } })
    }

    #[test]
    fn a_spare_holding_the_pattern_asked_for_is_taken_first_and_said_filled() {
        let mut spares = Spares::default();
        spares.keep(64, spare(1, None), true);
        spares.keep(64, spare(2, Some(7)), true);
        spares.keep(64, spare(3, Some(9)), true);
        assert_eq!(spares.take(64, source(Some(7))), Found::Spare { ptr: 2, filled: true });
        // No spare holds pattern 8: one holding none is taken, and it must be generated.
        assert_eq!(spares.take(64, source(Some(8))), Found::Spare { ptr: 1, filled: false });
        // Only one holding another pattern is left: taken, never said filled.
        assert_eq!(spares.take(64, source(Some(8))), Found::Spare { ptr: 3, filled: false });
        assert_eq!(spares.take(64, source(Some(8))), Found::None);
        assert_eq!(spares.bytes(), 0);
    }

    #[test]
    fn a_region_asking_for_no_pattern_leaves_the_patterned_spares() {
        let mut spares = Spares::default();
        spares.keep(64, spare(1, Some(7)), true);
        spares.keep(64, spare(2, None), true);
        spares.keep(64, spare(3, Some(7)), true);
        assert_eq!(spares.take(64, source(None)), Found::Spare { ptr: 2, filled: false });
        assert_eq!(spares.take(64, source(None)), Found::Spare { ptr: 3, filled: false });
    }

    #[test]
    fn a_sentinel_spare_is_filled_for_a_sentinel_and_never_for_a_source() {
        let mut spares = Spares::default();
        spares.keep(64, spare(1, Some(u32::MAX)), true);
        spares.keep(64, spare(2, Some(u32::MAX)), true);
        assert_eq!(spares.take(64, source(Some(u32::MAX))), Found::Spare { ptr: 2, filled: true });
        assert_eq!(spares.take(64, source(Some(5))), Found::Spare { ptr: 1, filled: false });
    }

    #[test]
    fn busy_spares_are_handed_out_only_through_a_synchronisation() {
        let mut spares = Spares::default();
        spares.keep(64, spare(1, Some(7)), false);
        spares.keep(128, spare(2, None), false);
        assert_eq!(spares.bytes(), 192);
        let Found::Busy(busy) = spares.take(64, source(Some(7))) else {
            panic!("a busy spare is not handed out as idle")
        };
        assert_eq!(busy.values().map(Vec::len).sum::<usize>(), 2, "every size's busy spares, settled at once");
        // Taken away for the synchronisation, the spares are still counted, and not handed out twice.
        assert_eq!(spares.bytes(), 192);
        assert_eq!(spares.take(64, source(Some(7))), Found::None);
        spares.settled(busy, true);
        assert_eq!(spares.take(64, source(Some(7))), Found::Spare { ptr: 1, filled: true });
        assert_eq!(spares.take(128, source(None)), Found::Spare { ptr: 2, filled: false });
    }

    #[test]
    fn spares_whose_synchronisation_failed_stay_busy() {
        let mut spares = Spares::default();
        spares.keep(64, spare(1, None), false);
        let Found::Busy(busy) = spares.take(64, source(None)) else { panic!("busy expected") };
        spares.settled(busy, false);
        assert!(matches!(spares.take(64, source(None)), Found::Busy(_)));
    }

    #[test]
    fn draining_frees_idle_and_busy_spares_alike() {
        let mut spares = Spares::default();
        spares.keep(64, spare(1, None), true);
        spares.keep(32, spare(2, Some(3)), false);
        let (mut ptrs, bytes) = spares.drain();
        ptrs.sort_unstable();
        assert_eq!((ptrs, bytes), (vec![1, 2], 96));
        assert_eq!(spares.take(64, source(None)), Found::None);
    }
}
