//! Ranks as processes: `kvrelay serve` runs one rank of a scenario in this process on a real fabric, talking to
//! the others through the bootstrap [`Hub`]; `kvrelay launch` starts the hub and one `serve` child per rank, and
//! gathers the decode ranks' verdicts.
//!
//! Every process loads the same scenario file and numbers the nodes the same way (prefill ranks first, then decode
//! ranks, each in stage-major order), so the only things exchanged are what real ranks exchange: prefill rank 0's
//! published topology, registrations with queue pairs, GIDs, addresses and keys, request metadata and statuses.
//! A decode process judges its own memory with the oracle ([`verify::check_rank`]) and prints its verdict as one
//! `verdict-json {...}` line; the double-write check needs the prefill side's write log and is not run here.

#![allow(clippy::disallowed_methods, reason = "the launcher is a process edge: its deadlines are wall time")]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::control::{Client, Hub, HubPlan, HubReport};
use crate::engine::live::LiveOptions;
use crate::engine::sim::{self, SimRun};
use crate::fabric::verbs::NodeId;
use crate::harness::{self, Fabric, Failure, FailureKind, RoomEnds};
use crate::model::{Problem, RankId, Topology};
use crate::scenario::Scenario;
use crate::verify;
use crate::wire::KvPoll;

pub mod chaos;
pub mod launcher;
use chaos::{Chaos, ChaosPlan, Striker};

/// Which side a process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    Prefill,
    Decode,
}

/// How one rank process runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub role: Role,
    /// Index of the rank on its side, in stage-major order (`kvrelay layout --rank`).
    pub rank: u32,
    /// `HOST:PORT` of the hub.
    pub bootstrap: String,
    pub fabric: Fabric,
    pub connect_timeout: Duration,
    pub live: LiveOptions,
}

/// A decode process's verdict, as it prints it and the launcher reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankVerdict {
    /// `pp0-tp1`.
    pub rank: String,
    pub rooms: Vec<RoomVerdict>,
    /// The oracle's violations (the first 20), in coordinates.
    pub violations: Vec<String>,
    pub violation_count: usize,
    /// Decode bytes judged.
    pub bytes: u64,
}

/// How one request ended on a decode rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomVerdict {
    pub request: u64,
    /// `KVPoll` code (domain.md §6.1): 4 is Success.
    pub poll: u8,
    pub reason: Option<String>,
}

/// Why a rank process or the launcher failed, or why a decode rank has no verdict.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("--rank {rank}: the scenario has {count} {role:?} ranks (fix: 0..{count})")]
    NoSuchRank { rank: u32, role: Role, count: usize },
    #[error("{IN_ONE_PROCESS}")]
    InOneProcess,
    /// A child-process fabric's transport or engine cannot be opened (`fabric::child`).
    #[error("cannot open the {fabric} fabric: {reason}")]
    Transport { fabric: String, reason: String },
    #[error(transparent)]
    Live(#[from] crate::engine::live::LiveError),
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error("the hub has no local address")]
    NoAddress,
    #[error("cannot start a rank process: {0} (fix: check that the kvrelay binary is still in place)")]
    Spawn(#[from] std::io::Error),
    #[error("no verdict ({status})")]
    NoVerdict { status: String },
    #[error("not started (--omit)")]
    Omitted,
}

error_kinds! {
    /// The kind of a [`ProcessError`].
    pub enum ProcessErrorKind {
        /// `--rank` names no rank of the scenario.
        NoSuchRank = "no_such_rank",
        /// The fabric cannot serve one rank per process (in-memory, or built without RDMA).
        WrongFabric = "wrong_fabric",
        /// The RDMA device or the live run failed.
        Fabric = "fabric",
        /// The control plane (hub, connection) failed.
        Control = "control",
        /// A rank process cannot be started.
        Spawn = "spawn",
        /// A decode rank reported no verdict (it failed, was killed, or was not started).
        NoVerdict = "no_verdict",
    }
}

impl ProcessError {
    /// The failure's kind (stable across rewording).
    pub fn kind(&self) -> ProcessErrorKind {
        match self {
            ProcessError::NoSuchRank { .. } => ProcessErrorKind::NoSuchRank,
            ProcessError::InOneProcess => ProcessErrorKind::WrongFabric,
            ProcessError::Transport { .. } | ProcessError::Live(_) => ProcessErrorKind::Fabric,
            ProcessError::Control(_) | ProcessError::NoAddress => ProcessErrorKind::Control,
            ProcessError::Spawn(_) => ProcessErrorKind::Spawn,
            ProcessError::NoVerdict { .. } | ProcessError::Omitted => ProcessErrorKind::NoVerdict,
        }
    }
}

/// The node number of rank `index` of `role` in `problem`, if there is such a rank.
pub fn node_of(problem: &Problem, role: Role, index: u32) -> Option<NodeId> {
    let prefill = problem.prefill.ranks.len() as u32;
    match role {
        Role::Prefill => (index < prefill).then_some(NodeId(index)),
        Role::Decode => (index < problem.decode.ranks.len() as u32).then(|| NodeId(prefill + index)),
    }
}

/// Runs one rank of `scenario` until the hub stops the run; a decode rank returns its verdict, handed to `publish`
/// first while its engine is still open (see [`crate::engine::live::serve`]).
pub fn serve(
    scenario: &Scenario,
    options: &ServeOptions,
    publish: impl FnOnce(&RankVerdict),
) -> Result<Option<RankVerdict>, ProcessError> {
    let problem = &scenario.problem;
    let Some(node) = node_of(problem, options.role, options.rank) else {
        let count = match options.role {
            Role::Prefill => problem.prefill.ranks.len(),
            Role::Decode => problem.decode.ranks.len(),
        };
        return Err(ProcessError::NoSuchRank { rank: options.rank, role: options.role, count });
    };
    let decode = (options.role == Role::Decode).then(|| problem.decode.ranks[options.rank as usize].rank);
    serve_on_fabric(problem, node, options, |run| {
        let verdict = decode.map(|rank| rank_verdict(scenario, rank, run));
        if let Some(verdict) = &verdict {
            publish(verdict);
        }
        verdict
    })
}

/// Connects to the hub as `node` and waits for the start: the control and the published prefill topology.
/// Prefill rank 0 publishes the topology (domain.md §6.1 step 1), as SGLang's bootstrap server learns it.
fn join(problem: &Problem, node: NodeId, options: &ServeOptions) -> Result<(Client, Option<Topology>), ProcessError> {
    let published = if node == NodeId(0) { sim::prefill_info(problem).encode() } else { Vec::new() };
    let mut client = Client::connect(&options.bootstrap, node, published, options.connect_timeout)?;
    let start = client.wait_start(options.connect_timeout * 2)?;
    let topology = if start.is_empty() { None } else { sim::published_topology(&start) };
    Ok((client, topology))
}

/// Opens the rank's transfer engine on the fabric before joining the run (a rank that cannot open its device,
/// load its engine or start its child never connects), then serves: the RDMA device's, NIXL's, a child-process
/// fabric's (its own child per process).
fn serve_on_fabric<R>(
    problem: &Problem,
    node: NodeId,
    options: &ServeOptions,
    judge: impl FnOnce(&SimRun) -> R,
) -> Result<R, ProcessError> {
    if matches!(options.fabric, Fabric::Sim | Fabric::LiveSim) {
        return Err(ProcessError::InOneProcess);
    }
    let failed = |reason: String| ProcessError::Transport { fabric: options.fabric.name(), reason };
    let mut transport = options.fabric.transport().map_err(|error| failed(error.to_string()))?;
    let engine = transport.engine(node, harness::RDMA_CAPS).map_err(|error| failed(error.to_string()))?;
    let (client, topology) = join(problem, node, options)?;
    Ok(crate::engine::live::serve(problem, node, engine, client, topology, &options.live, judge)?)
}

/// Why the in-memory fabric cannot serve one rank per process.
const IN_ONE_PROCESS: &str =
    "the in-memory fabric lives inside one process: ranks as processes need a fabric that crosses processes, --fabric rdma, nixl, mooncake or child:COMMAND (use `kvrelay run` for the simulation)";

/// The oracle's verdict on this decode process's own memory.
fn rank_verdict(scenario: &Scenario, rank: RankId, run: &SimRun) -> RankVerdict {
    let problem = &scenario.problem;
    let rooms = run.rooms.get(&rank).cloned().unwrap_or_default();
    let verdicts = harness::verdicts(&scenario.expect, run, rank);
    let violations = verify::check_rank(problem, rank, &run.observation, &verdicts);
    RankVerdict {
        rank: rank.to_string(),
        rooms: rooms
            .iter()
            .map(|(id, room)| RoomVerdict { request: *id, poll: room.poll as u8, reason: room.reason.clone() })
            .collect(),
        violations: violations.iter().take(20).map(ToString::to_string).collect(),
        violation_count: violations.len(),
        // Read back to this process, or judged where they live (device memory).
        bytes: run.observation.images.values().map(|image| image.len() as u64).sum::<u64>()
            + run.observation.resident.values().map(|region| region.len).sum::<u64>(),
    }
}

/// How `launch` runs a scenario.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub fabric: Fabric,
    /// Extra arguments every child gets (e.g. `--seed N`).
    pub child_args: Vec<String>,
    pub connect_timeout: Duration,
    pub live: LiveOptions,
    /// Ranks not started (a rank that never connects).
    pub omit: Vec<(Role, u32)>,
    /// A process fault to inject (`--chaos`), seeded by the scenario's seed; the run is then judged by the fault
    /// guarantee instead of the expectation.
    pub chaos: Option<Chaos>,
}

/// What `launch` gathered.
#[derive(Debug)]
pub struct Launched {
    /// Per decode rank (stage-major index), its verdict or why there is none.
    pub verdicts: BTreeMap<u32, Result<RankVerdict, ProcessError>>,
    /// Per process, `role index: exit status`.
    pub exits: Vec<String>,
    /// Decode processes ended by a signal after they gave their verdict (an engine that aborts at teardown, its
    /// peer gone, or a chaos victim struck late): the verdict stands, and the exit is reported beside it.
    pub after_verdict: Vec<String>,
    pub hub: HubReport,
    /// Why the run does not meet the scenario's expectation (under `--chaos`: the fault guarantee); empty means
    /// pass.
    pub failures: Vec<Failure>,
    /// Under `--chaos`: what was injected and what the striker did, and the requests that succeeded byte-exact and
    /// failed with a reason.
    pub chaos: Option<(String, String, u64, u64)>,
}

/// Starts the hub and one `serve` child per rank of the scenario at `path`, waits for them (killing any that
/// outlive the time limit), and judges the gathered verdicts against the scenario's expectation.
pub fn launch(path: &Path, scenario: &Scenario, options: &LaunchOptions) -> Result<Launched, ProcessError> {
    let problem = &scenario.problem;
    let hub = Hub::bind("127.0.0.1:0")?;
    let addr = hub.local_addr().ok_or(ProcessError::NoAddress)?.to_string();
    let mut plan = hub_plan(problem, options.connect_timeout, options.live.time_limit);
    let counts = (problem.prefill.ranks.len() as u32, problem.decode.ranks.len() as u32);
    let chaos =
        options.chaos.map(|chaos| ChaosPlan::draw(chaos, crate::seed::Seed(scenario.seed), counts, &options.omit));
    let started = chaos.as_ref().and_then(|chaos| chaos.arm(&mut plan));
    let mut children = Vec::new();
    // Decode ranks first, so their verdicts are gathered before a stalled prefill process is put down.
    for (role, count) in [(Role::Decode, counts.1), (Role::Prefill, counts.0)] {
        for index in (0..count).filter(|index| !options.omit.contains(&(role, *index))) {
            children.push((role, index, spawn_rank(path, role, index, &addr, options)?));
        }
    }
    let striker = chaos.as_ref().zip(started).and_then(|(chaos, started)| {
        let (_, _, victim) = children.iter().find(|(role, index, _)| chaos.victim == Some((*role, *index)))?;
        Some(Striker::arm(chaos, victim.id(), started, options.connect_timeout + Duration::from_secs(5)))
    });
    let report = hub.run(&plan);
    let struck = striker.map(Striker::finish);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut verdicts = BTreeMap::new();
    let (mut exits, mut after_verdict) = (Vec::new(), Vec::new());
    for (role, index, mut child) in children {
        if chaos.as_ref().is_some_and(|chaos| chaos.chaos == Chaos::StallPrefill && chaos.victim == Some((role, index)))
        {
            chaos::release_victim(&mut child);
        }
        let (status, verdict) = gather(child, deadline);
        exits.push(format!("{} {index}: {status}", role_name(role)));
        if role == Role::Decode {
            if verdict.is_some() && status.contains("signal") {
                after_verdict.push(format!("decode {index}: {status}"));
            }
            verdicts.insert(index, verdict.ok_or_else(|| ProcessError::NoVerdict { status: status.clone() }));
        }
    }
    for &(_, index) in options.omit.iter().filter(|(role, _)| *role == Role::Decode) {
        verdicts.insert(index, Err(ProcessError::Omitted));
    }
    let Some(chaos) = chaos else {
        let failures = launch_failures(scenario, &verdicts, &report);
        return Ok(Launched { verdicts, exits, after_verdict, hub: report, failures, chaos: None });
    };
    let ranks: Vec<String> = problem.decode.ranks.iter().map(|layout| layout.rank.to_string()).collect();
    let (succeeded, failed, failures) = chaos::guarantee_failures(&chaos, &ranks, &verdicts, &report);
    let struck = struck.unwrap_or_else(|| format!("{} messages cut short", report.truncated));
    let chaos = Some((chaos.describe(), struck, succeeded, failed));
    Ok(Launched { verdicts, exits, after_verdict, hub: report, failures, chaos })
}

pub(crate) fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

/// Who the hub of `problem` expects (every rank, numbered as [`node_of`] does), and its deadlines: the run may last
/// `run_limit` after the connect deadline.
pub fn hub_plan(problem: &Problem, connect_timeout: Duration, run_limit: Duration) -> HubPlan {
    let mut nodes = BTreeMap::new();
    let mut decode = BTreeSet::new();
    for (role, layouts) in [(Role::Prefill, &problem.prefill.ranks), (Role::Decode, &problem.decode.ranks)] {
        for (index, layout) in layouts.iter().enumerate() {
            let node = node_of(problem, role, index as u32).expect("every rank of the problem has a node");
            nodes.insert(node, format!("{} {}", role_name(role), layout.rank));
            if role == Role::Decode {
                decode.insert(node);
            }
        }
    }
    HubPlan { nodes, decode, connect_timeout, time_limit: connect_timeout + run_limit, faults: None, started: None }
}

fn spawn_rank(path: &Path, role: Role, index: u32, addr: &str, options: &LaunchOptions) -> Result<Child, ProcessError> {
    let exe = std::env::current_exe()?;
    let mut command = Command::new(exe);
    command.arg("serve").arg("--role").arg(role_name(role)).arg("--rank").arg(index.to_string());
    command.arg("--bootstrap").arg(addr);
    command.arg("--connect-timeout").arg(options.connect_timeout.as_secs().to_string());
    command.arg("--timeout").arg((options.live.waiting_timeout_ns / 1_000_000_000).to_string());
    command.args(options.fabric.flags());
    command.args(&options.child_args).arg(path);
    command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    Ok(command.spawn()?)
}

/// Waits for a child until `deadline` (then kills it) and reads its verdict line, if it printed one.
fn gather(mut child: Child, deadline: Instant) -> (String, Option<RankVerdict>) {
    let stdout = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut verdict = None;
        for line in stdout.map(BufReader::new).into_iter().flat_map(|reader| reader.lines()) {
            let Ok(line) = line else { break };
            if let Some(json) = line.strip_prefix(VERDICT_PREFIX) {
                verdict = serde_json::from_str(json).ok();
            }
        }
        verdict
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status.to_string(),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                break "killed at the launcher's deadline".to_owned();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(error) => break format!("cannot wait: {error}"),
        }
    };
    (status, reader.join().ok().flatten())
}

/// The prefix of a decode process's verdict line on stdout.
pub const VERDICT_PREFIX: &str = "verdict-json ";

/// How the gathered verdicts depart from the scenario's expectation.
fn launch_failures(
    scenario: &Scenario,
    verdicts: &BTreeMap<u32, Result<RankVerdict, ProcessError>>,
    report: &HubReport,
) -> Vec<Failure> {
    let problem = &scenario.problem;
    let mut failures = Vec::new();
    let mut ends = RoomEnds::new();
    for (index, verdict) in verdicts {
        let rank = problem.decode.ranks[*index as usize].rank;
        match verdict {
            Ok(verdict) => {
                if verdict.violation_count > 0 {
                    failures.push(Failure::new(
                        FailureKind::Oracle,
                        format!("decode {rank}: {} oracle violations", verdict.violation_count),
                    ));
                }
                let rooms = verdict.rooms.iter().map(|room| (room.request, (poll(room.poll), room.reason.clone())));
                ends.insert(rank, rooms.collect());
            }
            Err(why) => failures.push(Failure::new(FailureKind::Fabric, format!("decode {rank}: {why}"))),
        }
    }
    let plan = crate::plan::plan(problem);
    failures.extend(harness::expectation_failures(&scenario.expect, &plan, Some(&ends)));
    if report.timed_out {
        failures.push(Failure::new(FailureKind::Fabric, "the hub's time limit passed"));
    }
    failures
}

pub(crate) fn poll(code: u8) -> KvPoll {
    KvPoll::ALL.into_iter().find(|poll| *poll as u8 == code).unwrap_or(KvPoll::Failed)
}
