// What the page can learn about the machine before the user consents: the browser APIs that
// web-sys does not cover stably (WebGPU adapter info, Battery, Compute Pressure). Every probe
// is optional; a missing API reads as null, never as an error.

export async function probeEnvironment() {
  const nav = globalThis.navigator || {};
  const env = {
    userAgent: nav.userAgent || null,
    deviceMemoryGiB: typeof nav.deviceMemory === "number" ? nav.deviceMemory : null,
    hardwareConcurrency: typeof nav.hardwareConcurrency === "number" ? nav.hardwareConcurrency : null,
    visibility: typeof document !== "undefined" ? document.visibilityState : null,
    webgpu: null,
    battery: null,
    pressure: null,
    pressureSupported: typeof globalThis.PressureObserver === "function",
  };
  env.webgpu = await probeWebGpu(nav);
  env.battery = await readBattery();
  return env;
}

async function probeWebGpu(nav) {
  if (!nav.gpu) {
    return { available: false, reason: "navigator.gpu is missing (no WebGPU in this browser, or not a secure context)" };
  }
  let adapter = null;
  try {
    adapter = await nav.gpu.requestAdapter({ powerPreference: "high-performance" });
  } catch (e) {
    return { available: false, reason: "requestAdapter failed: " + e };
  }
  if (!adapter) {
    return { available: false, reason: "no WebGPU adapter (blocked or disabled)" };
  }
  const info = adapter.info || {};
  const limits = {};
  for (const key in adapter.limits) {
    const v = adapter.limits[key];
    if (typeof v === "number") limits[key] = v;
  }
  return {
    available: true,
    vendor: info.vendor || "",
    architecture: info.architecture || "",
    device: info.device || "",
    description: info.description || "",
    isFallbackAdapter: !!(info.isFallbackAdapter ?? adapter.isFallbackAdapter),
    features: Array.from(adapter.features || []).sort(),
    limits,
  };
}

let batteryManager = null;

export async function readBattery() {
  try {
    if (!batteryManager && typeof navigator !== "undefined" && navigator.getBattery) {
      batteryManager = await navigator.getBattery();
    }
  } catch (_) {
    batteryManager = null;
  }
  if (!batteryManager) return null;
  return { level: batteryManager.level, charging: batteryManager.charging };
}

/// Calls `onChange(state)` ("nominal", "fair", "serious", "critical") as CPU pressure changes.
/// Returns false where Compute Pressure is not available.
export async function watchPressure(onChange) {
  if (typeof PressureObserver !== "function") return false;
  try {
    const observer = new PressureObserver((records) => {
      const last = records[records.length - 1];
      if (last) onChange(last.state);
    });
    await observer.observe("cpu", { sampleInterval: 1000 });
    return true;
  } catch (_) {
    return false;
  }
}

/// Fetches `url` with `Range: bytes=start-end_inclusive`; resolves to
/// `{ bytes: Uint8Array, total: number|null, status }`. Reports progress through
/// `onBytes(n)` as chunks arrive, when the body can be streamed.
export async function fetchRange(url, start, endInclusive, onBytes) {
  const init = { headers: { Range: `bytes=${start}-${endInclusive}` } };
  let response;
  try {
    response = await fetch(url, init);
  } catch (e) {
    // The coordinator serves both this page and the model; a source URL naming another
    // address of it (a LAN IP where the page was opened as localhost) is cross-origin and
    // may be refused. The same path on this page's origin is the same file.
    const target = new URL(url, location.href);
    if (target.origin === location.origin) throw e;
    response = await fetch(location.origin + target.pathname + target.search, init);
  }
  if (response.status !== 206 && response.status !== 200) {
    throw new Error(`GET ${url} bytes ${start}-${endInclusive}: HTTP ${response.status}`);
  }
  let total = null;
  const range = response.headers.get("Content-Range");
  if (range) {
    const m = /\/(\d+)\s*$/.exec(range);
    if (m) total = Number(m[1]);
  } else if (response.status === 200) {
    const len = response.headers.get("Content-Length");
    if (len) total = Number(len);
  }
  let bytes;
  if (response.body && response.body.getReader) {
    const reader = response.body.getReader();
    const parts = [];
    let n = 0;
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      parts.push(value);
      n += value.length;
      if (onBytes) onBytes(value.length);
    }
    bytes = new Uint8Array(n);
    let at = 0;
    for (const p of parts) {
      bytes.set(p, at);
      at += p.length;
    }
  } else {
    bytes = new Uint8Array(await response.arrayBuffer());
    if (onBytes) onBytes(bytes.length);
  }
  if (response.status === 200) {
    // The server ignored the range: cut it out of the whole body.
    bytes = bytes.slice(start, Math.min(bytes.length, endInclusive + 1));
  }
  return { bytes, total, status: response.status };
}

const CACHE_NAME = "cairn-weights-v1";

function cacheKey(key) {
  return new Request(`https://cairn.invalid/${encodeURIComponent(key)}`);
}

/// The bytes stored under `key` in Cache Storage, or null.
export async function cacheGet(key) {
  try {
    if (typeof caches === "undefined") return null;
    const cache = await caches.open(CACHE_NAME);
    const hit = await cache.match(cacheKey(key));
    if (!hit) return null;
    return new Uint8Array(await hit.arrayBuffer());
  } catch (_) {
    return null;
  }
}

/// Stores `bytes` under `key`; false when Cache Storage is unavailable or full.
export async function cachePut(key, bytes) {
  try {
    if (typeof caches === "undefined") return false;
    const cache = await caches.open(CACHE_NAME);
    await cache.put(cacheKey(key), new Response(bytes));
    return true;
  } catch (_) {
    return false;
  }
}

/// Resolves once the data channel's buffered amount falls to its low threshold (or it closes).
export function bufferedLow(channel) {
  return new Promise((resolve) => {
    const done = () => {
      channel.removeEventListener("bufferedamountlow", done);
      channel.removeEventListener("close", done);
      resolve();
    };
    channel.addEventListener("bufferedamountlow", done);
    channel.addEventListener("close", done);
  });
}

// A JSON document from the page's own server (the join page's cost estimate), or null when
// the server has none: the page then says what it can without it.
export async function fetchJson(url) {
  try {
    const r = await fetch(url, { cache: "no-store" });
    if (!r.ok) return null;
    return await r.json();
  } catch (_) {
    return null;
  }
}
