//! Join tokens: HMAC-SHA256 signed claims naming a room, a role, an expiry
//! and a unique id (so one token can be revoked without touching others).
//!
//! Format: `v1.<base64url(claims JSON)>.<base64url(HMAC-SHA256(secret, "v1.<claims>"))>`.
//! Only URL-safe characters, so a token travels in a query string as is.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use rand::RngCore as _;
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::SignalError;

/// Shortest secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 32;

/// Longest lifetime a token may have. The server refuses tokens whose expiry
/// lies further ahead, which is what lets it forget a revocation after this
/// long.
pub const MAX_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

/// Tokens longer than this are refused unread.
pub const MAX_TOKEN_CHARS: usize = 2048;

const VERSION: &str = "v1";

/// Room names: 1 to 64 of `A-Z a-z 0-9 . _ -`.
pub fn valid_room(room: &str) -> bool {
    (1..=64).contains(&room.len())
        && room
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The shared signing secret. Its bytes never appear in `Debug` output.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

impl Secret {
    /// A fresh random secret of 32 bytes.
    pub fn generate() -> Self {
        let mut bytes = [0u8; MIN_SECRET_BYTES];
        rand::rng().fill_bytes(&mut bytes);
        Self(Arc::from(&bytes[..]))
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, TokenError> {
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(TokenError::SecretTooShort(bytes.len()));
        }
        Ok(Self(Arc::from(bytes)))
    }

    /// Reads a secret file: its raw bytes, all of them, are the secret.
    pub fn read_file(path: &Path) -> Result<Self, SignalError> {
        let bytes = std::fs::read(path).map_err(|source| SignalError::ReadFile {
            path: path.to_owned(),
            source,
        })?;
        Ok(Self::from_bytes(&bytes)?)
    }

    /// Creates a new secret file (64 hex characters, readable by its owner
    /// only) and returns the secret. Refuses to overwrite an existing file.
    pub fn create_file(path: &Path) -> Result<Self, SignalError> {
        use std::io::Write as _;
        let mut raw = [0u8; MIN_SECRET_BYTES];
        rand::rng().fill_bytes(&mut raw);
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt as _;
            options.mode(0o600);
        }
        let write_err = |source| SignalError::WriteFile {
            path: path.to_owned(),
            source,
        };
        let mut file = options.open(path).map_err(write_err)?;
        file.write_all(hex.as_bytes()).map_err(write_err)?;
        Self::from_bytes(hex.as_bytes()).map_err(SignalError::from)
    }

    /// A value only holders of the secret can compute, for `label` (64 hex
    /// characters): an embedder's capability in a URL, stable across
    /// restarts when the secret is.
    pub fn derive(&self, label: &str) -> String {
        let mut mac = self.mac();
        mac.update(b"cairn-derive:");
        mac.update(label.as_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The secret in `path`, created there (0600) when the file does not exist yet.
    pub fn load_or_create(path: &Path) -> Result<Self, SignalError> {
        if path.exists() {
            Self::read_file(path)
        } else {
            Self::create_file(path)
        }
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes keys of any length, so this cannot fail.
        match <Hmac<Sha256> as Mac>::new_from_slice(&self.0) {
            Ok(mac) => mac,
            Err(_) => unreachable!("HMAC accepts keys of every length"),
        }
    }
}

/// What a peer may do in its room.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Worker,
    Coordinator,
    Observer,
    /// Only for the admin endpoint; refused on `/ws`.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Worker => "worker",
            Role::Coordinator => "coordinator",
            Role::Observer => "observer",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The signed content of a token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub room: String,
    pub role: Role,
    /// Expiry, seconds since the Unix epoch.
    pub exp: u64,
    /// Unique id, what `revoke` names.
    pub jti: String,
}

impl Claims {
    /// Claims valid for `ttl` from now (capped at [`MAX_TTL`]), with a fresh
    /// random id.
    pub fn new(room: impl Into<String>, role: Role, ttl: Duration) -> Self {
        let mut id = [0u8; 12];
        rand::rng().fill_bytes(&mut id);
        Self {
            room: room.into(),
            role,
            exp: unix_now().saturating_add(ttl.min(MAX_TTL).as_secs()),
            jti: URL_SAFE_NO_PAD.encode(id),
        }
    }
}

/// Why a token was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("malformed token")]
    Malformed,
    #[error("invalid token signature")]
    BadSignature,
    #[error("token expired")]
    Expired,
    #[error("token lifetime exceeds the server's maximum")]
    LifetimeTooLong,
    #[error("secret too short: {0} bytes, need at least 32")]
    SecretTooShort(usize),
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Signs `claims` into a token string.
pub fn issue(secret: &Secret, claims: &Claims) -> String {
    // Serializing a struct of strings and integers cannot fail.
    let json = serde_json::to_vec(claims).unwrap_or_default();
    let signed = format!("{VERSION}.{}", URL_SAFE_NO_PAD.encode(json));
    let mut mac = secret.mac();
    mac.update(signed.as_bytes());
    let tag = mac.finalize().into_bytes();
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(tag))
}

/// Checks a token's signature and expiry and returns its claims.
pub fn verify(secret: &Secret, token: &str) -> Result<Claims, TokenError> {
    verify_at(secret, token, unix_now())
}

/// [`verify`] against a given clock.
pub fn verify_at(secret: &Secret, token: &str, now: u64) -> Result<Claims, TokenError> {
    if token.len() > MAX_TOKEN_CHARS {
        return Err(TokenError::Malformed);
    }
    let (signed, tag) = token.rsplit_once('.').ok_or(TokenError::Malformed)?;
    let (version, payload) = signed.split_once('.').ok_or(TokenError::Malformed)?;
    if version != VERSION {
        return Err(TokenError::Malformed);
    }
    let tag = URL_SAFE_NO_PAD
        .decode(tag)
        .map_err(|_| TokenError::Malformed)?;
    let mut mac = secret.mac();
    mac.update(signed.as_bytes());
    // Constant-time comparison.
    mac.verify_slice(&tag)
        .map_err(|_| TokenError::BadSignature)?;
    let json = URL_SAFE_NO_PAD
        .decode(payload)
        .map_err(|_| TokenError::Malformed)?;
    let claims: Claims = serde_json::from_slice(&json).map_err(|_| TokenError::Malformed)?;
    if claims.exp <= now {
        return Err(TokenError::Expired);
    }
    // A minute of slack for clocks of issuing and verifying hosts that differ.
    if claims.exp > now.saturating_add(MAX_TTL.as_secs() + 60) {
        return Err(TokenError::LifetimeTooLong);
    }
    Ok(claims)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> Secret {
        Secret::from_bytes(&[7u8; 32]).unwrap()
    }

    #[test]
    fn round_trip() {
        let claims = Claims::new("lab", Role::Worker, Duration::from_secs(60));
        let token = issue(&secret(), &claims);
        assert_eq!(verify(&secret(), &token).unwrap(), claims);
        assert!(
            token
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        );
    }

    #[test]
    fn other_secret_is_refused() {
        let token = issue(
            &secret(),
            &Claims::new("lab", Role::Worker, Duration::from_secs(60)),
        );
        let other = Secret::from_bytes(&[8u8; 32]).unwrap();
        assert_eq!(verify(&other, &token), Err(TokenError::BadSignature));
    }

    #[test]
    fn tampered_claims_are_refused() {
        let token = issue(
            &secret(),
            &Claims::new("lab", Role::Worker, Duration::from_secs(60)),
        );
        let forged_claims = Claims::new("lab", Role::Coordinator, Duration::from_secs(60));
        let forged_payload = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&forged_claims).unwrap());
        let tag = token.rsplit_once('.').unwrap().1;
        let forged = format!("v1.{forged_payload}.{tag}");
        assert_eq!(verify(&secret(), &forged), Err(TokenError::BadSignature));
    }

    #[test]
    fn expiry_and_lifetime() {
        let mut claims = Claims::new("lab", Role::Worker, Duration::from_secs(60));
        let token = issue(&secret(), &claims);
        assert_eq!(
            verify_at(&secret(), &token, claims.exp),
            Err(TokenError::Expired)
        );
        claims.exp = unix_now() + MAX_TTL.as_secs() * 2;
        let token = issue(&secret(), &claims);
        assert_eq!(verify(&secret(), &token), Err(TokenError::LifetimeTooLong));
    }

    #[test]
    fn garbage_is_malformed() {
        for bad in ["", "abc", "v1.x", "v2.e30.AAAA", &"a".repeat(5000)] {
            assert!(verify(&secret(), bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn short_secret_is_refused() {
        assert_eq!(
            Secret::from_bytes(b"short").unwrap_err(),
            TokenError::SecretTooShort(5)
        );
    }

    #[test]
    fn room_names() {
        assert!(valid_room("default"));
        assert!(valid_room("lab-2.gpu_pool"));
        assert!(!valid_room(""));
        assert!(!valid_room("a b"));
        assert!(!valid_room(&"r".repeat(65)));
    }
}
