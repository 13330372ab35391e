//! Running a list of launches: parameters to the device arena, then the kernels, either
//! launched one by one or as a replay of a CUDA graph captured from an identical earlier run.
//!
//! A run is identified by its key: every launch's kernel, grid and buffer addresses, but not
//! its parameter words. Decode steps differ only in parameters (positions, KV offsets, the
//! sampling step), which live in a pinned host buffer that the graph's first node copies to
//! the device each time it runs; so the second step with the same key captures a graph and
//! every later one replays it after rewriting the parameters. "The same key" means one of the
//! last few runs', not only the last one's: a step may be several runs (a tensor-parallel
//! stage runs the embedding, the layers and the head apart on its first device).

use super::driver::{self, Context, DevicePtr, Function, GraphExec, ParamSlot};
use super::launch::PARAM_WORDS;
use crate::backend::Result;

/// How many captured graphs are kept (a model shard needs one per distinct step shape:
/// decode with and without sampling, the last prefill chunk...).
const MAX_GRAPHS: usize = 16;

/// Parameter words a direct run's slot holds at least (4,096 launches, 256 KiB pinned): a
/// slot that must grow is freed, and freeing waits for the device, which must never happen
/// while a tensor-parallel pass has queued half its devices (the others' sums would wait for
/// the rest until they give up).
const DIRECT_SLOT_WORDS: usize = 4096 * PARAM_WORDS;

/// How many recent runs' keys a run's key is compared with before it is captured.
const RECENT_KEYS: usize = 4;

/// A launch with everything resolved to driver handles.
pub(crate) struct Resolved {
    pub function: Function,
    /// Identifies the function in keys (kernel and module), independent of handle values.
    pub function_id: u32,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes.
    pub shared: u32,
    pub buffers: Vec<DevicePtr>,
    pub params: [u32; PARAM_WORDS],
}

/// Everything about a run except its parameter words.
pub(crate) fn key_of(launches: &[Resolved]) -> Vec<u64> {
    let mut k = Vec::with_capacity(launches.len() * 8);
    for l in launches {
        k.push(u64::from(l.function_id) << 32 | l.buffers.len() as u64);
        k.push(u64::from(l.grid[0]) << 32 | u64::from(l.grid[1]));
        k.push(u64::from(l.grid[2]) << 32 | u64::from(l.block[0]));
        k.push(u64::from(l.block[1]) << 32 | u64::from(l.block[2]));
        k.push(u64::from(l.shared));
        k.extend(l.buffers.iter().copied());
    }
    k
}

/// A small least-recently-used list; pure bookkeeping, tested on its own.
pub(crate) struct Lru<T> {
    entries: Vec<(Vec<u64>, T, u64)>,
    clock: u64,
    cap: usize,
}

impl<T> Lru<T> {
    pub(crate) fn new(cap: usize) -> Self {
        Lru {
            entries: Vec::new(),
            clock: 0,
            cap,
        }
    }

    pub(crate) fn get_mut(&mut self, key: &[u64]) -> Option<&mut T> {
        self.clock += 1;
        let now = self.clock;
        self.entries.iter_mut().find(|e| e.0 == key).map(|e| {
            e.2 = now;
            &mut e.1
        })
    }

    /// Inserts, returning the evicted entry when full.
    pub(crate) fn insert(&mut self, key: Vec<u64>, value: T) -> Option<T> {
        self.clock += 1;
        let evicted = if self.entries.len() >= self.cap {
            let oldest = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.2)
                .map(|(i, _)| i);
            oldest.map(|i| self.entries.swap_remove(i).1)
        } else {
            None
        };
        self.entries.push((key, value, self.clock));
        evicted
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

struct Graph {
    exec: GraphExec,
    slot: ParamSlot,
}

/// Counters for logs and `docs/cuda.md`'s launch-overhead figures.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Stats {
    pub direct_runs: u64,
    pub captures: u64,
    pub replays: u64,
    pub capture_failures: u64,
    /// Launches in the latest run.
    pub last_launches: u64,
}

pub(crate) struct Executor {
    /// Two slots for direct runs, so one run's parameters can be written while the previous
    /// run's copy is still queued.
    direct: [Option<ParamSlot>; 2],
    next_direct: usize,
    graphs: Lru<Graph>,
    /// Keys of the latest runs that were not replays, newest last.
    recent: std::collections::VecDeque<Vec<u64>>,
    pub(crate) graphs_enabled: bool,
    pub(crate) stats: Stats,
}

impl Executor {
    pub(crate) fn new(graphs_enabled: bool) -> Executor {
        Executor {
            direct: [None, None],
            next_direct: 0,
            graphs: Lru::new(MAX_GRAPHS),
            recent: std::collections::VecDeque::with_capacity(RECENT_KEYS),
            graphs_enabled,
            stats: Stats::default(),
        }
    }

    pub(crate) fn run(&mut self, ctx: &Context, launches: &[Resolved]) -> Result<()> {
        self.stats.last_launches = launches.len() as u64;
        if launches.is_empty() {
            return Ok(());
        }
        let words = launches.len() * PARAM_WORDS;
        let mut params = Vec::with_capacity(words);
        for l in launches {
            params.extend_from_slice(&l.params);
        }
        if self.graphs_enabled {
            let key = key_of(launches);
            if let Some(g) = self.graphs.get_mut(&key) {
                g.slot.fill(&params)?;
                g.exec.launch(ctx)?;
                g.slot.mark_taken(ctx)?;
                self.stats.replays += 1;
                return Ok(());
            }
            if let Some(at) = self.recent.iter().position(|k| *k == key) {
                self.recent.remove(at);
                match self.capture(ctx, launches, &params) {
                    Ok(g) => {
                        g.exec.launch(ctx)?;
                        g.slot.mark_taken(ctx)?;
                        self.stats.captures += 1;
                        // An evicted graph may still be running: its slot waits in Drop.
                        drop(self.graphs.insert(key, g));
                        return Ok(());
                    }
                    Err(e) => {
                        // Graphs are an optimisation: fall back to direct launches for good.
                        tracing::warn!(error = %e, "cuda graph capture failed; launching directly from now on");
                        self.stats.capture_failures += 1;
                        self.graphs_enabled = false;
                    }
                }
            } else {
                if self.recent.len() == RECENT_KEYS {
                    self.recent.pop_front();
                }
                self.recent.push_back(key);
            }
        }
        self.run_direct(ctx, launches, &params)
    }

    fn capture(&self, ctx: &Context, launches: &[Resolved], params: &[u32]) -> Result<Graph> {
        let mut slot = ParamSlot::new(params.len())?;
        slot.fill(params)?;
        let exec = driver::capture(ctx, || {
            slot.queue_upload(ctx, params.len())?;
            enqueue(ctx, launches, slot.dev)
        })?;
        Ok(Graph { exec, slot })
    }

    fn run_direct(&mut self, ctx: &Context, launches: &[Resolved], params: &[u32]) -> Result<()> {
        let i = self.next_direct;
        self.next_direct ^= 1;
        let slot = match &mut self.direct[i] {
            Some(s) if s.words >= params.len() => s,
            entry => {
                // Dropping the old slot waits for its last copy.
                *entry = None;
                entry.insert(ParamSlot::new(
                    params.len().next_power_of_two().max(DIRECT_SLOT_WORDS),
                )?)
            }
        };
        slot.fill(params)?;
        slot.queue_upload(ctx, params.len())?;
        slot.mark_taken(ctx)?;
        enqueue(ctx, launches, slot.dev)?;
        self.stats.direct_runs += 1;
        Ok(())
    }
}

/// Queues every launch, launch `i` reading its parameters at `arena + i * 64` bytes.
fn enqueue(ctx: &Context, launches: &[Resolved], arena: DevicePtr) -> Result<()> {
    let mut args = Vec::with_capacity(8);
    for (i, l) in launches.iter().enumerate() {
        args.clear();
        args.push(arena + (i * PARAM_WORDS * 4) as u64);
        args.extend_from_slice(&l.buffers);
        driver::launch(ctx, l.function, l.grid, l.block, l.shared, &mut args)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut c = Lru::new(2);
        assert!(c.insert(vec![1], "a").is_none());
        assert!(c.insert(vec![2], "b").is_none());
        assert_eq!(c.get_mut(&[1]).copied(), Some("a"));
        assert_eq!(c.insert(vec![3], "c"), Some("b"));
        assert_eq!(c.len(), 2);
        assert!(c.get_mut(&[2]).is_none());
        assert_eq!(c.get_mut(&[3]).copied(), Some("c"));
    }
}
