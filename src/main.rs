//! The `kvrelay` binary; everything lives in [`kvrelay::cli`].

fn main() -> std::process::ExitCode {
    kvrelay::cli::main()
}
