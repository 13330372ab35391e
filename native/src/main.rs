//! `cairn`: pool the GPUs at hand into one inference cluster.

mod cmd;
mod loading;
mod model_path;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cairn",
    version,
    about = "Pool every GPU at hand into one LLM inference cluster"
)]
struct Cli {
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
    /// Join a cluster and serve the layers the coordinator assigns.
    Worker(cmd::worker::Args),
    /// Prefill and decode tokens/s against the device's copy bandwidth and dispatch cost.
    Bench(cmd::bench::Args),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,cairn=info,cairn_native=info,wgpu_hal::gles=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Devices(a) => cmd::devices::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Score(a) => cmd::score::run(a),
        Command::Quantize(a) => cmd::quantize::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Worker(a) => cmd::worker::run(a),
        Command::Bench(a) => cmd::bench::run(a),
    }
}
