//! Where tensor bytes come from: a whole file in memory, or a memory map.

use super::{GgufError, GgufFile};

/// A parsed file together with access to its tensor bytes, so model loading works the same
/// over a memory map and over bytes in memory.
pub trait TensorSource {
    fn gguf(&self) -> &GgufFile;

    /// The raw (still quantized) bytes of a tensor; the error names a missing tensor.
    fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError>;
}

/// Slices a tensor's bytes out of the whole file.
fn slice<'a>(file: &GgufFile, bytes: &'a [u8], name: &str) -> Result<&'a [u8], GgufError> {
    let t = file.require_tensor(name)?;
    let range = file.tensor_range(t);
    // `parse` already checked the range against these very bytes; this is for a `GgufFile`
    // that was edited or paired with other bytes.
    usize::try_from(range.start)
        .ok()
        .zip(usize::try_from(range.end).ok())
        .and_then(|(start, end)| bytes.get(start..end))
        .ok_or_else(|| GgufError::TensorOutOfBounds {
            tensor: name.to_owned(),
            start: range.start,
            end: range.end,
            file_len: bytes.len() as u64,
        })
}

/// A whole GGUF file held in memory (wasm, tests).
#[derive(Debug, Clone)]
pub struct BytesGguf {
    pub file: GgufFile,
    pub data: Vec<u8>,
}

impl BytesGguf {
    pub fn new(data: Vec<u8>) -> Result<Self, GgufError> {
        let file = GgufFile::parse(&data)?;
        Ok(BytesGguf { file, data })
    }

    /// Reads a whole file from a stream; memory grows with the bytes actually read.
    pub fn from_reader(mut reader: impl std::io::Read) -> Result<Self, GgufError> {
        let mut data = Vec::new();
        reader.read_to_end(&mut data)?;
        Self::new(data)
    }

    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        slice(&self.file, &self.data, name)
    }
}

impl TensorSource for BytesGguf {
    fn gguf(&self) -> &GgufFile {
        &self.file
    }

    fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        BytesGguf::tensor_data(self, name)
    }
}

#[cfg(not(target_arch = "wasm32"))]
pub use mapped::MappedGguf;

#[cfg(not(target_arch = "wasm32"))]
mod mapped {
    use std::path::Path;

    use super::{GgufError, GgufFile, TensorSource, slice};

    /// A GGUF file memory-mapped read-only; tensor bytes are read in place, paged in on use.
    #[derive(Debug)]
    pub struct MappedGguf {
        pub file: GgufFile,
        mmap: memmap2::Mmap,
    }

    impl MappedGguf {
        pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
            let path = path.as_ref();
            let open_err = |source| GgufError::Open {
                path: path.to_owned(),
                source,
            };
            let f = std::fs::File::open(path).map_err(open_err)?;
            // SAFETY: the map is read-only and lives as long as `self`. The one assumption
            // is that nobody truncates or rewrites the model file while it is mapped: that
            // would change bytes behind `&[u8]`s we hand out (or fault on a shrunk file). We
            // treat model files as immutable, as every mmap-based loader does.
            let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(open_err)?;
            let file = GgufFile::parse(&mmap)?;
            Ok(MappedGguf { file, mmap })
        }

        pub fn bytes(&self) -> &[u8] {
            &self.mmap
        }

        pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
            slice(&self.file, &self.mmap, name)
        }
    }

    impl TensorSource for MappedGguf {
        fn gguf(&self) -> &GgufFile {
            &self.file
        }

        fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
            MappedGguf::tensor_data(self, name)
        }
    }
}
