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
use cairn_engine::tokenizer::{ChatMessage, Tokenizer, TokenizerError, TokenizerSpec};

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

/// A system prompt, then two user turns around an assistant turn.
fn conversation(with_system: bool) -> Vec<ChatMessage> {
    let mut m = Vec::new();
    if with_system {
        m.push(ChatMessage::new("system", "You are terse."));
    }
    m.push(ChatMessage::new("user", "Hi there"));
    m.push(ChatMessage::new("assistant", "Hello!"));
    m.push(ChatMessage::new("user", "What is 2+2?"));
    m
}

/// The families' chat templates, from the vocabulary files that carry one and from llama.cpp's
/// collection of real templates (each rendered with a vocabulary of its family, for the BOS and
/// EOS texts), against the text each template says it writes.
#[test]
fn family_chat_templates_render_as_their_text_says() {
    let Some(dir) = vocab_dir() else { return };
    let template = |file: &str| {
        let path = dir.join("templates").join(file);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    // (what, vocabulary, template in place of the file's own, system prompt, expected)
    let cases: Vec<(&str, &str, Option<String>, bool, &str)> = vec![
        (
            "Llama 3.1",
            "llama-bpe",
            Some(template("meta-llama-Llama-3.1-8B-Instruct.jinja")),
            true,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
             Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n\
             You are terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n\
             Hi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n\
             Hello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n\
             What is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        (
            "Qwen2 (ChatML, the file's own)",
            "qwen2",
            None,
            false,
            "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n\
             <|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n\
             <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        ),
        (
            "Gemma 2",
            "gemma-4",
            Some(template("google-gemma-2-2b-it.jinja")),
            false,
            "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n\
             Hello!<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n\
             <start_of_turn>model\n",
        ),
        (
            "Gemma 4 (the file's own)",
            "gemma-4",
            None,
            true,
            "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHi there<turn|>\n\
             <|turn>model\nHello!<turn|>\n<|turn>user\nWhat is 2+2?<turn|>\n\
             <|turn>model\n<|channel>thought\n<channel|>",
        ),
        (
            "Phi-3 (the file's own)",
            "phi-3",
            None,
            false,
            "<s><|user|>\nHi there<|end|>\n<|assistant|>\nHello!<|end|>\n\
             <|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n",
        ),
        (
            "Mistral [INST]",
            "llama-spm",
            Some(template("mistralai-Mistral-Nemo-Instruct-2407.jinja")),
            false,
            "<s>[INST]Hi there[/INST]Hello!</s>[INST]What is 2+2?[/INST]",
        ),
        (
            "Mistral [INST] with a system prompt",
            "llama-spm",
            Some(template("mistralai-Mistral-Nemo-Instruct-2407.jinja")),
            true,
            "<s>[INST]Hi there[/INST]Hello!</s>[INST]You are terse.\n\nWhat is 2+2?[/INST]",
        ),
        (
            "Command-R (the file's own)",
            "command-r",
            None,
            false,
            "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>\
             <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|>\
             <|START_OF_TURN_TOKEN|><|USER_TOKEN|>What is 2+2?<|END_OF_TURN_TOKEN|>\
             <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        ),
    ];
    for (what, vocab, replacement, system, expected) in cases {
        let mut spec = spec(&dir, vocab);
        if let Some(t) = replacement {
            spec.chat_template = Some(t);
        }
        assert!(spec.chat_template.is_some(), "{what}: no template");
        let tok = Tokenizer::from_spec(&spec).expect("tokenizer");
        let text = tok
            .apply_chat_template(&conversation(system), true)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(text, expected, "{what}");
        println!("chat template renders: {what}");
    }
}

/// A rendered conversation becomes ids with exactly one BOS (the template writes it and the
/// vocabulary asks for it), and the turn markers as their special tokens.
#[test]
fn chat_prompts_encode_with_one_bos_and_marker_tokens() {
    let Some(dir) = vocab_dir() else { return };
    let mut spec = spec(&dir, "llama-bpe");
    spec.chat_template = Some(
        std::fs::read_to_string(dir.join("templates/meta-llama-Llama-3.1-8B-Instruct.jinja"))
            .expect("Llama 3.1 template"),
    );
    let tok = Tokenizer::from_spec(&spec).expect("tokenizer");
    let ids = tok.encode_chat(&conversation(false)).expect("encode");
    let bos = tok.bos_id().expect("bos");
    assert_eq!(ids[0], bos);
    assert_eq!(ids.iter().filter(|&&i| i == bos).count(), 1);
    let header = tok.encode("<|start_header_id|>", true).expect("encode");
    assert_eq!(header.len(), 1, "a single special token");
    // system, three turns and the generation prompt.
    assert_eq!(ids.iter().filter(|&&i| i == header[0]).count(), 5);

    // SentencePiece with the template's own BOS: Phi-3.
    let tok = tokenizer(&dir, "phi-3");
    let ids = tok.encode_chat(&conversation(false)).expect("encode");
    let bos = tok.bos_id().expect("bos");
    assert_eq!(ids[0], bos);
    assert_eq!(ids.iter().filter(|&&i| i == bos).count(), 1);
    let user = tok.encode("<|user|>", true).expect("encode");
    assert_eq!(user.len(), 1, "a single special token");
    assert_eq!(ids[1], user[0]);
}

/// 10,000-character inputs of awkward shapes (one long word, long runs of spaces, newlines
/// or digits, CJK, punctuation) go through every claimed tokenizer and decode back. Not timed:
/// the merges are heap-based (spm.rs counts its candidates); this catches pieces that are
/// dropped or mangled when a regex or merge meets a long run.
#[test]
fn long_inputs_of_every_shape_round_trip() {
    let Some(dir) = vocab_dir() else { return };
    let shapes: Vec<(&str, String)> = vec![
        ("one word", "a".repeat(10_000)),
        ("spaces, then a letter", format!("{}x", " ".repeat(10_000))),
        ("newlines", "\n".repeat(10_000)),
        ("digits", "7".repeat(10_000)),
        (
            "prose",
            "The quick brown fox, jumps over 12 lazy dogs! ".repeat(220),
        ),
        ("CJK", "中文字符".repeat(2_500)),
        ("spaces and tabs", " \t".repeat(5_000)),
        ("punctuation", "!?".repeat(5_000)),
    ];
    for name in CLAIMED {
        let spec = spec(&dir, name);
        let tok = Tokenizer::from_spec(&spec).expect("tokenizer");
        let prefix = if spec.model == "llama" { " " } else { "" };
        for (what, text) in &shapes {
            let ids = tok.encode(text, false).expect("encode");
            assert!(
                ids.len() <= text.len() + 1,
                "{name}, {what}: {} ids",
                ids.len()
            );
            let back = tok.decode(&ids).expect("decode");
            assert!(
                back == format!("{prefix}{text}"),
                "{name}, {what}: decodes differently"
            );
        }
    }
}
