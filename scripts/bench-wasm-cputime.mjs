// The single-thread wasm package's prefill under Node, in process CPU time as well as wall
// time: on a shared machine (a load of 6 on 2 cores) the wall time of a run is mostly the
// other processes', while the CPU time per prompt token still compares two builds of the
// package (docs/performance.md, session 20). Each round times the short prompt's first token
// and a long prompt's (128 more tokens by the package's tokenizer); the figure is the
// difference, as scripts/bench-wasm.sh computes it. Needs `Model.countTokens`.
//
//   node scripts/bench-wasm-cputime.mjs PKG_DIR MODEL_URL [ROUNDS]
//
// PKG_DIR: a package folder (cairn_web.js, cairn_web_bg.wasm); MODEL_URL: the GGUF over HTTP
// (e.g. `python3 -m http.server` in ~/.cache/cairn/models). Alternate the builds compared in
// one shell loop (A B A B).
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";
// A dedicated worker's global scope without WebGPU, as in scripts/bench-wasm.mjs: what the
// engine's device discovery looks for.
class WorkerGlobalScope {}
class DedicatedWorkerGlobalScope extends WorkerGlobalScope {}
globalThis.WorkerGlobalScope = WorkerGlobalScope;
globalThis.DedicatedWorkerGlobalScope = DedicatedWorkerGlobalScope;
Object.setPrototypeOf(globalThis, DedicatedWorkerGlobalScope.prototype);
if (typeof globalThis.navigator === "undefined") globalThis.navigator = {};
if (typeof globalThis.self === "undefined") globalThis.self = globalThis;
const [dir, url, rounds = "4"] = process.argv.slice(2);
const pkg = await import(pathToFileURL(path.join(dir, "cairn_web.js")).href);
await pkg.default({ module_or_path: fs.readFileSync(path.join(dir, "cairn_web_bg.wasm")) });
const engine = await pkg.Engine.open("cpu");
const model = await engine.loadModel(url);
const prompt = "1, 2,";
const base = model.countTokens(prompt);
let words = 128, long;
for (let i = 0; i < 8; i++) { long = prompt + " stone".repeat(words); const e = model.countTokens(long) - base; if (e === 128) break; words += 128 - e; }
const extra = model.countTokens(long) - base;
const wall = [], cpu = [];
for (let r = 0; r <= Number(rounds); r++) {
  let t = performance.now(); let c = process.cpuUsage();
  await model.generate(prompt, 1);
  const sw = performance.now() - t; const sc = process.cpuUsage(c);
  t = performance.now(); c = process.cpuUsage();
  await model.generate(long, 1);
  const lw = performance.now() - t; const lc = process.cpuUsage(c);
  if (r === 0) continue;
  wall.push(extra * 1e3 / (lw - sw));
  cpu.push(extra * 1e6 / ((lc.user + lc.system) - (sc.user + sc.system)));
}
const med = (v) => v.sort((a, b) => a - b)[Math.floor(v.length / 2)];
console.log(`${path.basename(path.dirname(dir))}: prefill ${extra} tokens: wall median ${med(wall).toFixed(1)} tok/s, cpu-time median ${med(cpu).toFixed(1)} tok/s`);
