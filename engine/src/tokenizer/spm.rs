//! SentencePiece-style encoding (`tokenizer.ggml.model = llama`: Llama 2, Mistral, TinyLlama,
//! Phi-3, Gemma): the text's characters merge pairwise, the pair whose merged text is the
//! vocabulary entry with the highest score first, and a character no token covers falls back
//! to its UTF-8 bytes as `<0xXX>` tokens. Spaces arrive already written as `▁`.
//!
//! The merge is driven by a max-heap of candidate pairs over a linked list of symbols, as in
//! llama.cpp (whose ids are the reference): every merge adds at most two candidates, so a text
//! of n characters costs O(n log n) whatever its shape.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The vocabulary as the merge needs it.
pub(crate) struct Spm {
    by_text: HashMap<String, u32>,
    scores: Vec<f32>,
    /// The token for each byte: `<0xXX>`, else the one-byte string itself (llama.cpp's order).
    byte_tokens: Box<[Option<u32>; 256]>,
    unknown: Option<u32>,
}

/// A pair of neighbouring symbols whose concatenation is a token.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text; a pair whose sides have changed since no longer adds up.
    len: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    /// Higher score first; among equal scores the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// A run of the text: one character at first, then whatever merged into it.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    /// Bytes; 0 once merged into its left neighbour.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    /// `tokens` with duplicates resolved as the caller's text map does (later ids win).
    pub fn new(tokens: &[String], scores: &[f32], unknown: Option<u32>) -> Spm {
        let mut by_text = HashMap::with_capacity(tokens.len());
        for (i, t) in tokens.iter().enumerate() {
            by_text.insert(t.clone(), i as u32);
        }
        let mut byte_tokens = Box::new([None; 256]);
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = by_text.get(hex.as_str()).copied().or_else(|| {
                // A lone byte is a token text only where it is valid UTF-8 (ASCII).
                u8::try_from(b)
                    .ok()
                    .filter(u8::is_ascii)
                    .and_then(|c| by_text.get(char::from(c).to_string().as_str()).copied())
            });
        }
        Spm {
            by_text,
            scores: scores.to_vec(),
            byte_tokens,
            unknown,
        }
    }

    /// Appends the ids of `text` (spaces already escaped). Returns how many merge candidates
    /// were queued, at most 3 per character (the bound the tests hold the merge to).
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> usize {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
        }
        let n = symbols.len();
        for (i, s) in symbols.iter_mut().enumerate() {
            s.next = (i + 1 < n).then_some(i + 1);
        }

        let mut heap = BinaryHeap::with_capacity(n);
        let mut queued = 0usize;
        for i in 1..n {
            queued += self.push_pair(text, &symbols, Some(i - 1), Some(i), &mut heap);
        }
        while let Some(c) = heap.pop() {
            let (l, r) = (symbols[c.left], symbols[c.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != c.len {
                continue;
            }
            symbols[c.left].len += r.len;
            symbols[c.right].len = 0;
            symbols[c.left].next = r.next;
            if let Some(next) = r.next {
                symbols[next].prev = Some(c.left);
            }
            queued += self.push_pair(text, &symbols, l.prev, Some(c.left), &mut heap);
            queued += self.push_pair(text, &symbols, Some(c.left), r.next, &mut heap);
        }

        let mut at = (n > 0).then_some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.by_text.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        if let Some(id) = self.byte_tokens[usize::from(b)].or(self.unknown) {
                            out.push(id);
                        }
                    }
                }
            }
            at = s.next;
        }
        queued
    }

    /// Queues the pair if its merged text is a token; returns 1 if it did.
    fn push_pair(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: Option<usize>,
        right: Option<usize>,
        heap: &mut BinaryHeap<Candidate>,
    ) -> usize {
        let (Some(left), Some(right)) = (left, right) else {
            return 0;
        };
        let start = symbols[left].start;
        let len = symbols[left].len + symbols[right].len;
        let Some(&id) = self.by_text.get(&text[start..start + len]) else {
            return 0;
        };
        heap.push(Candidate {
            score: self.scores.get(id as usize).copied().unwrap_or(0.0),
            left,
            right,
            len,
        });
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> Spm {
        let mut tokens: Vec<String> = vec!["<unk>".into()];
        let mut scores = vec![0.0];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            scores.push(0.0);
        }
        for (t, s) in [
            ("▁", -1.0),
            ("a", -2.0),
            ("b", -2.0),
            ("ab", -3.0),
            ("▁a", -1.5),
            ("▁ab", -0.5),
            ("bb", -0.1),
        ] {
            tokens.push(t.into());
            scores.push(s);
        }
        Spm::new(&tokens, &scores, Some(0))
    }

    fn texts(spm: &Spm, s: &str) -> Vec<String> {
        let mut ids = Vec::new();
        spm.encode(s, &mut ids);
        let rev: HashMap<u32, &str> = spm.by_text.iter().map(|(t, &i)| (i, t.as_str())).collect();
        ids.iter().map(|i| rev[i].to_string()).collect()
    }

    #[test]
    fn highest_score_merges_first() {
        let spm = vocab();
        // "bb" (-0.1) beats "ab" (-3.0), so "abb" is not "ab" + "b".
        assert_eq!(texts(&spm, "abb"), ["a", "bb"]);
        // "▁a" (-1.5) beats "ab" (-3.0); then "▁ab" exists and merges.
        assert_eq!(texts(&spm, "▁ab"), ["▁ab"]);
    }

    #[test]
    fn uncovered_characters_fall_back_to_bytes() {
        let spm = vocab();
        assert_eq!(texts(&spm, "aé"), ["a", "<0xC3>", "<0xA9>"]);
        let mut ids = Vec::new();
        spm.encode("", &mut ids);
        assert!(ids.is_empty());
    }

    #[test]
    fn equal_scores_merge_leftmost_first() {
        let tokens: Vec<String> = ["x", "xx"].iter().map(|s| s.to_string()).collect();
        let spm = Spm::new(&tokens, &[0.0, 0.0], None);
        let mut ids = Vec::new();
        spm.encode("xxx", &mut ids);
        assert_eq!(ids, [1, 0]);
    }

    #[test]
    fn long_input_costs_linear_candidates() {
        // 10k characters that keep merging: a quadratic rescan would be visible as far more
        // than three candidates per character.
        let spm = vocab();
        let text = "▁abb".repeat(2_500);
        let mut ids = Vec::new();
        let queued = spm.encode(&text, &mut ids);
        let chars = text.chars().count();
        assert!(
            queued <= 3 * chars,
            "{queued} candidates for {chars} characters"
        );
        assert_eq!(ids.len(), 2 * 2_500);
    }
}
