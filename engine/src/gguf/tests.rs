use std::time::{Duration, Instant};

use super::limits::*;
use super::*;
use crate::quant::quantize_row;

fn ramp(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1)
        .collect()
}

/// A small file with every supported tensor type and a bit of every metadata shape.
fn small_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.add("general.architecture", "llama")
        .add("llama.block_count", 2u32)
        .add("llama.rope.freq_base", 10000f32)
        .add("tokenizer.ggml.model", "gpt2")
        .add("tokenizer.ggml.tokens", vec!["a", "b", "ab"])
        .add("tokenizer.ggml.merges", vec!["a b"])
        .add("tokenizer.ggml.bos_token_id", 0u32)
        .add("tokenizer.ggml.add_bos_token", false);
    for (name, ty) in [
        ("t.f32", GgmlType::F32),
        ("t.f16", GgmlType::F16),
        ("t.q8_0", GgmlType::Q8_0),
        ("t.q4_0", GgmlType::Q4_0),
        ("t.q4_1", GgmlType::Q4_1),
    ] {
        w.add_tensor(name, &[32, 2], ty, quantize_row(ty, &ramp(64)));
    }
    w
}

fn small_file() -> Vec<u8> {
    small_writer().finish()
}

fn patch(bytes: &mut [u8], at: usize, with: &[u8]) {
    bytes[at..at + with.len()].copy_from_slice(with);
}

/// A file with no tensors and a single key `k`: its value type sits at byte 33, the value
/// at byte 37.
fn one_key(value: impl Into<Value>) -> Vec<u8> {
    GgufWriter::new().add("k", value).finish()
}
const ONE_KEY_TYPE_AT: usize = 33;
const ONE_KEY_VALUE_AT: usize = 37;

/// A file with no metadata and one tensor named `t`: n_dims at 33, dims from 37.
fn one_tensor(dims: &[u64], ty: GgmlType) -> Vec<u8> {
    let n: u64 = dims.iter().product();
    let bytes = ty.row_bytes(n as usize).unwrap();
    GgufWriter::new()
        .add_tensor("t", dims, ty, vec![0u8; bytes])
        .finish()
}
const ONE_TENSOR_NDIMS_AT: usize = 33;

#[test]
fn metadata_round_trips() {
    let nested = Value::Array(vec![
        Value::Array(vec![Value::U8(1), Value::U8(2)]),
        Value::Array(vec![Value::String("x".into())]),
        Value::Array(vec![]),
    ]);
    let entries: Vec<(&str, Value)> = vec![
        ("u8", Value::U8(200)),
        ("i8", Value::I8(-3)),
        ("u16", Value::U16(60000)),
        ("i16", Value::I16(-30000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f32", Value::F32(1.5e-5)),
        ("f64", Value::F64(-2.25)),
        ("yes", Value::Bool(true)),
        ("no", Value::Bool(false)),
        ("s", Value::String("héllo {{ template }}".into())),
        ("empty", Value::String(String::new())),
        ("arr.f32", vec![1f32, 2.0, 3.0].into()),
        ("arr.empty", Value::Array(vec![])),
        ("arr.nested", nested),
    ];
    let mut w = GgufWriter::new();
    for (k, v) in &entries {
        w.add(*k, v.clone());
    }
    let file = GgufFile::parse(&w.finish()).unwrap();
    assert_eq!(file.version, 3);
    assert_eq!(file.alignment, DEFAULT_ALIGNMENT);
    assert!(file.tensors.is_empty());
    let expected: Metadata = entries.into_iter().collect();
    assert_eq!(file.metadata, expected);
}

#[test]
fn tensors_round_trip() {
    let bytes = small_file();
    let g = BytesGguf::new(bytes).unwrap();
    assert_eq!(g.file.data_offset % 32, 0);
    assert_eq!(g.file.tensors.len(), 5);
    for t in &g.file.tensors {
        let expected = quantize_row(t.ty, &ramp(64));
        assert_eq!(t.dims, [32, 2]);
        assert_eq!(t.n_elements, 64);
        assert_eq!(t.n_bytes, expected.len() as u64);
        assert_eq!(t.row_len(), 32);
        assert_eq!(t.n_rows(), 2);
        assert_eq!(t.row_bytes() * 2, t.n_bytes);
        assert_eq!(t.offset % 32, 0);
        assert_eq!(g.tensor_data(&t.name).unwrap(), expected);
        let r = g.file.tensor_range(t);
        assert_eq!(&g.data[r.start as usize..r.end as usize], expected);
    }
    assert_eq!(g.file.tensor("t.q4_1").unwrap().ty, GgmlType::Q4_1);
    assert!(g.file.tensor("nope").is_none());
    let src: &dyn TensorSource = &g;
    assert_eq!(src.gguf().tensors.len(), 5);
    assert_eq!(src.tensor_data("t.f32").unwrap().len(), 256);
}

#[test]
fn custom_alignment_is_honored() {
    let mut w = small_writer();
    w.alignment(256);
    let file = GgufFile::parse(&w.finish()).unwrap();
    assert_eq!(file.alignment, 256);
    assert_eq!(file.data_offset % 256, 0);
    assert!(file.tensors.iter().all(|t| t.offset % 256 == 0));
    assert_eq!(file.tensors[1].offset, 256);
}

#[test]
fn missing_tensor_is_named() {
    let g = BytesGguf::new(small_file()).unwrap();
    let err = g.tensor_data("blk.0.attn_q.weight").unwrap_err();
    assert!(matches!(err, GgufError::MissingTensor { .. }), "{err:?}");
    assert!(err.to_string().contains("blk.0.attn_q.weight"), "{err}");
}

#[test]
fn every_truncation_point_is_an_error() {
    let bytes = small_file();
    let full = GgufFile::parse(&bytes).unwrap();
    let len = bytes.len() as u64;
    let data_end = full
        .tensors
        .iter()
        .map(|t| full.tensor_range(t).end)
        .max()
        .unwrap();
    for k in 0..bytes.len() {
        let prefix = &bytes[..k];
        match GgufFile::parse(prefix) {
            Err(GgufError::Truncated { offset, needed, .. }) => {
                assert!(offset + needed > k as u64, "cut at {k}")
            }
            Err(GgufError::TensorOutOfBounds { .. }) => assert!(k as u64 >= full.data_offset - 31),
            // Only the last tensor's trailing padding is gone.
            Ok(f) => assert!(k as u64 >= data_end && f == full, "cut at {k}"),
            other => panic!("cut at {k}: {other:?}"),
        }
        // The same prefix, known to be a prefix: either "fetch more" or the full header.
        for file_len in [None, Some(len)] {
            match GgufFile::parse_prefix(prefix, file_len) {
                Err(GgufError::NeedMoreBytes { needed_at_least }) => {
                    assert!(
                        needed_at_least > k as u64 && needed_at_least <= len,
                        "cut at {k}"
                    )
                }
                Ok(f) => assert_eq!(f, full, "cut at {k}"),
                Err(e) => panic!("cut at {k}, file_len {file_len:?}: {e}"),
            }
        }
    }
}

#[test]
fn prefix_fetching_converges() {
    let bytes = small_file();
    let mut have = 0usize;
    let mut rounds = 0;
    let file = loop {
        rounds += 1;
        match GgufFile::parse_prefix(&bytes[..have], None) {
            Ok(f) => break f,
            Err(GgufError::NeedMoreBytes { needed_at_least }) => {
                assert!(needed_at_least as usize > have);
                have = needed_at_least as usize;
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert!(rounds < 200);
    assert_eq!(file, GgufFile::parse(&bytes).unwrap());
    assert!(have as u64 <= file.data_offset);
}

/// Each corrupt header must fail fast, and without allocating by the corrupt number: the
/// numbers used are far beyond what could be allocated, so trying would abort the test.
#[track_caller]
fn fails_fast(bytes: &[u8], file_len: Option<u64>) -> GgufError {
    let start = Instant::now();
    let r = GgufFile::parse_prefix(bytes, file_len);
    assert!(start.elapsed() < Duration::from_secs(1));
    match r {
        Ok(f) => panic!("parsed: {f:?}"),
        Err(e) => e,
    }
}

#[test]
fn huge_counts_and_lengths_are_refused() {
    let base = small_file();
    let len = Some(base.len() as u64);
    for (at, field) in [(8, "tensor count"), (16, "metadata entry count")] {
        for huge in [u64::MAX, 1 << 40, MAX_KV_COUNT + 1] {
            let mut b = base.clone();
            patch(&mut b, at, &huge.to_le_bytes());
            match fails_fast(&b, len) {
                GgufError::TooLarge { what, value, .. }
                | GgufError::Truncated {
                    what,
                    needed: value,
                    ..
                } => {
                    assert!(what.contains(field), "{what}");
                    assert!(value >= huge.min(MAX_KV_COUNT));
                }
                e => panic!("{e:?}"),
            }
            // Without the file length, only the fixed limit stands in the way.
            assert!(matches!(fails_fast(&b, None), GgufError::TooLarge { .. }));
        }
    }

    // The first key's length.
    let mut b = base.clone();
    patch(&mut b, 24, &u64::MAX.to_le_bytes());
    assert!(matches!(
        fails_fast(&b, len),
        GgufError::TooLarge { offset: 24, .. }
    ));
    assert!(matches!(
        fails_fast(&b, None),
        GgufError::TooLarge { offset: 24, .. }
    ));
    patch(&mut b, 24, &60_000u64.to_le_bytes());
    let e = fails_fast(&b, len);
    assert!(
        matches!(
            e,
            GgufError::Truncated {
                offset: 32,
                needed: 60_000,
                ..
            }
        ),
        "{e:?}"
    );

    // A string value's length.
    let mut b = one_key("abc");
    patch(
        &mut b,
        ONE_KEY_VALUE_AT,
        &(MAX_STRING_LEN + 1).to_le_bytes(),
    );
    let e = fails_fast(&b, None);
    assert!(e.to_string().contains("`k`"), "{e}");
    assert!(matches!(e, GgufError::TooLarge { .. }));

    // Array lengths: fixed-size elements, strings, nested arrays.
    for value in [
        Value::from(vec![1u32, 2]),
        Value::from(vec!["x", "y"]),
        Value::Array(vec![Value::Array(vec![]), Value::Array(vec![])]),
    ] {
        let count_at = ONE_KEY_VALUE_AT + 4;
        for huge in [u64::MAX, MAX_ARRAY_LEN + 1, MAX_ARRAY_LEN] {
            let mut b = one_key(value.clone());
            patch(&mut b, count_at, &huge.to_le_bytes());
            let e = fails_fast(&b, Some(b.len() as u64));
            assert!(
                matches!(e, GgufError::TooLarge { .. } | GgufError::Truncated { .. }),
                "{e:?}"
            );
            assert!(e.to_string().contains("array `k`"), "{e}");
            let e = fails_fast(&b, None);
            assert!(
                matches!(
                    e,
                    GgufError::TooLarge { .. } | GgufError::NeedMoreBytes { .. }
                ),
                "{e:?}"
            );
        }
    }

    // Dimension count and dims.
    let mut b = one_tensor(&[32], GgmlType::F32);
    patch(&mut b, ONE_TENSOR_NDIMS_AT, &u32::MAX.to_le_bytes());
    assert!(matches!(fails_fast(&b, None), GgufError::BadDims { .. }));
    let mut b = one_tensor(&[32, 4], GgmlType::F32);
    patch(&mut b, ONE_TENSOR_NDIMS_AT + 12, &u64::MAX.to_le_bytes());
    let e = fails_fast(&b, None);
    assert!(e.to_string().contains("overflows"), "{e}");
    patch(
        &mut b,
        ONE_TENSOR_NDIMS_AT + 12,
        &(1u64 << 40).to_le_bytes(),
    );
    let e = fails_fast(&b, Some(b.len() as u64));
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e:?}");
}

#[test]
fn unsupported_tensor_type_is_named() {
    for (id, name) in [
        (16, "IQ2_XXS"),
        (20, "IQ4_NL"),
        (15, "Q8_K"),
        (30, "BF16"),
        (9999, "unknown"),
    ] {
        let b = GgufWriter::new()
            .add_tensor_raw("output.weight", &[256, 4], id, vec![0u8; 1024])
            .finish();
        let e = GgufFile::parse(&b).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, GgufError::UnsupportedTensorType { .. }),
            "{e:?}"
        );
        assert!(msg.contains(name) && msg.contains("output.weight"), "{msg}");
        assert!(msg.contains("Q4_K") && msg.contains("Q5_0"), "{msg}");
    }
}

/// Tensors of the K-quant and Q5 formats parse with their GGML byte sizes, side by side
/// (Q6_K's 210-byte blocks leave the next tensor to be realigned), and read back unchanged.
#[test]
fn k_quant_and_q5_tensors_round_trip() {
    let types = [
        (GgmlType::Q5_0, 22 * 8 * 3),
        (GgmlType::Q5_1, 24 * 8 * 3),
        (GgmlType::Q2_K, 84 * 3),
        (GgmlType::Q3_K, 110 * 3),
        (GgmlType::Q4_K, 144 * 3),
        (GgmlType::Q5_K, 176 * 3),
        (GgmlType::Q6_K, 210 * 3),
    ];
    let data = |ty| -> Vec<u8> {
        (0..3)
            .flat_map(|r| quantize_row(ty, &ramp(256 + r)[r..]))
            .collect()
    };
    let mut w = GgufWriter::new();
    for (ty, _) in types {
        w.add_tensor(format!("t.{}", ty.name()), &[256, 3], ty, data(ty));
    }
    let bytes = w.finish();
    let g = GgufFile::parse(&bytes).unwrap();
    for (ty, n_bytes) in types {
        let t = g.tensor(&format!("t.{}", ty.name())).unwrap();
        assert_eq!((t.ty, t.n_elements, t.n_bytes), (ty, 768, n_bytes as u64));
        assert_eq!(t.row_bytes() * 3, t.n_bytes);
        assert_eq!(t.offset % 32, 0);
        let r = g.tensor_range(t);
        assert_eq!(bytes[r.start as usize..r.end as usize], data(ty));
    }
    // Rows of 576 (SmolLM2's width) are not whole K-quant super-blocks.
    let b = GgufWriter::new()
        .add_tensor_raw("blk.0.ffn_up.weight", &[576, 2], 12, vec![0u8; 576])
        .finish();
    let e = GgufFile::parse(&b).unwrap_err();
    assert!(matches!(e, GgufError::BadDims { .. }), "{e:?}");
    assert!(e.to_string().contains("Q4_K block length 256"), "{e}");
}

#[test]
fn bad_magic_and_versions() {
    let mut b = small_file();
    b[..4].copy_from_slice(b"GGML");
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::BadMagic { .. })
    ));
    // A wrong first byte is recognized from a one-byte prefix.
    assert!(matches!(
        GgufFile::parse_prefix(b"{", None),
        Err(GgufError::BadMagic { .. })
    ));
    assert!(matches!(
        GgufFile::parse_prefix(b"GG", None),
        Err(GgufError::NeedMoreBytes { needed_at_least: 4 })
    ));

    for (v, big) in [(1u32, false), (4, false), (3u32.swap_bytes(), true)] {
        let mut b = small_file();
        patch(&mut b, 4, &v.to_le_bytes());
        match GgufFile::parse(&b) {
            Err(GgufError::UnsupportedVersion { version }) if !big => assert_eq!(version, v),
            Err(GgufError::BigEndian { .. }) if big => {}
            other => panic!("{other:?}"),
        }
    }
    // Version 2 has the same layout as 3.
    let mut b = small_file();
    patch(&mut b, 4, &2u32.to_le_bytes());
    assert_eq!(GgufFile::parse(&b).unwrap().version, 2);
}

#[test]
fn structural_errors_say_what_and_where() {
    // Duplicate key: rename the second of two one-letter keys.
    let mut b = GgufWriter::new().add("a", 1u8).add("b", 2u8).finish();
    let second_key_at = 24 + 8 + 1 + 4 + 1;
    b[second_key_at + 8] = b'a';
    let e = GgufFile::parse(&b).unwrap_err();
    assert!(
        matches!(e, GgufError::DuplicateKey { offset, .. } if offset == second_key_at as u64),
        "{e:?}"
    );

    let b = GgufWriter::new()
        .add_tensor("t", &[32], GgmlType::F32, vec![0u8; 128])
        .add_tensor("t", &[32], GgmlType::F32, vec![0u8; 128])
        .finish();
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::DuplicateTensor { .. })
    ));

    let b = GgufWriter::new().add("general.alignment", 48u32).finish();
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::BadAlignment { .. })
    ));
    let b = GgufWriter::new().add("general.alignment", -32i32).finish();
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::BadAlignment { .. })
    ));
    let b = GgufWriter::new()
        .add("general.alignment", 1u64 << 31)
        .finish();
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::BadAlignment { .. })
    ));
    let b = GgufWriter::new().add("general.alignment", "32").finish();
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::BadAlignment { .. })
    ));

    let mut b = one_key(1u8);
    patch(&mut b, ONE_KEY_TYPE_AT, &13u32.to_le_bytes());
    let e = GgufFile::parse(&b).unwrap_err();
    assert!(
        matches!(
            e,
            GgufError::UnknownValueType {
                type_id: 13,
                offset: 33,
                ..
            }
        ),
        "{e:?}"
    );

    let mut b = one_key(vec![1u8, 2]);
    patch(&mut b, ONE_KEY_VALUE_AT, &99u32.to_le_bytes());
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::UnknownValueType { type_id: 99, .. })
    ));

    let mut b = one_key(true);
    b[ONE_KEY_VALUE_AT] = 2;
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::BadBool { value: 2, .. })
    ));

    let mut b = one_key("ok");
    b[ONE_KEY_VALUE_AT + 8] = 0xff;
    let e = GgufFile::parse(&b).unwrap_err();
    assert!(matches!(e, GgufError::BadUtf8 { offset: 45, .. }), "{e:?}");
    assert!(e.to_string().contains("`k`"), "{e}");

    let mut deep = Value::Array(vec![]);
    for _ in 0..MAX_ARRAY_DEPTH {
        deep = Value::Array(vec![deep]);
    }
    let b = one_key(deep);
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::NestingTooDeep { .. })
    ));

    let row = GgufWriter::new()
        .add_tensor_raw("w", &[31, 2], GgmlType::Q8_0.id(), vec![0u8; 68])
        .finish();
    let e = GgufFile::parse(&row).unwrap_err();
    assert!(
        e.to_string()
            .contains("not a multiple of the Q8_0 block length"),
        "{e}"
    );
    let zero = GgufWriter::new()
        .add_tensor_raw("w", &[32, 0], GgmlType::F32.id(), vec![])
        .finish();
    assert!(matches!(
        GgufFile::parse(&zero),
        Err(GgufError::BadDims { .. })
    ));

    // Tensor offsets: the last 8 bytes of the one-tensor header are its offset.
    let b = one_tensor(&[32], GgmlType::F32);
    let offset_at = ONE_TENSOR_NDIMS_AT + 4 + 8 + 4;
    let mut m = b.clone();
    patch(&mut m, offset_at, &4u64.to_le_bytes());
    let e = GgufFile::parse(&m).unwrap_err();
    assert!(
        matches!(
            e,
            GgufError::Misaligned {
                offset: 4,
                alignment: 32,
                ..
            }
        ),
        "{e:?}"
    );
    let mut m = b.clone();
    patch(&mut m, offset_at, &32u64.to_le_bytes());
    let e = GgufFile::parse(&m).unwrap_err();
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e:?}");
    assert!(e.to_string().contains("`t`"), "{e}");
    let mut m = b.clone();
    patch(&mut m, offset_at, &(u64::MAX - 31).to_le_bytes());
    assert!(matches!(
        GgufFile::parse(&m),
        Err(GgufError::TensorOffsetOverflow { .. })
    ));

    let mut b = GgufWriter::new()
        .add_tensor("a", &[32], GgmlType::F32, vec![0u8; 128])
        .add_tensor("b", &[32], GgmlType::F32, vec![0u8; 128])
        .finish();
    let second_offset_at = 24 + (8 + 1 + 4 + 8 + 4 + 8) + (8 + 1 + 4 + 8 + 4);
    assert_eq!(b[second_offset_at], 128);
    patch(&mut b, second_offset_at, &64u64.to_le_bytes());
    assert!(matches!(
        GgufFile::parse(&b),
        Err(GgufError::OverlappingTensors { .. })
    ));
}

#[test]
fn truncation_message_names_field_and_offset() {
    let b = one_key(vec!["alpha", "beta"]);
    let beta_at = b.windows(4).position(|w| w == b"beta").unwrap();
    let e = GgufFile::parse(&b[..beta_at + 2]).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("element 1 of `k`") && msg.contains("byte"),
        "{msg}"
    );
}

#[test]
fn metadata_getters() {
    let md: Metadata = [
        ("u8", Value::U8(7)),
        ("i32", Value::I32(9)),
        ("neg", Value::I32(-1)),
        ("big", Value::U64(1 << 40)),
        ("f64", Value::F64(0.5)),
        ("s", Value::String("x".into())),
        ("b", Value::Bool(true)),
        ("strs", vec!["a", "b"].into()),
        ("ints", vec![1u32, 2].into()),
        (
            "mixed",
            vec![Value::from(1i64), Value::from(1i64 << 40)].into(),
        ),
        ("empty", Value::Array(vec![])),
    ]
    .into_iter()
    .collect();
    assert_eq!(md.get_u32("u8").unwrap(), 7);
    assert_eq!(md.get_u32("i32").unwrap(), 9);
    assert_eq!(md.get_u64("big").unwrap(), 1 << 40);
    assert_eq!(md.get_f32("f64").unwrap(), 0.5);
    assert_eq!(md.get_str("s").unwrap(), "x");
    assert!(md.get_bool("b").unwrap());
    assert_eq!(md.get_str_array("strs").unwrap(), ["a", "b"]);
    assert_eq!(md.get_i32_array("ints").unwrap(), [1, 2]);
    assert!(md.get_str_array("empty").unwrap().is_empty());
    assert!(md.get_i32_array("empty").unwrap().is_empty());
    for e in [
        md.get_u32("neg").unwrap_err(),
        md.get_u32("big").unwrap_err(),
        md.get_u32("s").unwrap_err(),
        md.get_f32("i32").unwrap_err(),
        md.get_str("b").unwrap_err(),
        md.get_bool("u8").unwrap_err(),
        md.get_str_array("ints").unwrap_err(),
        md.get_i32_array("mixed").unwrap_err(),
        md.get_i32_array("s").unwrap_err(),
    ] {
        assert!(matches!(e, GgufError::WrongType { .. }), "{e:?}");
    }
    let e = md.get_i32_array("mixed").unwrap_err().to_string();
    assert!(e.contains("`mixed`") && e.contains("element 1"), "{e}");
    assert!(matches!(
        md.get_u32("nope"),
        Err(GgufError::MissingKey { .. })
    ));
    assert_eq!(md.opt_u32("nope").unwrap(), None);
    assert_eq!(md.opt_f32("nope").unwrap(), None);
    assert_eq!(md.opt_str("nope").unwrap(), None);
    assert_eq!(md.opt_bool("nope").unwrap(), None);
    assert_eq!(md.opt_u32("u8").unwrap(), Some(7));
    assert!(md.opt_u32("s").is_err());
    assert!(md.opt_str("u8").is_err());
    assert_eq!(md.iter().count(), md.len());
}

#[test]
fn tokenizer_spec_from_metadata() {
    let mut w = small_writer();
    w.add("tokenizer.ggml.pre", "smollm")
        .add("tokenizer.ggml.token_type", vec![1i32, 1, 3])
        .add("tokenizer.ggml.eos_token_id", 2u32)
        .add("tokenizer.ggml.eom_token_id", 1u32)
        .add("tokenizer.chat_template", "{{ messages }}");
    let spec = GgufFile::parse(&w.finish())
        .unwrap()
        .tokenizer_spec()
        .unwrap();
    assert_eq!(spec.model, "gpt2");
    assert_eq!(spec.pre, "smollm");
    assert_eq!(spec.tokens, ["a", "b", "ab"]);
    assert_eq!(spec.token_types, [1, 1, 3]);
    assert_eq!(spec.merges, ["a b"]);
    assert_eq!(
        (spec.bos_id, spec.eos_id, spec.eot_id),
        (Some(0), Some(2), Some(1))
    );
    assert_eq!((spec.unknown_id, spec.padding_id), (None, None));
    assert_eq!((spec.add_bos, spec.add_eos), (Some(false), None));
    assert_eq!(spec.chat_template.as_deref(), Some("{{ messages }}"));

    let mut w = small_writer();
    w.add("tokenizer.ggml.eos_token_id", 3u32);
    let e = GgufFile::parse(&w.finish())
        .unwrap()
        .tokenizer_spec()
        .unwrap_err();
    assert!(matches!(e, GgufError::InvalidValue { .. }), "{e:?}");
    let mut w = small_writer();
    w.add("tokenizer.ggml.tokens", 5u32);
    let e = GgufFile::parse(&w.finish())
        .unwrap()
        .tokenizer_spec()
        .unwrap_err();
    assert!(matches!(e, GgufError::WrongType { .. }), "{e:?}");
}

#[test]
fn sentencepiece_metadata_in_the_tokenizer_spec() {
    let mut w = small_writer();
    w.add("tokenizer.ggml.scores", vec![-1.5f32, -2.0, 0.25])
        .add("tokenizer.ggml.add_space_prefix", false)
        .add("general.name", "Phi 3 Mini");
    let spec = GgufFile::parse(&w.finish())
        .unwrap()
        .tokenizer_spec()
        .unwrap();
    assert_eq!(spec.scores, [-1.5, -2.0, 0.25]);
    assert_eq!(spec.add_space_prefix, Some(false));
    assert_eq!(spec.name, "Phi 3 Mini");

    // Some converters write integer scores; llama.cpp reads them as numbers too.
    let mut w = small_writer();
    w.add("tokenizer.ggml.scores", vec![3i32, -4, 0]);
    let spec = GgufFile::parse(&w.finish())
        .unwrap()
        .tokenizer_spec()
        .unwrap();
    assert_eq!(spec.scores, [3.0, -4.0, 0.0]);
    assert_eq!((spec.add_space_prefix, spec.name.as_str()), (None, ""));

    let mut w = small_writer();
    w.add("tokenizer.ggml.scores", vec![1.0f32]);
    let e = GgufFile::parse(&w.finish())
        .unwrap()
        .tokenizer_spec()
        .unwrap_err();
    assert!(matches!(e, GgufError::InvalidValue { .. }), "{e:?}");
    let mut w = small_writer();
    w.add("tokenizer.ggml.scores", vec!["x", "y", "z"]);
    let e = GgufFile::parse(&w.finish())
        .unwrap()
        .tokenizer_spec()
        .unwrap_err();
    assert!(matches!(e, GgufError::WrongType { .. }), "{e:?}");
}

#[test]
fn reader_and_mmap_give_the_same_file() {
    let bytes = small_file();
    let from_reader = BytesGguf::from_reader(&bytes[..]).unwrap();
    assert_eq!(from_reader.file, GgufFile::parse(&bytes).unwrap());

    #[cfg(not(target_arch = "wasm32"))]
    {
        let path =
            std::env::temp_dir().join(format!("cairn-gguf-test-{}.gguf", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let mapped = MappedGguf::open(&path);
        std::fs::remove_file(&path).unwrap();
        let mapped = mapped.unwrap();
        assert_eq!(mapped.bytes(), bytes);
        assert_eq!(mapped.file, from_reader.file);
        for t in &mapped.file.tensors {
            assert_eq!(
                mapped.tensor_data(&t.name).unwrap(),
                from_reader.tensor_data(&t.name).unwrap()
            );
        }
        let e = MappedGguf::open("/nonexistent/model.gguf").unwrap_err();
        assert!(e.to_string().contains("/nonexistent/model.gguf"), "{e}");
    }
}

#[cfg(not(target_arch = "wasm32"))]
#[test]
fn real_model_smollm2_135m_q4_1() {
    let path = std::env::var("CAIRN_MODEL").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
        format!("{home}/.cache/cairn/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(
        std::path::Path::new(&path).exists(),
        "model file {path} is missing: run scripts/fetch-model.sh (or point $CAIRN_MODEL at \
         SmolLM2-135M-Instruct.Q4_1.gguf)"
    );
    let g = MappedGguf::open(&path).unwrap();
    let f = &g.file;
    assert_eq!(g.bytes().len(), 98_362_432);
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.tensors.len(), 272);
    let count = |ty| f.tensors.iter().filter(|t| t.ty == ty).count();
    assert_eq!(
        (
            count(GgmlType::Q4_1),
            count(GgmlType::F32),
            count(GgmlType::Q8_0)
        ),
        (210, 61, 1)
    );
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (embd.ty, embd.dims.as_slice()),
        (GgmlType::Q8_0, &[576u64, 49152][..])
    );

    let md = &f.metadata;
    for (key, want) in [
        ("llama.block_count", 30),
        ("llama.embedding_length", 576),
        ("llama.feed_forward_length", 1536),
        ("llama.attention.head_count", 9),
        ("llama.attention.head_count_kv", 3),
        ("llama.rope.dimension_count", 64),
        ("llama.context_length", 8192),
    ] {
        assert_eq!(md.get_u32(key).unwrap(), want, "{key}");
    }
    assert_eq!(md.get_f32("llama.rope.freq_base").unwrap(), 100000.0);
    assert_eq!(
        md.get_f32("llama.attention.layer_norm_rms_epsilon")
            .unwrap(),
        1e-5
    );

    let spec = f.tokenizer_spec().unwrap();
    assert_eq!((spec.model.as_str(), spec.pre.as_str()), ("gpt2", "smollm"));
    assert_eq!((spec.tokens.len(), spec.merges.len()), (49152, 48900));
    assert_eq!(
        (spec.bos_id, spec.eos_id, spec.add_bos),
        (Some(1), Some(2), Some(false))
    );
    assert!(spec.chat_template.is_some_and(|t| t.contains("im_start")));

    let mut total = 0;
    for t in &f.tensors {
        let data = g.tensor_data(&t.name).unwrap();
        assert_eq!(data.len() as u64, t.n_bytes);
        total += t.n_bytes;
    }
    assert!(total <= g.bytes().len() as u64 - f.data_offset);

    // What a browser would do: fetch only the header.
    let header = &g.bytes()[..f.data_offset as usize];
    let len = Some(g.bytes().len() as u64);
    assert_eq!(&GgufFile::parse_prefix(header, len).unwrap(), f);
    assert!(matches!(
        GgufFile::parse_prefix(&header[..1 << 16], len),
        Err(GgufError::NeedMoreBytes { .. })
    ));
}

/// Regenerates the fuzz target's seed inputs: `cargo test -p cairn-engine --lib
/// write_fuzz_seeds -- --ignored`.
#[test]
#[ignore]
fn write_fuzz_seeds() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/gguf_parse");
    std::fs::create_dir_all(&dir).unwrap();
    let mut tiny = GgufWriter::new();
    tiny.add("general.architecture", "llama")
        .add("general.alignment", 8u32)
        .add("tokenizer.ggml.tokens", vec!["a", "b"])
        .add("tokenizer.ggml.bos_token_id", 0u32)
        .add_tensor(
            "w",
            &[32],
            GgmlType::Q4_0,
            quantize_row(GgmlType::Q4_0, &ramp(32)),
        );
    let nested = GgufWriter::new()
        .add(
            "k",
            Value::Array(vec![Value::Array(vec![Value::U8(1)]), Value::Array(vec![])]),
        )
        .add("f", 1.5f64)
        .add("b", true)
        .add("i", vec![-1i16, 2])
        .finish();
    for (name, bytes) in [
        ("small.gguf", small_file()),
        ("tiny.gguf", tiny.finish()),
        ("nested.gguf", nested),
        ("empty.gguf", GgufWriter::new().finish()),
    ] {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}
