//! Loopback RDMA WRITE bandwidth through `kvrelay::fabric::rdma::write_bandwidth`, to compare with `ib_write_bw`
//! at the same message size and depth (cargo feature `rdma`; run it where a device is, e.g. in the test guest:
//! `run-in-guest.sh target/release/examples/rdma_write_bw --size 65536 --iterations 2000`).

use clap::Parser;
use kvrelay::fabric::rdma::write_bandwidth;

/// Loopback RDMA WRITE bandwidth on one device (two endpoints, one QP pair).
#[derive(Debug, Parser)]
struct Args {
    /// Device name (default: the first device with an active port).
    #[arg(long)]
    device: Option<String>,
    /// Message size in bytes.
    #[arg(long, default_value_t = 65536)]
    size: u64,
    /// Work requests to complete.
    #[arg(long, default_value_t = 2000)]
    iterations: u64,
    /// Work requests kept outstanding (ib_write_bw's tx-depth).
    #[arg(long, default_value_t = 128)]
    depth: usize,
}

#[allow(clippy::print_stdout, reason = "a benchmark prints its result")]
fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let run = write_bandwidth(args.device.as_deref(), args.size, args.iterations, args.depth)?;
    let rate = run.bytes_per_second();
    println!(
        "rdma_write_bw: {} B x {} (depth {}): {:.2} MB/s = {:.2} MiB/s (ib_write_bw's \"MB/sec\"), {:.3} s",
        args.size,
        run.work_requests,
        args.depth,
        rate / 1e6,
        rate / 1_048_576.0,
        run.seconds
    );
    Ok(())
}
