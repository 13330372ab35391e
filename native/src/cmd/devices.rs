//! `cairn devices`: what the engine sees, as a table or JSON.

use std::path::PathBuf;

use anyhow::{Context, Result};
use cairn_engine::device::discover_blocking;
use cairn_engine::gguf::MappedGguf;

use super::formats::ModelFormats;

#[derive(clap::Args)]
pub struct Args {
    /// Print a JSON array instead of a table (with --model, an object of `devices` and `model`).
    #[arg(long)]
    json: bool,
    /// Also name a model file's architecture and weight formats.
    #[arg(long)]
    model: Option<PathBuf>,
}

pub fn run(args: Args) -> Result<()> {
    let model = match &args.model {
        Some(path) => {
            let file =
                MappedGguf::open(path).with_context(|| format!("opening {}", path.display()))?;
            Some((path.clone(), ModelFormats::of(&file.file)))
        }
        None => None,
    };
    let found = discover_blocking();
    tracing::debug!(elapsed_ms = found.elapsed.as_secs_f64() * 1e3, "discovery");
    if args.json {
        let devices = serde_json::to_value(&found.devices)?;
        let out = match &model {
            Some((_, m)) => serde_json::json!({ "devices": devices, "model": m.json() }),
            None => devices,
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "{:<16} {:<7} {:<8} {:<10} {:<34} {:>10}  {:<12} support",
        "ID", "BACKEND", "API", "TYPE", "NAME", "MEMORY", "VENDOR"
    );
    for d in &found.devices {
        let mem = format!(
            "{}{:.1} GiB",
            if d.memory_exact { "" } else { "~" },
            d.memory_bytes as f64 / (1u64 << 30) as f64
        );
        println!(
            "{:<16} {:<7} {:<8} {:<10} {:<34} {:>10}  {:<12} {:?}: {}",
            d.id,
            d.backend.name(),
            d.api,
            d.device_type,
            truncate(&d.name, 34),
            mem,
            d.vendor.0,
            d.support,
            d.support_reason
        );
    }
    let auto = found.choose(&Default::default()).map(|d| d.id.clone());
    println!(
        "\n{} devices found in {:.0} ms; automatic choice: {}",
        found.devices.len(),
        found.elapsed.as_secs_f64() * 1e3,
        auto.unwrap_or_else(|e| e.to_string())
    );
    if let Some((path, m)) = model {
        println!("model {}: {m}", path.display());
    }
    Ok(())
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).collect::<String>() + "…"
    }
}
