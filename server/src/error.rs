use std::path::PathBuf;

/// Errors the library reports to its embedder.
#[derive(Debug, thiserror::Error)]
pub enum SignalError {
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot read {path}: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    WriteFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("TLS: {0}")]
    Tls(String),
    #[error("mDNS: {0}")]
    Mdns(String),
    #[error(transparent)]
    Token(#[from] crate::token::TokenError),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}
