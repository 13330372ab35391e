//! GGUF reader: header, metadata, tensor infos and tensor data.
