//! `kvrelay bench --fabric F` on an engine that meets only the transfer-engine seam (NIXL, Mooncake, a child, the
//! GPU fabrics): the Kimi-K3 32K request's KV as descriptor lists through two of the fabric's engines, in one
//! process or (`--across-processes`) with the target engine in a child process (`kvrelay bench-target`), as ranks
//! run in production: NIXL on VRAM between two agents of one process goes through UCX's loopback, which is not the
//! path `cuda_ipc` takes between processes (engines.md §1). Numbers only, never a pass/fail timing.

#![allow(clippy::disallowed_methods, reason = "benchmarks read the wall clock at the CLI edge")]

use std::io::{BufRead as _, Write as _};
use std::time::Instant;

use super::shapes::bench_problem;
use crate::fabric::seam::{Batch, Entry, Event, NodeId, Pattern, PeerAddress, RemoteMemory, TransferEngine};
use crate::harness;
use crate::model::RankId;
use crate::plan;

/// One descriptor list of the list benchmark: (source offset, target offset, length) into one source and one target
/// buffer.
type List = Vec<(u64, u64, u64)>;
/// A list and its name.
type Named = (&'static str, List);

/// The lists of the Kimi-K3 32K request's KV (24 MLA layers, prefill PP8/TP1 → decode TP8/DCP8, the allocator's
/// shuffled pages), every rank's regions laid end to end in one source and one target buffer: kvrelay's plan as the
/// transfer-engine seam carries it (row runs, merged where source and target both continue), the per-token list
/// SGLang's DCP path builds (one descriptor per token row), a page-granular list of the same bytes (one descriptor
/// per prefill page and layer, as a page-run list without merges), and one contiguous transfer. Also the two
/// buffers' sizes.
fn engine_lists(tokens: u32) -> anyhow::Result<(Vec<Named>, List, u64, u64)> {
    let problem = bench_problem(tokens, true)?;
    let plan = plan::plan(&problem).map_err(|error| anyhow::anyhow!("plan rejected: {error}"))?;
    let (mut sources, mut targets) = (std::collections::BTreeMap::new(), std::collections::BTreeMap::new());
    for copy in plan.copies() {
        let extent = |map: &mut std::collections::BTreeMap<(RankId, u32), u64>, key, end: u64| {
            let slot = map.entry(key).or_insert(0);
            *slot = (*slot).max(end);
        };
        extent(&mut sources, (copy.source, copy.source_region), copy.source_offset + copy.length);
        extent(&mut targets, (copy.target, copy.target_region), copy.target_offset + copy.length);
    }
    let bases = |map: &std::collections::BTreeMap<(RankId, u32), u64>| {
        let mut next = 0;
        let bases: std::collections::BTreeMap<(RankId, u32), u64> = map
            .iter()
            .map(|(key, extent)| {
                let base = next;
                next += extent;
                (*key, base)
            })
            .collect();
        (bases, next)
    };
    let ((source_base, source_len), (target_base, target_len)) = (bases(&sources), bases(&targets));
    let rows: List = plan
        .copies()
        .map(|copy| {
            let source = source_base[&(copy.source, copy.source_region)] + copy.source_offset;
            (source, target_base[&(copy.target, copy.target_region)] + copy.target_offset, copy.length)
        })
        .collect();
    let mut merged: List = Vec::new();
    for &(source, target, length) in &rows {
        match merged.last_mut() {
            Some(last) if last.0 + last.2 == source && last.1 + last.2 == target => last.2 += length,
            _ => merged.push((source, target, length)),
        }
    }
    let bytes: u64 = rows.iter().map(|row| row.2).sum();
    let page = 64 * rows.first().map_or(1, |row| row.2);
    let pages: List = (0..bytes / page).map(|k| (k * page, ((k * 7919) % (bytes / page)) * page, page)).collect();
    let (gather, packed) = pack(&rows);
    let lists = vec![
        ("kvrelay (seam entries)", merged),
        (PACKED, packed),
        ("per-token (SGLang DCP)", rows),
        ("per-page", pages),
        ("contiguous", vec![(0, 0, bytes)]),
    ];
    Ok((lists, gather, source_len, target_len))
}

/// The name of kvrelay's packed list in the list benchmark.
const PACKED: &str = "kvrelay packed (2.8)";

/// kvrelay's copies packed (domain.md §2.8): the rows gathered on the sending side into one buffer in target order,
/// so that the engine sees one entry per run of contiguous target bytes. `(gather, entries)`: the gather's copies
/// (source offset, pack offset, length), merged where contiguous, and the engine's entries (pack offset, target
/// offset, length).
fn pack(rows: &List) -> (List, List) {
    let mut order: Vec<(u64, u64, u64)> = rows.clone();
    order.sort_by_key(|row| row.1);
    let (mut gather, mut entries): (List, List) = (Vec::new(), Vec::new());
    let mut at = 0;
    for (source, target, length) in order {
        for (list, from, to) in [(&mut gather, source, at), (&mut entries, at, target)] {
            match list.last_mut() {
                Some(last) if last.0 + last.2 == from && last.1 + last.2 == to => last.2 += length,
                _ => list.push((from, to, length)),
            }
        }
        at += length;
    }
    (gather, entries)
}

/// Applies `list`'s copies (from, to, length) from `source` into `target`.
fn apply(list: &List, source: &[u8], target: &mut [u8]) {
    for &(from, to, length) in list {
        let (from, to, length) = (from as usize, to as usize, length as usize);
        target[to..to + length].copy_from_slice(&source[from..from + length]);
    }
}

/// `kvrelay bench --fabric F` on an engine that meets only the transfer-engine seam (NIXL, Mooncake, a child):
/// the Kimi-K3 32K request's KV moved between two of its engines as each list of [`engine_lists`], in batches of at
/// most the engine's declared entries, best of `iterations`; GB/s and the ratio to the contiguous transfer measured in
/// the same run. Numbers only.
/// `only`: the lists whose names contain one of these words (`seam`, `packed`, `per-token`, `per-page`,
/// `contiguous`); every list when empty.
pub(super) fn bench_engine_lists(
    fabric: &harness::Fabric,
    iterations: u32,
    across: bool,
    only: &[String],
) -> anyhow::Result<()> {
    let (mut lists, gather, source_len, target_len) = engine_lists(32768)?;
    let bytes: u64 = lists.last().map_or(0, |(_, list)| list.iter().map(|entry| entry.2).sum());
    if !only.is_empty() {
        lists.retain(|(name, _)| only.iter().any(|word| name.contains(word.as_str())));
        anyhow::ensure!(
            !lists.is_empty(),
            "--lists {} names none of seam, packed, per-token, per-page, contiguous",
            only.join(",")
        );
    }
    let mut transport = fabric.transport().map_err(anyhow::Error::msg)?;
    let mut sender = transport.engine(NodeId(0), harness::RDMA_CAPS).map_err(anyhow::Error::msg)?;
    let fill = std::sync::Arc::new(|offset: u64, out: &mut [u8]| {
        out.iter_mut().enumerate().for_each(|(index, byte)| *byte = ((offset + index as u64) % 251) as u8)
    });
    // The packed list's sending side: the pack buffer, gathered from the same source bytes (its gather is timed
    // below on host memory, as the sending rank would run it before posting: a GPU gather kernel in production).
    let host: Vec<u8> = {
        let mut host = vec![0u8; source_len as usize];
        fill(0, &mut host);
        host
    };
    let mut scratch = vec![0u8; bytes as usize];
    apply(&gather, &host, &mut scratch);
    let packed = std::sync::Arc::new(scratch.clone());
    let pack_fill = {
        let packed = packed.clone();
        std::sync::Arc::new(move |offset: u64, out: &mut [u8]| {
            let at = offset as usize;
            out.copy_from_slice(&packed[at..at + out.len()]);
        })
    };
    let kind = sender.memory_kind();
    let pack = sender.register(kind, bytes.max(1), 0, pack_fill)?;
    let source = sender.register(kind, source_len, 0, fill)?;
    let target_bytes = target_len.max(source_len);
    let mut receiver = if across {
        Receiver::child(fabric, target_bytes)?
    } else {
        Receiver::here(transport.engine(NodeId(1), harness::RDMA_CAPS).map_err(anyhow::Error::msg)?, target_bytes)?
    };
    let (conn, _) = sender.open()?;
    sender.connect(conn, &receiver.address, &[receiver.memory])?;
    outln!(
        "bench: the Kimi-K3 32K request's KV ({bytes} B) through {} as descriptor lists, target {}, best of {}",
        fabric.name(),
        if across { "in another process" } else { "in this process" },
        iterations.max(1)
    );
    outln!("{:<24} {:>12} {:>10} {:>10} {:>16}", "list", "descriptors", "seconds", "GB/s", "x contiguous");
    let mut results = Vec::new();
    let mut gathered = f64::INFINITY;
    // On host memory the packed list's time includes the sending side's gather into the pack buffer (a memcpy
    // here); device memory holds the pack buffer from registration on, and the GPU's gather kernel is measured on
    // its own (`bench --fabric cuda`'s gather line).
    let gather_on_host = kind == crate::fabric::seam::MemoryKind::Host;
    // One untimed transfer of the longest list first: connections are made, and NIXL's request structures grow, on
    // first use (measured: the first 786,432-descriptor request took 4x the second).
    let warm = lists.first().map(|(_, list)| list.clone()).unwrap_or_default();
    send(&mut *sender, &mut receiver, conn, "warm-up", &warm, source.id)?;
    for (name, list) in &lists {
        let local = if *name == PACKED { pack.id } else { source.id };
        let mut best = f64::INFINITY;
        for _ in 0..iterations.max(1) {
            if *name == PACKED && gather_on_host {
                scratch.fill(0);
            }
            let start = Instant::now();
            if *name == PACKED && gather_on_host {
                apply(&gather, &host, &mut scratch);
                gathered = gathered.min(start.elapsed().as_secs_f64());
            }
            send(&mut *sender, &mut receiver, conn, name, list, local)?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        results.push((*name, list.len(), best));
    }
    let seconds = |wanted: &str| results.iter().find(|result| result.0.starts_with(wanted)).map(|result| result.2);
    let contiguous = seconds("contiguous").unwrap_or(f64::NAN);
    for &(name, count, seconds) in &results {
        outln!(
            "{name:<24} {count:>12} {seconds:>10.3} {:>10.3} {:>16.2}",
            bytes as f64 / seconds.max(1e-12) / 1e9,
            seconds / contiguous.max(1e-12)
        );
    }
    // The packed list against the per-token one, when both ran (`--lists` may leave either out).
    if let (Some(per_token), Some(packed)) = (seconds("per-token"), seconds(PACKED)) {
        let ratio = per_token / packed.max(1e-12);
        if gather_on_host {
            outln!(
                "{PACKED}: {gathered:.3} s of its time is the sending side's gather into the pack buffer (host \
                 memcpy here; a GPU gather kernel in production, ../shared/docs/engines.md section 4); {ratio:.2}x \
                 faster than the per-token list"
            );
        } else {
            outln!(
                "{PACKED}: {ratio:.2}x faster than the per-token list; the sending side's gather into the pack \
                 buffer runs on the GPU and is not in its time (the gather kernel's own rate: `bench --fabric cuda`)"
            );
        }
    }
    Ok(())
}

/// Submits `list` (from local memory `local`) in batches of at most the engine's entries and waits for each.
fn send(
    sender: &mut dyn TransferEngine,
    receiver: &mut Receiver,
    conn: crate::fabric::seam::ConnId,
    name: &str,
    list: &List,
    local: u32,
) -> anyhow::Result<()> {
    for chunk in list.chunks(sender.limits().max_entries.clamp(1, 1 << 20)) {
        let entries = chunk
            .iter()
            .map(|&(local_offset, remote_offset, len)| Entry::new(local, local_offset, 0, remote_offset, len))
            .collect();
        let id = sender.submit(conn, Batch { entries, notify: None, tables: Vec::new() })?;
        sender.flush();
        let mut events = Vec::new();
        'wait: loop {
            sender.poll(&mut events, usize::MAX);
            for event in events.drain(..) {
                if let Event::Completed(completion) = event {
                    anyhow::ensure!(
                        completion.status == crate::fabric::seam::BatchStatus::Success,
                        "the {name} list's batch failed: {}",
                        completion.detail
                    );
                    if completion.batch == id {
                        break 'wait;
                    }
                }
            }
            // The target makes progress only when polled (NIXL's agents run no progress thread).
            receiver.progress(&mut events);
            sender.wait(std::time::Duration::from_millis(1));
        }
    }
    Ok(())
}

/// Where the target engine runs.
enum Place {
    Here(Box<dyn TransferEngine>),
    Child(std::process::Child),
}

/// The target side of the list benchmark: an engine of this process, or one in a `kvrelay bench-target` child.
struct Receiver {
    place: Place,
    address: PeerAddress,
    memory: RemoteMemory,
}

impl Receiver {
    fn here(mut engine: Box<dyn TransferEngine>, bytes: u64) -> anyhow::Result<Receiver> {
        let target = engine.register_pattern(engine.memory_kind(), bytes, 0, Pattern::Sentinel)?;
        let (_, address) = engine.open()?;
        Ok(Receiver { place: Place::Here(engine), address, memory: target.remote() })
    }

    /// Starts `kvrelay bench-target` on `fabric` and reads its one line (`target <address hex> <addr> <len> <key>`).
    fn child(fabric: &harness::Fabric, bytes: u64) -> anyhow::Result<Receiver> {
        use std::process::{Command, Stdio};
        let mut command = Command::new(std::env::current_exe()?);
        command.arg("bench-target").args(fabric.flags()).args(["--bytes", &bytes.to_string()]);
        let mut child = command.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
        let mut line = String::new();
        let stdout = child.stdout.take().ok_or_else(|| anyhow::anyhow!("bench-target has no stdout"))?;
        std::io::BufReader::new(stdout).read_line(&mut line)?;
        let fields: Vec<&str> = line.split_whitespace().collect();
        let parsed = match fields.as_slice() {
            ["target", address, addr, len, key] => {
                unhex(address).zip(addr.parse().ok()).zip(len.parse().ok()).zip(key.parse().ok())
            }
            _ => None,
        };
        let Some((((address, addr), len), key)) = parsed else {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("bench-target answered `{}` instead of its target (its error is above)", line.trim());
        };
        let memory = RemoteMemory { addr, len, key };
        Ok(Receiver { place: Place::Child(child), address: PeerAddress(address), memory })
    }

    /// Lets a target in this process make progress (a child polls its own engine).
    fn progress(&mut self, events: &mut Vec<Event>) {
        if let Place::Here(engine) = &mut self.place {
            engine.poll(events, usize::MAX);
            events.clear();
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Place::Child(child) = &mut self.place {
            drop(child.stdin.take()); // the child's cue to go
            let _ = child.wait();
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if text.len() % 2 != 0 {
        return None;
    }
    (0..text.len()).step_by(2).map(|at| u8::from_str_radix(text.get(at..at + 2)?, 16).ok()).collect()
}

/// `kvrelay bench-target --fabric F --bytes N` (hidden; started by `bench --across-processes`): one engine of `F`
/// holding `N` bytes of the sentinel in its own memory kind, announced on stdout as `target <address hex> <addr>
/// <len> <key>`, polled until stdin closes.
pub(super) fn bench_target(fabric: &harness::Fabric, bytes: u64) -> anyhow::Result<()> {
    let mut transport = fabric.transport().map_err(anyhow::Error::msg)?;
    let mut engine = transport.engine(NodeId(1), harness::RDMA_CAPS).map_err(anyhow::Error::msg)?;
    let target = engine.register_pattern(engine.memory_kind(), bytes, 0, Pattern::Sentinel)?;
    let (_, address) = engine.open()?;
    let remote = target.remote();
    outln!("target {} {} {} {}", hex(&address.0), remote.addr, remote.len, remote.key);
    std::io::stdout().flush()?;
    let closed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = closed.clone();
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        watcher.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let mut events = Vec::new();
    while !closed.load(std::sync::atomic::Ordering::Relaxed) {
        engine.poll(&mut events, usize::MAX);
        events.clear();
        engine.wait(std::time::Duration::from_millis(1));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packed list (gather, then the pack buffer's entries) writes exactly the bytes the per-token rows write.
    #[test]
    fn packed_lists_write_what_the_rows_write() {
        let (lists, gather, source_len, target_len) = engine_lists(1024).unwrap();
        let list = |wanted: &str| lists.iter().find(|(name, _)| name.starts_with(wanted)).unwrap().1.clone();
        let source: Vec<u8> = (0..source_len).map(|at| (at % 251) as u8 ^ (at >> 8) as u8).collect();
        let bytes: u64 = list("per-token").iter().map(|row| row.2).sum();
        let mut by_rows = vec![0u8; target_len as usize];
        apply(&list("per-token"), &source, &mut by_rows);
        let mut pack = vec![0u8; bytes as usize];
        apply(&gather, &source, &mut pack);
        let mut by_pack = vec![0u8; target_len as usize];
        apply(&list(PACKED), &pack, &mut by_pack);
        assert!(by_rows == by_pack, "the packed list writes other bytes than the rows");
        assert!(list(PACKED).len() * 8 < list("per-token").len(), "packing merged too little");
    }
}
