//! `cairn score`: teacher-forced evaluation of a continuation, for checking a backend against
//! a reference implementation token by token.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use cairn_engine::model::generate::score;

use crate::loading::{self, DeviceArgs};

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text (tokenized like `cairn run`).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Use the prompt text as-is, without the chat template.
    #[arg(long)]
    raw: bool,
    /// Prompt as comma-separated token ids.
    #[arg(long)]
    prompt_ids: Option<String>,
    /// Continuation token ids, comma-separated.
    #[arg(long)]
    continuation_ids: String,
    #[command(flatten)]
    device: DeviceArgs,
    /// Print JSON (the only output format).
    #[arg(long)]
    json: bool,
}

pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .with_context(|| format!("'{t}' is not a token id"))
        })
        .collect()
}

pub fn run(a: Args) -> Result<()> {
    let path = crate::model_path::resolve(a.model)?;
    let continuation = parse_ids(&a.continuation_ids)?;
    if continuation.is_empty() {
        bail!("--continuation-ids is empty");
    }
    let m = loading::load(&path, &a.device)?;
    let prompt = match (&a.prompt, &a.prompt_ids) {
        (Some(p), None) => m.tokenizer.encode_prompt(p, a.raw)?,
        (None, Some(ids)) => parse_ids(ids)?,
        _ => bail!("give --prompt or --prompt-ids"),
    };
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    let s = pollster::block_on(score(&m.shard, &prompt, &continuation))?;
    let out = serde_json::json!({
        "prompt_tokens": prompt,
        "top1": s.top1,
        "top2_logits": s.top2_logits,
        "backend": m.device.kind().name(),
        "device": m.device.info().id,
    });
    println!("{out}");
    Ok(())
}
