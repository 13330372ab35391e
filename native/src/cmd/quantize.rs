//! `cairn quantize IN OUT TYPE`: writes a GGUF file of another weight format, with the
//! per-tensor types llama-quantize would choose (see `cairn_engine::quant::tensor_type`).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, anyhow};
use cairn_engine::gguf::MappedGguf;
use cairn_engine::quant::{FileType, QuantizeOptions, quantize_model};

#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file to read (F32, F16 or Q8_0 weights; others with --allow-requantize).
    input: PathBuf,
    /// The GGUF file to write.
    output: PathBuf,
    /// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K_S, Q4_K_M (or Q4_K), Q5_K_S, Q5_K_M (or Q5_K), Q6_K.
    #[arg(value_name = "TYPE")]
    file_type: String,
    /// Quantize tensors that are already quantized below Q8_0 (loses precision).
    #[arg(long)]
    allow_requantize: bool,
    /// Worker threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

pub fn run(a: Args) -> Result<()> {
    let file_type = FileType::parse(&a.file_type).ok_or_else(|| {
        anyhow!(
            "'{}' is not a type cairn quantize writes; choose one of {}",
            a.file_type,
            FileType::names()
        )
    })?;
    let src =
        MappedGguf::open(&a.input).with_context(|| format!("reading {}", a.input.display()))?;
    let opts = QuantizeOptions {
        file_type,
        allow_requantize: a.allow_requantize,
        threads: a.threads,
    };
    let t0 = std::time::Instant::now();
    let mut stderr = std::io::stderr();
    let writer = quantize_model(&src, &opts, &mut |p| {
        // One line rewritten in place; errors writing progress are not worth failing for.
        let _ = write!(
            stderr,
            "\r[{:>4}/{}] {:<40} {:<5}",
            p.done,
            p.total,
            p.name,
            p.ty.name()
        );
        let _ = stderr.flush();
    })?;
    eprintln!();
    let out = std::fs::File::create(&a.output)
        .with_context(|| format!("creating {}", a.output.display()))?;
    let mut buf = std::io::BufWriter::new(out);
    writer
        .write_to(&mut buf)
        .and_then(|()| buf.flush())
        .with_context(|| format!("writing {}", a.output.display()))?;
    let size = std::fs::metadata(&a.output).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "wrote {} ({}, {:.1} MiB) in {:.1} s",
        a.output.display(),
        file_type.name(),
        size as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
