//! [`Ceilings`]: the GPU's copy ceilings and kernel rates, measured for `kvrelay bench --fabric cuda`.

#![allow(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaStream, PushKernelArg};

use super::{driver, Shared};
use crate::fabric::seam::{Pattern, SeamError};

/// Ceilings and kernel rates measured on the GPU (GB/s of payload).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ceilings {
    /// One large device-to-device copy.
    pub device_copy: f64,
    /// Pinned host to device.
    pub host_to_device: f64,
    /// The gather kernel over scattered rows.
    pub gather: f64,
    /// One `cuMemcpyDtoDAsync` per row, same rows.
    pub copy_engine_rows: f64,
    /// The compare kernel over the gathered rows.
    pub judge: f64,
}

/// Times `run` between two events on `stream` (milliseconds), best of `reps`.
fn timed(
    stream: &Arc<CudaStream>,
    reps: u32,
    mut run: impl FnMut() -> Result<(), SeamError>,
) -> Result<f64, SeamError> {
    let mut best = f64::MAX;
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    for _ in 0..reps {
        let start = stream.record_event(timing).map_err(|error| driver("cuEventRecord", error))?;
        run()?;
        let end = stream.record_event(timing).map_err(|error| driver("cuEventRecord", error))?;
        let ms = start.elapsed_ms(&end).map_err(|error| driver("cuEventElapsedTime", error))?;
        best = best.min(f64::from(ms));
    }
    Ok(best)
}

pub(super) fn ceilings(shared: &Arc<Shared>, bytes: u64, row: u64) -> Result<Ceilings, SeamError> {
    let stream = &shared.stream;
    let gbs = |moved: u64, ms: f64| moved as f64 / (ms.max(1e-9) * 1e6);
    let (src, src_ptr, _) = shared.alloc(bytes, 0, None)?;
    let (dst, dst_ptr, _) = shared.alloc(bytes, 0, None)?;
    shared.generate(src_ptr, bytes, Pattern::Source { number: 1 })?;
    let copy_ms = timed(stream, 5, || {
        // SAFETY: both allocations are `bytes` long.
        unsafe { result::memcpy_dtod_async(dst_ptr, src_ptr, bytes as usize, stream.cu_stream()) }
            .map_err(|error| driver("cuMemcpyDtoDAsync", error))
    })?;
    // Pinned host to device, 256 MiB.
    let pinned_len = (bytes.min(256 << 20)) as usize;
    let mut pinned = {
        // SAFETY: the pinned buffer is only copied from, after being written.
        unsafe { shared.ctx.alloc_pinned::<u8>(pinned_len) }
    }
    .map_err(|error| driver("cuMemHostAlloc", error))?;
    pinned.as_mut_slice().map_err(|error| driver("cuMemHostAlloc", error))?.fill(7);
    let host_ms = timed(stream, 5, || {
        let host = pinned.as_slice().map_err(|error| driver("cuMemHostAlloc", error))?;
        // SAFETY: the target allocation holds at least `pinned_len` bytes.
        unsafe { result::memcpy_htod_async(dst_ptr, host, stream.cu_stream()) }
            .map_err(|error| driver("cuMemcpyHtoDAsync", error))
    })?;
    // Rows scattered by a fixed odd-stride permutation.
    let rows = bytes / row;
    let stride = (rows / 2 + 1) | 1;
    let mut table = Vec::with_capacity(rows as usize * 3);
    let mut checks = Vec::with_capacity(rows as usize * 5);
    for index in 0..rows {
        let from = (index * stride) % rows;
        table.extend([src_ptr + from * row, dst_ptr + index * row, row]);
        checks.extend([dst_ptr + index * row, (1u64 << 40) | (from * row), row, row, 0]);
    }
    let device_table = Shared::upload(stream, &table)?;
    let count = rows;
    let gather_ms = timed(stream, 5, || {
        let mut launch = stream.launch_builder(&shared.gather);
        launch.arg(&device_table).arg(&count);
        // SAFETY: every row lies inside the two allocations.
        unsafe { launch.launch(Shared::launch_config(count)) }.map(drop).map_err(|error| driver("kv_gather", error))
    })?;
    let device_checks = Shared::upload(stream, &checks)?;
    let mut bad = stream.alloc_zeros::<u32>(rows as usize).map_err(|error| driver("cuMemAlloc", error))?;
    let mut any = stream.alloc_zeros::<u32>(1).map_err(|error| driver("cuMemAlloc", error))?;
    let judge_ms = timed(stream, 5, || {
        let mut launch = stream.launch_builder(&shared.judge);
        launch.arg(&device_checks).arg(&count).arg(&mut bad).arg(&mut any);
        // SAFETY: every check lies inside the target allocation.
        unsafe { launch.launch(Shared::launch_config(count)) }.map(drop).map_err(|error| driver("kv_judge", error))
    })?;
    let flagged = stream.clone_dtoh(&any).map_err(|error| driver("cuMemcpyDtoH", error))?;
    if flagged.first().copied() != Some(0) {
        return Err(SeamError::Engine {
            call: "kv_judge",
            message: "the gathered rows did not compare equal".to_owned(),
        });
    }
    // The copy engines, one copy per row, over at most 20,000 rows (launch-bound; scaled).
    let some = rows.min(20_000);
    let rows_ms = timed(stream, 2, || {
        for index in 0..some {
            let [src, dst, len] =
                [table[index as usize * 3], table[index as usize * 3 + 1], table[index as usize * 3 + 2]];
            // SAFETY: as for the gather.
            unsafe { result::memcpy_dtod_async(dst, src, len as usize, stream.cu_stream()) }
                .map_err(|error| driver("cuMemcpyDtoDAsync", error))?;
        }
        Ok(())
    })?;
    drop((src, dst));
    shared.forget(src_ptr, bytes);
    shared.forget(dst_ptr, bytes);
    Ok(Ceilings {
        device_copy: gbs(bytes, copy_ms),
        host_to_device: gbs(pinned_len as u64, host_ms),
        gather: gbs(rows * row, gather_ms),
        copy_engine_rows: gbs(some * row, rows_ms),
        judge: gbs(rows * row, judge_ms),
    })
}
