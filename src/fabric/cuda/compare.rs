//! Kept memory compared on the GPU ([`DeviceCompare`], the judge kernels' tables) and [`plant`] for tests.

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, CudaContext, CudaStream, PushKernelArg};

use super::engine::Staging;
use super::{Device, Region, Shared, PIECE_BYTES};
use crate::fabric::seam::{Check, Compare, Pattern, RowRun, RowsCheck};

/// A kept region's memory, freed when the last handle goes.
pub(super) struct Holder {
    pub(super) shared: Arc<Shared>,
    pub(super) region: Option<Region>,
}

impl Drop for Holder {
    fn drop(&mut self) {
        if let Some(mut region) = self.region.take() {
            self.shared.state().resident.remove(&region.ptr);
            // Nothing on the GPU still uses it: it was kept after its writes finished, and every compare or read of
            // it synchronised its stream before answering (a failed compare's slot does so when dropped).
            region.idle();
            // Reset to the sentinel here, on the oracle's side, so the next wave's decode region of this size takes
            // it as registered (a fill queued on the shared stream, settled before any engine's next launch like
            // every fill); whatever a test planted is gone with it.
            let reset = self.shared.ctx.bind_to_thread().is_ok()
                && self.shared.generate_counted(region.ptr, region.len, Pattern::Sentinel).is_ok();
            region.holds(reset.then_some(Pattern::Sentinel));
            drop(region); // its allocation goes back to the GPU's spares
        }
    }
}

/// Overwrites byte `offset` of kept memory (the `keep` of a [`Kept`] this fabric made) with `byte`: how a test
/// plants a wrong byte in device memory for the oracle to find. Errors for anything else or a byte outside it.
///
/// [`Kept`]: crate::fabric::seam::Kept
pub fn plant(keep: &(dyn std::any::Any + Send + Sync), offset: u64, byte: u8) -> Result<(), String> {
    let holder = keep.downcast_ref::<Holder>().ok_or("not memory the cuda fabric kept")?;
    let region = holder.region.as_ref().ok_or("the memory was freed")?;
    if offset >= region.len {
        return Err(format!("byte {offset} is outside the {}-byte memory", region.len));
    }
    holder.shared.ctx.synchronize().map_err(|error| format!("cuCtxSynchronize: {error:?}"))?;
    // SAFETY: one byte inside a live allocation.
    unsafe { result::memset_d8_async(region.ptr + offset, byte, 1, holder.shared.stream.cu_stream()) }
        .map_err(|error| format!("cuMemsetD8Async: {error:?}"))?;
    holder.shared.stream.synchronize().map_err(|error| format!("cuStreamSynchronize: {error:?}"))
}

/// Kept memory compared on the GPU: a batch of checks is one compare launch.
pub(super) struct DeviceCompare(pub(super) Arc<Shared>);

/// One compare's stream and buffers, reused from call to call (`Device::judges`): the words uploaded (checks, row
/// checks, runs) and the flags read back, page-locked on the host.
pub(super) struct JudgeSlot {
    stream: Arc<CudaStream>,
    words: Option<Staging>,
    flags: Option<Staging>,
}

/// A compare slot taken from the GPU's pool, handed back when dropped.
struct TakenSlot<'a> {
    device: &'a Device,
    slot: Option<JudgeSlot>,
}

impl TakenSlot<'_> {
    fn take(device: &Device) -> Result<TakenSlot<'_>, String> {
        let kept = device.judges.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pop();
        let slot = match kept {
            Some(slot) => slot,
            None => {
                let stream = device.ctx.new_stream().map_err(|error| format!("cuStreamCreate: {error:?}"))?;
                JudgeSlot { stream, words: None, flags: None }
            }
        };
        Ok(TakenSlot { device, slot: Some(slot) })
    }

    fn slot(&mut self) -> &mut JudgeSlot {
        self.slot.as_mut().expect("held until dropped")
    }
}

impl Drop for TakenSlot<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            // Only a slot whose stream finished: a call that failed half-way may still have a copy in flight.
            if slot.stream.synchronize().is_ok() {
                self.device.judges.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(slot);
            }
        }
    }
}

impl JudgeSlot {
    /// `buffer`, holding at least `words` words (replaced by a larger one where it holds fewer).
    fn ensure<'a>(
        buffer: &'a mut Option<Staging>,
        ctx: &Arc<CudaContext>,
        words: usize,
    ) -> Result<&'a mut Staging, String> {
        if buffer.as_ref().is_none_or(|staging| staging.words < words) {
            *buffer = None;
            *buffer = Some(Staging::new(ctx, words).map_err(|error| error.to_string())?);
        }
        Ok(buffer.as_mut().expect("set above"))
    }
}

/// A batch of compares laid out for the two judge kernels: `words` holds the plain checks (5 words each), then the
/// row checks (6 words each), then the runs of their tables (4 words each, cut to at most PIECE_BYTES of rows).
#[derive(Default)]
struct JudgeTable {
    words: Vec<u64>,
    /// The check each plain entry (a piece of a check) answers for.
    owner: Vec<u32>,
    rows: u64,
    runs: u64,
    /// Warps' work items for the row kernel: the runs of every row check's table.
    works: u64,
}

impl JudgeTable {
    /// `checks` as plain entries, every check inside kept memory (`kept`: address to length).
    fn plain(&mut self, checks: &[Check], kept: &BTreeMap<u64, u64>) -> Result<(), String> {
        for (index, check) in checks.iter().enumerate() {
            let handle = check.handle;
            let len = kept.get(&handle).copied().ok_or_else(|| format!("no kept memory at {handle:#x}"))?;
            if check.start.checked_add(check.len).is_none_or(|end| end > len) || check.len >= 1 << 62 {
                return Err(format!("bytes {}.. ({} bytes) are outside the {len}-byte memory", check.start, check.len));
            }
            let plain = check.block == check.len || check.pattern == Pattern::Sentinel;
            if !plain && (check.block == 0 || check.len % check.block != 0) {
                return Err(format!("a check of {} bytes is not made of {}-byte blocks", check.len, check.block));
            }
            let (block, stride) = if plain { (check.len, 0) } else { (check.block, check.pattern_stride) };
            let (source, flag) = match check.pattern {
                Pattern::Source { number } => {
                    let offset = check.pattern_offset;
                    let last = (check.len / block.max(1)).saturating_sub(1);
                    let end = last.checked_mul(stride).and_then(|span| span.checked_add(offset + block));
                    (source_word(number, end)?, 0)
                }
                Pattern::Sentinel => (0, 1u64 << 63),
            };
            // Pieces of at most PIECE_BYTES: whole blocks where blocks are smaller, a plain check cut anywhere.
            let per_piece = if plain { PIECE_BYTES } else { (PIECE_BYTES / block).max(1) * block };
            let mut done = 0;
            while done < check.len {
                let piece = (check.len - done).min(per_piece);
                let skipped = if plain { done } else { done / block * stride };
                let source = if flag == 0 { source + skipped + check.pattern_offset } else { 0 };
                let piece_block = if plain { piece } else { block };
                self.words.extend([handle + check.start + done, source, piece | flag, piece_block, stride]);
                self.owner.push(index as u32);
                done += piece;
            }
        }
        Ok(())
    }

    /// `rows` and the runs of the `tables` they name (appended after the plain entries), each check's every run
    /// inside its kept memory.
    fn rows(&mut self, tables: &[&[RowRun]], rows: &[RowsCheck], kept: &BTreeMap<u64, u64>) -> Result<(), String> {
        // Rows per piece of each table's runs: PIECE_BYTES of the widest rows checked through it.
        let mut cap = vec![0u64; tables.len()];
        for check in rows {
            let slot = cap.get_mut(check.table as usize).ok_or_else(|| format!("no table {} of runs", check.table))?;
            let rows = (PIECE_BYTES / check.row.max(1)).max(1);
            *slot = if *slot == 0 { rows } else { (*slot).min(rows) };
        }
        // Every table's pieces, and how far its rows reach (past the last target row, the last source row).
        let mut runs = Vec::new();
        let mut placed = Vec::with_capacity(tables.len());
        for (table, cap) in tables.iter().zip(&cap) {
            let (first, mut target_end, mut source_last) = (runs.len() as u64 / 4, 0u64, 0u64);
            for run in table.iter().filter(|_| *cap > 0) {
                let end = run.target.checked_add(run.count);
                let last =
                    run.count.saturating_sub(1).checked_mul(run.step).and_then(|span| span.checked_add(run.source));
                let (Some(end), Some(last)) = (end, last) else {
                    return Err(format!("run {run:?} overflows"));
                };
                (target_end, source_last) = (target_end.max(end), source_last.max(last));
                let mut done = 0;
                while done < run.count {
                    let count = (run.count - done).min(*cap);
                    runs.extend([run.target + done, run.source + done * run.step, count, run.step]);
                    done += count;
                }
            }
            placed.push((first, runs.len() as u64 / 4 - first, target_end, source_last));
        }
        for check in rows {
            let (first, pieces, target_end, source_last) = placed[check.table as usize];
            let handle = check.handle;
            let len = kept.get(&handle).copied().ok_or_else(|| format!("no kept memory at {handle:#x}"))?;
            if target_end.checked_mul(check.row).is_none_or(|end| end > len) {
                return Err(format!(
                    "table {} reaches row {target_end} of {}-byte rows, past the {len}-byte memory",
                    check.table, check.row
                ));
            }
            let source = match check.pattern {
                Pattern::Source { number } => {
                    let end = source_last.checked_mul(check.pattern_row).and_then(|at| at.checked_add(check.row));
                    source_word(number, end)?
                }
                Pattern::Sentinel => 1u64 << 63,
            };
            self.words.extend([handle, check.row, source, check.pattern_row, first, self.works]);
            self.works += pieces;
        }
        self.rows = rows.len() as u64;
        self.runs = runs.len() as u64 / 4;
        self.words.extend(runs);
        Ok(())
    }
}

/// Source `number`'s word for the judge kernels (`number << 40`), its pattern read up to byte `end` (`None`:
/// overflowed).
fn source_word(number: u32, end: Option<u64>) -> Result<u64, String> {
    if end.is_none_or(|end| end >= 1 << 40) || number >= 1 << 23 {
        return Err(format!("source {number} is read past its pattern's range"));
    }
    Ok(u64::from(number) << 40)
}

impl Compare for DeviceCompare {
    fn compare(&self, checks: &[Check]) -> Result<Vec<bool>, String> {
        self.compare_with_rows(checks, &[], &[])
    }

    /// One upload of every check, row check and run through reused page-locked buffers, one launch of each judge
    /// kernel, one read-back of the flags.
    #[allow(clippy::disallowed_methods, reason = "the fabric times its own compares for the benchmark")]
    fn compare_with_rows(
        &self,
        checks: &[Check],
        tables: &[&[RowRun]],
        rows: &[RowsCheck],
    ) -> Result<Vec<bool>, String> {
        let shared = &self.0;
        let began = Instant::now();
        let mut table = JudgeTable::default();
        // The lengths of the kept memory asked about, copied out under the lock: the tables are built without it,
        // so the harness's per-rank threads build theirs side by side. Each handle is looked up once (a call's
        // thousands of checks name a few hundred regions), so the lock is held briefly.
        let handles: std::collections::BTreeSet<u64> =
            checks.iter().map(|check| check.handle).chain(rows.iter().map(|check| check.handle)).collect();
        let kept: BTreeMap<u64, u64> = {
            let state = shared.state();
            handles.into_iter().filter_map(|handle| state.resident.get(&handle).map(|len| (handle, *len))).collect()
        };
        table.plain(checks, &kept)?;
        table.rows(tables, rows, &kept)?;
        let mut answers = vec![true; checks.len() + rows.len()];
        let plain = table.owner.len() as u64;
        if plain == 0 && table.works == 0 {
            return Ok(answers);
        }
        let built = Instant::now();
        let failed = |call: &str, error: cudarc::driver::DriverError| format!("{call}: {error:?}");
        shared.ctx.bind_to_thread().map_err(|error| failed("cuCtxSetCurrent", error))?;
        let mut taken = TakenSlot::take(&shared.device)?;
        let buffers = taken.slot();
        let stream = &buffers.stream.clone();
        // Flags: [any, bad of each plain entry, bad of each row check].
        let flag_count = 1 + plain as usize + rows.len();
        let words = JudgeSlot::ensure(&mut buffers.words, &shared.ctx, table.words.len())?;
        words.host()[..table.words.len()].copy_from_slice(&table.words);
        let base = words.device.ptr;
        // SAFETY: the device buffer holds at least as many words; the host words are not written again before the
        // stream is synchronised below.
        unsafe { result::memcpy_htod_async(base, &words.host()[..table.words.len()], stream.cu_stream()) }
            .map_err(|error| failed("cuMemcpyHtoDAsync", error))?;
        let flags = JudgeSlot::ensure(&mut buffers.flags, &shared.ctx, flag_count.div_ceil(2))?;
        let (any, bad) = (flags.device.ptr, flags.device.ptr + 4);
        // SAFETY: the flags buffer holds at least `flag_count` 4-byte words.
        unsafe { result::memset_d8_async(any, 0, 4 * flag_count, stream.cu_stream()) }
            .map_err(|error| failed("cuMemsetD8Async", error))?;
        if plain > 0 {
            let mut launch = stream.launch_builder(&shared.judge);
            launch.arg(&base).arg(&plain).arg(&bad).arg(&any);
            // SAFETY: every entry lies inside kept memory (checked above) that its `Holder` keeps alive; the table
            // and flags are as long as the launch reads.
            unsafe { launch.launch(Shared::launch_config(plain)) }.map_err(|error| failed("kv_judge", error))?;
        }
        if table.works > 0 {
            let row_checks = base + 8 * 5 * plain;
            let runs = row_checks + 8 * 6 * table.rows;
            let row_bad = bad + 4 * plain;
            let mut launch = stream.launch_builder(&shared.judge_rows);
            launch.arg(&row_checks).arg(&table.rows).arg(&runs).arg(&table.works).arg(&row_bad).arg(&any);
            // SAFETY: as above: every run of every row check lies inside its kept memory (checked above).
            unsafe { launch.launch(Shared::launch_config(table.works)) }
                .map_err(|error| failed("kv_judge_rows", error))?;
        }
        let host = flags.host();
        // SAFETY: the flags' host words hold at least `flag_count` 4-byte words, read after the synchronisation.
        let host = unsafe { std::slice::from_raw_parts_mut(host.as_mut_ptr().cast::<u32>(), flag_count) };
        // SAFETY: as above.
        unsafe { result::memcpy_dtoh_async(&mut *host, any, stream.cu_stream()) }
            .map_err(|error| failed("cuMemcpyDtoHAsync", error))?;
        stream.synchronize().map_err(|error| failed("cuStreamSynchronize", error))?;
        if host[0] != 0 {
            for (flag, index) in host[1..=plain as usize].iter().zip(&table.owner) {
                if *flag != 0 {
                    answers[*index as usize] = false;
                }
            }
            for (answer, flag) in answers[checks.len()..].iter_mut().zip(&host[1 + plain as usize..]) {
                *answer = *flag == 0;
            }
        }
        shared.device.judged.add(
            checks.len() + rows.len(),
            plain as usize + table.works as usize,
            [began, built, Instant::now()],
        );
        Ok(answers)
    }

    fn read(&self, handle: u64, start: u64, out: &mut [u8]) -> Result<(), String> {
        let shared = &self.0;
        let len =
            shared.state().resident.get(&handle).copied().ok_or_else(|| format!("no kept memory at {handle:#x}"))?;
        if start.checked_add(out.len() as u64).is_none_or(|end| end > len) {
            return Err(format!("bytes {start}.. ({} bytes) are outside the {len}-byte region", out.len()));
        }
        shared.ctx.bind_to_thread().map_err(|error| format!("cuCtxSetCurrent: {error:?}"))?;
        let mut taken = TakenSlot::take(&shared.device)?;
        let stream = taken.slot().stream.clone();
        // SAFETY: the range lies inside kept memory that its `Holder` keeps alive.
        unsafe { result::memcpy_dtoh_async(out, handle + start, stream.cu_stream()) }
            .map_err(|error| format!("cuMemcpyDtoHAsync: {error:?}"))?;
        stream.synchronize().map_err(|error| format!("cuStreamSynchronize: {error:?}"))
    }

    fn name(&self) -> String {
        format!("cuda GPU {}", self.0.gpu)
    }
}
