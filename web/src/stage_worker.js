// The CPU fallback's Web Worker script. This one file has three roles: on the page the
// package imports it for `spawnStageWorker`; the stage worker it spawns runs this same file as
// its script, which then loads a package and hands over to `cpuWorkerMain`
// (web/src/stage_worker.rs); and the stage worker's team workers run it too (web/src/team.rs).
// It needs no file of its own beside the package: wasm-bindgen copies it to
// `pkg/snippets/<crate>-<hash>/src/`, three levels below `pkg/cairn_web.js`.
//
// Threads: where the page is cross-origin isolated (SharedArrayBuffer exists) and `cairn`
// carries the threaded package (`pkg/threads/`, built with shared memory by a nightly
// toolchain: native/build.rs), the stage worker loads that one, makes a team of `threads`
// and starts `threads - 1` team workers over the same module and memory. Otherwise it loads
// the single-thread package beside the page's own (`pkg/cairn_web.js`). The threaded package
// is also built with relaxed SIMD (its integer dot products), which a browser without it
// (Safari, Firefox before 146) refuses to compile: there too the single-thread one runs,
// decided by validating a tiny module that uses the instruction before fetching the package.

const STAGE_NAME = "cairn-cpu-stage";
const TEAM_NAME = "cairn-cpu-team";
const SINGLE = "../../../cairn_web.js";
const THREADED = "../../../threads/cairn_web.js";

// `threads` above 1 asks for the threaded package (where the page can run it).
export function spawnStageWorker(threads) {
  const name = threads > 1 ? `${STAGE_NAME} threads=${threads}` : STAGE_NAME;
  return new Worker(import.meta.url, { type: "module", name });
}

const url = (rel) => new URL(rel, import.meta.url).href;

// Whether this engine has relaxed SIMD: a module whose one function returns
// `i32x4.relaxed_dot_i8x16_i7x16_add_s` of three zero vectors.
export function hasRelaxedSimd() {
  const zero = new Array(16).fill(0);
  const v128Const = [0xfd, 0x0c, ...zero];
  const module = new Uint8Array([
    0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, // magic, version
    0x01, 0x05, 0x01, 0x60, 0x00, 0x01, 0x7b, // types: () -> v128
    0x03, 0x02, 0x01, 0x00, // one function of type 0
    0x0a, 0x3d, 0x01, 0x3b, 0x00, // code: one body of 59 bytes, no locals
    ...v128Const, ...v128Const, ...v128Const,
    0xfd, 0x93, 0x02, // i32x4.relaxed_dot_i8x16_i7x16_add_s
    0x0b, // end
  ]);
  try {
    return WebAssembly.validate(module);
  } catch {
    return false;
  }
}

// The threaded package with its team started, or null (then the single-thread one runs).
async function threaded(threads) {
  if (!(threads > 1) || !self.crossOriginIsolated) return null;
  if (!hasRelaxedSimd()) {
    console.warn("cairn cpu worker: this browser has no relaxed SIMD, which the threaded package needs; one thread");
    return null;
  }
  let pkg, shared;
  try {
    // Missing where this cairn was built without it; its shared memory may also be refused
    // (a device that cannot reserve it).
    pkg = await import(url(THREADED));
    await pkg.default();
    shared = pkg.cpuTeamStart(threads);
  } catch (e) {
    console.warn(`cairn cpu worker: no threaded package (${e}); one thread`);
    return null;
  }
  if (!shared) return null;
  for (let i = 1; i < threads; i++) {
    const w = new Worker(import.meta.url, { type: "module", name: TEAM_NAME });
    // A team worker that fails leaves its tasks to the others: nobody waits for a worker
    // that never joined an op.
    w.onerror = (e) => console.error(`cairn cpu team worker: ${e.message}`);
    w.postMessage(shared);
  }
  return pkg;
}

// No top-level await: the package imports this module too, and inside the worker it must
// find it evaluated, not waiting on the package. Both packages carry a copy of this file, and
// a worker that loads the threaded one evaluates that copy too: only the first copy a worker
// evaluates takes its role (`cairnWorkerRole`).
if (typeof WorkerGlobalScope !== "undefined" && self instanceof WorkerGlobalScope && !self.cairnWorkerRole) {
  self.cairnWorkerRole = self.name;
  const m = /^cairn-cpu-stage(?: threads=(\d+))?$/.exec(self.name);
  if (m) {
    const asked = Number(m[1] || 1);
    threaded(asked)
      .then(async (pkg) => {
        if (pkg) return pkg.cpuWorkerMain(asked);
        pkg = await import(url(SINGLE));
        await pkg.default();
        pkg.cpuWorkerMain(1);
      })
      .catch((e) => self.postMessage({ failed: String((e && e.stack) || e) }));
  } else if (self.name === TEAM_NAME) {
    self.onmessage = async (e) => {
      self.onmessage = null;
      const pkg = await import(url(THREADED));
      await pkg.default({ module_or_path: e.data.module, memory: e.data.memory });
      try {
        // Runs for the worker's whole life, waiting on the shared memory between ops.
        pkg.cpuTeamWorker();
      } catch (err) {
        // A task trapped (a panic): the op it was in would never finish. The stage
        // worker's next check fails the op instead (web/src/team.rs, `failedAt`).
        Atomics.store(new Int32Array(e.data.memory.buffer), e.data.failedAt >> 2, 1);
        throw err;
      }
    };
  }
}
