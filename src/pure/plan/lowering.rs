//! Lowering descriptors to work requests within a fabric's limits (gather lists, largest message).
//!
//! Pure and counted in shapes, not materialised: a [`WrRun`] is `work_requests` work requests of one shape along
//! one descriptor. [`Lowering::work_requests`] expands them (for checks and engines); counting never does.
//!
//! Rules: a contiguous source into a contiguous target is cut into messages of at most `max_message` bytes; a
//! strided source into a contiguous target becomes gather lists of up to `max_sge` elements (and at most
//! `max_message` bytes) per work request; a strided target needs one work request per element (an RDMA write has
//! one remote address). An element larger than `max_message` is cut into single-SGE pieces. The pack buffer of
//! domain.md §2.8 is not used here.

use std::collections::BTreeMap;

use super::Descriptor;
use crate::model::RankId;

/// What a fabric allows per work request and queue (`ibv_device_attr` / `ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Scatter/gather entries per work request.
    pub max_sge: usize,
    /// Largest message in bytes.
    pub max_message: u64,
    /// Work requests outstanding per send queue.
    pub sq_depth: usize,
}

/// `work_requests` work requests of one shape along descriptor `descriptor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrRun {
    /// Index into the lowered descriptor list.
    pub descriptor: usize,
    pub shape: Shape,
    pub work_requests: u64,
    /// SGEs over all `work_requests`.
    pub sges: u64,
}

/// How a descriptor's bytes are cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One contiguous range on both sides, cut into messages of `message` bytes (the last shorter).
    Contiguous { message: u64 },
    /// Gather lists of `elements` elements per work request (the last shorter) into a contiguous target.
    Gather { elements: u64 },
    /// One work request per piece of `piece` bytes of each element (`pieces` per element).
    PerElement { piece: u64, pieces: u64 },
}

/// One concrete work request: a gather list from one source region into one contiguous target range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkRequest {
    pub source: RankId,
    pub source_region: u32,
    pub target: RankId,
    pub target_region: u32,
    pub target_offset: u64,
    /// (source offset, length) per SGE, landing back to back from `target_offset`.
    pub sges: Vec<(u64, u64)>,
}

/// Descriptors lowered to work-request shapes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lowering {
    pub limits: Limits,
    pub runs: Vec<WrRun>,
}

/// Lowers `descriptors` to work requests within `limits` (`max_sge` and `max_message` of at least 1).
pub fn lower(descriptors: &[Descriptor], limits: Limits) -> Lowering {
    let max_sge = limits.max_sge.max(1) as u64;
    let max_message = limits.max_message.max(1);
    let mut runs = Vec::with_capacity(descriptors.len());
    for (index, descriptor) in descriptors.iter().enumerate() {
        let (element, count) = (descriptor.element_len, descriptor.count);
        if descriptor.bytes() == 0 {
            continue;
        }
        let run = if descriptor.source_contiguous() && descriptor.target_contiguous() {
            let work_requests = descriptor.bytes().div_ceil(max_message);
            WrRun {
                descriptor: index,
                shape: Shape::Contiguous { message: max_message },
                work_requests,
                sges: work_requests,
            }
        } else if descriptor.target_contiguous() && element <= max_message && max_sge > 1 {
            let elements = max_sge.min(max_message / element);
            WrRun {
                descriptor: index,
                shape: Shape::Gather { elements },
                work_requests: count.div_ceil(elements),
                sges: count,
            }
        } else {
            let pieces = element.div_ceil(max_message);
            let work_requests = count * pieces;
            WrRun {
                descriptor: index,
                shape: Shape::PerElement { piece: max_message, pieces },
                work_requests,
                sges: work_requests,
            }
        };
        runs.push(run);
    }
    Lowering { limits, runs }
}

impl Lowering {
    /// Work requests in total.
    pub fn work_request_count(&self) -> u64 {
        self.runs.iter().map(|run| run.work_requests).sum()
    }

    /// SGEs in total.
    pub fn sge_count(&self) -> u64 {
        self.runs.iter().map(|run| run.sges).sum()
    }

    /// Send-queue rounds: per (source, target) queue, work requests divided by the queue depth, summed.
    pub fn queue_rounds(&self, descriptors: &[Descriptor]) -> u64 {
        let mut per_queue: BTreeMap<(RankId, RankId), u64> = BTreeMap::new();
        for run in &self.runs {
            let descriptor = &descriptors[run.descriptor];
            *per_queue.entry((descriptor.source, descriptor.target)).or_default() += run.work_requests;
        }
        let depth = self.limits.sq_depth.max(1) as u64;
        per_queue.values().map(|count| count.div_ceil(depth)).sum()
    }

    /// Every work request, in order (materialised: for checks and small plans).
    pub fn work_requests<'a>(&'a self, descriptors: &'a [Descriptor]) -> impl Iterator<Item = WorkRequest> + 'a {
        self.runs.iter().flat_map(move |run| expand(&descriptors[run.descriptor], run))
    }
}

fn expand(descriptor: &Descriptor, run: &WrRun) -> Vec<WorkRequest> {
    let request = |target_offset, sges| WorkRequest {
        source: descriptor.source,
        source_region: descriptor.source_region,
        target: descriptor.target,
        target_region: descriptor.target_region,
        target_offset,
        sges,
    };
    let mut res = Vec::new();
    match run.shape {
        Shape::Contiguous { message } => {
            let mut done = 0;
            while done < descriptor.bytes() {
                let len = message.min(descriptor.bytes() - done);
                res.push(request(descriptor.target_offset + done, vec![(descriptor.source_offset + done, len)]));
                done += len;
            }
        }
        Shape::Gather { elements } => {
            let mut first = 0;
            while first < descriptor.count {
                let last = (first + elements).min(descriptor.count);
                let sges =
                    (first..last).map(|k| (descriptor.element(k).source_offset, descriptor.element_len)).collect();
                res.push(request(descriptor.element(first).target_offset, sges));
                first = last;
            }
        }
        Shape::PerElement { piece, .. } => {
            for element in descriptor.elements() {
                let mut done = 0;
                while done < element.length {
                    let len = piece.min(element.length - done);
                    res.push(request(element.target_offset + done, vec![(element.source_offset + done, len)]));
                    done += len;
                }
            }
        }
    }
    res
}

/// Work requests within `limits` when strided sources are first gathered into a registered pack buffer (domain.md
/// §2.8, counted only): packed rows are contiguous, so consecutive descriptors into one contiguous target range
/// become one message (cut at `max_message`). Draft entries are never packed, nor is a strided target.
pub fn packed_work_request_count(descriptors: &[Descriptor], limits: Limits) -> u64 {
    let max_message = limits.max_message.max(1);
    let mut count = 0;
    // The open packed message: (source, target, target region, next target offset, bytes so far).
    let mut open: Option<(RankId, RankId, u32, u64, u64)> = None;
    for (index, descriptor) in descriptors.iter().enumerate() {
        if descriptor.bytes() == 0 {
            continue;
        }
        let packable = descriptor.target_contiguous() && descriptor.kind != super::TransferKind::Draft;
        if !packable {
            if let Some((.., bytes)) = open.take() {
                count += bytes.div_ceil(max_message);
            }
            count += lower(&descriptors[index..=index], limits).work_request_count();
            continue;
        }
        let key = (descriptor.source, descriptor.target, descriptor.target_region);
        match &mut open {
            Some((source, target, region, next, bytes))
                if (*source, *target, *region) == key && *next == descriptor.target_offset =>
            {
                *next += descriptor.bytes();
                *bytes += descriptor.bytes();
            }
            _ => {
                if let Some((.., bytes)) = open.take() {
                    count += bytes.div_ceil(max_message);
                }
                open = Some((key.0, key.1, key.2, descriptor.target_offset + descriptor.bytes(), descriptor.bytes()));
            }
        }
    }
    count + open.map_or(0, |(.., bytes)| bytes.div_ceil(max_message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::TransferKind;

    fn strided(source_stride: u64, target_stride: u64, element_len: u64, count: u64) -> Descriptor {
        let rank = RankId::new(0, 0);
        Descriptor {
            request: 0,
            chunk: 0,
            kind: TransferKind::Kv,
            source: rank,
            source_region: 0,
            source_offset: 0,
            source_stride,
            target: rank,
            target_region: 0,
            target_offset: 0,
            target_stride,
            element_len,
            count,
        }
    }

    const SOFT_ROCE: Limits = Limits { max_sge: 32, max_message: 8 << 20, sq_depth: 256 };
    const ONE_SGE: Limits = Limits { max_sge: 1, max_message: 1 << 30, sq_depth: 1024 };

    /// One K3 decode rank's rows of one layer (domain.md §2.4): a strided source (every 8th 576-byte row) into
    /// contiguous target rows gathers 32 rows per work request under Soft-RoCE's limits, one per row with one SGE.
    #[test]
    fn relayout_rows_gather_up_to_max_sge() {
        let descriptors = [strided(8 * 576, 576, 576, 4096)];
        let lowering = lower(&descriptors, SOFT_ROCE);
        assert_eq!(lowering.runs[0].shape, Shape::Gather { elements: 32 });
        assert_eq!((lowering.work_request_count(), lowering.sge_count()), (128, 4096));
        assert_eq!(lowering.queue_rounds(&descriptors), 1);
        assert_eq!(lower(&descriptors, ONE_SGE).work_request_count(), 4096);
        let requests: Vec<WorkRequest> = lowering.work_requests(&descriptors).collect();
        assert_eq!(requests[1].target_offset, 32 * 576);
        assert_eq!(requests[1].sges[..2], [(32 * 8 * 576, 576), (33 * 8 * 576, 576)]);
    }

    /// Packed (domain.md §2.8), one rank's rows of one layer are one message; per prefill page descriptors into
    /// one decode page join.
    #[test]
    fn packing_makes_one_message_per_contiguous_target_range() {
        let descriptors = [strided(8 * 576, 576, 576, 4096)];
        assert_eq!(packed_work_request_count(&descriptors, SOFT_ROCE), 1);
        let mut pages: Vec<Descriptor> = (0..8).map(|_| strided(8 * 576, 576, 576, 8)).collect();
        for (k, descriptor) in pages.iter_mut().enumerate() {
            descriptor.source_offset = 100_000 * k as u64;
            descriptor.target_offset = 8 * 576 * k as u64;
        }
        assert_eq!(packed_work_request_count(&pages, SOFT_ROCE), 1);
        pages[4].target_offset += 1 << 20;
        assert_eq!(packed_work_request_count(&pages, SOFT_ROCE), 3);
    }

    /// A strided target (head slices into wider rows) needs one work request per element, whatever max_sge.
    #[test]
    fn strided_target_is_one_work_request_per_element() {
        let descriptors = [strided(128, 256, 128, 10)];
        assert_eq!(lower(&descriptors, SOFT_ROCE).work_request_count(), 10);
    }

    /// Contiguous bytes (whole pages adjacent on both sides) are cut at max_message only.
    #[test]
    fn contiguous_bytes_are_cut_at_max_message() {
        let descriptors = [strided(36864, 36864, 36864, 3)];
        let limits = Limits { max_message: 50_000, ..SOFT_ROCE };
        let lowering = lower(&descriptors, limits);
        let lengths: Vec<u64> = lowering.work_requests(&descriptors).map(|request| request.sges[0].1).collect();
        assert_eq!(lengths, [50_000, 50_000, 10_592]);
        // Elements larger than a message are cut into single-SGE pieces.
        let descriptors = [strided(2000, 1000, 1000, 2)];
        let limits = Limits { max_message: 300, ..SOFT_ROCE };
        assert_eq!(lower(&descriptors, limits).work_request_count(), 8);
    }
}
