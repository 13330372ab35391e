//! LAN discovery over mDNS/DNS-SD: the server announces `_cairn._tcp` with
//! its URL and certificate fingerprint in the TXT record, and native workers
//! browse for it instead of asking for an address.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use mdns_sd::{ServiceDaemon, ServiceEvent, ServiceInfo};
use tracing::{debug, info};

use crate::SignalError;

/// The DNS-SD service type.
pub const SERVICE_TYPE: &str = "_cairn._tcp.local.";

/// TXT keys: protocol version, WebSocket base URL, certificate fingerprint.
pub const TXT_VERSION: &str = "v";
pub const TXT_URL: &str = "url";
pub const TXT_FINGERPRINT: &str = "fp";

/// This host's name as one DNS label (`a-z 0-9 -`), if it has one.
pub fn host_label() -> Option<String> {
    let raw = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())?;
    let label: String = raw
        .trim()
        .split('.')
        .next()
        .unwrap_or_default()
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(63)
        .collect();
    let label = label.trim_matches('-').to_owned();
    (!label.is_empty()).then_some(label)
}

fn mdns_err(e: mdns_sd::Error) -> SignalError {
    SignalError::Mdns(e.to_string())
}

/// The addresses peers on the LAN can reach a server on `listen` at.
fn announced_addresses(listen: SocketAddr) -> Vec<IpAddr> {
    if !listen.ip().is_unspecified() {
        return vec![listen.ip()];
    }
    let mut addrs: Vec<IpAddr> = if_addrs::get_if_addrs()
        .unwrap_or_default()
        .into_iter()
        .map(|i| i.ip())
        .filter(|ip| listen.is_ipv6() || ip.is_ipv4())
        .collect();
    // LAN addresses first, so the URL in the TXT record is one peers can use.
    addrs.sort_by_key(|ip| (ip.is_loopback(), ip.is_ipv6()));
    addrs.dedup();
    addrs
}

/// A live announcement; withdrawn by [`Announcement::stop`] or on drop.
pub(crate) struct Announcement {
    daemon: ServiceDaemon,
    fullname: String,
}

impl Announcement {
    pub(crate) fn start(
        listen: SocketAddr,
        tls: bool,
        fingerprint: Option<&str>,
    ) -> Result<Self, SignalError> {
        let addrs = announced_addresses(listen);
        let Some(first) = addrs.first() else {
            return Err(SignalError::Mdns("no interface address to announce".into()));
        };
        let scheme = if tls { "wss" } else { "ws" };
        let url = format!("{scheme}://{}", SocketAddr::new(*first, listen.port()));
        let host = host_label().unwrap_or_else(|| "cairn".to_owned());
        let instance = format!("cairn-signal-{host}-{}", listen.port());
        let mut txt = vec![(TXT_VERSION, "1".to_owned()), (TXT_URL, url.clone())];
        if let Some(fp) = fingerprint {
            txt.push((TXT_FINGERPRINT, fp.to_owned()));
        }
        let daemon = ServiceDaemon::new().map_err(mdns_err)?;
        let info = ServiceInfo::new(
            SERVICE_TYPE,
            &instance,
            &format!("{host}.local."),
            addrs.as_slice(),
            listen.port(),
            &txt[..],
        )
        .map_err(mdns_err)?;
        let fullname = info.get_fullname().to_owned();
        daemon.register(info).map_err(mdns_err)?;
        info!(%instance, %url, "announced over mDNS");
        Ok(Self { daemon, fullname })
    }

    /// Does not block: the daemon thread handles its commands in order, so
    /// the goodbye for the unregistration goes out before it exits.
    pub(crate) fn stop(self) {
        // A goodbye makes browsers forget us at once, not after the TTL.
        let _ = self.daemon.unregister(&self.fullname);
        let _ = self.daemon.shutdown();
    }
}

/// A server found on the LAN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovered {
    /// DNS-SD instance name.
    pub instance: String,
    /// WebSocket base URL from the TXT record, for `SignalClient::connect`.
    pub url: String,
    /// Certificate fingerprint to pin, when the server speaks TLS.
    pub fingerprint: Option<String>,
    pub addresses: Vec<IpAddr>,
    pub port: u16,
}

/// Browses the LAN for `timeout` and returns every server found.
pub async fn discover(timeout: Duration) -> Result<Vec<Discovered>, SignalError> {
    tokio::task::spawn_blocking(move || discover_blocking(timeout))
        .await
        .map_err(|e| SignalError::Mdns(e.to_string()))?
}

fn discover_blocking(timeout: Duration) -> Result<Vec<Discovered>, SignalError> {
    let daemon = ServiceDaemon::new().map_err(mdns_err)?;
    let events = daemon.browse(SERVICE_TYPE).map_err(mdns_err)?;
    let deadline = Instant::now() + timeout;
    let mut found = BTreeMap::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Ok(event) = events.recv_timeout(left) else {
            break;
        };
        if let ServiceEvent::ServiceResolved(service) = event {
            let Some(url) = service.get_property_val_str(TXT_URL) else {
                debug!(name = service.get_fullname(), "announcement without url");
                continue;
            };
            let mut addresses: Vec<IpAddr> = service
                .get_addresses()
                .iter()
                .map(|a| a.to_ip_addr())
                .collect();
            addresses.sort();
            found.insert(
                service.get_fullname().to_owned(),
                Discovered {
                    instance: service.get_fullname().to_owned(),
                    url: url.to_owned(),
                    fingerprint: service
                        .get_property_val_str(TXT_FINGERPRINT)
                        .map(str::to_owned),
                    addresses,
                    port: service.get_port(),
                },
            );
        }
    }
    let _ = daemon.shutdown();
    Ok(found.into_values().collect())
}
