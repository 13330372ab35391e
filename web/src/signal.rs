//! The cairn-signal session: a WebSocket carrying JSON (`server/src/protocol.rs`,
//! `docs/signal.md`). Server messages are handed on as JSON values; this module only
//! knows the URL form and the socket.

use futures::channel::mpsc::UnboundedSender;
use wasm_bindgen::prelude::*;
use web_sys::{CloseEvent, MessageEvent, WebSocket};

/// What the socket reports.
pub enum SignalEvent {
    Open,
    Message(serde_json::Value),
    Closed { code: u16, reason: String },
}

pub struct SignalSocket {
    ws: WebSocket,
    _on_open: Closure<dyn FnMut()>,
    _on_message: Closure<dyn FnMut(MessageEvent)>,
    _on_close: Closure<dyn FnMut(CloseEvent)>,
}

/// The `/ws` URL for `base` (`ws://host:port`, `wss://…`, `http(s)://…`, with or without a
/// path prefix or a trailing `/ws`), `room` and `token`.
pub fn ws_url(base: &str, room: &str, token: &str) -> Result<String, String> {
    let base = base.trim().trim_end_matches('/');
    let base = if let Some(rest) = base.strip_prefix("http://") {
        format!("ws://{rest}")
    } else if let Some(rest) = base.strip_prefix("https://") {
        format!("wss://{rest}")
    } else if base.starts_with("ws://") || base.starts_with("wss://") {
        base.to_owned()
    } else {
        return Err(format!(
            "signal URL {base:?} is not ws://, wss://, http:// or https://"
        ));
    };
    let base = base.strip_suffix("/ws").unwrap_or(&base);
    let enc = |s: &str| String::from(js_sys::encode_uri_component(s));
    Ok(format!("{base}/ws?room={}&token={}", enc(room), enc(token)))
}

impl SignalSocket {
    /// Opens the session; events go to `events` from now on.
    pub fn open(url: &str, events: UnboundedSender<SignalEvent>) -> Result<Self, String> {
        let ws = WebSocket::new(url).map_err(|e| crate::js::js_error_text(&e))?;
        let on_open = Closure::<dyn FnMut()>::new({
            let events = events.clone();
            move || {
                let _ = events.unbounded_send(SignalEvent::Open);
            }
        });
        let on_message = Closure::<dyn FnMut(MessageEvent)>::new({
            let events = events.clone();
            move |e: MessageEvent| {
                let Some(text) = e.data().as_string() else {
                    return;
                };
                match serde_json::from_str(&text) {
                    Ok(v) => {
                        let _ = events.unbounded_send(SignalEvent::Message(v));
                    }
                    Err(err) => crate::ui::log(&format!("signal: unreadable message: {err}")),
                }
            }
        });
        let on_close = Closure::<dyn FnMut(CloseEvent)>::new(move |e: CloseEvent| {
            let _ = events.unbounded_send(SignalEvent::Closed {
                code: e.code(),
                reason: e.reason(),
            });
        });
        ws.set_onopen(Some(on_open.as_ref().unchecked_ref()));
        ws.set_onmessage(Some(on_message.as_ref().unchecked_ref()));
        ws.set_onclose(Some(on_close.as_ref().unchecked_ref()));
        Ok(SignalSocket {
            ws,
            _on_open: on_open,
            _on_message: on_message,
            _on_close: on_close,
        })
    }

    pub fn send(&self, message: &serde_json::Value) {
        if self.ws.ready_state() == WebSocket::OPEN {
            let _ = self.ws.send_with_str(&message.to_string());
        }
    }

    /// Relays `data` to peer `to`.
    pub fn signal(&self, to: &str, data: serde_json::Value) {
        self.send(&serde_json::json!({ "type": "signal", "to": to, "data": data }));
    }

    /// Replaces our advertised meta.
    pub fn set_meta(&self, meta: &serde_json::Map<String, serde_json::Value>) {
        self.send(&serde_json::json!({ "type": "meta", "meta": meta }));
    }

    /// Leaves the room: the server tells the others `peer-left`.
    pub fn close(&self) {
        let _ = self.ws.close_with_code_and_reason(1000, "leaving");
    }
}

impl Drop for SignalSocket {
    fn drop(&mut self) {
        self.ws.set_onopen(None);
        self.ws.set_onmessage(None);
        self.ws.set_onclose(None);
        self.close();
    }
}
