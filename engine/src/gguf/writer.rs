//! Builds GGUF v3 files, for tests and synthetic models.

use std::io::{self, Read, Write};

use super::limits::DEFAULT_ALIGNMENT;
use super::parse::*;
use super::value::Value;
use crate::quant::GgmlType;

/// Builds a GGUF v3 file: metadata in insertion order, tensors in insertion order, each
/// tensor's data aligned to `general.alignment` (32 unless set to another power of two).
///
/// ```
/// use cairn_engine::gguf::{BytesGguf, GgufWriter};
/// use cairn_engine::quant::GgmlType;
///
/// let bytes = GgufWriter::new()
///     .add("general.architecture", "llama")
///     .add_tensor("norm.weight", &[4], GgmlType::F32, vec![0u8; 16])
///     .finish();
/// let file = BytesGguf::new(bytes).unwrap();
/// assert_eq!(file.tensor_data("norm.weight").unwrap().len(), 16);
/// ```
#[derive(Debug, Clone, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets a metadata value; setting a key again replaces its value in place.
    ///
    /// # Panics
    /// If `value` is an array whose elements differ in type: GGUF arrays are homogeneous.
    pub fn add(&mut self, key: impl Into<String>, value: impl Into<Value>) -> &mut Self {
        let (key, value) = (key.into(), value.into());
        check_homogeneous(&key, &value);
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.metadata.push((key, value)),
        }
        self
    }

    /// Sets `general.alignment`.
    pub fn alignment(&mut self, alignment: u32) -> &mut Self {
        self.add("general.alignment", alignment)
    }

    /// Adds a tensor; `dims` in GGUF order (`dims[0]` is the row length).
    ///
    /// # Panics
    /// If `data` is not exactly the size of `dims` elements of `ty`.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: impl Into<Vec<u8>>,
    ) -> &mut Self {
        let (name, data) = (name.into(), data.into());
        let n: u64 = dims.iter().product();
        let expected = usize::try_from(n)
            .ok()
            .and_then(|n| ty.row_bytes(n))
            .filter(|_| !dims.is_empty());
        assert_eq!(
            expected,
            Some(data.len()),
            "tensor `{name}`: {} bytes given for dims {dims:?} of {}",
            data.len(),
            ty.name()
        );
        self.add_tensor_raw(name, dims, ty.id(), data)
    }

    /// Adds a tensor without checking anything, with any GGML type id: for files that
    /// exercise the reader's errors.
    pub fn add_tensor_raw(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        type_id: u32,
        data: impl Into<Vec<u8>>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            dims: dims.to_vec(),
            type_id,
            data: data.into(),
        });
        self
    }

    /// `general.alignment` when it is a valid one, else the default. An invalid value is
    /// still written, so that files exercising that error can be built.
    fn effective_alignment(&self) -> u64 {
        self.metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| alignment_of(v))
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Writes the file to `out` (streams tensor data rather than assembling a second copy).
    pub fn write_to(&self, mut out: impl Write) -> io::Result<()> {
        let alignment = self.effective_alignment();
        let mut header = Vec::new();
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut header, key);
            header.extend_from_slice(&type_id(value).to_le_bytes());
            put_value(&mut header, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            put_str(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.type_id.to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offset = (offset + t.data.len() as u64).next_multiple_of(alignment);
        }
        pad(&mut header, alignment);
        out.write_all(&header)?;
        for t in &self.tensors {
            out.write_all(&t.data)?;
            let rem = t.data.len() as u64 % alignment;
            if rem != 0 {
                io::copy(&mut io::repeat(0).take(alignment - rem), &mut out)?;
            }
        }
        Ok(())
    }

    /// The whole file in memory.
    pub fn finish(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = self.write_to(&mut out);
        out
    }
}

fn pad(buf: &mut Vec<u8>, alignment: u64) {
    let len = (buf.len() as u64).next_multiple_of(alignment);
    buf.resize(len as usize, 0);
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => T_U8,
        Value::I8(_) => T_I8,
        Value::U16(_) => T_U16,
        Value::I16(_) => T_I16,
        Value::U32(_) => T_U32,
        Value::I32(_) => T_I32,
        Value::U64(_) => T_U64,
        Value::I64(_) => T_I64,
        Value::F32(_) => T_F32,
        Value::F64(_) => T_F64,
        Value::Bool(_) => T_BOOL,
        Value::String(_) => T_STRING,
        Value::Array(_) => T_ARRAY,
    }
}

fn check_homogeneous(key: &str, v: &Value) {
    if let Value::Array(items) = v {
        if let Some(first) = items.first() {
            let ty = type_id(first);
            assert!(
                items.iter().all(|i| type_id(i) == ty),
                "metadata `{key}`: array elements must all have one type"
            );
        }
        items.iter().for_each(|i| check_homogeneous(key, i));
    }
}

fn put_value(buf: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(u8::from(*x)),
        Value::String(s) => put_str(buf, s),
        Value::Array(items) => {
            // An empty array's element type is not kept in `Value`; any type reads back the same.
            let ety = items.first().map_or(T_U8, type_id);
            buf.extend_from_slice(&ety.to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| put_value(buf, i));
        }
    }
}
