//! `cairn`: pool the GPUs at hand into one inference cluster.

mod cmd;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cairn", version, about = "Pool every GPU at hand into one LLM inference cluster")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List every device the engine can use.
    Devices(cmd::devices::Args),
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,cairn=info,wgpu_hal::gles=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Devices(a) => cmd::devices::run(a),
    }
}
