//! TLS for the server (PEM files or a self-signed certificate for this
//! host's LAN names) and for clients (public roots, or a pinned fingerprint
//! for a self-signed server).

use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use sha2::{Digest as _, Sha256};

use crate::SignalError;

/// A server certificate ready to serve.
pub(crate) struct TlsMaterial {
    pub config: Arc<rustls::ServerConfig>,
    pub fingerprint: String,
    pub cert_pem: String,
}

/// A freshly generated self-signed certificate.
pub struct GeneratedCert {
    pub cert_pem: String,
    pub key_pem: String,
    pub fingerprint: String,
}

/// Which server certificates a client accepts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ServerTrust {
    /// Certificates chaining to the public web roots (a reverse proxy with a
    /// real certificate).
    #[default]
    PublicRoots,
    /// Exactly the certificate with this SHA-256 fingerprint (hex, colons
    /// optional): what `--tls-self-signed` prints and mDNS announces.
    Fingerprint(String),
}

// Pinned explicitly so the build does not depend on which rustls backends
// other crates in the same binary switch on.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// SHA-256 of a DER certificate as uppercase hex pairs joined by colons,
/// the form browsers show.
pub fn fingerprint(der: &[u8]) -> String {
    let digest = Sha256::digest(der);
    digest
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Uppercase hex without separators, for comparing fingerprints however
/// they were typed.
pub fn normalize_fingerprint(text: &str) -> String {
    text.chars()
        .filter(|c| c.is_ascii_hexdigit())
        .map(|c| c.to_ascii_uppercase())
        .collect()
}

/// Names a certificate for this host should cover: localhost, loopback,
/// `<hostname>.local` and every non-loopback interface address.
pub fn local_names() -> Vec<String> {
    let mut names = vec![
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
        "::1".to_owned(),
    ];
    if let Some(host) = crate::mdns::host_label() {
        names.push(format!("{host}.local"));
    }
    if let Ok(interfaces) = if_addrs::get_if_addrs() {
        for interface in interfaces {
            let ip = interface.ip();
            let link_local = match ip {
                IpAddr::V4(v4) => v4.is_link_local(),
                IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
            };
            if !ip.is_loopback() && !link_local {
                names.push(ip.to_string());
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

/// Generates a self-signed certificate for `names` (DNS names or IPs),
/// valid from yesterday for 397 days: Apple platforms refuse server
/// certificates valid longer than 825 days, browsers anything over 398.
pub fn generate_self_signed(names: &[String]) -> Result<GeneratedCert, SignalError> {
    use rcgen::{
        CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, KeyPair,
        KeyUsagePurpose,
    };
    let tls_err = |e: rcgen::Error| SignalError::Tls(e.to_string());
    let mut params = CertificateParams::new(names.to_vec()).map_err(tls_err)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "cairn-signal");
    params.distinguished_name = dn;
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(397);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate().map_err(tls_err)?;
    let cert = params.self_signed(&key).map_err(tls_err)?;
    Ok(GeneratedCert {
        fingerprint: fingerprint(cert.der()),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

pub(crate) fn self_signed() -> Result<TlsMaterial, SignalError> {
    let generated = generate_self_signed(&local_names())?;
    material(generated.cert_pem.as_bytes(), generated.key_pem.as_bytes())
}

pub(crate) fn load_files(cert: &Path, key: &Path) -> Result<TlsMaterial, SignalError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| SignalError::ReadFile {
            path: path.to_owned(),
            source,
        })
    };
    material(&read(cert)?, &read(key)?)
}

fn material(cert_pem: &[u8], key_pem: &[u8]) -> Result<TlsMaterial, SignalError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| SignalError::Tls(format!("certificate PEM: {e}")))?;
    let Some(leaf) = chain.first() else {
        return Err(SignalError::Tls("no certificate in the PEM file".into()));
    };
    let fingerprint = fingerprint(leaf);
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| SignalError::Tls(format!("private key PEM: {e}")))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| SignalError::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| SignalError::Tls(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsMaterial {
        config: Arc::new(config),
        fingerprint,
        cert_pem: String::from_utf8_lossy(cert_pem).into_owned(),
    })
}

pub(crate) fn client_config(trust: &ServerTrust) -> Result<Arc<rustls::ClientConfig>, SignalError> {
    let tls_err = |e: rustls::Error| SignalError::Tls(e.to_string());
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?;
    let mut config = match trust {
        ServerTrust::PublicRoots => {
            let roots = rustls::RootCertStore {
                roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
            };
            builder.with_root_certificates(roots).with_no_client_auth()
        }
        ServerTrust::Fingerprint(expected) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(PinnedCertificate {
                expected: normalize_fingerprint(expected),
                provider: provider(),
            }))
            .with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Accepts one certificate, named by its SHA-256. Names and chains do not
/// matter: the pin was learned out of band (printed by the server, or in
/// its mDNS record), which is the whole trust decision. Handshake signatures
/// are still checked, so only the key's holder passes.
#[derive(Debug)]
struct PinnedCertificate {
    expected: String,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCertificate {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if normalize_fingerprint(&fingerprint(end_entity)) == self.expected {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "server certificate does not match the pinned fingerprint".into(),
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_certificate_loads_and_fingerprint_matches() {
        let generated = generate_self_signed(&["localhost".into(), "127.0.0.1".into()]).unwrap();
        let loaded = material(generated.cert_pem.as_bytes(), generated.key_pem.as_bytes()).unwrap();
        assert_eq!(loaded.fingerprint, generated.fingerprint);
        assert_eq!(normalize_fingerprint(&loaded.fingerprint).len(), 64);
    }

    #[test]
    fn fingerprints_compare_however_typed() {
        assert_eq!(
            normalize_fingerprint("ab:cd:EF"),
            normalize_fingerprint("ABCDef")
        );
    }
}
