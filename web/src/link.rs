//! The link to the coordinator: an `RTCPeerConnection` that answers the native side's offer
//! (str0m, `native/src/link/mesh.rs`), its data channel, and the engine's framing on it.
//!
//! The offerer creates the channel (label `cairn`). What goes on over it (`Hello`, answers
//! to pings and probes, close, protocol failures) is the engine's link session
//! (`cairn_engine::session`), the same code as the native side's; this module is only its
//! glue to the `RTCDataChannel`. The session runs right in the channel's message handler,
//! so a long forward pass in the serving loop never starves the peer's heartbeat.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use cairn_engine::protocol::{FlowControl, Hello, Message};
use cairn_engine::session::{Session, SessionConfig, SessionEvent};
use futures::channel::mpsc::UnboundedSender;
use js_sys::{ArrayBuffer, Reflect, Uint8Array};
use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::JsFuture;
use web_sys::{
    MessageEvent, RtcConfiguration, RtcDataChannel, RtcDataChannelEvent, RtcDataChannelState,
    RtcDataChannelType, RtcIceCandidateInit, RtcIceTransportPolicy, RtcPeerConnection,
    RtcPeerConnectionIceEvent, RtcPeerConnectionState, RtcSdpType, RtcSessionDescriptionInit,
};

use crate::ice::IceConfig;
use crate::js::js_error_text;

/// Link setup payloads inside signal `data`; the same JSON as
/// `native/src/link/signal_msg.rs`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "link", rename_all = "kebab-case")]
pub enum SignalPayload {
    Offer { session: String, sdp: String },
    Answer { session: String, sdp: String },
    Candidate { session: String, candidate: String },
    Bye { session: String, reason: String },
}

/// The meta key under which peers announce their DTLS fingerprint.
pub const FINGERPRINT_META_KEY: &str = "dtls_fingerprint";

/// `RTCConfiguration` for an offerer's shared servers.
fn rtc_configuration(ice: &IceConfig) -> Result<RtcConfiguration, String> {
    let config = RtcConfiguration::new();
    let servers = serde_json::to_string(&ice.servers).map_err(|e| e.to_string())?;
    let servers = js_sys::JSON::parse(&servers).map_err(|e| js_error_text(&e))?;
    config.set_ice_servers(&servers);
    if ice.relay_only {
        config.set_ice_transport_policy(RtcIceTransportPolicy::Relay);
    }
    Ok(config)
}

/// Lower-case hash name, one space, upper-case hex pairs (as the native side compares them).
pub fn normalize_fingerprint(f: &str) -> String {
    let mut parts = f.split_whitespace();
    let hash = parts.next().unwrap_or_default().to_ascii_lowercase();
    let hex = parts.next().unwrap_or_default().to_ascii_uppercase();
    format!("{hash} {hex}")
}

/// The SDP's `a=fingerprint`, normalized.
pub fn sdp_fingerprint(sdp: &str) -> Option<String> {
    sdp.lines()
        .find_map(|l| l.trim().strip_prefix("a=fingerprint:"))
        .map(normalize_fingerprint)
}

/// The SDP's `a=max-message-size` (RFC 8841: 64 KiB when absent, 0 for no limit).
pub fn sdp_max_message_size(sdp: &str) -> Option<u64> {
    sdp.lines()
        .find_map(|l| l.trim().strip_prefix("a=max-message-size:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Largest frame we send, whatever the peer accepts: small frames keep the native side's
/// SCTP fast (docs/protocol.md).
const MAX_FRAME_BYTES: usize = 64 * 1024;
/// Flow control thresholds on `bufferedAmount`.
const FLOW: FlowControl = FlowControl {
    high_water: 1024 * 1024,
    low_water: 256 * 1024,
};

/// What a link reports to the serving loop.
pub enum LinkEvent {
    LocalCandidate {
        session: String,
        candidate: String,
    },
    /// Both `Hello`s exchanged (the session checked the peer's).
    Up {
        session: String,
    },
    /// An application message (the session handles its own).
    Message {
        session: String,
        message: Message,
    },
    Down {
        session: String,
        reason: String,
    },
}

/// The session's time: the page's clock, which the session never reads itself.
fn now() -> Duration {
    Duration::from_secs_f64(js_sys::Date::now().max(0.0) / 1000.0)
}

struct Channel {
    dc: RtcDataChannel,
    session: Session,
    open: bool,
    down: bool,
    _on_open: Closure<dyn FnMut()>,
    _on_message: Closure<dyn FnMut(MessageEvent)>,
    _on_close: Closure<dyn FnMut()>,
}

impl Channel {
    /// Hands every frame the session has queued to the data channel, which buffers them
    /// (callers that must respect flow control wait before queueing, see `PeerLink::send`).
    fn flush(&mut self) -> Result<(), String> {
        if self.dc.ready_state() != RtcDataChannelState::Open {
            return Err("the data channel is not open".into());
        }
        while let Some(frame) = self.session.next_frame().map_err(|e| e.to_string())? {
            self.dc
                .send_with_u8_array(frame)
                .map_err(|e| js_error_text(&e))?;
            self.session.frame_sent();
        }
        Ok(())
    }

    fn send_now(&mut self, message: &Message) -> Result<(), String> {
        if self.dc.ready_state() != RtcDataChannelState::Open {
            return Err("the data channel is not open".into());
        }
        self.session.send(message).map_err(|e| e.to_string())?;
        self.flush()
    }

    /// Reports what the session has for the serving loop: the link is up, messages, the
    /// end of the link.
    fn report(&mut self, events: &UnboundedSender<LinkEvent>, session: &str) {
        while let Some(event) = self.session.poll_event() {
            if let SessionEvent::Up { .. } = event {
                let _ = events.unbounded_send(LinkEvent::Up {
                    session: session.to_owned(),
                });
            }
        }
        while let Some(message) = self.session.pop_received() {
            let _ = events.unbounded_send(LinkEvent::Message {
                session: session.to_owned(),
                message,
            });
        }
        // What the session queued is with the data channel, which sends its buffer
        // before it closes: nothing of ours is left to wait for.
        if let Some(reason) = self.session.finished(now(), 0) {
            self.down = true;
            down(events, session, reason.to_string());
        }
    }
}

type Shared = Rc<RefCell<Option<Channel>>>;

/// One link attempt (a session) with the coordinator.
pub struct PeerLink {
    pub peer: String,
    pub session: String,
    pc: RtcPeerConnection,
    channel: Shared,
    _on_datachannel: Closure<dyn FnMut(RtcDataChannelEvent)>,
    _on_candidate: Closure<dyn FnMut(RtcPeerConnectionIceEvent)>,
    _on_state: Closure<dyn FnMut()>,
}

fn down(events: &UnboundedSender<LinkEvent>, session: &str, reason: impl Into<String>) {
    let _ = events.unbounded_send(LinkEvent::Down {
        session: session.to_owned(),
        reason: reason.into(),
    });
}

fn on_channel_data(
    shared: &Shared,
    events: &UnboundedSender<LinkEvent>,
    session: &str,
    e: MessageEvent,
) {
    let mut guard = shared.borrow_mut();
    let Some(ch) = guard.as_mut() else {
        return;
    };
    if ch.down {
        return;
    }
    let result = match e.data().dyn_into::<ArrayBuffer>() {
        Ok(buffer) => ch
            .session
            .on_frame_bytes(&Uint8Array::new(&buffer).to_vec(), now()),
        Err(_) => {
            ch.session.on_text_frame(now());
            Ok(())
        }
    };
    if let Err(reason) = result {
        ch.down = true;
        down(events, session, reason.to_string());
        return;
    }
    // Pongs, probe acks, or the `Error` of a protocol failure.
    let _ = ch.flush();
    ch.report(events, session);
}

fn setup_channel(
    dc: RtcDataChannel,
    shared: &Shared,
    events: &UnboundedSender<LinkEvent>,
    session: &str,
    config: &SessionConfig,
) {
    if shared.borrow().is_some() {
        // One channel per link: ignore any other.
        return;
    }
    dc.set_binary_type(RtcDataChannelType::Arraybuffer);
    dc.set_buffered_amount_low_threshold(config.flow.low_water as u32);
    let session = session.to_owned();
    let announce_open = {
        let shared = Rc::clone(shared);
        move || {
            let mut guard = shared.borrow_mut();
            if let Some(ch) = guard.as_mut()
                && !ch.open
            {
                // Our `Hello` goes first.
                ch.open = true;
                ch.session.on_open(now());
                if let Err(e) = ch.flush() {
                    crate::ui::log(&format!("cannot send hello: {e}"));
                }
            }
        }
    };
    let on_open = Closure::<dyn FnMut()>::new(announce_open.clone());
    let on_message = Closure::<dyn FnMut(MessageEvent)>::new({
        let shared = Rc::clone(shared);
        let events = events.clone();
        let session = session.clone();
        move |e: MessageEvent| on_channel_data(&shared, &events, &session, e)
    });
    let on_close = Closure::<dyn FnMut()>::new({
        let shared = Rc::clone(shared);
        let events = events.clone();
        let session = session.clone();
        move || {
            let mut guard = shared.borrow_mut();
            if let Some(ch) = guard.as_mut()
                && !ch.down
            {
                ch.down = true;
                down(&events, &session, "the data channel closed");
            }
        }
    });
    dc.set_onopen(Some(on_open.as_ref().unchecked_ref()));
    dc.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
    dc.set_onclose(Some(on_close.as_ref().unchecked_ref()));
    let already_open = dc.ready_state() == RtcDataChannelState::Open;
    *shared.borrow_mut() = Some(Channel {
        dc,
        session: Session::new(config.clone(), now()),
        open: false,
        down: false,
        _on_open: on_open,
        _on_message: on_message,
        _on_close: on_close,
    });
    if already_open {
        announce_open();
    }
}

impl PeerLink {
    /// Accepts `offer_sdp` from `peer`: a new peer connection (on the STUN/TURN servers of
    /// `ice`, if the offerer shared any), its answer (returned, not yet sent). `hello` goes
    /// out when the channel opens. Candidates and the channel's events go to `events`.
    pub async fn accept_offer(
        peer: &str,
        session: &str,
        offer_sdp: &str,
        ice: Option<&IceConfig>,
        hello: Hello,
        events: UnboundedSender<LinkEvent>,
    ) -> Result<(PeerLink, String), String> {
        let config = match ice {
            Some(ice) => rtc_configuration(ice)?,
            None => RtcConfiguration::new(),
        };
        let pc =
            RtcPeerConnection::new_with_configuration(&config).map_err(|e| js_error_text(&e))?;
        let frame_bytes = match sdp_max_message_size(offer_sdp) {
            Some(0) => MAX_FRAME_BYTES,
            Some(n) => (n as usize).min(MAX_FRAME_BYTES),
            None => 64 * 1024,
        };
        // The browser answers the peer's pings and probes; liveness is the peer
        // connection's state and the native side's heartbeat.
        let config = SessionConfig {
            flow: FLOW,
            ..SessionConfig::answering(hello, frame_bytes)
        };
        let channel: Shared = Rc::new(RefCell::new(None));
        let on_datachannel = Closure::<dyn FnMut(RtcDataChannelEvent)>::new({
            let channel = Rc::clone(&channel);
            let events = events.clone();
            let session = session.to_owned();
            move |e: RtcDataChannelEvent| {
                setup_channel(e.channel(), &channel, &events, &session, &config)
            }
        });
        let on_candidate = Closure::<dyn FnMut(RtcPeerConnectionIceEvent)>::new({
            let events = events.clone();
            let session = session.to_owned();
            move |e: RtcPeerConnectionIceEvent| {
                if let Some(c) = e.candidate() {
                    let candidate = c.candidate();
                    if !candidate.is_empty() {
                        let _ = events.unbounded_send(LinkEvent::LocalCandidate {
                            session: session.clone(),
                            candidate,
                        });
                    }
                }
            }
        });
        let on_state = Closure::<dyn FnMut()>::new({
            let pc = pc.clone();
            let events = events.clone();
            let session = session.to_owned();
            move || match pc.connection_state() {
                RtcPeerConnectionState::Failed => down(&events, &session, "connection failed"),
                RtcPeerConnectionState::Closed => down(&events, &session, "connection closed"),
                _ => {}
            }
        });
        pc.set_ondatachannel(Some(on_datachannel.as_ref().unchecked_ref()));
        pc.set_onicecandidate(Some(on_candidate.as_ref().unchecked_ref()));
        pc.set_onconnectionstatechange(Some(on_state.as_ref().unchecked_ref()));
        let link = PeerLink {
            peer: peer.to_owned(),
            session: session.to_owned(),
            pc,
            channel,
            _on_datachannel: on_datachannel,
            _on_candidate: on_candidate,
            _on_state: on_state,
        };
        let offer = RtcSessionDescriptionInit::new(RtcSdpType::Offer);
        offer.set_sdp(offer_sdp);
        JsFuture::from(link.pc.set_remote_description(&offer))
            .await
            .map_err(|e| format!("the offer was refused: {}", js_error_text(&e)))?;
        let answer = JsFuture::from(link.pc.create_answer())
            .await
            .map_err(|e| format!("no answer: {}", js_error_text(&e)))?;
        let sdp = Reflect::get(&answer, &"sdp".into())
            .ok()
            .and_then(|s| s.as_string())
            .ok_or("the answer has no SDP")?;
        let local = RtcSessionDescriptionInit::new(RtcSdpType::Answer);
        local.set_sdp(&sdp);
        JsFuture::from(link.pc.set_local_description(&local))
            .await
            .map_err(|e| format!("cannot apply our answer: {}", js_error_text(&e)))?;
        let sdp = link.pc.local_description().map(|d| d.sdp()).unwrap_or(sdp);
        Ok((link, sdp))
    }

    /// Adds a trickled candidate from the peer (`candidate:…`; empty means no more).
    pub async fn add_remote_candidate(&self, candidate: &str) {
        let text = candidate.trim().trim_start_matches("a=");
        if text.is_empty() {
            return;
        }
        let init = RtcIceCandidateInit::new(text);
        init.set_sdp_m_line_index(Some(0));
        let p = self
            .pc
            .add_ice_candidate_with_opt_rtc_ice_candidate_init(Some(&init));
        if let Err(e) = JsFuture::from(p).await {
            crate::ui::log(&format!("ignoring a candidate: {}", js_error_text(&e)));
        }
    }

    /// Sends now, whatever is buffered (small control messages).
    pub fn send_now(&self, message: &Message) -> Result<(), String> {
        match self.channel.borrow_mut().as_mut() {
            Some(ch) => ch.send_now(message),
            None => Err("no data channel yet".into()),
        }
    }

    /// Sends once the channel's buffer has room (tensors).
    pub async fn send(&self, message: &Message) -> Result<(), String> {
        loop {
            let dc = match self.channel.borrow().as_ref() {
                Some(ch) if !ch.session.may_write(ch.dc.buffered_amount() as usize) => {
                    ch.dc.clone()
                }
                Some(_) => break,
                None => return Err("no data channel yet".into()),
            };
            crate::js::buffered_low(&dc).await;
            if dc.ready_state() != RtcDataChannelState::Open {
                return Err("the data channel closed".into());
            }
        }
        self.send_now(message)
    }

    /// Closes the link: a `Close` message, then the channel and the connection.
    pub fn close(&self, reason: &str) {
        if let Some(mut ch) = self.channel.borrow_mut().take() {
            if !ch.down {
                ch.session.close(reason, now());
                let _ = ch.flush();
            }
            ch.down = true;
            ch.dc.set_onmessage(None);
            ch.dc.set_onclose(None);
            ch.dc.set_onopen(None);
            ch.dc.close();
        }
        self.pc.set_onicecandidate(None);
        self.pc.set_ondatachannel(None);
        self.pc.set_onconnectionstatechange(None);
        self.pc.close();
    }
}

impl Drop for PeerLink {
    fn drop(&mut self) {
        self.close("dropped");
    }
}
