//! The tokenizers Cairn claims, held to llama.cpp's own test data: vocabulary-only GGUF files
//! (`ggml-vocab-NAME.gguf`) with inputs (`.inp`, cases separated by `__ggml_vocab_test__`
//! lines) and the ids llama.cpp's `test-tokenizer-0` expects (`.out`, one line per case),
//! tokenized as that test does: no BOS/EOS, special-token texts left as text. Every case of
//! every claimed file must match.
//!
//! The files come from `scripts/fetch-vocab.sh` (into ~/.cache/cairn/llama-cpp-python-0.3.36,
//! or wherever `CAIRN_VOCAB_DIR` points). Without them the tests say so and pass, unless
//! `CAIRN_TEST_REQUIRE_VOCAB=1` (set by scripts/test.sh), which makes a missing file a failure.

use std::path::{Path, PathBuf};

use cairn_engine::gguf::MappedGguf;
use cairn_engine::tokenizer::{Tokenizer, TokenizerError, TokenizerSpec};

/// Vocabularies whose every case passes, by the name in `ggml-vocab-NAME.gguf`.
const CLAIMED: &[&str] = &[
    "llama-spm",
    "phi-3",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "gpt-2",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
    "gemma-4",
];

/// Shipped vocabularies Cairn does not tokenize, each with the name its error must carry.
const REFUSED: &[(&str, &str)] = &[("bert-bge", "'bert'"), ("nomic-bert-moe", "'t5'")];

fn vocab_dir() -> Option<PathBuf> {
    let dir = match std::env::var_os("CAIRN_VOCAB_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache")))?;
            cache.join("cairn/llama-cpp-python-0.3.36")
        }
    };
    if dir.join("ggml-vocab-llama-spm.gguf").exists() {
        return Some(dir);
    }
    let why = format!(
        "llama.cpp's vocabulary test files are not in {}: run scripts/fetch-vocab.sh \
         (or set CAIRN_VOCAB_DIR)",
        dir.display()
    );
    assert!(
        std::env::var("CAIRN_TEST_REQUIRE_VOCAB").as_deref() != Ok("1"),
        "{why}"
    );
    eprintln!("skipped: {why}");
    None
}

fn spec(dir: &Path, name: &str) -> TokenizerSpec {
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    let gguf = MappedGguf::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    gguf.file
        .tokenizer_spec()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn tokenizer(dir: &Path, name: &str) -> Tokenizer {
    Tokenizer::from_spec(&spec(dir, name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The cases of one file as `test-tokenizer-0` reads them.
fn cases(dir: &Path, name: &str) -> Vec<(String, Vec<u32>)> {
    let read = |ext: &str| {
        let path = dir.join(format!("ggml-vocab-{name}.gguf.{ext}"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let inp = read("inp");
    let out = read("out");
    let mut inputs: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    // The file ends with a separator, which leaves nothing after it.
    if inputs.last() == Some(&"") {
        inputs.pop();
    }
    let outputs: Vec<Vec<u32>> = out
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| {
                    t.parse()
                        .unwrap_or_else(|e| panic!("{name}.out: {t:?}: {e}"))
                })
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: .inp and .out disagree"
    );
    assert!(!inputs.is_empty(), "{name}: no cases");
    inputs.into_iter().map(str::to_owned).zip(outputs).collect()
}

#[test]
fn every_case_of_every_claimed_vocabulary_matches_llama_cpp() {
    let Some(dir) = vocab_dir() else { return };
    let mut failures = Vec::new();
    let mut total = 0;
    for name in CLAIMED {
        let tok = tokenizer(&dir, name);
        let cases = cases(&dir, name);
        let mut passed = 0;
        for (text, expected) in &cases {
            let ids = tok.encode(text, false).expect("encode");
            if &ids == expected {
                passed += 1;
            } else {
                failures.push(format!(
                    "{name}: {text:?}\n  expected {expected:?}\n  got      {ids:?}"
                ));
            }
        }
        total += passed;
        println!(
            "vocab {name}: {passed}/{} cases match llama.cpp",
            cases.len()
        );
    }
    println!(
        "{total} cases of {} vocabularies run: {}",
        CLAIMED.len(),
        CLAIMED.join(", ")
    );
    assert!(
        failures.is_empty(),
        "{} cases differ from llama.cpp:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn claimed_vocabularies_decode_their_cases_back() {
    let Some(dir) = vocab_dir() else { return };
    for name in CLAIMED {
        let spec = spec(&dir, name);
        let tok = Tokenizer::from_spec(&spec).expect("tokenizer");
        // SentencePiece writes one leading space that decoding keeps.
        let prefix = if spec.model == "llama" { " " } else { "" };
        for (text, expected) in cases(&dir, name) {
            if text.is_empty() {
                continue;
            }
            let back = tok.decode(&expected).expect("decode");
            assert_eq!(
                back,
                format!("{prefix}{text}"),
                "{name}: decoding {expected:?}"
            );
        }
    }
}

#[test]
fn unsupported_vocabularies_are_refused_by_name() {
    let Some(dir) = vocab_dir() else { return };
    for (name, needle) in REFUSED {
        match Tokenizer::from_spec(&spec(&dir, name)) {
            Err(e @ TokenizerError::UnsupportedModel(_))
            | Err(e @ TokenizerError::UnsupportedPreTokenizer(_)) => {
                assert!(e.to_string().contains(needle), "{name}: {e}");
            }
            Err(e) => panic!("{name}: refused for another reason: {e}"),
            Ok(_) => panic!("{name}: accepted, but its cases are not claimed"),
        }
    }
}
