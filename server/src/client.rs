//! A client for other crates (native workers, the coordinator): connects to
//! `/ws`, hands back typed [`ServerMessage`]s and sends [`ClientMessage`]s.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{SinkExt as _, Stream, StreamExt as _};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};
use tracing::debug;

use crate::protocol::{ClientMessage, PeerId, PeerInfo, ServerMessage};
pub use crate::tls::ServerTrust;
use crate::token::{MAX_TOKEN_CHARS, valid_room};

/// Messages buffered towards the application before the client stops
/// reading the socket (and the server, in turn, drops it as too slow).
const EVENT_BUFFER: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid server URL: {0}")]
    InvalidUrl(String),
    #[error("invalid room name (1-64 of A-Z a-z 0-9 . _ -)")]
    InvalidRoom,
    #[error("token has characters a token cannot have")]
    InvalidToken,
    #[error("connect: {0}")]
    Io(#[from] std::io::Error),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("server refused: {status} {reason}")]
    Refused { status: u16, reason: String },
    #[error("WebSocket: {0}")]
    WebSocket(String),
    #[error("timed out")]
    Timeout,
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("connection closed{}", .0.as_ref().map(|c| format!(": {} {}", c.code, c.reason)).unwrap_or_default())]
    Closed(Option<CloseInfo>),
}

/// How a session ended, as the server said in its close frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloseInfo {
    pub code: u16,
    pub reason: String,
}

/// Connection settings.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    pub trust: ServerTrust,
    /// For TCP, TLS, the upgrade and the welcome together.
    pub timeout: Duration,
    /// Largest message accepted from the server.
    pub max_message_bytes: usize,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            trust: ServerTrust::default(),
            timeout: Duration::from_secs(10),
            max_message_bytes: 4 * 1024 * 1024,
        }
    }
}

/// A server base URL taken apart: `ws://`, `wss://`, `http://` or `https://`,
/// with an optional path prefix for servers behind a reverse proxy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub tls: bool,
    /// As in the URL, brackets around IPv6 included.
    pub authority: String,
    /// Without brackets: for DNS, TLS names and TCP.
    pub host: String,
    pub port: u16,
    /// No trailing slash; empty at the root.
    pub prefix: String,
}

impl Endpoint {
    pub(crate) fn parse(url: &str) -> Result<Self, ClientError> {
        let bad = || ClientError::InvalidUrl(url.to_owned());
        let uri: axum::http::Uri = url.parse().map_err(|_| bad())?;
        let tls = match uri.scheme_str() {
            Some("ws" | "http") => false,
            Some("wss" | "https") => true,
            _ => return Err(bad()),
        };
        let authority = uri.authority().ok_or_else(bad)?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let authority = match authority.port_u16() {
            Some(_) => authority.as_str().to_owned(),
            None => format!("{}:{port}", authority.host()),
        };
        let prefix = uri.path().trim_end_matches('/').to_owned();
        Ok(Self {
            tls,
            authority,
            host,
            port,
            prefix,
        })
    }

    fn ws_url(&self, path_and_query: &str) -> String {
        let scheme = if self.tls { "wss" } else { "ws" };
        format!(
            "{scheme}://{}{}{path_and_query}",
            self.authority, self.prefix
        )
    }
}

/// A byte stream to the server, plain or TLS.
pub(crate) trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

pub(crate) async fn open(
    endpoint: &Endpoint,
    trust: &ServerTrust,
) -> Result<Box<dyn Io>, ClientError> {
    let tcp = TcpStream::connect((endpoint.host.as_str(), endpoint.port)).await?;
    let _ = tcp.set_nodelay(true);
    if !endpoint.tls {
        return Ok(Box::new(tcp));
    }
    let config = crate::tls::client_config(trust).map_err(|e| ClientError::Tls(e.to_string()))?;
    let name = rustls::pki_types::ServerName::try_from(endpoint.host.clone())
        .map_err(|e| ClientError::Tls(e.to_string()))?;
    let stream = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| ClientError::Tls(e.to_string()))?;
    Ok(Box::new(stream))
}

/// Sends [`ClientMessage`]s on a session; cheap to clone.
#[derive(Clone, Debug)]
pub struct SignalSender(mpsc::Sender<ClientMessage>);

impl SignalSender {
    pub async fn send(&self, message: ClientMessage) -> Result<(), ClientError> {
        self.0
            .send(message)
            .await
            .map_err(|_| ClientError::Closed(None))
    }
}

/// One session with the signaling server. Also a [`Stream`] of
/// [`ServerMessage`]s, which ends when the session does.
pub struct SignalClient {
    peer_id: PeerId,
    peers: Vec<PeerInfo>,
    events: mpsc::Receiver<ServerMessage>,
    sender: SignalSender,
    closed: Arc<Mutex<Option<CloseInfo>>>,
}

impl SignalClient {
    /// Joins `room` on the server at `url` (`ws://host:port`, `wss://...`,
    /// optionally with a path prefix) and waits for the welcome.
    pub async fn connect(url: &str, room: &str, token: &str) -> Result<Self, ClientError> {
        Self::connect_with(url, room, token, &ConnectOptions::default()).await
    }

    pub async fn connect_with(
        url: &str,
        room: &str,
        token: &str,
        options: &ConnectOptions,
    ) -> Result<Self, ClientError> {
        if !valid_room(room) {
            return Err(ClientError::InvalidRoom);
        }
        // Tokens are base64url and dots; anything else would need escaping
        // in the query and cannot be a valid token anyway.
        if token.is_empty()
            || token.len() > MAX_TOKEN_CHARS
            || !token
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(ClientError::InvalidToken);
        }
        let endpoint = Endpoint::parse(url)?;
        tokio::time::timeout(
            options.timeout,
            Self::establish(&endpoint, room, token, options),
        )
        .await
        .map_err(|_| ClientError::Timeout)?
    }

    async fn establish(
        endpoint: &Endpoint,
        room: &str,
        token: &str,
        options: &ConnectOptions,
    ) -> Result<Self, ClientError> {
        let stream = open(endpoint, &options.trust).await?;
        let request = endpoint
            .ws_url(&format!("/ws?room={room}&token={token}"))
            .into_client_request()
            .map_err(|e| ClientError::InvalidUrl(e.to_string()))?;
        let config = WebSocketConfig::default()
            .max_message_size(Some(options.max_message_bytes))
            .max_frame_size(Some(options.max_message_bytes));
        let (ws, _) = tokio_tungstenite::client_async_with_config(request, stream, Some(config))
            .await
            .map_err(|e| match e {
                tungstenite::Error::Http(response) => ClientError::Refused {
                    status: response.status().as_u16(),
                    reason: response
                        .body()
                        .as_deref()
                        .map(|b| String::from_utf8_lossy(b).trim().to_owned())
                        .unwrap_or_default(),
                },
                other => ClientError::WebSocket(other.to_string()),
            })?;
        let (events_tx, mut events) = mpsc::channel(EVENT_BUFFER);
        let (outgoing_tx, outgoing) = mpsc::channel(64);
        let closed = Arc::new(Mutex::new(None));
        tokio::spawn(pump(ws, events_tx, outgoing, Arc::clone(&closed)));
        match events.recv().await {
            Some(ServerMessage::Welcome { peer_id, peers }) => Ok(Self {
                peer_id,
                peers,
                events,
                sender: SignalSender(outgoing_tx),
                closed,
            }),
            Some(other) => Err(ClientError::Protocol(format!(
                "expected a welcome, got {other:?}"
            ))),
            None => Err(ClientError::Closed(
                closed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone(),
            )),
        }
    }

    /// This session's id, from the welcome.
    pub fn peer_id(&self) -> &PeerId {
        &self.peer_id
    }

    /// Who was in the room when this session joined.
    pub fn peers(&self) -> &[PeerInfo] {
        &self.peers
    }

    /// The next message from the server; `None` once the session is over.
    pub async fn recv(&mut self) -> Option<ServerMessage> {
        self.events.recv().await
    }

    pub async fn send(&self, message: ClientMessage) -> Result<(), ClientError> {
        self.sender.send(message).await
    }

    /// A handle for sending from other tasks.
    pub fn sender(&self) -> SignalSender {
        self.sender.clone()
    }

    /// Why the server closed the session, once it has.
    pub fn close_info(&self) -> Option<CloseInfo> {
        self.closed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Stream for SignalClient {
    type Item = ServerMessage;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.events.poll_recv(cx)
    }
}

/// Moves messages between the socket and the application until either side
/// is gone. Ends (closing the socket) when the `SignalClient` and every
/// `SignalSender` are dropped.
async fn pump<S>(
    mut ws: WebSocketStream<S>,
    events: mpsc::Sender<ServerMessage>,
    mut outgoing: mpsc::Receiver<ClientMessage>,
    closed: Arc<Mutex<Option<CloseInfo>>>,
) where
    S: AsyncRead + AsyncWrite + Unpin,
{
    loop {
        tokio::select! {
            frame = ws.next() => match frame {
                Some(Ok(Message::Text(text))) => match serde_json::from_str::<ServerMessage>(&text) {
                    Ok(message) => {
                        if events.send(message).await.is_err() {
                            break;
                        }
                    }
                    Err(error) => debug!(%error, "ignoring a message this client does not know"),
                },
                Some(Ok(Message::Close(frame))) => {
                    if let Some(frame) = frame {
                        *closed.lock().unwrap_or_else(PoisonError::into_inner) = Some(CloseInfo {
                            code: frame.code.into(),
                            reason: frame.reason.to_string(),
                        });
                    }
                    // tungstenite answers the close; the stream ends next.
                }
                Some(Ok(_)) => {}
                Some(Err(error)) => {
                    debug!(%error, "signal connection failed");
                    return;
                }
                None => return,
            },
            message = outgoing.recv() => match message {
                Some(message) => {
                    let Ok(text) = serde_json::to_string(&message) else { continue };
                    if ws.send(Message::text(text)).await.is_err() {
                        return;
                    }
                }
                None => break,
            },
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), ws.close(None)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        let e = Endpoint::parse("wss://example.org/signal/").unwrap();
        assert!(e.tls);
        assert_eq!(
            (e.host.as_str(), e.port, e.prefix.as_str()),
            ("example.org", 443, "/signal")
        );
        assert_eq!(e.ws_url("/ws?x"), "wss://example.org:443/signal/ws?x");
        let e = Endpoint::parse("ws://[::1]:7777").unwrap();
        assert_eq!(
            (e.host.as_str(), e.port, e.prefix.as_str()),
            ("::1", 7777, "")
        );
        assert_eq!(e.ws_url("/ws"), "ws://[::1]:7777/ws");
        assert!(Endpoint::parse("ftp://x").is_err());
        assert!(Endpoint::parse("not a url").is_err());
    }
}
