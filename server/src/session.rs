//! `/ws`: checks a join request before upgrading it, then runs one task per
//! WebSocket session that reads the client, writes its queue, pings it and
//! enforces the per-connection limits.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tracing::{Instrument as _, debug, info, info_span};

use crate::config::{SessionEvent, SessionObserver};
use crate::limits::{RateLimiter, TokenRate, Verdict};
use crate::protocol::{Incoming, Outgoing, PeerId, close_code};
use crate::quota;
use crate::room::{Joined, Kick, RelayError, Reservation};
use crate::server::{AppState, Remote};
use crate::token::{Claims, Role, valid_room, verify};

const KICK_IDLE: Kick = Kick {
    code: close_code::IDLE,
    reason: "idle timeout",
};
const KICK_RATE: Kick = Kick {
    code: close_code::POLICY,
    reason: "message rate limit exceeded",
};
const KICK_TOO_BIG: Kick = Kick {
    code: close_code::TOO_BIG,
    reason: "message too large",
};

/// How long a closing session waits for the client's close reply.
const CLOSE_LINGER: Duration = Duration::from_secs(1);

#[derive(Deserialize)]
pub(crate) struct JoinParams {
    room: Option<String>,
    token: Option<String>,
}

pub(crate) async fn ws_handler(
    State(app): State<Arc<AppState>>,
    remote: Option<Extension<Remote>>,
    Query(params): Query<JoinParams>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let addr = remote.map(|Extension(Remote(ip))| ip);
    // Every refusal is told to the embedder, with the token's id once it is known.
    let refused = |room: Option<&str>, token_id: Option<&str>, status, reason: &str| {
        SessionObserver::tell(
            &app.observer,
            SessionEvent::Refused {
                room: room.map(str::to_owned),
                token_id: token_id.map(str::to_owned),
                addr,
                reason: reason.to_owned(),
            },
        );
        (status, reason.to_owned()).into_response()
    };
    let Some(room) = params.room.filter(|r| valid_room(r)) else {
        return refused(
            None,
            None,
            StatusCode::BAD_REQUEST,
            "missing or invalid room",
        );
    };
    let Some(token) = params.token else {
        return refused(Some(&room), None, StatusCode::UNAUTHORIZED, "missing token");
    };
    let claims = match verify(&app.secret, &token) {
        Ok(claims) => claims,
        Err(error) => {
            debug!(%room, %error, "join refused");
            return refused(
                Some(&room),
                None,
                StatusCode::UNAUTHORIZED,
                &error.to_string(),
            );
        }
    };
    let id = Some(claims.jti.as_str());
    if claims.role == Role::Admin {
        return refused(
            Some(&room),
            id,
            StatusCode::FORBIDDEN,
            "admin tokens cannot join rooms",
        );
    }
    if claims.room != room {
        return refused(
            Some(&room),
            id,
            StatusCode::FORBIDDEN,
            "token is for another room",
        );
    }
    if app.hub.is_revoked(&claims.jti) {
        debug!(%room, token_id = %claims.jti, "revoked token refused");
        return refused(Some(&room), id, StatusCode::FORBIDDEN, "token revoked");
    }
    let upgrade = match upgrade {
        Ok(upgrade) => upgrade,
        Err(rejection) => return rejection.into_response(),
    };
    // A leaked token or one busy address can hold only its share of the
    // server's sessions and of a room.
    let by_addr = match addr {
        Some(ip) => match app.sessions_per_addr.take(ip) {
            Some(held) => Some(held),
            None => {
                return refused(
                    Some(&room),
                    id,
                    StatusCode::TOO_MANY_REQUESTS,
                    "too many sessions from this address",
                );
            }
        },
        None => None,
    };
    let Some(by_token) = app.sessions_per_token.take(claims.jti.clone()) else {
        return refused(
            Some(&room),
            id,
            StatusCode::TOO_MANY_REQUESTS,
            "too many sessions with this token",
        );
    };
    let Ok(permit) = Arc::clone(&app.sessions).try_acquire_owned() else {
        return refused(
            Some(&room),
            id,
            StatusCode::SERVICE_UNAVAILABLE,
            "server at its connection limit",
        );
    };
    let held = Held {
        _permit: permit,
        _by_addr: by_addr,
        _by_token: by_token,
    };
    let Some(reservation) = app.hub.reserve(&room) else {
        return refused(Some(&room), id, StatusCode::FORBIDDEN, "room is full");
    };
    let limits = &app.limits;
    upgrade
        .read_buffer_size(limits.read_buffer_bytes)
        .write_buffer_size(0)
        .max_message_size(limits.max_frame_bytes)
        .max_frame_size(limits.max_frame_bytes)
        .on_failed_upgrade(|error| debug!(%error, "WebSocket upgrade failed"))
        .on_upgrade(move |socket| run(app, socket, claims, reservation, held, addr))
}

async fn run(
    app: Arc<AppState>,
    mut socket: WebSocket,
    claims: Claims,
    reservation: Reservation,
    held: Held,
    addr: Option<IpAddr>,
) {
    let _tracked = app.tracker.token();
    let joined = match app.hub.join(reservation, claims.role, &claims.jti) {
        Ok(joined) => joined,
        Err(kick) => {
            SessionObserver::tell(
                &app.observer,
                SessionEvent::Refused {
                    room: Some(claims.room.clone()),
                    token_id: Some(claims.jti.clone()),
                    addr,
                    reason: kick.reason.to_owned(),
                },
            );
            close(&mut socket, kick, app.limits.write_timeout).await;
            return;
        }
    };
    let peer_id = joined.peer_id.clone();
    SessionObserver::tell(
        &app.observer,
        SessionEvent::Joined {
            room: claims.room.clone(),
            peer_id: peer_id.clone(),
            role: claims.role,
            token_id: claims.jti.clone(),
            addr,
        },
    );
    let span =
        info_span!("session", peer = %joined.peer_id, room = %claims.room, role = %claims.role);
    Session {
        app: Arc::clone(&app),
        room: claims.room.clone(),
        peer_id: joined.peer_id.clone(),
        token_rate: app.token_rates.join(&claims.jti),
    }
    .serve(socket, joined, &claims)
    .instrument(span)
    .await;
    drop(held);
    SessionObserver::tell(
        &app.observer,
        SessionEvent::Left {
            room: claims.room.clone(),
            peer_id,
            token_id: claims.jti.clone(),
        },
    );
}

/// What a session holds of the server's limits while it lives.
struct Held {
    _permit: OwnedSemaphorePermit,
    _by_addr: Option<quota::Held<IpAddr>>,
    _by_token: quota::Held<String>,
}

struct Session {
    app: Arc<AppState>,
    room: String,
    peer_id: PeerId,
    /// The token's budget, shared with its other sessions.
    token_rate: TokenRate,
}

/// What the read side decided about the session.
enum Next {
    Continue,
    Reply(Utf8Bytes),
    Close(Kick),
    /// The client closed or vanished.
    Gone,
}

impl Session {
    async fn serve(&self, mut socket: WebSocket, joined: Joined, claims: &Claims) {
        let Joined {
            membership,
            welcome,
            mut outbox,
            mut kicked,
            ..
        } = joined;
        let limits = &self.app.limits;
        info!(token_id = %claims.jti, "joined");
        let mut ending = None;
        if send(&mut socket, Message::Text(welcome), limits.write_timeout)
            .await
            .is_ok()
        {
            let mut limiter = RateLimiter::new(
                limits.messages_per_sec,
                limits.message_burst,
                std::time::Instant::now(),
            );
            let mut ping = tokio::time::interval_at(
                Instant::now() + limits.ping_interval,
                limits.ping_interval,
            );
            ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let idle = tokio::time::sleep(limits.idle_timeout);
            tokio::pin!(idle);
            ending = loop {
                tokio::select! {
                    changed = kicked.changed() => {
                        let kick = *kicked.borrow_and_update();
                        if changed.is_err() || kick.is_some() {
                            break kick;
                        }
                    }
                    queued = outbox.recv() => {
                        let Some(text) = queued else {
                            // Dropped from the room; the kick says why.
                            break *kicked.borrow();
                        };
                        if send(&mut socket, Message::Text(text), limits.write_timeout).await.is_err() {
                            debug!("write failed or timed out");
                            break None;
                        }
                    }
                    frame = socket.recv() => {
                        idle.as_mut().reset(Instant::now() + limits.idle_timeout);
                        let next = match frame {
                            None => Next::Gone,
                            Some(Err(error)) => read_error(error),
                            Some(Ok(message)) => self.handle(message, &mut limiter),
                        };
                        match next {
                            Next::Continue => {}
                            Next::Reply(text) => {
                                if send(&mut socket, Message::Text(text), limits.write_timeout).await.is_err() {
                                    break None;
                                }
                            }
                            Next::Close(kick) => {
                                let error = Outgoing::Error { message: kick.reason }.encode();
                                let _ = send(&mut socket, Message::Text(error), limits.write_timeout).await;
                                break Some(kick);
                            }
                            Next::Gone => break None,
                        }
                    }
                    _ = ping.tick() => {
                        if send(&mut socket, Message::Ping(Default::default()), limits.write_timeout).await.is_err() {
                            break None;
                        }
                    }
                    () = &mut idle => break Some(KICK_IDLE),
                }
            };
        }
        // Leave before the close handshake so the others hear of it at once.
        drop(membership);
        match ending {
            Some(kick) => {
                info!(code = kick.code, reason = kick.reason, "dropped");
                close(&mut socket, kick, limits.write_timeout).await;
            }
            None => info!("left"),
        }
    }

    fn handle(&self, message: Message, limiter: &mut RateLimiter) -> Next {
        if matches!(message, Message::Close(_)) {
            return Next::Gone;
        }
        let now = std::time::Instant::now();
        let over_rate = match limiter.check(now) {
            Verdict::Allow => !self.token_rate.allows(now),
            Verdict::Refuse => true,
            Verdict::Disconnect => return Next::Close(KICK_RATE),
        };
        match message {
            // tungstenite answers pings itself; both only keep the session alive.
            Message::Ping(_) | Message::Pong(_) => Next::Continue,
            _ if over_rate => error("rate limit exceeded: message dropped"),
            Message::Binary(_) => error("binary frames are not supported: send JSON text"),
            Message::Text(text) => self.handle_text(&text, limiter),
            Message::Close(_) => Next::Gone,
        }
    }

    fn handle_text(&self, text: &str, limiter: &mut RateLimiter) -> Next {
        let incoming: Incoming<'_> = match serde_json::from_str(text) {
            Ok(incoming) => incoming,
            Err(e) => return error(&format!("malformed message: {e}")),
        };
        match incoming.kind.as_deref() {
            Some("signal") => self.relay(incoming.to, incoming.data),
            Some("meta") => self.set_meta(incoming.meta, limiter),
            Some(other) => error(&format!("unknown message type '{}'", clip(other))),
            None => error("message has no 'type'"),
        }
    }

    fn relay(&self, to: Option<PeerId>, data: Option<&RawValue>) -> Next {
        let (Some(to), Some(data)) = (to, data) else {
            return error("signal needs 'to' and 'data'");
        };
        let message = Outgoing::Signal {
            from: &self.peer_id,
            data,
        }
        .encode();
        match self.app.hub.relay(&self.room, &self.peer_id, &to, message) {
            Ok(()) => Next::Continue,
            Err(RelayError::ToSelf) => error("cannot signal yourself"),
            Err(RelayError::UnknownPeer) => error(&format!("unknown peer '{}'", clip(to.as_str()))),
            Err(RelayError::TargetBusy) => error(&format!(
                "peer '{to}' has too many of your messages waiting: message dropped"
            )),
            // Our own kick is on its way.
            Err(RelayError::NotJoined) => Next::Continue,
        }
    }

    fn set_meta(&self, meta: Option<&RawValue>, limiter: &mut RateLimiter) -> Next {
        let Some(meta) = meta else {
            return error("meta needs 'meta'");
        };
        let max = self.app.limits.max_meta_bytes;
        if meta.get().len() > max.saturating_mul(2) {
            return error(&format!("meta too large: limit is {max} bytes"));
        }
        let Ok(object) = serde_json::from_str::<Map<String, Value>>(meta.get()) else {
            return error("meta must be a JSON object");
        };
        // Size is judged on the compact form, so whitespace neither helps nor hurts.
        let compact = match serde_json::to_string(&object)
            .ok()
            .and_then(|s| RawValue::from_string(s).ok())
        {
            Some(compact) => compact,
            None => return error("meta must be a JSON object"),
        };
        if compact.get().len() > max {
            return error(&format!(
                "meta too large: {} bytes, limit is {max}",
                compact.get().len()
            ));
        }
        let sent = self.app.hub.set_meta(&self.room, &self.peer_id, &compact);
        // Each copy costs the sender, so an update fanned out to a full
        // room is worth as many messages as it makes.
        limiter.charge(sent.saturating_sub(1));
        self.token_rate.charge(sent.saturating_sub(1));
        Next::Continue
    }
}

fn error(message: &str) -> Next {
    Next::Reply(Outgoing::Error { message }.encode())
}

/// Client-supplied text echoed in errors is cut short.
fn clip(text: &str) -> &str {
    match text.char_indices().nth(64) {
        Some((end, _)) => &text[..end],
        None => text,
    }
}

fn read_error(error: axum::Error) -> Next {
    use tokio_tungstenite::tungstenite::Error as WsError;
    let inner = error.into_inner();
    match inner.downcast_ref::<WsError>() {
        Some(WsError::Capacity(_)) => Next::Close(KICK_TOO_BIG),
        _ => {
            debug!(error = %inner, "read failed");
            Next::Gone
        }
    }
}

async fn send(socket: &mut WebSocket, message: Message, timeout: Duration) -> Result<(), ()> {
    match tokio::time::timeout(timeout, socket.send(message)).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(()),
    }
}

async fn close(socket: &mut WebSocket, kick: Kick, write_timeout: Duration) {
    let frame = CloseFrame {
        code: kick.code,
        reason: kick.reason.into(),
    };
    if send(
        socket,
        Message::Close(Some(frame)),
        write_timeout.min(CLOSE_LINGER),
    )
    .await
    .is_err()
    {
        return;
    }
    // Read until the client answers the close: dropping a socket with unread
    // input makes the kernel reset the connection, which can destroy the
    // close frame before the client reads it.
    let deadline = Instant::now() + CLOSE_LINGER;
    while let Ok(Some(Ok(_))) = tokio::time::timeout_at(deadline, socket.recv()).await {}
}
