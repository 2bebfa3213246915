//! A transport certified from its own Rust code: the template for a vendor whose transport is a Rust crate.
//!
//! The crate implements `kvrelay::certify::Transport` (endpoints behind `kvrelay::fabric::verbs::Endpoint`) and
//! calls `kvrelay::certify::certify`, the library entry point, then writes the same three files as
//! `kvrelay certify`. Run it from the repository root:
//!
//! ```sh
//! cargo run --release --example certify-loopback -- target/certify/loopback            # certified, exit 0
//! cargo run --release --example certify-loopback -- target/certify/loopback-planted --plant-wrong-offset  # exit 1
//! ```
//!
//! This template's endpoints are a thin layer over kvrelay's in-memory fabric (so the template stays short); a
//! vendor replaces `LoopbackEndpoint`'s body with calls into its own transport. `--plant-wrong-offset` makes every
//! write land 64 bytes past its target, the kind of bug certification exists to catch.

#![allow(clippy::print_stdout, clippy::print_stderr, reason = "a command-line example reports on its terminal")]

use std::path::PathBuf;
use std::process::ExitCode;

use kvrelay::certify::{self, CaseSet, Identity, Options, SimTransport, Transport};
use kvrelay::fabric::verbs::{
    Caps, Endpoint, FabricError, MemoryRegion, NodeId, QpInfo, QpNum, WorkCompletion, WorkRequest,
};
use kvrelay::harness::Budget;

/// One endpoint of the loopback transport.
struct LoopbackEndpoint {
    inner: Box<dyn Endpoint>,
    /// Bytes every write lands past its target (0: no bug).
    planted_offset: u64,
}

impl Endpoint for LoopbackEndpoint {
    fn caps(&self) -> Caps {
        self.inner.caps()
    }

    fn node(&self) -> NodeId {
        self.inner.node()
    }

    fn register(&mut self, bytes: Vec<u8>) -> Result<MemoryRegion, FabricError> {
        self.inner.register(bytes)
    }

    fn deregister(&mut self, region: &MemoryRegion) -> Result<Vec<u8>, FabricError> {
        self.inner.deregister(region)
    }

    fn read_local(&self, region: &MemoryRegion, offset: u64, out: &mut [u8]) -> Result<(), FabricError> {
        self.inner.read_local(region, offset, out)
    }

    fn create_qp(&mut self) -> Result<QpInfo, FabricError> {
        self.inner.create_qp()
    }

    fn connect_qp(&mut self, local: QpNum, remote: QpInfo) -> Result<(), FabricError> {
        self.inner.connect_qp(local, remote)
    }

    fn post_send(&mut self, qp: QpNum, wrs: &[WorkRequest]) -> Result<(), FabricError> {
        if self.planted_offset == 0 {
            return self.inner.post_send(qp, wrs);
        }
        let mut planted = wrs.to_vec();
        for wr in &mut planted {
            wr.remote.addr = wr.remote.addr.wrapping_add(self.planted_offset);
        }
        self.inner.post_send(qp, &planted)
    }

    fn poll_cq(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        self.inner.poll_cq(out, max)
    }
}

/// The transport: opens endpoints and lets time pass.
struct Loopback {
    fabric: SimTransport,
    planted_offset: u64,
}

impl Transport for Loopback {
    fn identity(&self) -> Identity {
        let mut identity =
            Identity { name: "loopback".to_owned(), version: "template-1".to_owned(), ..Identity::default() };
        identity.facts.insert("planted-offset".to_owned(), self.planted_offset.to_string());
        identity
    }

    fn open(&mut self, node: NodeId, caps: Caps) -> Result<Box<dyn Endpoint>, String> {
        let inner = self.fabric.open(node, caps)?;
        Ok(Box::new(LoopbackEndpoint { inner, planted_offset: self.planted_offset }))
    }

    fn step(&mut self) {
        self.fabric.step();
    }

    fn settle(&mut self) {
        self.fabric.settle();
    }

    fn reset(&mut self) {
        self.fabric.reset();
    }
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let out = PathBuf::from(args.next().unwrap_or_else(|| "target/certify/loopback".to_owned()));
    let planted = args.next().as_deref() == Some("--plant-wrong-offset");
    let mut transport = Loopback { fabric: SimTransport::eager(), planted_offset: if planted { 64 } else { 0 } };
    let set = match CaseSet::load("scenarios".as_ref()) {
        Ok(set) => set,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::FAILURE;
        }
    };
    let budget = Budget::from_env().unwrap_or_else(|_| Budget::bytes(4 << 30));
    let options = Options::new(budget, "cargo run --release --example certify-loopback -- OUT_DIR");
    let report = certify::certify(&mut transport, &set, &options, &mut |result| {
        println!("{:<26} {}", result.verdict.name(), result.id);
    });
    println!("{}", report.summary());
    match report.write(&out) {
        Ok(written) => {
            println!("wrote {}, {}, {}", written.junit.display(), written.json.display(), written.manifest.display())
        }
        Err(error) => {
            eprintln!("error: writing the report into {}: {error}", out.display());
            return ExitCode::FAILURE;
        }
    }
    if report.certified() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
