//! Whole-model conversion: every tensor of a GGUF file to the type [`tensor_type`] gives it
//! for the chosen [`FileType`], metadata copied with `general.file_type` set. Rows are
//! dequantized to f32 and quantized again, spread over threads by rows; tensors already of
//! their target type are copied unchanged.

use super::GgmlType;
use super::quantize::quantize_row_best;
use super::quantize_mix::{FileType, ModelShape, tensor_type};
use crate::gguf::{GgufError, GgufWriter, TensorInfo, TensorSource, Value};

#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error("model file: {0}")]
    Gguf(#[from] GgufError),
    #[error(
        "tensor {name} is already quantized ({ty}); requantizing loses precision, pass --allow-requantize to do it anyway"
    )]
    Requantize { name: String, ty: &'static str },
    #[error("tensor {name}: {why}")]
    BadTensor { name: String, why: String },
}

#[derive(Debug, Clone, Copy)]
pub struct QuantizeOptions {
    pub file_type: FileType,
    /// Quantize sources that are already quantized (other than Q8_0), as llama-quantize's
    /// `--allow-requantize` does.
    pub allow_requantize: bool,
    /// Worker threads; 0 means one per available core.
    pub threads: usize,
}

/// Progress of a conversion: tensors done of the total, the one just done and its new type.
pub struct Progress<'a> {
    pub done: usize,
    pub total: usize,
    pub name: &'a str,
    pub ty: GgmlType,
}

/// The target type of every tensor of `src`, in file order.
pub fn plan(
    src: &dyn TensorSource,
    file_type: FileType,
) -> Result<Vec<(String, GgmlType)>, QuantizeError> {
    let file = src.gguf();
    let arch = file.architecture()?;
    let n_layers = file.metadata.get_u32(&format!("{arch}.block_count"))? as usize;
    let shape = ModelShape {
        n_layers,
        tied_output: file.tensor("output.weight").is_none(),
    };
    Ok(file
        .tensors
        .iter()
        .map(|t| {
            let ty = tensor_type(file_type, shape, &t.name, &t.dims).unwrap_or(t.ty);
            (t.name.clone(), ty)
        })
        .collect())
}

/// Converts `src` into a GGUF file of `opts.file_type`, ready to write.
pub fn quantize_model(
    src: &dyn TensorSource,
    opts: &QuantizeOptions,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<GgufWriter, QuantizeError> {
    let file = src.gguf();
    let plan = plan(src, opts.file_type)?;
    for (t, (_, ty)) in file.tensors.iter().zip(&plan) {
        let requantizes = !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0);
        if *ty != t.ty && requantizes && !opts.allow_requantize {
            return Err(QuantizeError::Requantize {
                name: t.name.clone(),
                ty: t.ty.name(),
            });
        }
    }
    let mut out = GgufWriter::new();
    for (key, value) in file.metadata.iter() {
        out.add(key, value.clone());
    }
    out.add("general.file_type", Value::U32(opts.file_type.gguf_id()));
    out.add("general.quantization_version", Value::U32(2));
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let total = plan.len();
    for (done, (t, (name, ty))) in file.tensors.iter().zip(&plan).enumerate() {
        let data = src.tensor_data(name)?;
        let bytes = if *ty == t.ty {
            data.to_vec()
        } else {
            convert(t, data, *ty, threads)?
        };
        out.add_tensor(name.clone(), &t.dims, *ty, bytes);
        progress(Progress {
            done: done + 1,
            total,
            name,
            ty: *ty,
        });
    }
    Ok(out)
}

/// One tensor's rows from `t.ty` to `ty`.
fn convert(
    t: &TensorInfo,
    data: &[u8],
    ty: GgmlType,
    threads: usize,
) -> Result<Vec<u8>, QuantizeError> {
    let bad = |why: String| QuantizeError::BadTensor {
        name: t.name.clone(),
        why,
    };
    let row_len = usize::try_from(t.row_len()).map_err(|_| bad("row too long".into()))?;
    let in_row = t.row_bytes() as usize;
    let out_row = ty.row_bytes(row_len).ok_or_else(|| {
        bad(format!(
            "rows of {row_len} are not whole {} blocks",
            ty.name()
        ))
    })?;
    let rows = t.n_rows() as usize;
    if in_row == 0 || data.len() != in_row * rows {
        return Err(bad(format!(
            "{} bytes of data for {rows} rows of {in_row}",
            data.len()
        )));
    }
    let mut out = vec![0u8; out_row * rows];
    let per = rows.div_ceil(threads.max(1)).max(1);
    let work = |src: &[u8], dst: &mut [u8]| {
        let mut x = vec![0f32; row_len];
        for (i, o) in src.chunks_exact(in_row).zip(dst.chunks_exact_mut(out_row)) {
            super::dequantize_row(t.ty, i, &mut x);
            o.copy_from_slice(&quantize_row_best(ty, &x));
        }
    };
    if threads <= 1 || rows < 2 {
        work(data, &mut out);
    } else {
        std::thread::scope(|s| {
            for (src, dst) in data.chunks(per * in_row).zip(out.chunks_mut(per * out_row)) {
                s.spawn(move || work(src, dst));
            }
        });
    }
    Ok(out)
}
