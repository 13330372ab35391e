//! `cairn`: pool the GPUs at hand into one inference cluster.

mod cmd;
mod loading;
mod model_path;
#[cfg(target_os = "linux")]
mod runtime_dir;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cairn",
    version,
    about = "Pool every GPU at hand into one LLM inference cluster"
)]
struct Cli {
    /// Show what the libraries say too (wgpu's adapter probing, GL fallbacks); RUST_LOG,
    /// when set, chooses instead.
    #[arg(long, short, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List every device the engine can use.
    Devices(cmd::devices::Args),
    /// Generate text from a prompt on one device.
    Run(cmd::run::Args),
    /// Teacher-forced top-1 predictions and logits for a given continuation.
    Score(cmd::score::Args),
    /// Write a GGUF file in another weight format (Q4_K_M, Q5_K_M, Q6_K, Q8_0, ...).
    Quantize(cmd::quantize::Args),
    /// Coordinate a cluster: placement, the OpenAI-compatible API, the dashboard.
    Serve(cmd::serve::Args),
    /// List, issue or revoke a running coordinator's worker join tokens.
    Token(cmd::token::Args),
    /// Check (verify) or print (show) a coordinator's tamper-evident audit log.
    Audit(cmd::audit::Args),
    /// Join a cluster and serve the layers the coordinator assigns.
    Worker(cmd::worker::Args),
    /// Prefill and decode tokens/s against the device's copy bandwidth and dispatch cost.
    Bench(cmd::bench::Args),
}

/// What a normal run logs: our own progress, and no library chatter. wgpu warns about every
/// adapter it probes and fails over (GL without a display, Vulkan ICDs it cannot load), which a
/// newcomer reads as failures; its errors still show.
const QUIET: &str =
    "warn,cairn=info,cairn_native=info,wgpu_hal=off,wgpu_core=error,wgpu=error,naga=error";
/// `--verbose`: the libraries' warnings and our own details.
const VERBOSE: &str = "info,cairn=debug,cairn_native=debug,wgpu_hal=warn,wgpu_core=warn,naga=warn";

fn main() -> Result<()> {
    let cli = Cli::parse();
    #[cfg(target_os = "linux")]
    runtime_dir::ensure();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| if cli.verbose { VERBOSE } else { QUIET }.into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Devices(a) => cmd::devices::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Score(a) => cmd::score::run(a),
        Command::Quantize(a) => cmd::quantize::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Token(a) => cmd::token::run(a),
        Command::Audit(a) => cmd::audit::run(a),
        Command::Worker(a) => cmd::worker::run(a),
        Command::Bench(a) => cmd::bench::run(a),
    }
}
