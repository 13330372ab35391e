//! The file types `cairn quantize` writes, and the type each tensor gets in them, following
//! llama.cpp's `llama-quantize` rules for dense models: the output head (or a tied embedding)
//! at Q6_K, attention-value and feed-forward-down matrices one step up on some layers in the
//! `_M` mixtures, and rows whose length is not a multiple of 256 falling back to a 32-element
//! format (Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0). Norms and other vectors stay as they are.

use super::GgmlType;

/// A target file type, named as llama.cpp names them.
// GGML's own names, which users type and files record.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileType {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
}

impl FileType {
    pub const ALL: [FileType; 10] = [
        FileType::Q4_0,
        FileType::Q4_1,
        FileType::Q5_0,
        FileType::Q5_1,
        FileType::Q8_0,
        FileType::Q4_K_S,
        FileType::Q4_K_M,
        FileType::Q5_K_S,
        FileType::Q5_K_M,
        FileType::Q6_K,
    ];

    /// Parses a name, case-insensitively; `Q4_K` and `Q5_K` mean their `_M` mixtures, as in
    /// llama-quantize.
    pub fn parse(name: &str) -> Option<FileType> {
        let up = name.to_ascii_uppercase();
        let up = match up.as_str() {
            "Q4_K" => "Q4_K_M",
            "Q5_K" => "Q5_K_M",
            other => other,
        };
        FileType::ALL.into_iter().find(|t| t.name() == up)
    }

    pub fn name(self) -> &'static str {
        match self {
            FileType::Q4_0 => "Q4_0",
            FileType::Q4_1 => "Q4_1",
            FileType::Q5_0 => "Q5_0",
            FileType::Q5_1 => "Q5_1",
            FileType::Q8_0 => "Q8_0",
            FileType::Q4_K_S => "Q4_K_S",
            FileType::Q4_K_M => "Q4_K_M",
            FileType::Q5_K_S => "Q5_K_S",
            FileType::Q5_K_M => "Q5_K_M",
            FileType::Q6_K => "Q6_K",
        }
    }

    /// The names `parse` accepts, for error messages.
    pub fn names() -> String {
        FileType::ALL.map(FileType::name).join(", ")
    }

    /// llama.cpp's `general.file_type` value for this mixture.
    pub fn gguf_id(self) -> u32 {
        match self {
            FileType::Q4_0 => 2,
            FileType::Q4_1 => 3,
            FileType::Q8_0 => 7,
            FileType::Q5_0 => 8,
            FileType::Q5_1 => 9,
            FileType::Q4_K_S => 14,
            FileType::Q4_K_M => 15,
            FileType::Q5_K_S => 16,
            FileType::Q5_K_M => 17,
            FileType::Q6_K => 18,
        }
    }

    /// The type of matrices no rule singles out.
    pub fn base(self) -> GgmlType {
        match self {
            FileType::Q4_0 => GgmlType::Q4_0,
            FileType::Q4_1 => GgmlType::Q4_1,
            FileType::Q5_0 => GgmlType::Q5_0,
            FileType::Q5_1 => GgmlType::Q5_1,
            FileType::Q8_0 => GgmlType::Q8_0,
            FileType::Q4_K_S | FileType::Q4_K_M => GgmlType::Q4_K,
            FileType::Q5_K_S | FileType::Q5_K_M => GgmlType::Q5_K,
            FileType::Q6_K => GgmlType::Q6_K,
        }
    }
}

/// What the rules need to know about the model.
#[derive(Debug, Clone, Copy)]
pub struct ModelShape {
    pub n_layers: usize,
    /// No `output.weight`: the token embedding is also the output head.
    pub tied_output: bool,
}

/// The type tensor `name` of shape `dims` (GGUF order, `dims[0]` the row length) gets in a
/// file of type `ft`, or `None` to keep it as it is (vectors, norms).
pub fn tensor_type(ft: FileType, shape: ModelShape, name: &str, dims: &[u64]) -> Option<GgmlType> {
    // ggml's dimension count: up to the last dimension above 1.
    let matrix = dims.iter().rposition(|d| *d > 1).is_some_and(|i| i >= 1);
    if !matrix || !name.ends_with(".weight") || name.contains("_norm") {
        return None;
    }
    let nx = dims.first().copied().unwrap_or(0);
    let layer = layer_of(name);
    let more_bits = |i: usize| {
        let n = shape.n_layers;
        i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64).rem_euclid(3) == 2
    };
    let mixture_m = matches!(ft, FileType::Q4_K_M | FileType::Q5_K_M);
    let mut ty = ft.base();
    if name == "output.weight" || (shape.tied_output && name == "token_embd.weight") {
        ty = if !nx.is_multiple_of(ty.block_len() as u64) {
            GgmlType::Q8_0
        } else if ty != GgmlType::Q8_0 {
            GgmlType::Q6_K
        } else {
            ty
        };
    } else if name.ends_with("attn_v.weight") {
        if let Some(i) = layer {
            if mixture_m && more_bits(i) {
                ty = GgmlType::Q6_K;
            } else if ft == FileType::Q4_K_S && i < 4 {
                ty = GgmlType::Q5_K;
            }
        }
    } else if name.ends_with("ffn_down.weight") {
        if let Some(i) = layer {
            if mixture_m && more_bits(i) {
                ty = GgmlType::Q6_K;
            } else if ft == FileType::Q4_K_S && i < shape.n_layers / 8 {
                ty = GgmlType::Q5_K;
            }
        }
    } else if name.ends_with("attn_qkv.weight") {
        match ft {
            FileType::Q4_K_M => ty = GgmlType::Q5_K,
            FileType::Q5_K_M => ty = GgmlType::Q6_K,
            _ => {}
        }
    }
    Some(fallback(ty, nx))
}

/// A 32-element format for rows a 256-element super-block does not divide, and F16 where
/// even 32 does not.
fn fallback(ty: GgmlType, nx: u64) -> GgmlType {
    let fits = |t: GgmlType| nx.is_multiple_of(t.block_len() as u64);
    if fits(ty) {
        return ty;
    }
    let smaller = match ty {
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        other => other,
    };
    if fits(smaller) {
        smaller
    } else {
        GgmlType::F16
    }
}

/// `N` of a `blk.N.` tensor name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: ModelShape = ModelShape {
        n_layers: 30,
        tied_output: true,
    };

    #[test]
    fn names_parse_like_llama_quantize() {
        assert_eq!(FileType::parse("q4_k_m"), Some(FileType::Q4_K_M));
        assert_eq!(FileType::parse("Q4_K"), Some(FileType::Q4_K_M));
        assert_eq!(FileType::parse("Q5_K"), Some(FileType::Q5_K_M));
        assert_eq!(FileType::parse("Q6_K"), Some(FileType::Q6_K));
        assert_eq!(FileType::parse("IQ4_XS"), None);
        assert_eq!(FileType::parse("F16"), None);
    }

    #[test]
    fn q4_k_m_rules() {
        let t = |name: &str, nx: u64| tensor_type(FileType::Q4_K_M, SHAPE, name, &[nx, 64]);
        // Layers 0-2, 26-29 and every third from 5 get more bits.
        assert_eq!(t("blk.0.ffn_down.weight", 1536), Some(GgmlType::Q6_K));
        assert_eq!(t("blk.3.ffn_down.weight", 1536), Some(GgmlType::Q4_K));
        assert_eq!(t("blk.5.ffn_down.weight", 1536), Some(GgmlType::Q6_K));
        assert_eq!(t("blk.6.ffn_down.weight", 1536), Some(GgmlType::Q4_K));
        assert_eq!(t("blk.26.ffn_down.weight", 1536), Some(GgmlType::Q6_K));
        // Rows of 576 fall back.
        assert_eq!(t("blk.0.attn_v.weight", 576), Some(GgmlType::Q8_0));
        assert_eq!(t("blk.4.attn_v.weight", 576), Some(GgmlType::Q5_0));
        assert_eq!(t("blk.4.attn_v.weight", 512), Some(GgmlType::Q4_K));
        assert_eq!(t("blk.4.attn_q.weight", 576), Some(GgmlType::Q5_0));
        assert_eq!(t("token_embd.weight", 576), Some(GgmlType::Q8_0));
        assert_eq!(t("token_embd.weight", 512), Some(GgmlType::Q6_K));
        assert_eq!(t("blk.4.attn_qkv.weight", 512), Some(GgmlType::Q5_K));
        assert_eq!(
            tensor_type(FileType::Q4_K_M, SHAPE, "blk.0.attn_norm.weight", &[576]),
            None
        );
        assert_eq!(fallback(GgmlType::Q4_K, 100), GgmlType::F16);
    }

    #[test]
    fn untied_embedding_keeps_the_base_type_and_output_gets_q6_k() {
        let shape = ModelShape {
            n_layers: 16,
            tied_output: false,
        };
        let t = |name: &str| tensor_type(FileType::Q4_0, shape, name, &[2048, 64]);
        assert_eq!(t("token_embd.weight"), Some(GgmlType::Q4_0));
        assert_eq!(t("output.weight"), Some(GgmlType::Q6_K));
        assert_eq!(
            tensor_type(FileType::Q8_0, shape, "output.weight", &[2048, 64]),
            Some(GgmlType::Q8_0)
        );
    }
}
