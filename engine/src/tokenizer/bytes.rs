//! The byte-level alphabet of GPT-2-style vocabularies: every byte is written as one
//! printable character, so token strings are valid text. Decoding maps them back.

/// Bytes that stand for themselves; the other 68 are shifted to U+0100 and up, in order.
fn is_self_mapped(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The character byte `b` is written as.
pub(crate) fn byte_char(b: u8) -> char {
    if is_self_mapped(b) {
        char::from(b)
    } else {
        // Rank of `b` among the bytes that are not self-mapped.
        let rank = (0..b).filter(|&x| !is_self_mapped(x)).count() as u32;
        char::from_u32(0x100 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
    }
}

/// Character (as a code point below 0x144) to byte; `None` where no byte maps there.
pub(crate) struct ByteDecoder {
    table: [Option<u8>; 0x144],
}

impl ByteDecoder {
    pub fn new() -> Self {
        let mut table = [None; 0x144];
        for b in 0..=255u8 {
            table[byte_char(b) as usize] = Some(b);
        }
        ByteDecoder { table }
    }

    /// Appends the bytes a byte-level token string stands for. A character outside the
    /// alphabet (a malformed vocabulary) is kept as its own UTF-8 rather than dropped.
    pub fn decode_into(&self, token: &str, out: &mut Vec<u8>) {
        for c in token.chars() {
            match self.table.get(c as usize).copied().flatten() {
                Some(b) => out.push(b),
                None => {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection_onto_bytes() {
        let d = ByteDecoder::new();
        let mapped: Vec<u8> = d.table.iter().flatten().copied().collect();
        assert_eq!(mapped.len(), 256);
        let mut sorted = mapped.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
        let mut out = Vec::new();
        // 'Ġ' is the space, 'Ċ' the newline in GPT-2 vocabularies.
        d.decode_into("ĠhelloĊ", &mut out);
        assert_eq!(out, b" hello\n");
    }
}
