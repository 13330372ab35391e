//! Uploading the tensors of a layer range from a GGUF source to a device.

use super::ModelError;
use super::config::{ModelConfig, block_tensor};
use crate::backend::{Buffer, Device};
use crate::gguf::TensorSource;
use crate::quant::GgmlType;

/// A weight matrix on a device: `rows` rows of `cols` elements in GGUF's block layout.
pub struct Matrix {
    pub buf: Buffer,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
}

pub struct LayerWeights {
    pub attn_norm: Buffer,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    pub ffn_norm: Buffer,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
}

pub struct ShardWeights {
    /// First shard only.
    pub embed: Option<Matrix>,
    pub layers: Vec<LayerWeights>,
    /// Last shard only: the final norm, and the output matrix unless it is `embed` (tied).
    pub head: Option<(Buffer, Option<Matrix>)>,
}

impl ShardWeights {
    /// The output head's matrix, if this shard has the head.
    pub fn output(&self) -> Option<&Matrix> {
        let (_, out) = self.head.as_ref()?;
        out.as_ref().or(self.embed.as_ref())
    }
}

/// The tensors a shard over `[start, end)` needs, with `(name, rows, cols)` as expected.
pub fn shard_tensors(cfg: &ModelConfig, start: usize, end: usize) -> Vec<(String, usize, usize)> {
    let mut v = Vec::new();
    if start == 0 {
        v.push(("token_embd.weight".to_string(), cfg.vocab_size, cfg.dim));
    }
    for l in start..end {
        v.push((block_tensor(l, "attn_norm"), 1, cfg.dim));
        v.push((block_tensor(l, "attn_q"), cfg.q_dim(), cfg.dim));
        v.push((block_tensor(l, "attn_k"), cfg.kv_dim(), cfg.dim));
        v.push((block_tensor(l, "attn_v"), cfg.kv_dim(), cfg.dim));
        v.push((block_tensor(l, "attn_output"), cfg.dim, cfg.q_dim()));
        v.push((block_tensor(l, "ffn_norm"), 1, cfg.dim));
        v.push((block_tensor(l, "ffn_gate"), cfg.ffn_dim, cfg.dim));
        v.push((block_tensor(l, "ffn_up"), cfg.ffn_dim, cfg.dim));
        v.push((block_tensor(l, "ffn_down"), cfg.dim, cfg.ffn_dim));
    }
    if end == cfg.n_layers {
        v.push(("output_norm.weight".to_string(), 1, cfg.dim));
        let head = if cfg.tied_output {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        if start != 0 || !cfg.tied_output {
            v.push((head.to_string(), cfg.vocab_size, cfg.dim));
        }
    }
    v
}

/// Total bytes of the tensors a shard loads (weights only).
pub fn shard_weight_bytes(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    start: usize,
    end: usize,
) -> u64 {
    shard_tensors(cfg, start, end)
        .iter()
        .filter_map(|(n, _, _)| src.gguf().tensor(n).map(|t| t.n_bytes))
        .sum()
}

pub(crate) struct Loader<'a> {
    pub dev: &'a Device,
    pub src: &'a dyn TensorSource,
    pub progress: &'a mut dyn FnMut(u64, u64),
    pub done: u64,
    pub total: u64,
}

impl Loader<'_> {
    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<Matrix, ModelError> {
        let info = self.src.gguf().require_tensor(name)?.clone();
        let dims_ok =
            info.dims.len() == 2 && info.dims[0] as usize == cols && info.dims[1] as usize == rows;
        if !dims_ok {
            return Err(ModelError::BadShape(format!(
                "{name} has dims {:?}, expected [{cols}, {rows}]",
                info.dims
            )));
        }
        let buf = self.upload(name)?;
        Ok(Matrix {
            buf,
            ty: info.ty,
            rows,
            cols,
        })
    }

    /// A norm weight vector, always loaded as f32.
    pub fn vector(&mut self, name: &str, len: usize) -> Result<Buffer, ModelError> {
        let info = self.src.gguf().require_tensor(name)?.clone();
        if info.n_elements as usize != len {
            return Err(ModelError::BadShape(format!(
                "{name} has {} elements, expected {len}",
                info.n_elements
            )));
        }
        if info.ty == GgmlType::F32 {
            return self.upload(name);
        }
        let data = self.src.tensor_data(name)?;
        let mut v = vec![0f32; len];
        crate::quant::dequantize_row(info.ty, data, &mut v);
        self.done += info.n_bytes;
        (self.progress)(self.done, self.total);
        Ok(self.dev.upload(name, bytemuck::cast_slice(&v))?)
    }

    fn upload(&mut self, name: &str) -> Result<Buffer, ModelError> {
        let data = self.src.tensor_data(name)?;
        let buf = self.dev.upload(name, data)?;
        self.done += data.len() as u64;
        (self.progress)(self.done, self.total);
        Ok(buf)
    }
}

pub(crate) fn load(
    dev: &Device,
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    start: usize,
    end: usize,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ShardWeights, ModelError> {
    let total = shard_weight_bytes(src, cfg, start, end);
    let mut ld = Loader {
        dev,
        src,
        progress,
        done: 0,
        total,
    };
    let embed = if start == 0 {
        Some(ld.matrix("token_embd.weight", cfg.vocab_size, cfg.dim)?)
    } else {
        None
    };
    let mut layers = Vec::with_capacity(end - start);
    for l in start..end {
        let t = |p: &str| block_tensor(l, p);
        layers.push(LayerWeights {
            attn_norm: ld.vector(&t("attn_norm"), cfg.dim)?,
            wq: ld.matrix(&t("attn_q"), cfg.q_dim(), cfg.dim)?,
            wk: ld.matrix(&t("attn_k"), cfg.kv_dim(), cfg.dim)?,
            wv: ld.matrix(&t("attn_v"), cfg.kv_dim(), cfg.dim)?,
            wo: ld.matrix(&t("attn_output"), cfg.dim, cfg.q_dim())?,
            ffn_norm: ld.vector(&t("ffn_norm"), cfg.dim)?,
            w_gate: ld.matrix(&t("ffn_gate"), cfg.ffn_dim, cfg.dim)?,
            w_up: ld.matrix(&t("ffn_up"), cfg.ffn_dim, cfg.dim)?,
            w_down: ld.matrix(&t("ffn_down"), cfg.dim, cfg.ffn_dim)?,
        });
    }
    let head = if end == cfg.n_layers {
        let norm = ld.vector("output_norm.weight", cfg.dim)?;
        let out = if !cfg.tied_output {
            Some(ld.matrix("output.weight", cfg.vocab_size, cfg.dim)?)
        } else if embed.is_none() {
            Some(ld.matrix("token_embd.weight", cfg.vocab_size, cfg.dim)?)
        } else {
            None
        };
        Some((norm, out))
    } else {
        None
    };
    Ok(ShardWeights {
        embed,
        layers,
        head,
    })
}
