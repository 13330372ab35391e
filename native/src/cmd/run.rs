//! `cairn run`: generate text from a prompt on one device, streaming it to stdout.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;
use cairn_engine::kernels::SampleParams;
use cairn_engine::model::generate::{GenerateOptions, generate};

use crate::loading::{self, DeviceArgs};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (default: $CAIRN_MODEL, then the default model's cache location).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Feed the prompt as-is: no chat template, no BOS unless the model asks for one.
    #[arg(long)]
    raw: bool,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// 0 disables the top-k cut.
    #[arg(long, default_value_t = 40)]
    top_k: u32,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Random seed (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    device: DeviceArgs,
    /// After the text, print one JSON object with ids, text and timings.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    // Written so that NaN fails too.
    let valid = a.temperature >= 0.0 && a.top_p > 0.0 && a.top_p <= 1.0;
    if !valid {
        anyhow::bail!("--temperature must be >= 0 and --top-p in (0, 1]");
    }
    let path = crate::model_path::resolve(a.model)?;
    let m = loading::load(&path, &a.device)?;
    let prompt = m.tokenizer.encode_prompt(&a.prompt, a.raw)?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sample: SampleParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed,
            step: 0,
        },
        stop_at_eog: true,
    };
    let mut dec = m.tokenizer.decoder();
    let mut text = String::new();
    let mut stdout = std::io::stdout().lock();
    let mut err = None;
    let (tokens, stats) = pollster::block_on(generate(
        &m.shard,
        &m.tokenizer,
        &prompt,
        &opts,
        &mut |id| {
            if m.tokenizer.is_end_of_generation(id) {
                return;
            }
            match dec.push(id) {
                Ok(Some(piece)) => {
                    text.push_str(&piece);
                    let _ = stdout.write_all(piece.as_bytes());
                    let _ = stdout.flush();
                }
                Ok(None) => {}
                Err(e) => err = Some(e),
            }
        },
    ))?;
    if let Some(e) = err {
        return Err(e.into());
    }
    if let Some(rest) = dec.finish() {
        text.push_str(&rest);
        stdout.write_all(rest.as_bytes())?;
    }
    writeln!(stdout)?;
    let info = m.device.info();
    tracing::info!(
        prompt_tokens = stats.prompt_tokens,
        generated = stats.generated,
        prefill_tok_s = format!("{:.1}", stats.prefill_tokens_per_s()),
        decode_tok_s = format!("{:.1}", stats.decode_tokens_per_s()),
        "done"
    );
    if a.json {
        let out = serde_json::json!({
            "prompt_tokens": prompt,
            "tokens": tokens,
            "text": text,
            "backend": m.device.kind().name(),
            "device": info.id,
            "device_name": info.name,
            "model": m.formats.json(),
            "load_s": m.load_s,
            "prefill_tokens_per_s": stats.prefill_tokens_per_s(),
            "decode_tokens_per_s": stats.decode_tokens_per_s(),
        });
        writeln!(stdout, "{out}")?;
    }
    Ok(())
}
