//! Writes one of the tiny random-weight family models the reference tests use:
//! `cargo run -p cairn-engine --example tiny_model -- FAMILY OUT.gguf [SEED]`.

use cairn_engine::model::tiny::{TINY_FAMILIES, tiny_model};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(family), Some(out)) = (args.first(), args.get(1)) else {
        return Err(format!(
            "usage: tiny_model FAMILY OUT.gguf [SEED] (FAMILY: {TINY_FAMILIES:?})"
        )
        .into());
    };
    let seed = match args.get(2) {
        Some(s) => s.parse()?,
        None => 1,
    };
    let bytes = tiny_model(family, seed).ok_or_else(|| format!("no tiny {family} model"))?;
    std::fs::write(out, bytes)?;
    Ok(())
}
