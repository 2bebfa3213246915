//! The one place every fabric is named: [`Fabric`] parses `--fabric` (`sim`, `live-sim`, `rdma`, `nixl`, `plugin:PATH`),
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
}

impl Fabric {
    /// The fabric called `name` (`sim`, `live-sim`, `rdma`), on `device` where that applies.
    pub fn parse(name: &str, device: Option<String>) -> Result<Fabric, TransportError> {
        match name {
            "sim" => Ok(Fabric::Sim),
            "live-sim" => Ok(Fabric::LiveSim),
            "rdma" => Ok(Fabric::Rdma { device }),
            "nixl" => Ok(Fabric::Nixl),
            other => match other.strip_prefix("plugin:") {
                Some(path) => Ok(Fabric::Plugin { path: path.to_owned() }),
                None => Err(TransportError::UnknownFabric { name: other.to_owned() }),
            },
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
        }
    }
}

impl Fabric {
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
