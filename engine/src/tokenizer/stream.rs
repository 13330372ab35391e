//! Incremental detokenization for streaming output: a character split across tokens is
//! held back until its last byte arrives, so streamed text never shows broken characters.

use super::{Tokenizer, TokenizerError};

/// Turns generated ids into text one id at a time. Created by [`Tokenizer::decoder`].
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    pub(crate) fn new(tokenizer: &'a Tokenizer) -> Self {
        StreamDecoder {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text that is now complete, if any. Bytes that can never
    /// become valid UTF-8 are emitted as U+FFFD rather than held forever.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        let piece = self.tokenizer.piece(id)?;
        self.pending.extend_from_slice(piece);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix was just validated, so this cannot fail.
                    out.push_str(
                        std::str::from_utf8(&self.pending[start..start + valid]).unwrap_or(""),
                    );
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += valid + bad;
                        }
                        None => {
                            // An incomplete character at the end: wait for more bytes.
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        Ok((!out.is_empty()).then_some(out))
    }

    /// Text held back for an unfinished character, flushed at the end of generation.
    pub fn finish(self) -> Option<String> {
        (!self.pending.is_empty()).then(|| String::from_utf8_lossy(&self.pending).into_owned())
    }

    /// Whether bytes of an unfinished character are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}
