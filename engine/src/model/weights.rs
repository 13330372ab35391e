//! Uploading the tensors of a layer range from a GGUF source to a device.

use std::ops::Range;

use super::ModelError;
use super::config::{ModelConfig, ROPE_FREQS, block_bias, block_tensor};
use super::tensor_split::TensorPart;
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
    /// Q, K and V biases, where the family has them.
    pub qkv_bias: Option<[Buffer; 3]>,
    /// Per-head Q and K norm weights (`head_dim` each), where the family has them.
    pub qk_norm: Option<[Buffer; 2]>,
    pub wo: Matrix,
    pub ffn_norm: Buffer,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
    /// Gemma's norms of the attention's and the FFN's outputs (`post_attention_norm`,
    /// `post_ffw_norm`).
    pub post_norms: Option<[Buffer; 2]>,
}

pub struct ShardWeights {
    /// First shard only.
    pub embed: Option<Matrix>,
    /// RoPE frequency divisors (`rope_dim / 2`), where the model has them.
    pub rope_freqs: Option<Buffer>,
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

/// The tensors a shard over `[start, end)` needs, with `(name, rows, cols)` as expected
/// (vectors as one row). Fused tensors are listed whole: the loader splits them.
pub fn shard_tensors(cfg: &ModelConfig, start: usize, end: usize) -> Vec<(String, usize, usize)> {
    let mut v = Vec::new();
    if start == 0 {
        v.push(("token_embd.weight".to_string(), cfg.vocab_size, cfg.dim));
    }
    if cfg.rope_freqs && start < end {
        v.push((ROPE_FREQS.to_string(), 1, cfg.rope_dim / 2));
    }
    let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
    for l in start..end {
        v.push((block_tensor(l, "attn_norm"), 1, cfg.dim));
        if cfg.fused_qkv {
            v.push((block_tensor(l, "attn_qkv"), q + 2 * kv, cfg.dim));
            if cfg.qkv_bias {
                v.push((block_bias(l, "attn_qkv"), 1, q + 2 * kv));
            }
        } else {
            for (part, rows) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                v.push((block_tensor(l, part), rows, cfg.dim));
            }
            if cfg.qkv_bias {
                for (part, rows) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                    v.push((block_bias(l, part), 1, rows));
                }
            }
        }
        if cfg.qk_norm {
            v.push((block_tensor(l, "attn_q_norm"), 1, cfg.head_dim));
            v.push((block_tensor(l, "attn_k_norm"), 1, cfg.head_dim));
        }
        v.push((block_tensor(l, "attn_output"), cfg.dim, q));
        v.push((block_tensor(l, "ffn_norm"), 1, cfg.dim));
        if cfg.fused_gate_up {
            v.push((block_tensor(l, "ffn_up"), 2 * cfg.ffn_dim, cfg.dim));
        } else {
            v.push((block_tensor(l, "ffn_gate"), cfg.ffn_dim, cfg.dim));
            v.push((block_tensor(l, "ffn_up"), cfg.ffn_dim, cfg.dim));
        }
        v.push((block_tensor(l, "ffn_down"), cfg.dim, cfg.ffn_dim));
        if cfg.family.gemma() {
            v.push((block_tensor(l, "post_attention_norm"), 1, cfg.dim));
            v.push((block_tensor(l, "post_ffw_norm"), 1, cfg.dim));
        }
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
        Ok(self.matrix_parts(name, cols, &[rows])?.remove(0))
    }

    /// Tensor `name` of `cols` columns whose rows are the consecutive parts `rows` (a fused
    /// tensor), one matrix per part: whole rows are whole blocks, so each part is a plain
    /// byte range of the tensor.
    pub fn matrix_parts(
        &mut self,
        name: &str,
        cols: usize,
        rows: &[usize],
    ) -> Result<Vec<Matrix>, ModelError> {
        let mut ranges = Vec::with_capacity(rows.len());
        let mut at = 0;
        for &r in rows {
            ranges.push(at..at + r);
            at += r;
        }
        self.matrix_rows(name, cols, at, &ranges)
    }

    /// The row ranges `ranges` of tensor `name` (`total` rows of `cols` columns), one matrix
    /// each: whole rows are whole blocks, so each is a plain byte range of the tensor.
    pub fn matrix_rows(
        &mut self,
        name: &str,
        cols: usize,
        total: usize,
        ranges: &[Range<usize>],
    ) -> Result<Vec<Matrix>, ModelError> {
        let info = self.src.gguf().require_tensor(name)?.clone();
        let dims_ok =
            info.dims.len() == 2 && info.dims[0] as usize == cols && info.dims[1] as usize == total;
        let row_bytes = info.ty.row_bytes(cols);
        let (true, Some(row_bytes)) = (dims_ok, row_bytes) else {
            return Err(ModelError::BadShape(format!(
                "{name} has dims {:?} of {:?}, expected [{cols}, {total}]",
                info.dims, info.ty
            )));
        };
        let data = self.src.tensor_data(name)?;
        let mut out = Vec::with_capacity(ranges.len());
        for r in ranges {
            let part = data
                .get(r.start * row_bytes..r.end * row_bytes)
                .filter(|_| r.start < r.end && r.end <= total)
                .ok_or_else(|| {
                    ModelError::BadShape(format!("rows {r:?} of {name} ({total} rows)"))
                })?;
            out.push(Matrix {
                buf: self
                    .dev
                    .upload_weights(name, part, info.ty, row_bytes as u64)?,
                ty: info.ty,
                rows: r.len(),
                cols,
            });
        }
        self.done += data.len() as u64;
        (self.progress)(self.done, self.total);
        Ok(out)
    }

    /// Columns `range` of every row of tensor `name` (`rows` × `cols`), as one matrix of
    /// `range.len()` columns. A quantized row is a run of blocks whose elements share scales,
    /// so the range must start and end on the format's block boundaries.
    pub fn matrix_cols(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        range: Range<usize>,
    ) -> Result<Matrix, ModelError> {
        if range == (0..cols) {
            return self.matrix(name, rows, cols);
        }
        let info = self.src.gguf().require_tensor(name)?.clone();
        let dims_ok =
            info.dims.len() == 2 && info.dims[0] as usize == cols && info.dims[1] as usize == rows;
        let sizes = (
            info.ty.row_bytes(cols),
            info.ty.row_bytes(range.start),
            info.ty.row_bytes(range.len()),
        );
        let (Some(row_bytes), Some(skip), Some(take)) = sizes else {
            return Err(ModelError::BadShape(format!(
                "columns {range:?} of {name} do not fall on {} block boundaries ({} elements)",
                info.ty.name(),
                info.ty.block_len()
            )));
        };
        if !dims_ok || range.is_empty() || range.end > cols {
            return Err(ModelError::BadShape(format!(
                "columns {range:?} of {name}, whose dims are {:?} (expected [{cols}, {rows}])",
                info.dims
            )));
        }
        let data = self.src.tensor_data(name)?;
        if data.len() < rows * row_bytes {
            return Err(ModelError::BadShape(format!(
                "{name} is shorter than its dims"
            )));
        }
        let mut part = Vec::with_capacity(rows * take);
        for r in 0..rows {
            let at = r * row_bytes + skip;
            part.extend_from_slice(&data[at..at + take]);
        }
        self.done += data.len() as u64;
        (self.progress)(self.done, self.total);
        Ok(Matrix {
            buf: self.dev.upload_weights(name, &part, info.ty, take as u64)?,
            ty: info.ty,
            rows,
            cols: range.len(),
        })
    }

    /// A norm weight or bias vector, always loaded as f32.
    pub fn vector(&mut self, name: &str, len: usize) -> Result<Buffer, ModelError> {
        Ok(self.vector_parts(name, &[len])?.remove(0))
    }

    /// Vector `name` cut into consecutive parts of the lengths `lens` (a fused bias).
    pub fn vector_parts(&mut self, name: &str, lens: &[usize]) -> Result<Vec<Buffer>, ModelError> {
        let mut ranges = Vec::with_capacity(lens.len());
        let mut at = 0;
        for &n in lens {
            ranges.push(at..at + n);
            at += n;
        }
        self.vector_ranges(name, at, &ranges)
    }

    /// The ranges `ranges` of vector `name` of `len` elements.
    pub fn vector_ranges(
        &mut self,
        name: &str,
        len: usize,
        ranges: &[Range<usize>],
    ) -> Result<Vec<Buffer>, ModelError> {
        let info = self.src.gguf().require_tensor(name)?.clone();
        let len_ok = info.n_elements as usize == len && info.ty.row_bytes(len).is_some();
        if !len_ok {
            return Err(ModelError::BadShape(format!(
                "{name} has {} elements of {:?}, expected {len}",
                info.n_elements, info.ty
            )));
        }
        let data = self.src.tensor_data(name)?;
        let mut v = vec![0f32; len];
        if info.ty == GgmlType::F32 {
            let src = data
                .get(..len * 4)
                .ok_or_else(|| ModelError::BadShape(format!("{name} is shorter than its dims")))?;
            for (o, c) in v.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        } else {
            crate::quant::dequantize_row(info.ty, data, &mut v);
        }
        self.done += info.n_bytes;
        (self.progress)(self.done, self.total);
        let mut out = Vec::with_capacity(ranges.len());
        for r in ranges {
            let part = v.get(r.clone()).ok_or_else(|| {
                ModelError::BadShape(format!("elements {r:?} of {name} ({len} elements)"))
            })?;
            out.push(self.dev.upload(name, bytemuck::cast_slice(part))?);
        }
        Ok(out)
    }
}

pub(crate) fn load(
    dev: &Device,
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    start: usize,
    end: usize,
    part: Option<&TensorPart>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ShardWeights, ModelError> {
    let total = shard_weight_bytes(src, cfg, start, end);
    // Of a tensor split, the first part holds the embedding and the head.
    let ends = part.is_none_or(|p| p.ends);
    let mut ld = Loader {
        dev,
        src,
        progress,
        done: 0,
        total,
    };
    let embed = if start == 0 && ends {
        Some(ld.matrix("token_embd.weight", cfg.vocab_size, cfg.dim)?)
    } else {
        None
    };
    let rope_freqs = if cfg.rope_freqs {
        Some(ld.vector(ROPE_FREQS, cfg.rope_dim / 2)?)
    } else {
        None
    };
    let mut layers = Vec::with_capacity(end - start);
    for l in start..end {
        layers.push(load_layer(&mut ld, cfg, l, part)?);
    }
    let head = if end == cfg.n_layers && ends {
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
        rope_freqs,
        layers,
        head,
    })
}

/// Loads block `l`, or with `part` that part's rows of Q, K, V, gate and up and its columns
/// of the output and down products.
fn load_layer(
    ld: &mut Loader<'_>,
    cfg: &ModelConfig,
    l: usize,
    part: Option<&TensorPart>,
) -> Result<LayerWeights, ModelError> {
    let t = |p: &str| block_tensor(l, p);
    let (q, kv, dim, ffn) = (cfg.q_dim(), cfg.kv_dim(), cfg.dim, cfg.ffn_dim);
    // This part's rows of Q (its query heads), of K and V (its key/value heads) and of the
    // feed-forward products.
    let (qr, kr, fr) = match part {
        None => (0..q, 0..kv, 0..ffn),
        Some(p) => (p.q_rows(cfg), p.kv_rows(cfg), p.ffn.clone()),
    };
    let shift = |r: &Range<usize>, by: usize| r.start + by..r.end + by;
    let attn_norm = ld.vector(&t("attn_norm"), dim)?;
    let [wq, wk, wv] = if cfg.fused_qkv {
        let ranges = [qr.clone(), shift(&kr, q), shift(&kr, q + kv)];
        three(ld.matrix_rows(&t("attn_qkv"), dim, q + 2 * kv, &ranges)?)?
    } else {
        let mut one = |name: &str, total: usize, r: &Range<usize>| {
            ld.matrix_rows(name, dim, total, std::slice::from_ref(r))
                .map(|mut v| v.remove(0))
        };
        [
            one(&t("attn_q"), q, &qr)?,
            one(&t("attn_k"), kv, &kr)?,
            one(&t("attn_v"), kv, &kr)?,
        ]
    };
    let qkv_bias = match (cfg.qkv_bias, cfg.fused_qkv) {
        (false, _) => None,
        (true, true) => Some(three(ld.vector_ranges(
            &block_bias(l, "attn_qkv"),
            q + 2 * kv,
            &[qr.clone(), shift(&kr, q), shift(&kr, q + kv)],
        )?)?),
        (true, false) => {
            let mut one = |part: &str, len: usize, r: &Range<usize>| {
                ld.vector_ranges(&block_bias(l, part), len, std::slice::from_ref(r))
                    .map(|mut v| v.remove(0))
            };
            Some([
                one("attn_q", q, &qr)?,
                one("attn_k", kv, &kr)?,
                one("attn_v", kv, &kr)?,
            ])
        }
    };
    let qk_norm = if cfg.qk_norm {
        Some([
            ld.vector(&t("attn_q_norm"), cfg.head_dim)?,
            ld.vector(&t("attn_k_norm"), cfg.head_dim)?,
        ])
    } else {
        None
    };
    let wo = ld.matrix_cols(&t("attn_output"), dim, q, qr.clone())?;
    let ffn_norm = ld.vector(&t("ffn_norm"), dim)?;
    let (w_gate, w_up) = if cfg.fused_gate_up {
        let ranges = [fr.clone(), shift(&fr, ffn)];
        let mut parts = ld.matrix_rows(&t("ffn_up"), dim, 2 * ffn, &ranges)?;
        let up = parts.pop();
        let gate = parts.pop();
        match (gate, up) {
            (Some(g), Some(u)) => (g, u),
            _ => return Err(ModelError::BadShape("fused gate/up did not split".into())),
        }
    } else {
        let mut one = |name: &str| {
            ld.matrix_rows(name, dim, ffn, std::slice::from_ref(&fr))
                .map(|mut v| v.remove(0))
        };
        (one(&t("ffn_gate"))?, one(&t("ffn_up"))?)
    };
    Ok(LayerWeights {
        attn_norm,
        wq,
        wk,
        wv,
        qkv_bias,
        qk_norm,
        wo,
        ffn_norm,
        w_gate,
        w_up,
        w_down: ld.matrix_cols(&t("ffn_down"), dim, ffn, fr)?,
        post_norms: if cfg.family.gemma() {
            Some([
                ld.vector(&t("post_attention_norm"), dim)?,
                ld.vector(&t("post_ffw_norm"), dim)?,
            ])
        } else {
            None
        },
    })
}

fn three<T>(v: Vec<T>) -> Result<[T; 3], ModelError> {
    v.try_into()
        .map_err(|_| ModelError::BadShape("a fused tensor did not split in three".into()))
}
