//! The drivers' half (called from `sim::finish_nodes`, never from an engine): kept device memory handed to the oracle: the fabric's [`Compare`] (checks against patterns) answering the
//! oracle's [`Judge`] questions. The one place the two vocabularies meet, so that the fabric knows no oracle and the
//! oracle no fabric.

use std::sync::Arc;

use crate::fabric::seam::{Check, Compare, Kept, Pattern};
use crate::verify::{Expect, Judge, Query, ResidentRegion};

/// The oracle's view of memory a fabric kept where it lives.
pub(crate) fn resident(kept: Kept) -> ResidentRegion {
    ResidentRegion { judge: Arc::new(Answers(kept.compare)), handle: kept.handle, len: kept.len, keep: kept.keep }
}

/// Queries asked as checks.
struct Answers(Arc<dyn Compare>);

impl Judge for Answers {
    fn judge(&self, queries: &[(u64, Query)]) -> Result<Vec<bool>, String> {
        let checks: Vec<Check> = queries
            .iter()
            .map(|(handle, query)| {
                let len = query.end - query.start;
                let (pattern, pattern_offset, block, pattern_stride) = match query.expect {
                    Expect::Source { number, offset } => (Pattern::Source { number }, offset, len, len),
                    Expect::Strided { number, offset, block, stride } => {
                        (Pattern::Source { number }, offset, block, stride)
                    }
                    Expect::Sentinel => (Pattern::Sentinel, 0, len, len),
                };
                Check { handle: *handle, start: query.start, len, block, pattern, pattern_offset, pattern_stride }
            })
            .collect();
        self.0.compare(&checks)
    }

    fn read(&self, handle: u64, start: u64, out: &mut [u8]) -> Result<(), String> {
        self.0.read(handle, start, out)
    }

    fn name(&self) -> String {
        self.0.name()
    }
}
