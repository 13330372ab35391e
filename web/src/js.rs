//! Bindings to `probe.js` (browser APIs web-sys covers only as unstable, or awkwardly) and
//! small helpers between JS values and Rust.

use js_sys::{Promise, Uint8Array};
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::JsFuture;

#[wasm_bindgen(module = "/src/probe.js")]
extern "C" {
    #[wasm_bindgen(js_name = probeEnvironment)]
    fn probe_environment_js() -> Promise;
    #[wasm_bindgen(js_name = readBattery)]
    fn read_battery_js() -> Promise;
    #[wasm_bindgen(js_name = watchPressure)]
    fn watch_pressure_js(on_change: &js_sys::Function) -> Promise;
    #[wasm_bindgen(js_name = fetchRange)]
    fn fetch_range_js(url: &str, start: f64, end_inclusive: f64, on_bytes: &JsValue) -> Promise;
    #[wasm_bindgen(js_name = cacheGet)]
    fn cache_get_js(key: &str) -> Promise;
    #[wasm_bindgen(js_name = cachePut)]
    fn cache_put_js(key: &str, bytes: &Uint8Array) -> Promise;
    #[wasm_bindgen(js_name = fetchJson)]
    fn fetch_json_js(url: &str) -> Promise;
    #[wasm_bindgen(js_name = bufferedLow)]
    fn buffered_low_js(channel: &web_sys::RtcDataChannel) -> Promise;
}

/// A JS error (or any thrown value) as text.
pub fn js_error_text(e: &JsValue) -> String {
    if let Some(s) = e.as_string() {
        return s;
    }
    if let Some(err) = e.dyn_ref::<js_sys::Error>() {
        return String::from(err.message());
    }
    format!("{e:?}")
}

/// A JS value as JSON (null when it cannot be stringified).
pub fn to_json(v: &JsValue) -> serde_json::Value {
    js_sys::JSON::stringify(v)
        .ok()
        .and_then(|s| s.as_string())
        .and_then(|s| serde_json::from_str(&s).ok())
        .unwrap_or(serde_json::Value::Null)
}

async fn await_promise(p: Promise) -> Result<JsValue, String> {
    JsFuture::from(p).await.map_err(|e| js_error_text(&e))
}

/// WebGPU adapter info, limits and features, memory, cores, battery, visibility (JSON).
pub async fn probe_environment() -> serde_json::Value {
    match await_promise(probe_environment_js()).await {
        Ok(v) => to_json(&v),
        Err(e) => serde_json::json!({ "error": e }),
    }
}

/// `{level, charging}` where the Battery API exists, else null.
pub async fn read_battery() -> serde_json::Value {
    match await_promise(read_battery_js()).await {
        Ok(v) => to_json(&v),
        Err(_) => serde_json::Value::Null,
    }
}

/// `url`'s JSON, or null when it cannot be fetched or is not JSON.
pub async fn fetch_json(url: &str) -> serde_json::Value {
    match await_promise(fetch_json_js(url)).await {
        Ok(v) => to_json(&v),
        Err(_) => serde_json::Value::Null,
    }
}

/// Calls `on_change` with each new CPU pressure state; false where unsupported.
pub async fn watch_pressure(on_change: impl FnMut(String) + 'static) -> bool {
    let closure = Closure::<dyn FnMut(JsValue)>::new({
        let mut on_change = on_change;
        move |v: JsValue| on_change(v.as_string().unwrap_or_default())
    });
    let ok = await_promise(watch_pressure_js(closure.as_ref().unchecked_ref()))
        .await
        .ok()
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    // The observer lives as long as the page.
    closure.forget();
    ok
}

/// Bytes `range` of `url` (HTTP Range request) and the file's total length if the server said.
pub async fn fetch_range(
    url: &str,
    range: std::ops::Range<u64>,
    on_bytes: Option<&Closure<dyn FnMut(f64)>>,
) -> Result<(Vec<u8>, Option<u64>), String> {
    if range.is_empty() {
        return Ok((Vec::new(), None));
    }
    let on_bytes = on_bytes.map_or(JsValue::UNDEFINED, |c| c.as_ref().clone());
    let v = await_promise(fetch_range_js(
        url,
        range.start as f64,
        (range.end - 1) as f64,
        &on_bytes,
    ))
    .await?;
    let bytes = js_sys::Reflect::get(&v, &"bytes".into())
        .map_err(|e| js_error_text(&e))?
        .dyn_into::<Uint8Array>()
        .map_err(|_| "fetchRange returned no bytes".to_string())?
        .to_vec();
    let total = js_sys::Reflect::get(&v, &"total".into())
        .ok()
        .and_then(|t| t.as_f64())
        .map(|t| t as u64);
    Ok((bytes, total))
}

pub async fn cache_get(key: &str) -> Option<Vec<u8>> {
    let v = await_promise(cache_get_js(key)).await.ok()?;
    v.dyn_into::<Uint8Array>().ok().map(|a| a.to_vec())
}

pub async fn cache_put(key: &str, bytes: &[u8]) -> bool {
    let array = Uint8Array::from(bytes);
    await_promise(cache_put_js(key, &array))
        .await
        .ok()
        .and_then(|v| v.as_bool())
        .unwrap_or(false)
}

/// Waits until `channel`'s buffered amount drops to its low threshold.
pub async fn buffered_low(channel: &web_sys::RtcDataChannel) {
    let _ = await_promise(buffered_low_js(channel)).await;
}
