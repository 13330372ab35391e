//! Opening a device and loading a whole model onto it, with a progress bar.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use cairn_engine::gguf::MappedGguf;
use cairn_engine::model::Shard;
use cairn_engine::model::shard::max_batch_for;
use cairn_engine::tokenizer::Tokenizer;
use cairn_engine::{Device, Selection};

use crate::cmd::engine_args::EngineArgs;
use crate::cmd::formats::ModelFormats;

pub struct Loaded {
    pub device: Arc<Device>,
    /// The file's architecture and weight formats.
    pub formats: ModelFormats,
    pub shard: Shard,
    pub tokenizer: Tokenizer,
    pub load_s: f64,
}

#[derive(clap::Args, Clone, Debug)]
pub struct DeviceArgs {
    #[arg(long, help = backend_help())]
    pub backend: Option<String>,
    /// Device id from `cairn devices`; for a worker, several ids separated by commas (or
    /// `all`) split its layers over those devices of this host.
    #[arg(long)]
    pub device: Option<String>,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// `--backend`'s help names the backends this build has (cuda and vulkan are features).
fn backend_help() -> String {
    use cairn_engine::backend::BackendKind;
    let compiled: Vec<&str> = [
        BackendKind::Cuda,
        BackendKind::Vulkan,
        BackendKind::Wgpu,
        BackendKind::Cpu,
    ]
    .into_iter()
    .filter(|k| k.compiled())
    .map(BackendKind::name)
    .collect();
    format!(
        "Backend: {} (automatic when omitted: best GPU, else cpu; `cairn devices` lists them)",
        compiled.join(", ")
    )
}

impl DeviceArgs {
    pub fn selection(&self) -> Selection {
        Selection {
            backend: self.backend.clone(),
            device: self.device.clone(),
        }
    }
}

/// Every device `--device` names: a comma-separated list of ids (`cuda:0,cuda:1`; an id may
/// repeat, which opens that device again as a device of its own) or `all` (every device of
/// the chosen backend); otherwise the one device `--backend`/`--device` select.
pub fn open_devices(args: &DeviceArgs) -> Result<Vec<Arc<Device>>> {
    let Some(list) = args.device.as_deref() else {
        return Ok(vec![open_device(args)?]);
    };
    let found = cairn_engine::device::discover_blocking_with(args.engine.options());
    let ids: Vec<String> = if list == "all" {
        let kind = found.choose(&args.selection())?.backend;
        found
            .devices
            .iter()
            .filter(|d| d.backend == kind)
            .map(|d| d.id.clone())
            .collect()
    } else {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    if ids.len() <= 1 {
        return Ok(vec![open_device(args)?]);
    }
    let mut devices = Vec::with_capacity(ids.len());
    for id in ids {
        let sel = Selection {
            backend: args.backend.clone(),
            device: Some(id.clone()),
        };
        let dev = found
            .open_blocking(&sel)
            .with_context(|| format!("opening device {id} of --device {list}"))?;
        tracing::info!(device = %dev.info().id, name = %dev.info().name, backend = %dev.kind(), "device");
        devices.push(Arc::new(dev));
    }
    Ok(devices)
}

pub fn open_device(args: &DeviceArgs) -> Result<Arc<Device>> {
    let found = cairn_engine::device::discover_blocking_with(args.engine.options());
    let dev = found.open_blocking(&args.selection())?;
    tracing::info!(device = %dev.info().id, name = %dev.info().name, backend = %dev.kind(), "device");
    Ok(Arc::new(dev))
}

pub fn load(path: &Path, args: &DeviceArgs) -> Result<Loaded> {
    let t0 = Instant::now();
    let device = open_device(args)?;
    let file = MappedGguf::open(path).with_context(|| format!("opening {}", path.display()))?;
    let tokenizer = Tokenizer::from_spec(&file.file.tokenizer_spec()?)
        .with_context(|| format!("building the tokenizer of {}", path.display()))?;
    let n_layers = cairn_engine::model::ModelConfig::from_gguf(&file.file)?.n_layers;
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "loading {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(device.info().name.clone());
    let shard = Shard::load(
        device.clone(),
        &file,
        0,
        n_layers,
        max_batch_for(&device),
        &mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        },
    )?;
    // Weights are queued; wait so load time covers the upload.
    device.sync_blocking()?;
    bar.finish_and_clear();
    let formats = ModelFormats::of(&file.file);
    tracing::info!(
        architecture = %formats.architecture,
        formats = %formats.formats_line(),
        load_s = format!("{:.2}", t0.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(Loaded {
        device,
        formats,
        shard,
        tokenizer,
        load_s: t0.elapsed().as_secs_f64(),
    })
}
