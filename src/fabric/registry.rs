//! The one place every fabric is named: [`Fabric`] parses `--fabric` (`sim`, `live-sim`, `rdma`, `nixl`, `plugin:PATH`,
//! `child:COMMAND`, `mooncake`, `cuda`, `nixl-cuda`),
//! prints it back, and opens the [`Transport`] whose per-node engines a run uses ([`Fabric::transport`]). A new
//! fabric adds its variant here, its own file (its engine or endpoint, and its `Transport`), and its tests.

use super::transport::{Transport, TransportError};
use super::verbs::Caps;

/// Where the engines run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fabric {
    /// The in-memory fabric in simulated time (one tokio task per rank on a paused clock).
    Sim,
    /// The live driver (real clock, one thread) on the in-memory fabric delivering at once: the live driver's
    /// cross-check where no NIC exists.
    LiveSim,
    /// The live driver on RDMA verbs (cargo feature `rdma`), one endpoint per rank on `device` (default: the
    /// first device with an active port).
    Rdma { device: Option<String> },
    /// The live driver on a C ABI transport plug-in (`fabric::plugin`), one endpoint per rank.
    Plugin { path: String },
    /// The live driver on NIXL (cargo feature `nixl`): one NIXL agent per rank, UCX backend, host memory.
    Nixl,
    /// NIXL on GPU memory (cargo features `nixl` and `cuda`): one NIXL agent per rank, every region in device
    /// memory of one GPU registered as VRAM, UCX `cuda_copy`/`cuda_ipc` (`fabric::nixl`).
    NixlCuda,
    /// The live driver on engines living in a child process speaking `kvrelay-transport-1` (`fabric::child`):
    /// `command` split on whitespace, one child per transport (per process when ranks are processes).
    Child { command: String },
    /// The live driver on GPU memory (cargo feature `cuda`): every rank's regions in device memory of one GPU,
    /// batches executed and decode memory judged on it (`fabric::cuda`).
    Cuda,
    /// Mooncake's Transfer Engine behind the child protocol: `python3 tests/transports/mooncake_engine.py` (the
    /// interpreter from `$KVRELAY_MOONCAKE_PYTHON`, else `$KVRELAY_PYTHON`, else `python3`).
    Mooncake,
}

/// The environment variables naming the Python interpreter of `--fabric mooncake`, first set wins.
pub const MOONCAKE_PYTHON_ENV: [&str; 2] = ["KVRELAY_MOONCAKE_PYTHON", "KVRELAY_PYTHON"];

/// The Mooncake adapter child's command line: the interpreter ([`MOONCAKE_PYTHON_ENV`]) and the script.
pub fn mooncake_command() -> Vec<String> {
    let python = MOONCAKE_PYTHON_ENV
        .iter()
        .find_map(|name| std::env::var(name).ok().filter(|value| !value.is_empty()))
        .unwrap_or_else(|| "python3".to_owned());
    vec![python, concat!(env!("CARGO_MANIFEST_DIR"), "/tests/transports/mooncake_engine.py").to_owned()]
}

impl Fabric {
    /// The fabric called `name` (`sim`, `live-sim`, `rdma`), on `device` where that applies.
    pub fn parse(name: &str, device: Option<String>) -> Result<Fabric, TransportError> {
        match name {
            "sim" => Ok(Fabric::Sim),
            "live-sim" => Ok(Fabric::LiveSim),
            "rdma" => Ok(Fabric::Rdma { device }),
            "nixl" => Ok(Fabric::Nixl),
            "nixl-cuda" => Ok(Fabric::NixlCuda),
            "mooncake" => Ok(Fabric::Mooncake),
            "cuda" => Ok(Fabric::Cuda),
            other => {
                if let Some(path) = other.strip_prefix("plugin:") {
                    Ok(Fabric::Plugin { path: path.to_owned() })
                } else if let Some(command) = other.strip_prefix("child:").filter(|c| !c.trim().is_empty()) {
                    Ok(Fabric::Child { command: command.to_owned() })
                } else {
                    Err(TransportError::UnknownFabric { name: other.to_owned() })
                }
            }
        }
    }

    /// The command-line flags that select this fabric.
    pub fn flags(&self) -> Vec<String> {
        let name = match self {
            Fabric::Sim => "sim".to_owned(),
            Fabric::LiveSim => "live-sim".to_owned(),
            Fabric::Rdma { .. } => "rdma".to_owned(),
            Fabric::Plugin { path } => format!("plugin:{path}"),
            Fabric::Nixl => "nixl".to_owned(),
            Fabric::NixlCuda => "nixl-cuda".to_owned(),
            Fabric::Child { command } => format!("child:{command}"),
            Fabric::Mooncake => "mooncake".to_owned(),
            Fabric::Cuda => "cuda".to_owned(),
        };
        let mut flags = vec!["--fabric".to_owned(), name];
        if let Fabric::Rdma { device: Some(device) } = self {
            flags.extend(["--device".to_owned(), device.clone()]);
        }
        flags
    }

    pub fn name(&self) -> String {
        match self {
            Fabric::Sim => "sim".to_owned(),
            Fabric::LiveSim => "live-sim".to_owned(),
            Fabric::Rdma { device: Some(device) } => format!("rdma ({device})"),
            Fabric::Rdma { device: None } => "rdma".to_owned(),
            Fabric::Plugin { path } => format!("plugin:{path}"),
            Fabric::Nixl => "nixl".to_owned(),
            Fabric::NixlCuda => "nixl-cuda".to_owned(),
            Fabric::Child { command } => format!("child:{command}"),
            Fabric::Mooncake => "mooncake".to_owned(),
            Fabric::Cuda => "cuda".to_owned(),
        }
    }
}

impl Fabric {
    /// `cargo run` with the cargo feature this fabric needs, for reproduce lines.
    pub fn cargo_run(&self) -> &'static str {
        match self {
            Fabric::Rdma { .. } => "cargo run --release --features rdma --",
            Fabric::Nixl => "cargo run --release --features nixl --",
            Fabric::NixlCuda => "cargo run --release --features nixl,cuda --",
            Fabric::Cuda => "cargo run --release --features cuda --",
            _ => "cargo run --release --",
        }
    }

    /// Whether this is the in-memory fabric in simulated time (run by the simulation driver, not a transport).
    pub fn simulated(&self) -> bool {
        *self == Fabric::Sim
    }

    /// The transport whose engines a run on this fabric uses (the in-memory fabric delivering at once for `sim`
    /// and `live-sim`: a real-clock driver's view of it).
    pub fn transport(&self) -> Result<Box<dyn Transport>, TransportError> {
        match self {
            Fabric::Sim | Fabric::LiveSim => Ok(Box::new(super::sim_transport::SimTransport::eager())),
            Fabric::Rdma { device } => rdma(device.as_deref()),
            Fabric::Plugin { path } => {
                let plugin = super::plugin::PluginTransport::load(path)
                    .map_err(|error| TransportError::Unavailable(error.to_string()))?;
                Ok(Box::new(plugin))
            }
            Fabric::Nixl => nixl(),
            Fabric::NixlCuda => nixl_cuda(),
            Fabric::Cuda => cuda(),
            Fabric::Child { command } => {
                Ok(Box::new(super::child::ChildTransport::start(super::child::ChildTransport::argv(command))?))
            }
            Fabric::Mooncake => match super::child::ChildTransport::start(mooncake_command()) {
                Ok(transport) => Ok(Box::new(transport)),
                Err(error) => Err(TransportError::Unavailable(format!(
                    "{error} (fix: install the pinned wheel mooncake-transfer-engine-non-cuda==0.3.13.post1 and numpy \
                     into a venv, apt-get install libibverbs1 libnl-3-200 libnl-route-3-200, and point \
                     KVRELAY_MOONCAKE_PYTHON at the venv's python)"
                ))),
            },
        }
    }
}

#[cfg(feature = "rdma")]
fn rdma(device: Option<&str>) -> Result<Box<dyn Transport>, TransportError> {
    let transport = super::rdma_transport::RdmaTransport::new(device)
        .map_err(|error| TransportError::Unavailable(error.to_string()))?;
    Ok(Box::new(transport))
}

#[cfg(not(feature = "rdma"))]
fn rdma(_: Option<&str>) -> Result<Box<dyn Transport>, TransportError> {
    Err(TransportError::Unavailable(RDMA_MISSING.to_owned()))
}

#[cfg(feature = "nixl")]
fn nixl() -> Result<Box<dyn Transport>, TransportError> {
    Ok(Box::new(super::nixl::NixlTransport::new()?))
}

#[cfg(not(feature = "nixl"))]
fn nixl() -> Result<Box<dyn Transport>, TransportError> {
    Err(TransportError::Unavailable(NIXL_MISSING.to_owned()))
}

#[cfg(all(feature = "nixl", feature = "cuda"))]
fn nixl_cuda() -> Result<Box<dyn Transport>, TransportError> {
    Ok(Box::new(super::nixl::NixlTransport::on_gpu()?))
}

#[cfg(not(all(feature = "nixl", feature = "cuda")))]
fn nixl_cuda() -> Result<Box<dyn Transport>, TransportError> {
    Err(TransportError::Unavailable(NIXL_CUDA_MISSING.to_owned()))
}

/// Why `--fabric nixl-cuda` cannot run in a build without both features.
pub const NIXL_CUDA_MISSING: &str =
    "this kvrelay was built without NIXL on GPU memory (fix: cargo build --release --features nixl,cuda; runs where an NVIDIA GPU is, with the nixl-cu13 wheel's libraries from bash ci/engines.sh --nixl-cu13)";

#[cfg(feature = "cuda")]
fn cuda() -> Result<Box<dyn Transport>, TransportError> {
    Ok(Box::new(super::cuda::CudaTransport::new()?))
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Box<dyn Transport>, TransportError> {
    Err(TransportError::Unavailable(CUDA_MISSING.to_owned()))
}

/// Why `--fabric cuda` cannot run in a build without the feature.
pub const CUDA_MISSING: &str =
    "this kvrelay was built without GPU memory (fix: cargo build --release --features cuda; builds anywhere, runs where an NVIDIA GPU, its driver and CUDA 13's libnvrtc are)";

/// Why `--fabric nixl` cannot run in a build without the feature.
pub const NIXL_MISSING: &str =
    "this kvrelay was built without NIXL (fix: cargo build --release --features nixl; needs g++ and libclang-dev to build, and bash ci/engines.sh for the pinned nixl-cu12 wheel's libraries)";

/// What kvrelay asks of an RDMA device per endpoint (clamped to the device's limits): gather lists of up to 30
/// entries (a ConnectX send queue's; Soft-RoCE offers 32), as the engines gather; a send queue of 256 (four
/// signalling intervals in flight), so that a prefill rank serving many decode ranks keeps its queue pairs'
/// completion-queue reservation within a soft device's CQ (Soft-RoCE ran out at 16 queue pairs of depth 1024).
pub const RDMA_CAPS: Caps = Caps { max_sge: 30, max_message: 1 << 30, sq_depth: 256 };

/// Why `--fabric rdma` cannot run in a build without the feature.
pub const RDMA_MISSING: &str =
    "this kvrelay was built without RDMA (fix: cargo build --release --features rdma; needs libibverbs-dev, librdmacm-dev, libclang-dev, pkg-config)";
