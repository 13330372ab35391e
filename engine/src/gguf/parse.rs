//! The header parser. Every length and count in the file is untrusted: each is checked
//! against a fixed limit and, where the file's length is known, against the bytes left,
//! before anything is allocated for it; vectors of variable-sized items grow as items are
//! actually read.

use std::collections::HashSet;

use super::limits::*;
use super::value::{Metadata, Value};
use super::{GgufError, GgufFile, TensorInfo};
use crate::quant::GgmlType;

pub(crate) const MAGIC: &[u8; 4] = b"GGUF";

// Metadata value type ids, as GGUF numbers them.
pub(crate) const T_U8: u32 = 0;
pub(crate) const T_I8: u32 = 1;
pub(crate) const T_U16: u32 = 2;
pub(crate) const T_I16: u32 = 3;
pub(crate) const T_U32: u32 = 4;
pub(crate) const T_I32: u32 = 5;
pub(crate) const T_F32: u32 = 6;
pub(crate) const T_BOOL: u32 = 7;
pub(crate) const T_STRING: u32 = 8;
pub(crate) const T_ARRAY: u32 = 9;
pub(crate) const T_U64: u32 = 10;
pub(crate) const T_I64: u32 = 11;
pub(crate) const T_F64: u32 = 12;

/// Smallest encodings, used to reject counts the remaining bytes cannot possibly hold:
/// a key/value pair is an empty key (8-byte length), a type (4) and a 1-byte value; a tensor
/// info is an empty name (8), a dim count (4), one dim (8), a type (4) and an offset (8).
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;
const MIN_STRING_BYTES: u64 = 8;
const MIN_ARRAY_BYTES: u64 = 4 + 8;

/// Byte size of a fixed-size value type; `None` for strings, arrays and unknown ids.
fn fixed_size(ty: u32) -> Option<u64> {
    match ty {
        T_U8 | T_I8 | T_BOOL => Some(1),
        T_U16 | T_I16 => Some(2),
        T_U32 | T_I32 | T_F32 => Some(4),
        T_U64 | T_I64 | T_F64 => Some(8),
        _ => None,
    }
}

/// `general.alignment` as a usable alignment, or `None` if it is not a power of two up to
/// `MAX_ALIGNMENT`.
pub(crate) fn alignment_of(v: &Value) -> Option<u64> {
    let a = u64::try_from(v.as_i128()?).ok()?;
    (a.is_power_of_two() && a <= MAX_ALIGNMENT).then_some(a)
}

struct Reader<'a> {
    /// The bytes we have, never longer than the file.
    buf: &'a [u8],
    pos: usize,
    /// The whole file's length when known; decides between `Truncated` and `NeedMoreBytes`.
    file_len: Option<u64>,
    /// Array elements read so far, across all keys.
    values: u64,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], file_len: Option<u64>) -> Self {
        let have = match file_len {
            Some(len) => usize::try_from(len).map_or(bytes.len(), |l| l.min(bytes.len())),
            None => bytes.len(),
        };
        Reader {
            buf: bytes.get(..have).unwrap_or(bytes),
            pos: 0,
            file_len,
            values: 0,
        }
    }

    fn offset(&self) -> u64 {
        self.pos as u64
    }

    /// Bytes left in the file, when its length is known.
    fn remaining(&self) -> Option<u64> {
        self.file_len.map(|len| len.saturating_sub(self.offset()))
    }

    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8], GgufError> {
        let rest = self.buf.get(self.pos..).unwrap_or_default();
        match usize::try_from(n) {
            Ok(n) if n <= rest.len() => {
                self.pos += n;
                Ok(&rest[..n])
            }
            _ => Err(self.short(n, what)),
        }
    }

    fn short(&self, n: u64, what: impl FnOnce() -> String) -> GgufError {
        let offset = self.offset();
        let end = offset.saturating_add(n);
        match self.file_len {
            Some(len) if end > len => GgufError::Truncated {
                what: what(),
                offset,
                needed: n,
                available: len.saturating_sub(offset),
            },
            _ => GgufError::NeedMoreBytes {
                needed_at_least: end,
            },
        }
    }

    fn bytes<const N: usize>(
        &mut self,
        what: impl FnOnce() -> String,
    ) -> Result<[u8; N], GgufError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: impl FnOnce() -> String) -> Result<u32, GgufError> {
        self.bytes(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: impl FnOnce() -> String) -> Result<u64, GgufError> {
        self.bytes(what).map(u64::from_le_bytes)
    }

    /// Rejects `count` items of at least `min_bytes` each when the limit or the bytes left
    /// in the file rule it out, so that a corrupt count fails here and not after a long loop.
    fn check_count(
        &self,
        count: u64,
        min_bytes: u64,
        limit: u64,
        at: u64,
        what: impl Fn() -> String,
    ) -> Result<(), GgufError> {
        if count > limit {
            return Err(GgufError::TooLarge {
                what: what(),
                offset: at,
                value: count,
                limit,
            });
        }
        let needed = count.saturating_mul(min_bytes);
        match self.remaining() {
            Some(available) if needed > available => Err(GgufError::Truncated {
                what: format!("{} ({count} items of at least {min_bytes} bytes)", what()),
                offset: self.offset(),
                needed,
                available,
            }),
            _ => Ok(()),
        }
    }

    fn string(&mut self, limit: u64, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let at = self.offset();
        let len = self.u64(|| format!("length of {}", what()))?;
        if len > limit {
            return Err(GgufError::TooLarge {
                what: format!("length of {}", what()),
                offset: at,
                value: len,
                limit,
            });
        }
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError::BadUtf8 {
                what: what(),
                offset: at + 8 + e.valid_up_to() as u64,
            }),
        }
    }

    fn value(&mut self, ty: u32, ty_at: u64, key: &str, depth: u32) -> Result<Value, GgufError> {
        let what = || format!("value of `{key}`");
        if let Some(size) = fixed_size(ty) {
            let at = self.offset();
            let bytes = self.take(size, what)?;
            return decode_fixed(ty, bytes, key, at);
        }
        match ty {
            T_STRING => Ok(Value::String(self.string(MAX_STRING_LEN, &what)?)),
            T_ARRAY => self.array(key, depth),
            _ => Err(GgufError::UnknownValueType {
                type_id: ty,
                key: key.to_owned(),
                offset: ty_at,
            }),
        }
    }

    fn array(&mut self, key: &str, depth: u32) -> Result<Value, GgufError> {
        let at = self.offset();
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep {
                key: key.to_owned(),
                offset: at,
                limit: MAX_ARRAY_DEPTH,
            });
        }
        let ety = self.u32(|| format!("element type of array `{key}`"))?;
        let count_at = self.offset();
        let count = self.u64(|| format!("length of array `{key}`"))?;
        let what = || format!("length of array `{key}`");
        let min_bytes = match (fixed_size(ety), ety) {
            (Some(size), _) => size,
            (None, T_STRING) => MIN_STRING_BYTES,
            (None, T_ARRAY) => MIN_ARRAY_BYTES,
            (None, _) => {
                return Err(GgufError::UnknownValueType {
                    type_id: ety,
                    key: key.to_owned(),
                    offset: at,
                });
            }
        };
        self.check_count(count, min_bytes, MAX_ARRAY_LEN, count_at, what)?;
        self.values = self.values.saturating_add(count);
        if self.values > MAX_METADATA_VALUES {
            return Err(GgufError::TooLarge {
                what: format!("total count of metadata array elements, reached in `{key}`"),
                offset: count_at,
                value: self.values,
                limit: MAX_METADATA_VALUES,
            });
        }

        if let Some(size) = fixed_size(ety) {
            // Fixed-size elements: the whole array must be present before decoding, so the
            // vector below is sized by bytes we hold, not by the count alone.
            let data_at = self.offset();
            let bytes = self.take(count * size, || format!("elements of array `{key}`"))?;
            let items = bytes
                .chunks_exact(size as usize)
                .enumerate()
                .map(|(i, b)| decode_fixed(ety, b, key, data_at + i as u64 * size))
                .collect::<Result<Vec<_>, _>>()?;
            return Ok(Value::Array(items));
        }

        let mut items = Vec::with_capacity(count.min(INITIAL_CAPACITY) as usize);
        for i in 0..count {
            items.push(if ety == T_STRING {
                Value::String(self.string(MAX_STRING_LEN, &|| format!("element {i} of `{key}`"))?)
            } else {
                self.array(key, depth + 1)?
            });
        }
        Ok(Value::Array(items))
    }
}

fn decode_fixed(ty: u32, b: &[u8], key: &str, at: u64) -> Result<Value, GgufError> {
    fn arr<const N: usize>(b: &[u8]) -> [u8; N] {
        let mut out = [0; N];
        out.copy_from_slice(&b[..N]);
        out
    }
    // `b` has exactly fixed_size(ty) bytes, taken by the caller.
    Ok(match ty {
        T_U8 => Value::U8(b[0]),
        T_I8 => Value::I8(b[0] as i8),
        T_BOOL => match b[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            value => {
                return Err(GgufError::BadBool {
                    key: key.to_owned(),
                    offset: at,
                    value,
                });
            }
        },
        T_U16 => Value::U16(u16::from_le_bytes(arr(b))),
        T_I16 => Value::I16(i16::from_le_bytes(arr(b))),
        T_U32 => Value::U32(u32::from_le_bytes(arr(b))),
        T_I32 => Value::I32(i32::from_le_bytes(arr(b))),
        T_F32 => Value::F32(f32::from_le_bytes(arr(b))),
        T_U64 => Value::U64(u64::from_le_bytes(arr(b))),
        T_I64 => Value::I64(i64::from_le_bytes(arr(b))),
        T_F64 => Value::F64(f64::from_le_bytes(arr(b))),
        _ => {
            return Err(GgufError::UnknownValueType {
                type_id: ty,
                key: key.to_owned(),
                offset: at,
            });
        }
    })
}

/// Element count and byte size of a tensor, checking the dims against its type.
fn tensor_size(name: &str, dims: &[u64], ty: GgmlType) -> Result<(u64, u64), GgufError> {
    let bad = |reason: String| GgufError::BadDims {
        tensor: name.to_owned(),
        dims: dims.to_vec(),
        reason,
    };
    if dims.contains(&0) {
        return Err(bad("a dimension is zero".to_owned()));
    }
    let block_len = ty.block_len() as u64;
    let row = dims.first().copied().unwrap_or(0);
    if !row.is_multiple_of(block_len) {
        return Err(bad(format!(
            "row length {row} is not a multiple of the {} block length {block_len}",
            ty.name()
        )));
    }
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= i64::MAX as u64)
        .ok_or_else(|| bad("element count overflows i64".to_owned()))?;
    let n_bytes = (n_elements / block_len)
        .checked_mul(ty.block_bytes() as u64)
        .ok_or_else(|| bad("byte size overflows u64".to_owned()))?;
    Ok((n_elements, n_bytes))
}

pub(crate) fn parse(bytes: &[u8], file_len: Option<u64>) -> Result<GgufFile, GgufError> {
    let mut r = Reader::new(bytes, file_len);

    // Compare whatever part of the magic we have, so a wrong file fails at once even from a
    // tiny prefix.
    let head = &r.buf[..r.buf.len().min(4)];
    if head != &MAGIC[..head.len()] {
        return Err(GgufError::BadMagic {
            found: head.to_vec(),
        });
    }
    r.take(4, || "magic".to_owned())?;

    let version = r.u32(|| "version".to_owned())?;
    match version {
        2 | 3 => {}
        v if (1..=3).contains(&v.swap_bytes()) => {
            return Err(GgufError::BigEndian { version: v });
        }
        v => return Err(GgufError::UnsupportedVersion { version: v }),
    }

    let tensor_count_at = r.offset();
    let tensor_count = r.u64(|| "tensor count".to_owned())?;
    let kv_count_at = r.offset();
    let kv_count = r.u64(|| "metadata entry count".to_owned())?;
    r.check_count(kv_count, MIN_KV_BYTES, MAX_KV_COUNT, kv_count_at, || {
        "metadata entry count".to_owned()
    })?;
    r.check_count(
        tensor_count,
        MIN_TENSOR_INFO_BYTES,
        MAX_TENSOR_COUNT,
        tensor_count_at,
        || "tensor count".to_owned(),
    )?;

    let mut metadata = Metadata::new();
    for i in 0..kv_count {
        let at = r.offset();
        let key = r.string(MAX_NAME_LEN, &|| format!("key of metadata entry {i}"))?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey { key, offset: at });
        }
        let ty_at = r.offset();
        let ty = r.u32(|| format!("value type of `{key}`"))?;
        let value = r.value(ty, ty_at, &key, 0)?;
        metadata.0.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => alignment_of(v).ok_or_else(|| GgufError::BadAlignment {
            value: format!("{v:?}"),
        })?,
    };

    let mut tensors = Vec::with_capacity(tensor_count.min(INITIAL_CAPACITY) as usize);
    let mut names = HashSet::new();
    for i in 0..tensor_count {
        let at = r.offset();
        let name = r.string(MAX_NAME_LEN, &|| format!("name of tensor info {i}"))?;
        if !names.insert(name.clone()) {
            return Err(GgufError::DuplicateTensor { name, offset: at });
        }
        let n_dims_at = r.offset();
        let n_dims = r.u32(|| format!("dimension count of tensor `{name}`"))?;
        if !(1..=MAX_DIMS).contains(&n_dims) {
            return Err(GgufError::BadDims {
                tensor: name,
                dims: Vec::new(),
                reason: format!(
                    "dimension count {n_dims} at byte {n_dims_at}; 1 to {MAX_DIMS} are supported"
                ),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(r.u64(|| format!("dimension {d} of tensor `{name}`"))?);
        }
        let type_id = r.u32(|| format!("type of tensor `{name}`"))?;
        let ty =
            GgmlType::from_id(type_id).map_err(|type_name| GgufError::UnsupportedTensorType {
                tensor: name.clone(),
                type_id,
                type_name,
            })?;
        let offset = r.u64(|| format!("data offset of tensor `{name}`"))?;
        let (n_elements, n_bytes) = tensor_size(&name, &dims, ty)?;
        if !offset.is_multiple_of(alignment) {
            return Err(GgufError::Misaligned {
                tensor: name,
                offset,
                alignment,
            });
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_bytes,
            n_elements,
        });
    }

    // The header ends at most a few GiB in; alignment fits in u32: no overflow.
    let data_offset = r.offset().next_multiple_of(alignment);

    for t in &tensors {
        let end = data_offset
            .checked_add(t.offset)
            .and_then(|start| start.checked_add(t.n_bytes))
            .ok_or_else(|| GgufError::TensorOffsetOverflow {
                tensor: t.name.clone(),
                offset: t.offset,
                data_offset,
            })?;
        if let Some(file_len) = file_len
            && end > file_len
        {
            return Err(GgufError::TensorOutOfBounds {
                tensor: t.name.clone(),
                start: data_offset + t.offset,
                end,
                file_len,
            });
        }
    }

    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        // Checked above: offset + n_bytes does not overflow.
        if pair[0].offset + pair[0].n_bytes > pair[1].offset {
            return Err(GgufError::OverlappingTensors {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
            });
        }
    }

    Ok(GgufFile {
        version,
        alignment,
        metadata,
        tensors,
        data_offset,
    })
}
