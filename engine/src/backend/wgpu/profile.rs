//! GPU time per kernel, for finding where a step goes (`CAIRN_WGPU_PROFILE=1`, native only).
//!
//! Each dispatch of a run gets its own compute pass with timestamps written at its start and
//! end, the run waits for its queries, and the time of each kernel (by name and weight
//! format) is added up per run shape: runs of the same kernels in the same order (every
//! decode step of a model, say) share a table. The tables are logged when the device is dropped
//! (and every [`REPORT_EVERY`] runs of a shape), largest first. Passes of one dispatch and a
//! wait per run change what is measured a little (a pass boundary is a barrier the fused
//! passes have anyway; the pipelining between steps is lost), so the totals are the kernels'
//! own time, not the step's: the bench's step time beside them says what the gaps cost.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

/// Most queries one run takes (two a dispatch); longer runs are not profiled.
pub(crate) const MAX_QUERIES: u32 = 4096;
/// A shape's table is logged again after this many more runs.
const REPORT_EVERY: u64 = 256;

/// Whether `CAIRN_WGPU_PROFILE` asks for profiling.
pub(crate) fn wanted() -> bool {
    std::env::var("CAIRN_WGPU_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

#[derive(Default)]
struct Kernel {
    dispatches: u64,
    ns: f64,
}

#[derive(Default)]
struct Shape {
    dispatches: usize,
    runs: u64,
    ns: f64,
    kernels: HashMap<String, Kernel>,
}

/// The tables, by a hash of a run's kernel names in order.
#[derive(Default)]
pub(crate) struct Profile {
    shapes: Mutex<HashMap<u64, Shape>>,
}

impl Profile {
    /// Adds one run: `names[i]` is dispatch i's kernel, `ticks` its begin and end stamps in
    /// order, `period_ns` the queue's nanoseconds per tick.
    pub(crate) fn add(&self, names: &[String], ticks: &[u64], period_ns: f32) {
        let Ok(mut shapes) = self.shapes.lock() else {
            return;
        };
        let mut h = std::collections::hash_map::DefaultHasher::new();
        names.hash(&mut h);
        let shape = shapes.entry(h.finish()).or_default();
        shape.dispatches = names.len();
        shape.runs += 1;
        for (name, t) in names.iter().zip(ticks.chunks_exact(2)) {
            let ns = t[1].saturating_sub(t[0]) as f64 * f64::from(period_ns);
            shape.ns += ns;
            let k = shape.kernels.entry(name.clone()).or_default();
            k.dispatches += 1;
            k.ns += ns;
        }
        if shape.runs.is_multiple_of(REPORT_EVERY) {
            tracing::info!("{}", table(shape));
        }
    }

    /// Logs every shape's table.
    pub(crate) fn report(&self) {
        let Ok(shapes) = self.shapes.lock() else {
            return;
        };
        let mut all: Vec<&Shape> = shapes.values().collect();
        all.sort_by_key(|s| (s.dispatches, s.runs));
        for s in all {
            tracing::info!("{}", table(s));
        }
    }
}

fn table(s: &Shape) -> String {
    use std::fmt::Write;
    let runs = s.runs.max(1) as f64;
    let mut rows: Vec<_> = s.kernels.iter().collect();
    rows.sort_by(|a, b| b.1.ns.total_cmp(&a.1.ns));
    let mut out = format!(
        "wgpu profile: {} runs of {} dispatches, kernels' time {:.1} us a run",
        s.runs,
        s.dispatches,
        s.ns / runs / 1e3
    );
    for (name, k) in rows {
        let _ = write!(
            out,
            "\n  {:>9.1} us a run {:>5.1}%  {:>6.1} a run  {name}",
            k.ns / runs / 1e3,
            100.0 * k.ns / s.ns.max(1.0),
            k.dispatches as f64 / runs,
        );
    }
    out
}
