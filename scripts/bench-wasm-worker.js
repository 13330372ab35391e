// The browser's CPU fallback timed in a real browser (headless Chromium): the package's own
// `Engine`/`Model` API on the cpu backend in a dedicated Web Worker, as the fallback's stage
// worker runs it, on one thread or (the threaded package) with a team of Web Workers over its
// shared memory. scripts/bench-wasm.sh serves this with scripts/bench-wasm.html; the figures
// are the same as scripts/bench-wasm.mjs prints under Node, whose V8 (11, Node 20) computes
// relaxed SIMD's dot product wrongly (twice the sum), so the threaded package is timed here.
//
// Worker names: "bench PKG THREADS TOKENS ROUNDS SPIN PROBE PREFILL" (PKG: the package's glue URL;
// SPIN: the team's spin budget in us, `cpuTeamSpin`, -1 for the package's default; PROBE 1:
// time the team's hand-offs first, `cpuTeamProbe`; PREFILL: the prefill's prompt tokens), or
// "bench-team PKG" for the team's workers.

const [role, glue, ...args] = self.name.split(" ");
const say = (line) => self.postMessage(line);

async function team() {
  self.onmessage = async (e) => {
    self.onmessage = null;
    const pkg = await import(glue);
    await pkg.default({ module_or_path: e.data.module, memory: e.data.memory });
    try {
      pkg.cpuTeamWorker();
    } catch (err) {
      Atomics.store(new Int32Array(e.data.memory.buffer), e.data.failedAt >> 2, 1);
      throw err;
    }
  };
}

// `prompt` followed by words until the package's tokenizer counts `target` more tokens
// (" stone" is one token of the default model's; a few tries correct for any merge), and
// that count.
function longPrompt(model, prompt, target) {
  if (typeof model.countTokens !== "function") {
    return [Array.from({ length: 24 }, (_, i) => `${i + 1},`).join(" "), 81];
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

async function bench() {
  const [threads, tokens, rounds, spin, probe, prefillTokens] = args.map(Number);
  const pkg = await import(glue);
  await pkg.default();
  if (glue.includes("/threads/")) {
    // How long the team's waiting threads spin before sleeping between checks (us; -1: the
    // package's default), where the package can be told (before session 19: 1,024 checks).
    if (spin >= 0 && typeof pkg.cpuTeamSpin === "function") pkg.cpuTeamSpin(spin);
    say(`team spin: ${typeof pkg.cpuTeamSpin !== "function" ? "1,024 checks" : spin >= 0 ? `${spin} us` : "default"}`);
    const shared = pkg.cpuTeamStart(threads);
    for (let i = 1; i < threads; i++) {
      const w = new Worker(import.meta.url, { type: "module", name: `bench-team ${glue}` });
      w.postMessage(shared);
    }
  }
  say(`threads: ${threads}; kernels: ${pkg.checkCpuKernels()}`);
  if (probe === 1 && threads > 1 && typeof pkg.cpuTeamProbe === "function") {
    // What one hand-off to the team costs with each spin budget: 4 small tasks per op, ops
    // back to back or 10 or 50 us of serial work apart. The team's workers start
    // asynchronously.
    await new Promise((r) => setTimeout(r, 1000));
    for (const budget of [0, 20, 100, 500]) {
      pkg.cpuTeamSpin(budget);
      for (const gap of [0, 10, 50]) {
        // 10,000 ops (tens to hundreds of ms): on a busy machine a shorter probe measures
        // whether the worker happened to hold a core during it.
        pkg.cpuTeamProbe(200, 4, gap);
        const [us, joined] = pkg.cpuTeamProbe(10000, 4, gap);
        say(`probe: spin ${budget} us, gap ${gap} us: ${(us - gap).toFixed(2)} us per op beyond the gap, a worker in ${(100 * joined).toFixed(0)}% of ops`);
      }
    }
    // Back to the run's budget (100 us: engine/src/backend/cpu/team.rs's default).
    pkg.cpuTeamSpin(spin >= 0 ? spin : 100);
  }
  const engine = await pkg.Engine.open("cpu");
  let t = performance.now();
  const model = await engine.loadModel(new URL("/model.gguf", self.location.href).href);
  say(`load: ${((performance.now() - t) / 1e3).toFixed(1)} s (${engine.name})`);
  const prompt = "1, 2,";
  // The long prompt: PREFILL more tokens than the short one (128 by default, as
  // scripts/bench-cpu.sh prefills; the native runs of bench-wasm.sh prefill as many), counted
  // by the package's tokenizer. Packages before `countTokens`: 24 numbers, 81 more tokens.
  const [long, extra] = longPrompt(model, prompt, prefillTokens);
  const median = (v) => v.sort((a, b) => a - b)[Math.floor(v.length / 2)];
  const decode = [];
  const prefill = [];
  for (let r = 0; r <= rounds; r++) {
    t = performance.now();
    await model.generate(prompt, 1);
    const one = performance.now() - t;
    t = performance.now();
    await model.generate(prompt, tokens);
    const msPerToken = (performance.now() - t - one) / (tokens - 1);
    t = performance.now();
    await model.generate(long, 1);
    const prefillMs = performance.now() - t - one;
    if (r === 0) continue;
    decode.push(1e3 / msPerToken);
    prefill.push((extra * 1e3) / prefillMs);
    say(
      `round ${r}: decode ${msPerToken.toFixed(1)} ms/token = ${(1e3 / msPerToken).toFixed(2)} tok/s; ` +
        `prefill ${extra} more tokens in ${prefillMs.toFixed(0)} ms = ${((extra * 1e3) / prefillMs).toFixed(1)} tok/s`,
    );
  }
  // The best round too: on a shared machine it is the one least disturbed.
  const best = (v) => Math.max(...v);
  say(
    `decode median: ${median(decode).toFixed(2)} tok/s; prefill median: ${median(prefill).toFixed(1)} tok/s ` +
      `(best: decode ${best(decode).toFixed(2)}, prefill ${best(prefill).toFixed(1)})`,
  );
}

if (role === "bench-team") {
  team();
} else {
  bench()
    .catch((e) => say(`failed: ${(e && e.stack) || e}`))
    .finally(() => say("DONE"));
}
