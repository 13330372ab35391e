//! `cairn devices`: what the engine sees, as a table or JSON.

use anyhow::Result;
use cairn_engine::device::discover_blocking;

#[derive(clap::Args)]
pub struct Args {
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> Result<()> {
    let found = discover_blocking();
    tracing::debug!(elapsed_ms = found.elapsed.as_secs_f64() * 1e3, "discovery");
    if args.json {
        println!("{}", serde_json::to_string_pretty(&found.devices)?);
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
    Ok(())
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).collect::<String>() + "…"
    }
}
