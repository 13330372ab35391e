//! A real TURN server (the `turn` crate's) on loopback, for relay-only links.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// The one user the server knows.
pub const USER: &str = "cairn";
/// Its password.
pub const PASSWORD: &str = "relay-secret";

/// Long-term credentials for [`USER`] (RFC 8656 section 9.2).
pub(crate) struct Auth;

impl turn::auth::AuthHandler for Auth {
    fn auth_handle(
        &self,
        username: &str,
        realm: &str,
        _src: SocketAddr,
    ) -> Result<Vec<u8>, turn::Error> {
        if username == USER {
            Ok(turn::auth::generate_auth_key(username, realm, PASSWORD))
        } else {
            Err(turn::Error::ErrFakeErr)
        }
    }
}

/// A TURN server listening on a free loopback UDP port and relaying on loopback.
pub async fn start() -> (turn::server::Server, SocketAddr) {
    use turn::relay::relay_static::RelayAddressGeneratorStatic;
    use turn::server::config::{ConnConfig, ServerConfig};
    let conn = Arc::new(
        tokio::net::UdpSocket::bind("127.0.0.1:0")
            .await
            .expect("bind the TURN server's socket"),
    );
    let addr = conn.local_addr().expect("the TURN server's address");
    let server = turn::server::Server::new(ServerConfig {
        conn_configs: vec![ConnConfig {
            conn,
            relay_addr_generator: Box::new(RelayAddressGeneratorStatic {
                relay_address: IpAddr::from([127, 0, 0, 1]),
                address: "127.0.0.1".into(),
                net: Arc::new(webrtc_util::vnet::net::Net::new(None)),
            }),
        }],
        realm: "cairn.test".into(),
        auth_handler: Arc::new(Auth),
        channel_bind_timeout: Duration::ZERO,
        alloc_close_notify: None,
    })
    .await
    .expect("start the TURN server");
    (server, addr)
}

/// Bytes each of [`USER`]'s allocations relayed, by relay address.
pub async fn relayed_bytes(server: &turn::server::Server) -> HashMap<SocketAddr, u64> {
    server
        .get_allocations_info(None)
        .await
        .expect("the TURN server's allocations")
        .values()
        .filter(|a| a.username == USER)
        .map(|a| (a.relay_addr, a.relayed_bytes as u64))
        .collect()
}
