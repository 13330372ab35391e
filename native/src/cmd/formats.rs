//! What a model file holds, in one line for logs and tables: its architecture and how many
//! tensors of each weight format, most common first ("llama, Q5_0 x 166, Q4_K x 16, ...").

use cairn_engine::gguf::GgufFile;
use cairn_engine::quant::GgmlType;

#[derive(Debug, Clone)]
pub struct ModelFormats {
    pub architecture: String,
    /// (type, tensors), most tensors first, then in GGML's type order.
    pub formats: Vec<(GgmlType, usize)>,
}

impl ModelFormats {
    pub fn of(file: &GgufFile) -> ModelFormats {
        let mut formats: Vec<(GgmlType, usize)> = GgmlType::ALL
            .into_iter()
            .map(|ty| (ty, file.tensors.iter().filter(|t| t.ty == ty).count()))
            .filter(|(_, n)| *n > 0)
            .collect();
        formats.sort_by_key(|(ty, n)| (std::cmp::Reverse(*n), ty.id()));
        ModelFormats {
            architecture: file.architecture().unwrap_or("unknown").to_string(),
            formats,
        }
    }

    /// The formats alone: "Q5_0 x 166, Q4_K x 16".
    pub fn formats_line(&self) -> String {
        self.formats
            .iter()
            .map(|(ty, n)| format!("{} x {n}", ty.name()))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// JSON: `{"architecture": "llama", "formats": [{"type": "Q5_0", "tensors": 166}, ...]}`,
    /// formats in this order.
    pub fn json(&self) -> serde_json::Value {
        let formats: Vec<serde_json::Value> = self
            .formats
            .iter()
            .map(|(ty, n)| serde_json::json!({ "type": ty.name(), "tensors": n }))
            .collect();
        serde_json::json!({ "architecture": self.architecture, "formats": formats })
    }
}

impl std::fmt::Display for ModelFormats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}, {}", self.architecture, self.formats_line())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_engine::gguf::{BytesGguf, GgufWriter};

    #[test]
    fn counts_each_format_most_common_first() {
        let mut w = GgufWriter::new();
        w.add("general.architecture", "qwen2");
        w.add_tensor("a", &[32, 2], GgmlType::Q8_0, vec![0u8; 68]);
        w.add_tensor("b", &[4], GgmlType::F32, vec![0u8; 16]);
        w.add_tensor("c", &[4], GgmlType::F32, vec![0u8; 16]);
        w.add_tensor("d", &[256], GgmlType::Q4_K, vec![0u8; 144]);
        let file = BytesGguf::new(w.finish()).unwrap();
        let m = ModelFormats::of(&file.file);
        assert_eq!(m.to_string(), "qwen2, F32 x 2, Q8_0 x 1, Q4_K x 1");
        assert_eq!(
            m.json().to_string(),
            r#"{"architecture":"qwen2","formats":[{"tensors":2,"type":"F32"},{"tensors":1,"type":"Q8_0"},{"tensors":1,"type":"Q4_K"}]}"#
        );
    }
}
