// The browser's CPU fallback (the engine's wasm build, simd128) under Node's V8, the engine
// Chromium runs: the package's own `Engine`/`Model` API on the cpu backend, on one thread as
// the fallback's Web Worker runs the single-thread package, or with THREADS above 1 on the
// threaded package (PKG_DIR/threads, built with CAIRN_WEB_THREADS) and a team of THREADS - 1
// worker threads over its shared memory, as the fallback's team of Web Workers
// (web/src/stage_worker.js). scripts/bench-wasm.sh starts it with WASM_ENGINE=node; see there.
// The threaded package is built with relaxed SIMD, which Node 20's V8 (11.3) has only behind
// `--experimental-wasm-relaxed-simd` and computes wrongly (`i32x4.relaxed_dot_i8x16_i7x16_add_s`
// returns twice the sum), so its runs here fail the kernel check: time it in Chromium
// (scripts/bench-wasm-worker.js).
//
//   node scripts/bench-wasm.mjs PKG_DIR MODEL_URL TOKENS ROUNDS [THREADS]
//
// Node has no window or worker scope: the engine's device discovery looks for one (wgpu asks
// the scope for `navigator.gpu`), so the global object is made to look like a dedicated
// worker's without WebGPU, which is what the fallback sees.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { Worker, isMainThread, workerData } from "node:worker_threads";

class WorkerGlobalScope {}
class DedicatedWorkerGlobalScope extends WorkerGlobalScope {}
globalThis.WorkerGlobalScope = WorkerGlobalScope;
globalThis.DedicatedWorkerGlobalScope = DedicatedWorkerGlobalScope;
Object.setPrototypeOf(globalThis, DedicatedWorkerGlobalScope.prototype);
if (typeof globalThis.navigator === "undefined") globalThis.navigator = {};
if (typeof globalThis.self === "undefined") globalThis.self = globalThis;

const glue = (dir) => import(pathToFileURL(path.join(dir, "cairn_web.js")).href);

if (!isMainThread) {
  // One of the team's workers: the same module over the same memory, serving the team for
  // the thread's whole life.
  const pkg = await glue(workerData.dir);
  await pkg.default({ module_or_path: workerData.module, memory: workerData.memory });
  try {
    pkg.cpuTeamWorker();
  } catch (err) {
    // A task trapped: the op it was in fails instead of waiting for it (web/src/team.rs).
    Atomics.store(new Int32Array(workerData.memory.buffer), workerData.failedAt >> 2, 1);
    throw err;
  }
} else {
  await main();
}

// `prompt` followed by words until the package's tokenizer counts `target` more tokens
// (PREFILL, 128 by default; " stone" is one token of the default model's, and a few tries
// correct for any merge), and that count. Older packages lack `countTokens`: 24 numbers, whose
// count PREFILL_EXTRA gives (48 with the default model's tokenizer).
function longPrompt(model, prompt, target) {
  if (typeof model.countTokens !== "function") {
    const long = Array.from({ length: 24 }, (_, i) => `${i + 1},`).join(" ");
    return [long, Number(process.env.PREFILL_EXTRA || 48)];
  }
  const base = model.countTokens(prompt);
  let words = target;
  let long = prompt;
  for (let i = 0; i < 8; i++) {
    long = prompt + " stone".repeat(Math.max(words, 1));
    const extra = model.countTokens(long) - base;
    if (extra === target) break;
    words += target - extra;
  }
  return [long, model.countTokens(long) - base];
}

async function main() {
  const [pkgDir, url, tokensArg, roundsArg, threadsArg] = process.argv.slice(2);
  const tokens = Number(tokensArg || 16);
  const rounds = Number(roundsArg || 3);
  const threads = Number(threadsArg || 1);
  const dir = threads > 1 ? path.join(pkgDir, "threads") : pkgDir;
  if (!fs.existsSync(path.join(dir, "cairn_web_bg.wasm"))) {
    console.error(`no package at ${dir} (the threaded one needs a cairn built with CAIRN_WEB_THREADS)`);
    process.exit(1);
  }
  const pkg = await glue(dir);
  await pkg.default({ module_or_path: fs.readFileSync(path.join(dir, "cairn_web_bg.wasm")) });
  if (dir !== pkgDir) {
    const shared = pkg.cpuTeamStart(threads);
    for (let i = 1; i < threads; i++) {
      const w = new Worker(fileURLToPath(import.meta.url), {
        workerData: { dir, module: shared.module, memory: shared.memory, failedAt: shared.failedAt },
      });
      // They serve until the process ends.
      w.unref();
    }
  }
  console.log(`threads: ${threads} (${path.basename(dir)}); kernels: ${pkg.checkCpuKernels()}`);
  const engine = await pkg.Engine.open("cpu");
  let t = performance.now();
  const model = await engine.loadModel(url);
  console.log(`load: ${((performance.now() - t) / 1e3).toFixed(1)} s (${engine.name})`);
  // A short prompt: the decode figure is a difference of two runs, and a long prefill's
  // jitter would swamp it.
  const prompt = "1, 2,";
  const decode = [];
  for (let r = 0; r <= rounds; r++) {
    t = performance.now();
    await model.generate(prompt, 1);
    const one = performance.now() - t;
    t = performance.now();
    await model.generate(prompt, tokens);
    const all = performance.now() - t;
    // The same prompt's prefill in both; what the longer call adds is its decode steps.
    const msPerToken = (all - one) / (tokens - 1);
    const load = fs.readFileSync("/proc/loadavg", "utf8").split(" ")[0];
    if (r === 0) {
      console.log(`warm-up: prompt + 1 token ${one.toFixed(0)} ms, ${msPerToken.toFixed(1)} ms/token`);
      continue;
    }
    decode.push(1e3 / msPerToken);
    console.log(`round ${r}: prompt + 1 token ${one.toFixed(0)} ms; decode ${msPerToken.toFixed(1)} ms/token = ${(1e3 / msPerToken).toFixed(2)} tok/s (load ${load})`);
  }
  decode.sort((a, b) => a - b);
  const tn = `${threads} thread${threads > 1 ? "s" : ""}`;
  console.log(`wasm decode median (${tn}): ${decode[Math.floor(decode.length / 2)].toFixed(2)} tok/s`);
  // Prefill: a longer prompt's first token against the short one's; the difference is the
  // extra prompt tokens' prefill (the count from the package's tokenizer, where it has one).
  const [long, extra] = longPrompt(model, prompt, Number(process.env.PREFILL || 128));
  const prefill = [];
  for (let r = 0; r <= rounds; r++) {
    t = performance.now();
    await model.generate(prompt, 1);
    const short = performance.now() - t;
    t = performance.now();
    await model.generate(long, 1);
    const ms = performance.now() - t - short;
    if (r === 0) continue;
    prefill.push((extra * 1e3) / ms);
    console.log(`prefill round ${r}: ${extra} more prompt tokens in ${ms.toFixed(0)} ms = ${((extra * 1e3) / ms).toFixed(1)} tok/s`);
  }
  prefill.sort((a, b) => a - b);
  console.log(`wasm prefill median (${tn}): ${prefill[Math.floor(prefill.length / 2)].toFixed(1)} tok/s`);
}
