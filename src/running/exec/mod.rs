//! The direct execution kept as the benchmark's baseline (`kvrelay bench`) and for planted-fault cases: one
//! [`Transport`] holding every rank's memory, the plan's copies posted in batches, completions collected, an
//! [`Observation`] read back. `kvrelay run` and `check` go through the per-rank engines instead (`engine`).

mod sim_fabric;
mod transport;

use crate::model::{Problem, Side};
use crate::plan::Plan;
use crate::verify::{pattern, Observation, RegionKey, Sources, WriteRecord};
pub use sim_fabric::SimFabric;
pub use transport::{Completion, CompletionStatus, Transport, TransportError, WriteRequest};

/// Writes posted per doorbell.
const BATCH: usize = 1024;

/// Why an execution stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("write {id} completed with {status:?}")]
    Completion { id: u64, status: CompletionStatus },
    #[error("{posted} writes posted but {completed} completions arrived")]
    LostCompletions { posted: u64, completed: u64 },
}

/// Registers every region of `problem`: prefill regions hold the coordinate pattern, decode regions the sentinel.
pub fn stage(problem: &Problem, transport: &mut impl Transport) -> Result<(), ExecError> {
    let sources = Sources::new(problem);
    for layout in &problem.prefill.ranks {
        for (index, region) in layout.regions.iter().enumerate() {
            let mut bytes = vec![0u8; region.len_bytes() as usize];
            pattern::fill_source(sources.number(layout.rank, index as u32), &mut bytes);
            transport.register(RegionKey { side: Side::Prefill, rank: layout.rank, region: index as u32 }, bytes)?;
        }
    }
    for layout in &problem.decode.ranks {
        for (index, region) in layout.regions.iter().enumerate() {
            let mut bytes = vec![0u8; region.len_bytes() as usize];
            pattern::fill_sentinel(&mut bytes);
            transport.register(RegionKey { side: Side::Decode, rank: layout.rank, region: index as u32 }, bytes)?;
        }
    }
    Ok(())
}

/// Posts every copy of `plan` and waits for all completions; the first failed completion is an error.
///
/// Returns the successful writes in completion order (the fabric's log, independent of the plan's claims).
pub fn execute(plan: &Plan, transport: &mut impl Transport) -> Result<Vec<WriteRecord>, ExecError> {
    let mut posted = Vec::with_capacity(BATCH);
    let mut targets = Vec::new();
    let mut completions = Vec::new();
    let mut records = Vec::new();
    let mut failure = None;
    let mut flush = |posted: &mut Vec<WriteRequest>, targets: &mut Vec<WriteRecord>| -> Result<(), ExecError> {
        transport.post_writes(posted)?;
        transport.poll(&mut completions);
        if completions.len() != posted.len() {
            return Err(ExecError::LostCompletions {
                posted: posted.len() as u64,
                completed: completions.len() as u64,
            });
        }
        for completion in completions.drain(..) {
            // An id this batch never posted is reported, never indexed with.
            let index =
                completion.id.checked_sub(posted[0].id).map(|index| index as usize).filter(|i| *i < posted.len());
            match (completion.status, index) {
                (CompletionStatus::Success, Some(index)) => records.push(targets[index]),
                (status, _) => {
                    failure.get_or_insert(ExecError::Completion { id: completion.id, status });
                }
            }
        }
        posted.clear();
        targets.clear();
        Ok(())
    };
    for (id, copy) in plan.copies().enumerate() {
        let source = RegionKey { side: Side::Prefill, rank: copy.source, region: copy.source_region };
        let target = RegionKey { side: Side::Decode, rank: copy.target, region: copy.target_region };
        posted.push(WriteRequest {
            id: id as u64,
            source,
            source_offset: copy.source_offset,
            target,
            target_offset: copy.target_offset,
            length: copy.length,
        });
        targets.push(WriteRecord { target, offset: copy.target_offset, length: copy.length });
        if posted.len() == BATCH {
            flush(&mut posted, &mut targets)?;
        }
    }
    if !posted.is_empty() {
        flush(&mut posted, &mut targets)?;
    }
    match failure {
        Some(error) => Err(error),
        None => Ok(records),
    }
}

/// Reads every decode region back.
pub fn observe(
    problem: &Problem,
    transport: &mut impl Transport,
    writes: Vec<WriteRecord>,
) -> Result<Observation, ExecError> {
    let mut observation = Observation { writes, ..Observation::default() };
    // Prefill bytes are not observed (the oracle recomputes the pattern); free them before verification.
    for layout in &problem.prefill.ranks {
        for index in 0..layout.regions.len() as u32 {
            transport.release(RegionKey { side: Side::Prefill, rank: layout.rank, region: index })?;
        }
    }
    for layout in &problem.decode.ranks {
        for index in 0..layout.regions.len() as u32 {
            let key = RegionKey { side: Side::Decode, rank: layout.rank, region: index };
            observation.images.insert(key, transport.read(key)?);
        }
    }
    Ok(observation)
}
