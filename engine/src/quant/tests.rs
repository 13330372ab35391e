use super::*;

/// Values from -1.3 to 1.3 whose magnitude changes every 16 elements, so the K-quants'
/// sub-block scales differ within a super-block.
fn sample(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let shape = ((i * 37 % 23) as f32 - 11.0) / 11.0;
            let size = 0.1 + ((i / 16) * 7 % 13) as f32 / 10.0;
            shape * size
        })
        .collect()
}

#[test]
fn round_trip_error_is_within_one_step() {
    let x = sample(512);
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    for ty in GgmlType::ALL {
        let q = quantize_row(ty, &x);
        assert_eq!(q.len(), ty.row_bytes(x.len()).unwrap(), "{ty:?}");
        let mut y = vec![0f32; x.len()];
        dequantize_row(ty, &q, &mut y);
        // One quantization step for a block spanning -amax..amax; the K-quants' 4- to 8-bit
        // sub-block scales and minimums add up to a quarter step at the extremes.
        let step = match ty {
            GgmlType::F32 => 0.0,
            GgmlType::F16 => amax / 1000.0,
            GgmlType::Q8_0 => amax / 127.0,
            GgmlType::Q4_0 => amax / 8.0,
            GgmlType::Q4_1 => 2.0 * amax / 15.0,
            GgmlType::Q5_0 => amax / 16.0,
            GgmlType::Q5_1 => 2.0 * amax / 31.0,
            GgmlType::Q2_K => 1.25 * 2.0 * amax / 3.0,
            GgmlType::Q3_K => 1.25 * amax / 4.0,
            GgmlType::Q4_K => 1.25 * 2.0 * amax / 15.0,
            GgmlType::Q5_K => 1.25 * 2.0 * amax / 31.0,
            GgmlType::Q6_K => 1.25 * amax / 32.0,
        };
        let mut worst = 0f32;
        for (a, b) in x.iter().zip(&y) {
            worst = worst.max((a - b).abs());
            // f16 rounding of the scale can stretch the worst case past one step by a hair.
            assert!((a - b).abs() <= step * 1.01, "{ty:?}: {a} vs {b}");
        }
        // A quantizer that wrote its bits where the dequantizer does not look would still
        // be caught above; this catches one that loses all resolution (every value zero).
        if step > 0.0 {
            assert!(worst < amax / 2.0, "{ty:?}: worst error {worst}");
        }
    }
}

/// Every loadable type is readable in place on the GPU backends: a WGSL format (wgpu,
/// vulkan, the browser) and a CUDA header (backend/cuda/compile.rs matches every type).
#[test]
fn every_type_has_a_wgsl_format() {
    for ty in GgmlType::ALL {
        assert!(
            cairn_shaders::FORMATS.iter().any(|(n, _)| *n == ty.name()),
            "{ty:?} has no shaders/formats entry"
        );
    }
}

#[test]
fn unknown_types_are_named() {
    assert_eq!(GgmlType::from_id(20), Err("IQ4_NL"));
    assert_eq!(GgmlType::from_id(15), Err("Q8_K"));
    assert_eq!(GgmlType::from_id(999), Err("unknown"));
    assert_eq!(GgmlType::from_id(3), Ok(GgmlType::Q4_1));
    assert_eq!(GgmlType::from_id(12), Ok(GgmlType::Q4_K));
}

#[test]
fn ids_names_and_sizes_match_ggml() {
    // (id, name, elements per block, bytes per block) from ggml's type traits.
    let ggml = [
        (0, "F32", 1, 4),
        (1, "F16", 1, 2),
        (2, "Q4_0", 32, 18),
        (3, "Q4_1", 32, 20),
        (6, "Q5_0", 32, 22),
        (7, "Q5_1", 32, 24),
        (8, "Q8_0", 32, 34),
        (10, "Q2_K", 256, 84),
        (11, "Q3_K", 256, 110),
        (12, "Q4_K", 256, 144),
        (13, "Q5_K", 256, 176),
        (14, "Q6_K", 256, 210),
    ];
    assert_eq!(ggml.len(), GgmlType::ALL.len());
    for (id, name, len, bytes) in ggml {
        let ty = GgmlType::from_id(id).unwrap();
        assert_eq!(
            (ty.id(), ty.name(), ty.block_len(), ty.block_bytes()),
            (id, name, len, bytes)
        );
    }
    assert_eq!(GgmlType::Q6_K.row_bytes(512), Some(420));
    assert_eq!(GgmlType::Q4_K.row_bytes(576), None);
}

/// One record of tests/data/quant_blocks.bin (see tools/reference/quant_blocks.py).
struct Record {
    id: u32,
    blocks: Vec<u8>,
    values: Vec<f32>,
}

fn records(mut data: &[u8]) -> Vec<Record> {
    let mut out = Vec::new();
    let u32_at = |d: &[u8], i: usize| u32::from_le_bytes([d[i], d[i + 1], d[i + 2], d[i + 3]]);
    while !data.is_empty() {
        let (id, n, b) = (
            u32_at(data, 0),
            u32_at(data, 4) as usize,
            u32_at(data, 8) as usize,
        );
        let blocks = data[12..12 + b].to_vec();
        let values = data[12 + b..12 + b + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.push(Record { id, blocks, values });
        data = &data[12 + b + 4 * n..];
    }
    out
}

/// The CPU reference decodes random blocks (random bytes, random finite f16 scales) exactly
/// as gguf-py, llama.cpp's Python package, does: both multiply in ggml's order in f32.
#[test]
fn matches_gguf_py_on_random_blocks() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/data/quant_blocks.bin"
    );
    let data = std::fs::read(path)
        .unwrap_or_else(|e| panic!("{path}: {e} (made by tools/reference/quant_blocks.py)"));
    let mut seen = Vec::new();
    for r in records(&data) {
        let ty = GgmlType::from_id(r.id).unwrap();
        assert_eq!(r.blocks.len(), ty.row_bytes(r.values.len()).unwrap());
        let mut got = vec![f32::NAN; r.values.len()];
        dequantize_row(ty, &r.blocks, &mut got);
        for (i, (g, w)) in got.iter().zip(&r.values).enumerate() {
            assert!(g == w, "{ty:?} element {i}: cairn {g}, gguf-py {w}");
        }
        seen.push(ty);
    }
    for ty in GgmlType::ALL {
        if ty.block_len() > 1 {
            assert!(seen.contains(&ty), "{ty:?} has no reference blocks");
        }
    }
}

/// One element decoded alone is the row dequantizer's value, in every format and position.
#[test]
fn element_decodes_what_the_row_dequantizer_gives() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for ty in GgmlType::ALL {
        let n = 2 * ty.block_len().max(32);
        let Some(bytes) = ty.row_bytes(n) else {
            panic!("{} rows of {n}", ty.name());
        };
        // Any bytes: the same arithmetic in the same order gives the same bits (NaN aside).
        let row: Vec<u8> = (0..bytes).map(|_| next() as u8).collect();
        let mut want = vec![0f32; n];
        dequantize_row(ty, &row, &mut want);
        for (i, w) in want.iter().enumerate() {
            let got = super::element(ty, &row, i);
            assert!(
                got.to_bits() == w.to_bits() || (got.is_nan() && w.is_nan()),
                "{} element {i}: {got} vs {w}",
                ty.name()
            );
        }
    }
}
