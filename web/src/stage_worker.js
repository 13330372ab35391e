// The CPU fallback's Web Worker script. This one file has two roles: on the page the package
// imports it for `spawnStageWorker`, and the worker it spawns runs this same file as its
// script, which then loads the package and hands over to `cpuWorkerMain` (web/src/stage_worker.rs).
// It needs no file of its own beside the package: wasm-bindgen copies it to
// `pkg/snippets/<crate>-<hash>/src/`, three levels below `pkg/cairn_web.js`.

const WORKER_NAME = "cairn-cpu-stage";

export function spawnStageWorker() {
  return new Worker(import.meta.url, { type: "module", name: WORKER_NAME });
}

// No top-level await: the package imports this module too, and inside the worker it must
// find it evaluated, not waiting on the package.
if (typeof WorkerGlobalScope !== "undefined" && self instanceof WorkerGlobalScope && self.name === WORKER_NAME) {
  import(new URL("../../../cairn_web.js", import.meta.url).href)
    .then(async (pkg) => {
      await pkg.default();
      pkg.cpuWorkerMain();
    })
    .catch((e) => self.postMessage({ failed: String((e && e.stack) || e) }));
}
