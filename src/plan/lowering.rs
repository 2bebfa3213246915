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
