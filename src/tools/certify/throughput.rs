//! The throughput case: WRITEs streamed from one endpoint to another through a transport, then every byte of the
//! target checked. The figure is reported beside the verdict; it is never a pass/fail threshold (machines differ).

#![allow(clippy::disallowed_methods, reason = "a throughput run reads the wall clock")]

use std::fmt;
use std::time::{Duration, Instant};

use super::conformance::CaseError;
use super::Transport;
use crate::fabric::verbs::{Caps, Endpoint, MemoryRegion, NodeId, QpNum, RemoteAddr, Sge, WcStatus, WorkRequest};

/// Largest region each side registers: the run writes it over and over until its byte count is reached.
const REGION_BYTES: u64 = 16 << 20;
/// Work requests kept outstanding.
const DEPTH: usize = 64;
/// One in this many work requests is signalled (the last of each list).
const LIST: usize = 16;
/// The run fails if no completion arrives for this long.
const STALL: Duration = Duration::from_secs(30);

/// What the throughput case measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Throughput {
    pub bytes: u64,
    pub message_bytes: u64,
    pub work_requests: u64,
    pub seconds: f64,
}

impl Throughput {
    /// MiB/s (perftest's unit).
    pub fn mib_per_second(&self) -> f64 {
        self.bytes as f64 / (1 << 20) as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }

    pub fn work_requests_per_second(&self) -> f64 {
        self.work_requests as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }
}

impl fmt::Display for Throughput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes in {} messages of {} bytes, {:.3} s: {:.2} MiB/s, {:.0} WR/s, every byte verified",
            self.bytes,
            self.work_requests,
            self.message_bytes,
            self.seconds,
            self.mib_per_second(),
            self.work_requests_per_second()
        )
    }
}

fn failed(what: impl fmt::Display) -> CaseError {
    CaseError::Failed(what.to_string())
}

/// The source byte at `offset` of lap `lap`: every lap writes different bytes, so a lap that never landed shows.
fn source_byte(offset: u64, lap: u64) -> u8 {
    (offset.wrapping_mul(31).wrapping_add(lap.wrapping_mul(7)) % 251) as u8
}

/// Streams `bytes` (rounded up to whole messages) of WRITEs of `message_bytes` and checks the target.
pub(super) fn measure(transport: &mut dyn Transport, bytes: u64, message_bytes: u64) -> Result<Throughput, CaseError> {
    let region = bytes.clamp(1, REGION_BYTES).div_ceil(message_bytes.max(1)) * message_bytes.max(1);
    let caps = Caps { max_sge: 1, max_message: message_bytes.max(1), sq_depth: DEPTH };
    let mut sender = transport.open(NodeId(0), caps).map_err(failed)?;
    let mut receiver = transport.open(NodeId(1), caps).map_err(failed)?;
    let granted = sender.caps();
    if granted.max_message < message_bytes || granted.sq_depth < LIST {
        return Err(CaseError::Unsupported(format!(
            "needs messages of {message_bytes} bytes and a send queue of {LIST}, the transport grants {} and {}",
            granted.max_message, granted.sq_depth
        )));
    }
    let laps = bytes.max(1).div_ceil(region);
    let len = usize::try_from(region).map_err(failed)?;
    let source_bytes: Vec<u8> = (0..region).map(|offset| source_byte(offset, laps - 1)).collect();
    let source = sender.register(source_bytes).map_err(failed)?;
    let target = receiver.register(vec![0; len]).map_err(failed)?;
    let qp = connect(&mut *sender, &mut *receiver).map_err(failed)?;
    let link = Stream { qp, source, target, message_bytes, depth: granted.sq_depth.min(DEPTH) };
    let messages = laps * (region / message_bytes.max(1));
    let start = Instant::now();
    link.run(transport, &mut *sender, messages)?;
    let seconds = start.elapsed().as_secs_f64();
    check_target(&*receiver, &target, laps - 1)?;
    Ok(Throughput { bytes: messages * message_bytes, message_bytes, work_requests: messages, seconds })
}

fn connect(sender: &mut dyn Endpoint, receiver: &mut dyn Endpoint) -> Result<QpNum, crate::fabric::verbs::FabricError> {
    let sender_qp = sender.create_qp()?;
    let receiver_qp = receiver.create_qp()?;
    sender.connect_qp(sender_qp.qpn, receiver_qp)?;
    receiver.connect_qp(receiver_qp.qpn, sender_qp)?;
    Ok(sender_qp.qpn)
}

/// One connected QP streaming the source region over the target region.
struct Stream {
    qp: QpNum,
    source: MemoryRegion,
    target: MemoryRegion,
    message_bytes: u64,
    depth: usize,
}

impl Stream {
    /// Message `index` (its position in the stream is its `wr_id`); the last of each list is signalled.
    fn write(&self, index: u64, signaled: bool) -> WorkRequest {
        let per_region = self.source.len / self.message_bytes;
        let offset = (index % per_region) * self.message_bytes;
        WorkRequest {
            wr_id: index,
            sges: vec![Sge { addr: self.source.addr + offset, len: self.message_bytes, lkey: self.source.lkey }],
            remote: RemoteAddr { addr: self.target.addr + offset, rkey: self.target.rkey },
            imm: None,
            signaled,
        }
    }

    /// Posts `messages` writes in lists of [`LIST`], keeping at most `depth` outstanding, until all complete.
    fn run(&self, transport: &mut dyn Transport, sender: &mut dyn Endpoint, messages: u64) -> Result<(), CaseError> {
        let (mut posted, mut completed) = (0u64, 0u64);
        let mut completions = Vec::new();
        let mut last_progress = Instant::now();
        while completed < messages {
            while posted < messages && posted - completed + LIST as u64 <= self.depth as u64 {
                let count = (messages - posted).min(LIST as u64);
                let list: Vec<WorkRequest> =
                    (posted..posted + count).map(|index| self.write(index, index + 1 == posted + count)).collect();
                sender.post_send(self.qp, &list).map_err(failed)?;
                posted += count;
            }
            completions.clear();
            if sender.poll_cq(&mut completions, usize::MAX) == 0 {
                if last_progress.elapsed() > STALL {
                    return Err(failed(format!("no completion for {STALL:?}: {completed} of {messages} writes done")));
                }
                if !sender.wait(Duration::from_millis(1)) {
                    transport.step();
                }
                continue;
            }
            last_progress = Instant::now();
            for wc in &completions {
                if wc.status != WcStatus::Success {
                    return Err(failed(format!("write {} completed {:?}", wc.wr_id, wc.status)));
                }
                // A signalled completion frees its own slot and every unsignalled one before it: a whole list.
                completed = completed.max(wc.wr_id + 1);
            }
        }
        Ok(())
    }
}

/// Every byte of the target holds the last lap's pattern.
fn check_target(receiver: &dyn Endpoint, target: &MemoryRegion, lap: u64) -> Result<(), CaseError> {
    const CHUNK: u64 = 1 << 20;
    let mut buffer = vec![0u8; CHUNK.min(target.len) as usize];
    let mut offset = 0;
    while offset < target.len {
        let len = CHUNK.min(target.len - offset);
        let chunk = &mut buffer[..len as usize];
        receiver.read_local(target, offset, chunk).map_err(failed)?;
        if let Some(index) = (0..len).find(|&index| chunk[index as usize] != source_byte(offset + index, lap)) {
            let at = offset + index;
            let (expected, found) = (source_byte(at, lap), chunk[index as usize]);
            return Err(failed(format!(
                "target byte {at} holds {found:#04x}, the last write put {expected:#04x} there"
            )));
        }
        offset += len;
    }
    Ok(())
}
