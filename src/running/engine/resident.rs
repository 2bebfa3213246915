//! The drivers' half (called from `sim::finish_nodes`, never from an engine): kept device memory handed to the oracle: the fabric's [`Compare`] (checks against patterns) answering the
//! oracle's [`Judge`] questions. The one place the two vocabularies meet, so that the fabric knows no oracle and the
//! oracle no fabric.

use std::sync::Arc;

use crate::fabric::seam::{self, Check, Compare, Kept, Pattern, RowsCheck};
use crate::verify::{Expect, Judge, Query, ResidentRegion, RowRun};

/// The oracle's view of memory a fabric kept where it lives.
pub(crate) fn resident(kept: Kept) -> ResidentRegion {
    ResidentRegion { judge: Arc::new(Answers(kept.compare)), handle: kept.handle, len: kept.len, keep: kept.keep }
}

/// Queries asked as checks.
struct Answers(Arc<dyn Compare>);

impl Judge for Answers {
    fn judge(&self, queries: &[(u64, Query)], tables: &[&[RowRun]]) -> Result<Vec<bool>, String> {
        // Plain checks and table checks go in one call; `order` says where each query's answer is.
        let (mut checks, mut rows, mut order) = (Vec::new(), Vec::new(), Vec::with_capacity(queries.len()));
        for (handle, query) in queries {
            let len = query.end - query.start;
            let (pattern, pattern_offset, block, pattern_stride) = match query.expect {
                Expect::Source { number, offset } => (Pattern::Source { number }, offset, len, len),
                Expect::Strided { number, offset, block, stride } => {
                    (Pattern::Source { number }, offset, block, stride)
                }
                Expect::Sentinel => (Pattern::Sentinel, 0, len, len),
                Expect::Rows { table, number, row, source_row } => {
                    order.push((true, rows.len()));
                    let pattern = Pattern::Source { number };
                    rows.push(RowsCheck { handle: *handle, table, row, pattern, pattern_row: source_row });
                    continue;
                }
                Expect::SentinelRows { table, row } => {
                    order.push((true, rows.len()));
                    rows.push(RowsCheck { handle: *handle, table, row, pattern: Pattern::Sentinel, pattern_row: 0 });
                    continue;
                }
            };
            order.push((false, checks.len()));
            checks.push(Check {
                handle: *handle,
                start: query.start,
                len,
                block,
                pattern,
                pattern_offset,
                pattern_stride,
            });
        }
        let runs: Vec<Vec<seam::RowRun>> = tables
            .iter()
            .map(|table| {
                table
                    .iter()
                    .map(|run| seam::RowRun {
                        target: run.target,
                        source: run.source,
                        count: run.count,
                        step: run.step,
                    })
                    .collect()
            })
            .collect();
        let runs: Vec<&[seam::RowRun]> = runs.iter().map(Vec::as_slice).collect();
        let answers = self.0.compare_with_rows(&checks, &runs, &rows)?;
        if answers.len() != checks.len() + rows.len() {
            return Err(format!("{} answers to {} checks", answers.len(), checks.len() + rows.len()));
        }
        Ok(order.into_iter().map(|(table, index)| answers[if table { checks.len() + index } else { index }]).collect())
    }

    fn read(&self, handle: u64, start: u64, out: &mut [u8]) -> Result<(), String> {
        self.0.read(handle, start, out)
    }

    fn name(&self) -> String {
        self.0.name()
    }
}
