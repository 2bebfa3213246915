//! Strided descriptors: the plan's compact unit (one per entry pair and strided run of rows).
//!
//! A [`Descriptor`] moves `count` elements of `element_len` bytes, the k-th from `source_offset + k *
//! source_stride` to `target_offset + k * target_stride`. The token relayout of domain.md §2.4 gives each decode
//! rank every DCP-th row of a prefill page (source stride `dcp` rows, target stride one row), so a whole chunk on
//! contiguous pages is one descriptor per decode rank and entry; head slices (§3.2) and Mamba blocks (§5.4) are
//! one element per row, strided by the row length; whole-row runs merge across pages while the offsets continue.
//!
//! [`Plan::copies`] stays the per-row reference: a descriptor expands ([`Descriptor::elements`]) to exactly the
//! copies of the runs it merged, in the same order.

use std::collections::BTreeMap;

use super::{Copy, EntryPair, Plan, RowRun, TransferKind};
use crate::model::RankId;

/// `count` equal elements at constant strides on both sides, between two registered regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    pub request: u32,
    pub chunk: u32,
    pub kind: TransferKind,
    pub source: RankId,
    pub source_region: u32,
    pub source_offset: u64,
    /// Bytes from one element's start to the next on the source (meaningless when `count` is 1).
    pub source_stride: u64,
    pub target: RankId,
    pub target_region: u32,
    pub target_offset: u64,
    pub target_stride: u64,
    pub element_len: u64,
    pub count: u64,
}

impl Descriptor {
    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.element_len * self.count
    }

    /// Whether the source bytes form one contiguous range.
    pub fn source_contiguous(&self) -> bool {
        self.count == 1 || self.source_stride == self.element_len
    }

    /// Whether the target bytes form one contiguous range.
    pub fn target_contiguous(&self) -> bool {
        self.count == 1 || self.target_stride == self.element_len
    }

    /// The k-th element as a byte copy.
    pub fn element(&self, k: u64) -> Copy {
        Copy {
            request: self.request,
            chunk: self.chunk,
            kind: self.kind,
            source: self.source,
            source_region: self.source_region,
            source_offset: self.source_offset + k * self.source_stride,
            target: self.target,
            target_region: self.target_region,
            target_offset: self.target_offset + k * self.target_stride,
            length: self.element_len,
        }
    }

    /// Every element as a byte copy, in order.
    pub fn elements(&self) -> impl Iterator<Item = Copy> + '_ {
        (0..self.count).map(|k| self.element(k))
    }
}

/// Rows of one element at constant row steps: `count` elements of `rows` rows, the k-th from row
/// `source_row + k * source_step` to row `target_row + k * target_step`. Independent of the entry pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Strided {
    source_row: u64,
    target_row: u64,
    rows: u64,
    source_step: u64,
    target_step: u64,
    count: u64,
}

impl Strided {
    /// Appends `next` to `self` when the elements continue at the same strides on both sides.
    fn absorb(&mut self, next: &Strided) -> bool {
        if next.rows != self.rows {
            return false;
        }
        if self.count == 1 {
            // Any forward step starts a stride; `next` must continue it.
            let (Some(source_step), Some(target_step)) =
                (next.source_row.checked_sub(self.source_row), next.target_row.checked_sub(self.target_row))
            else {
                return false;
            };
            if source_step == 0 || target_step == 0 {
                return false;
            }
            if next.count > 1 && (next.source_step, next.target_step) != (source_step, target_step) {
                return false;
            }
            (self.source_step, self.target_step, self.count) = (source_step, target_step, 1 + next.count);
            return true;
        }
        let continues = next.source_row == self.source_row + self.count * self.source_step
            && next.target_row == self.target_row + self.count * self.target_step;
        let same_steps =
            next.count == 1 || (next.source_step, next.target_step) == (self.source_step, self.target_step);
        if continues && same_steps {
            self.count += next.count;
        }
        continues && same_steps
    }
}

/// Merges a group's runs into strided runs: whole runs as elements (`full`) or single rows as elements.
fn strided(runs: &[RowRun], full: bool) -> Vec<Strided> {
    let mut res: Vec<Strided> = Vec::new();
    for run in runs {
        let next = if full {
            Strided {
                source_row: run.source_row,
                target_row: run.target_row,
                rows: run.rows,
                source_step: run.rows,
                target_step: run.rows,
                count: 1,
            }
        } else {
            Strided {
                source_row: run.source_row,
                target_row: run.target_row,
                rows: 1,
                source_step: 1,
                target_step: 1,
                count: run.rows,
            }
        };
        if next.count == 0 {
            continue;
        }
        if !res.last_mut().is_some_and(|last| last.absorb(&next)) {
            res.push(next);
        }
    }
    res
}

fn descriptor(group: &super::TransferGroup, entry: &EntryPair, run: &Strided) -> Descriptor {
    Descriptor {
        request: group.request,
        chunk: group.chunk,
        kind: group.kind,
        source: group.source,
        source_region: entry.source_region,
        source_offset: run.source_row * entry.source_row_len + entry.source_column,
        source_stride: run.source_step * entry.source_row_len,
        target: group.target,
        target_region: entry.target_region,
        target_offset: run.target_row * entry.target_row_len + entry.target_column,
        target_stride: run.target_step * entry.target_row_len,
        element_len: entry.length * run.rows,
        count: run.count,
    }
}

impl Plan {
    /// The plan as strided descriptors, in the order of [`Plan::copies`] (groups, entries, runs): expanding them
    /// element by element yields exactly the copies.
    pub fn descriptors(&self) -> Vec<Descriptor> {
        // Groups share row-run lists (one per chunk and transfer mode): merge each list once per element shape.
        let mut merged: BTreeMap<(usize, usize, bool), Vec<Strided>> = BTreeMap::new();
        let mut res = Vec::new();
        for group in &self.groups {
            for entry in group.entries.iter() {
                let full = entry.full_rows();
                let key = (group.runs.as_ptr() as usize, group.runs.len(), full);
                let runs = merged.entry(key).or_insert_with(|| strided(&group.runs, full));
                res.extend(runs.iter().map(|run| descriptor(group, entry, run)));
            }
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(source_row: u64, target_row: u64, rows: u64) -> RowRun {
        RowRun { source_row, target_row, rows }
    }

    /// domain.md §2.4 worked example C, rank 5: 125 rows of stride 8 over contiguous pages 100..115, into two
    /// non-adjacent decode pages [3, 9]: two strided runs (one per decode page).
    #[test]
    fn relayout_rows_merge_into_one_stride_per_decode_page() {
        let runs: Vec<RowRun> = (0..125u64)
            .map(|k| {
                let local = k;
                let target = if local < 64 { 3 * 64 + local } else { 9 * 64 + local - 64 };
                run(6405 + 8 * k, target, 1)
            })
            .collect();
        let merged = strided(&runs, true);
        assert_eq!(
            merged,
            vec![
                Strided { source_row: 6405, target_row: 192, rows: 1, source_step: 8, target_step: 1, count: 64 },
                Strided {
                    source_row: 6405 + 8 * 64,
                    target_row: 576,
                    rows: 1,
                    source_step: 8,
                    target_step: 1,
                    count: 61
                },
            ]
        );
    }

    #[test]
    fn partial_rows_become_one_element_per_row_and_continue_across_runs() {
        // Two runs of rows 10..14 and 20..22 (a gap): per-row elements, step 1 each, not mergeable.
        let merged = strided(&[run(10, 0, 4), run(20, 4, 2)], false);
        assert_eq!(merged.len(), 2);
        assert_eq!((merged[0].count, merged[1].count), (4, 2));
        // A run that continues the stride joins it.
        let merged = strided(&[run(10, 0, 4), run(14, 4, 2)], false);
        assert_eq!(
            merged,
            vec![Strided { source_row: 10, target_row: 0, rows: 1, source_step: 1, target_step: 1, count: 6 }]
        );
    }

    #[test]
    fn whole_pages_merge_at_a_constant_page_stride() {
        // Pages 4, 6, 8 into 1, 2, 3 (P = 64): equal runs, constant steps on both sides.
        let merged = strided(&[run(256, 64, 64), run(384, 128, 64), run(512, 192, 64)], true);
        assert_eq!(
            merged,
            vec![Strided { source_row: 256, target_row: 64, rows: 64, source_step: 128, target_step: 64, count: 3 }]
        );
        // A backwards page breaks the stride.
        assert_eq!(strided(&[run(256, 64, 64), run(128, 128, 64)], true).len(), 2);
    }
}
