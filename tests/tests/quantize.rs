//! `cairn_engine::quant::quantize_model` on the default model: the per-tensor types against
//! llama-quantize's own output (tests/data/llama-quantize-types.json, made from the same
//! source file), and a written file that parses, has those types and decodes close to its
//! source.

use std::collections::BTreeMap;

use cairn_engine::gguf::{BytesGguf, MappedGguf};
use cairn_engine::quant::{FileType, QuantizeOptions, dequantize_row, plan, quantize_model};
use cairn_tests::model_path;
use serde_json::Value;

fn llama_quantize_types() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/data/llama-quantize-types.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).expect("llama-quantize-types.json"))
        .expect("JSON")
}

#[test]
fn tensor_types_match_llama_quantize_on_the_default_model() {
    let src = MappedGguf::open(model_path()).unwrap();
    let want = llama_quantize_types();
    for (name, types) in want["types"].as_object().unwrap() {
        let ft = FileType::parse(name).expect("a file type cairn writes");
        let got: BTreeMap<String, String> = plan(&src, ft)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.name().to_string()))
            .collect();
        let want: BTreeMap<String, String> = types
            .as_object()
            .unwrap()
            .iter()
            .map(|(n, t)| (n.clone(), t.as_str().unwrap().to_string()))
            .collect();
        let differ: Vec<String> = want
            .iter()
            .filter(|(n, t)| got.get(*n) != Some(t))
            .map(|(n, t)| format!("{n}: llama-quantize {t}, cairn {:?}", got.get(n)))
            .collect();
        assert!(differ.is_empty(), "{name}:\n{}", differ.join("\n"));
        assert_eq!(got.len(), want.len(), "{name}: tensor count");
    }
}

#[test]
fn requantizing_needs_the_flag_and_q8_0_writes_a_close_file() {
    let src = MappedGguf::open(model_path()).unwrap();
    let mut opts = QuantizeOptions {
        file_type: FileType::Q8_0,
        allow_requantize: false,
        threads: 2,
    };
    let Err(err) = quantize_model(&src, &opts, &mut |_| {}) else {
        panic!("the default model is Q4_1: requantizing must be refused without the flag");
    };
    let err = err.to_string();
    assert!(
        err.contains("--allow-requantize") && err.contains("Q4_1"),
        "{err}"
    );
    opts.allow_requantize = true;
    let mut seen = 0;
    let bytes = quantize_model(&src, &opts, &mut |p| {
        seen += 1;
        assert_eq!(p.done, seen);
    })
    .unwrap()
    .finish();
    assert_eq!(seen, src.file.tensors.len());
    let out = BytesGguf::new(bytes).unwrap();
    assert_eq!(out.file.metadata.get_u32("general.file_type").unwrap(), 7);
    assert_eq!(
        out.file.metadata.get_str("tokenizer.ggml.model").unwrap(),
        src.file.metadata.get_str("tokenizer.ggml.model").unwrap()
    );
    for t in &src.file.tensors {
        let o = out.file.tensor(&t.name).expect("every tensor is written");
        assert_eq!(o.dims, t.dims, "{}", t.name);
        let n = t.row_len() as usize;
        let (mut a, mut b) = (vec![0f32; n], vec![0f32; n]);
        // First row: Q4_1 to Q8_0 adds at most half a Q8_0 step per element, plus the step's
        // f16 rounding (2^-11 relative) times up to 127 quants: 0.57 of a step.
        dequantize_row(
            t.ty,
            &src.tensor_data(&t.name).unwrap()[..t.row_bytes() as usize],
            &mut a,
        );
        dequantize_row(
            o.ty,
            &out.tensor_data(&t.name).unwrap()[..o.row_bytes() as usize],
            &mut b,
        );
        let amax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            worst <= amax / 127.0 * 0.57 + 1e-6,
            "{}: {worst} vs {amax}",
            t.name
        );
    }
}
