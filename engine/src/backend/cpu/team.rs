//! The threads one op's tasks run on: the thread that runs the op list and `threads - 1`
//! workers, all taking task numbers from one counter until none are left.
//!
//! A decode step is a few hundred ops, most too short to split and about half worth
//! splitting (the matrix-vector products, attention). Handing each of those to a pool and
//! sleeping until it finishes (rayon's `install`) costs the caller two wake-ups per op, a
//! few microseconds each plus a context switch, which on this scale was about a fifth of a
//! two-thread step. Here the caller works on its own op instead of waiting, and an idle
//! worker watches for the next op for a short while before it sleeps, so in a busy step it
//! sees the next op without a wake-up; it sleeps once the model has gone quiet (between
//! requests, say).
//!
//! Measured (docs/performance.md, 2026-11-26, 2 threads, default model): decode 1.06 to 1.37x
//! rayon's hand-over; with workers and caller spinning flat out instead of yielding between
//! checks it was 0.47 to 1.02x (on two cores the spinning thread takes the core from the one
//! it waits for whenever anything else runs).
//!
//! In the browser (wasm32 built with `atomics`: the threaded package of the CPU fallback,
//! web/src/team.rs) the team's workers cannot be started from here: wasm32 has no threads of
//! its own. Each is a Web Worker over the same shared memory that calls [`serve_wasm_team`]
//! once [`start_wasm_team`] has made the team; a worker that never comes (or comes late)
//! only leaves its share of the tasks to the others, since nobody waits for a worker that
//! has not joined the op.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::Duration;
#[cfg(not(target_arch = "wasm32"))]
use std::time::Instant;
// std's clock panics on wasm32; this one is `performance.now()` there.
#[cfg(target_arch = "wasm32")]
use web_time::Instant;

/// How long an idle worker watches for the next op before it sleeps: far longer than the
/// serial ops between two parallel ones of a step (norms, rotations, residual adds: a few
/// microseconds), and short enough that a model waiting for work stops taking a core at
/// once. Past its first few microseconds the watch yields the core between checks: spinning
/// flat out measured worse (module comment).
const SPIN: Duration = Duration::from_micros(500);

/// One op's tasks. Lives on the caller's stack for as long as [`Team::run`] runs.
struct Job {
    /// `task(i)` for `i < tasks`; its lifetime is erased: `run` does not return while a
    /// worker can still reach it (see `joined`).
    task: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    /// The next task number to take.
    next: AtomicUsize,
    /// Tasks finished (or panicked).
    done: AtomicUsize,
    panicked: AtomicBool,
    /// Workers holding a reference to this job: they join under the slot's lock while the
    /// job is posted, and leave once the counter has run out.
    joined: AtomicUsize,
}

/// The posted job, if any, and a number that changes with every post.
struct Slot {
    epoch: u64,
    job: *const Job,
    shutdown: bool,
}

// SAFETY: `job` is only dereferenced by workers that joined it under the lock while it was
// posted, and the poster keeps it alive until every one of them has left (`Team::run`).
unsafe impl Send for Slot {}

struct Shared {
    slot: Mutex<Slot>,
    /// `slot.epoch`, readable without the lock (what idle workers spin on).
    epoch: AtomicU64,
    wake: Condvar,
    /// Workers asleep (or about to be) on `wake`.
    sleepers: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The process's team: as many threads as the cpu backend's pool
/// (`EngineOptions::cpu_threads`); `None` with one thread, or where threads cannot start.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn team() -> Option<&'static Team> {
    static TEAM: OnceLock<Option<Team>> = OnceLock::new();
    TEAM.get_or_init(|| {
        let threads = crate::kernels::linear::pool().map_or(1, |p| p.current_num_threads());
        (threads > 1).then(|| Team::new(threads).ok()).flatten()
    })
    .as_ref()
}

/// The browser's team, once [`start_wasm_team`] has made it.
#[cfg(target_arch = "wasm32")]
static WASM_TEAM: OnceLock<Team> = OnceLock::new();

/// The browser's team: `None` until [`start_wasm_team`] (one thread until then).
#[cfg(target_arch = "wasm32")]
pub(crate) fn team() -> Option<&'static Team> {
    WASM_TEAM.get()
}

/// Makes the browser's team of `threads` (this thread and `threads - 1` workers, each a Web
/// Worker calling [`serve_wasm_team`]). Returns `false` where a team exists already, or
/// `threads` is below 2 (the ops then run on this thread alone).
#[cfg(target_arch = "wasm32")]
pub fn start_wasm_team(threads: usize) -> bool {
    if threads < 2 || WASM_TEAM.get().is_some() {
        return false;
    }
    WASM_TEAM.set(Team::without_workers()).is_ok()
}

/// Ops a worker of the browser's team took part in, since the page started: what shows the
/// team's Web Workers are running tasks (the stage worker reports it to the page).
#[cfg(target_arch = "wasm32")]
static WASM_JOINS: AtomicU64 = AtomicU64::new(0);

/// Ops a worker of the browser's team took part in so far.
#[cfg(target_arch = "wasm32")]
pub fn wasm_team_joins() -> u64 {
    WASM_JOINS.load(Ordering::Relaxed)
}

/// What a hand-off to the browser's team costs: `ops` ops of `tasks` tasks in a row, each
/// task a few hundred nanoseconds of arithmetic and each op followed by `gap_us` of serial
/// work on this thread (as a decode step's norms and rotations between its products).
/// Returns the microseconds per op and the share of ops a worker took part in, or `None`
/// without a team. A probe for the page (`cpuTeamProbe`), not used by the engine.
#[cfg(target_arch = "wasm32")]
pub fn wasm_team_probe(ops: u32, tasks: usize, gap_us: f64) -> Option<(f64, f64)> {
    let team = WASM_TEAM.get()?;
    let sink = AtomicU64::new(0);
    let task = |i: usize| {
        let mut v = i as u64;
        for _ in 0..256 {
            v = v.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(7);
        }
        sink.fetch_add(v, Ordering::Relaxed);
    };
    let joins = wasm_team_joins();
    let start = Instant::now();
    for _ in 0..ops {
        if !team.run(tasks, &task) {
            (0..tasks).for_each(task);
        }
        let gap = Instant::now();
        while gap.elapsed().as_secs_f64() * 1e6 < gap_us {
            std::hint::spin_loop();
        }
    }
    let us = start.elapsed().as_secs_f64() * 1e6 / f64::from(ops.max(1));
    let joined = (wasm_team_joins() - joins) as f64 / f64::from(ops.max(1));
    Some((us, joined))
}

/// Set (to 1) by a team worker's script when its call into the module failed: wasm32 has no
/// unwinding, so a task that panics there traps, and its op would never count it done. The
/// op's caller then fails instead of waiting forever.
#[cfg(target_arch = "wasm32")]
static WASM_WORKER_FAILED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Where [`WASM_WORKER_FAILED`] is in the shared memory, for the team workers' script.
#[cfg(target_arch = "wasm32")]
pub fn wasm_team_failed_flag() -> usize {
    std::ptr::addr_of!(WASM_WORKER_FAILED) as usize
}

#[cfg(target_arch = "wasm32")]
fn wasm_check_workers() {
    if WASM_WORKER_FAILED.load(Ordering::Relaxed) != 0 {
        panic!(
            "a worker of the cpu backend's thread team failed (its Web Worker's error is in the console)"
        );
    }
}

#[cfg(not(target_arch = "wasm32"))]
fn wasm_check_workers() {}

/// Lets another thread have this core for a moment: `sched_yield` natively. wasm32 has no
/// yield (std's is a no-op), so a waiting thread would spin through its whole time slice on
/// a busy machine while the thread it waits for is descheduled; it sleeps a few microseconds
/// instead (`park_timeout`: on wasm32 with atomics a timed `memory.atomic.wait32`, which the
/// browser and Node implement as a timed wait that gives up the core).
#[cfg(not(target_arch = "wasm32"))]
fn offer_core() {
    std::thread::yield_now();
}

/// On wasm32 a timed `memory.atomic.wait32` of 5 us: it returns after the OS's timer slack
/// (tens of microseconds in Chromium on Linux), and a decode step hands ~250 ops to the
/// team, so a waiting thread that slept at once came to each op late (a worker) or slept on
/// the op's last task (the caller): two threads decoded slower than one. So a wasm32 thread
/// first spins for [`wasm_spin`] (a budget the page may change) and only then sleeps between
/// checks; an idle worker still goes to sleep on the condition variable once no op has come
/// for [`SPIN`], so a team between requests takes no core. (docs/performance.md, issue 20
/// session 19.)
#[cfg(target_arch = "wasm32")]
fn offer_core() {
    std::thread::park_timeout(Duration::from_micros(5));
}

/// How long a waiting thread of the browser's team spins before it sleeps between checks,
/// in microseconds; 0: after 1,024 checks (session 17's waits).
#[cfg(target_arch = "wasm32")]
static WASM_SPIN_US: std::sync::atomic::AtomicU32 =
    std::sync::atomic::AtomicU32::new(WASM_SPIN_DEFAULT_US);

/// Long enough for the serial ops between two parallel ones of a decode step (norms,
/// rotations, residual adds), short next to a prefill's: a spinning worker takes a core its
/// caller may need where the machine has fewer free cores than the team has threads.
#[cfg(target_arch = "wasm32")]
const WASM_SPIN_DEFAULT_US: u32 = 100;

/// Sets how long the browser team's waiting threads spin before they sleep between checks
/// (microseconds, at most [`SPIN`]'s; 0: after 1,024 checks, as before session 19): for
/// comparing budgets in one package (`cpuTeamSpin` in the web package).
#[cfg(target_arch = "wasm32")]
pub fn set_wasm_team_spin(us: u32) {
    WASM_SPIN_US.store(us.min(SPIN.as_micros() as u32), Ordering::Relaxed);
}

#[cfg(target_arch = "wasm32")]
fn wasm_spin() -> Duration {
    Duration::from_micros(u64::from(WASM_SPIN_US.load(Ordering::Relaxed)))
}

/// A waiting thread's checks so far: natively an idle worker offers the core
/// ([`offer_core`]) at each check past its first 1,024 and a caller at every check, as before;
/// on wasm32 both only once [`wasm_spin`] has passed as well.
struct Patience {
    spins: u32,
    /// wasm32: whether the spin budget still runs (read from the clock every
    /// [`CLOCK_EVERY`] checks: a call out to `performance.now()` there).
    #[cfg(target_arch = "wasm32")]
    hot: bool,
    #[cfg(target_arch = "wasm32")]
    since: Instant,
}

impl Patience {
    fn new() -> Patience {
        Patience {
            spins: 0,
            #[cfg(target_arch = "wasm32")]
            hot: true,
            #[cfg(target_arch = "wasm32")]
            since: Instant::now(),
        }
    }

    /// Whether the next pause may offer the core. `elapsed`: the time since the wait began,
    /// where the caller has just read it.
    fn past_spin(&mut self, elapsed: Option<Duration>) -> bool {
        #[cfg(target_arch = "wasm32")]
        if self.hot {
            let elapsed = elapsed.or_else(|| {
                self.spins
                    .is_multiple_of(CLOCK_EVERY)
                    .then(|| self.since.elapsed())
            });
            if let Some(e) = elapsed {
                self.hot = e < wasm_spin() || self.spins < 1024;
            }
            return !self.hot;
        }
        let _ = elapsed;
        self.spins > 1024
    }

    /// Whether an idle worker reads the clock at this check: every [`CLOCK_EVERY`] checks,
    /// and on wasm32 at every check once it sleeps between them (a sleep costs far more than
    /// the clock, and the worker should reach its condition variable after [`SPIN`], not
    /// [`CLOCK_EVERY`] sleeps later).
    fn clock_due(&self) -> bool {
        #[cfg(target_arch = "wasm32")]
        if !self.hot {
            return true;
        }
        self.spins.is_multiple_of(CLOCK_EVERY)
    }

    /// One check's pause in a caller's wait for its op's last tasks: natively [`offer_core`]
    /// every time (a worker still on a task may be waiting for the core); on wasm32 once the
    /// spin budget has passed, since its [`offer_core`] sleeps.
    #[cfg(not(target_arch = "wasm32"))]
    fn pause(&mut self) {
        offer_core();
    }

    #[cfg(target_arch = "wasm32")]
    fn pause(&mut self) {
        self.spins = self.spins.saturating_add(1);
        if self.past_spin(None) {
            offer_core();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// How many checks of an idle worker's watch go between two readings of the clock: on
/// wasm32 the clock is a call out to JavaScript's `performance.now()`, far dearer than a
/// check.
#[cfg(not(target_arch = "wasm32"))]
const CLOCK_EVERY: u32 = 64;
#[cfg(target_arch = "wasm32")]
const CLOCK_EVERY: u32 = 1024;

/// Serves as one of the browser team's workers for as long as the team lives (its Web
/// Worker's whole life). Returns at once, `false`, where no team was made. Blocks (waiting on
/// the shared memory between ops): call it from a Web Worker, never from a page's thread.
#[cfg(target_arch = "wasm32")]
pub fn serve_wasm_team() -> bool {
    let Some(team) = WASM_TEAM.get() else {
        return false;
    };
    worker(&team.shared);
    true
}

thread_local! {
    /// Set on the team's workers: a task that splits its work again is declined by `run`
    /// (and its caller hands the pieces to rayon or runs them itself).
    static IN_WORKER: Cell<bool> = const { Cell::new(false) };
}

pub(crate) struct Team {
    shared: Arc<Shared>,
    /// Held by the one caller whose job is posted.
    busy: Mutex<()>,
}

impl Team {
    /// The calling thread and `threads - 1` workers started now.
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn new(threads: usize) -> std::io::Result<Team> {
        let team = Team::without_workers();
        for i in 1..threads {
            let shared = Arc::clone(&team.shared);
            std::thread::Builder::new()
                .name(format!("cairn-cpu-team-{i}"))
                .spawn(move || worker(&shared))?;
        }
        Ok(team)
    }

    /// A team whose workers come later (each runs [`worker`] on its own thread).
    fn without_workers() -> Team {
        let shared = Arc::new(Shared {
            slot: Mutex::new(Slot {
                epoch: 0,
                job: std::ptr::null(),
                shutdown: false,
            }),
            epoch: AtomicU64::new(0),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
        });
        Team {
            shared,
            busy: Mutex::new(()),
        }
    }

    /// Runs `task(i)` for every `i < tasks` on this thread and the workers, returning when
    /// all have run; a task's panic is raised here once every task has finished. Returns
    /// `false` without running anything where the team is taken: by another thread's op, or
    /// because this is one of its own workers (the caller then runs the tasks another way).
    pub(crate) fn run(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) -> bool {
        if IN_WORKER.get() {
            return false;
        }
        let _guard = match self.busy.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return false,
        };
        // SAFETY: only the lifetime is erased; `job` (which holds the pointer) is not
        // reachable by any worker once this function returns (below).
        let task: *const (dyn Fn(usize) + Sync + 'static) = unsafe {
            std::mem::transmute::<
                *const (dyn Fn(usize) + Sync + '_),
                *const (dyn Fn(usize) + Sync + 'static),
            >(task)
        };
        let job = Job {
            task,
            tasks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            joined: AtomicUsize::new(0),
        };
        {
            let mut slot = self.shared.lock();
            slot.epoch += 1;
            slot.job = &job;
            self.shared.epoch.store(slot.epoch, Ordering::Release);
        }
        // A worker that counted itself a sleeper did so under the lock, before the post
        // (so it is seen here) or after it (so it saw the new epoch and did not sleep).
        if self.shared.sleepers.load(Ordering::SeqCst) > 0 {
            self.shared.wake.notify_all();
        }
        work(&job);
        // Offering the core between checks: a worker still on a task may be waiting for it.
        let mut patience = Patience::new();
        while job.done.load(Ordering::Acquire) < tasks {
            wasm_check_workers();
            patience.pause();
        }
        // No worker joins after this; those that joined leave once they find the counter
        // run out (they touch nothing of the job after `joined`).
        self.shared.lock().job = std::ptr::null();
        while job.joined.load(Ordering::Acquire) > 0 {
            wasm_check_workers();
            patience.pause();
        }
        if job.panicked.load(Ordering::Relaxed) {
            panic!("a task of the cpu backend's thread team panicked");
        }
        true
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.epoch.fetch_add(1, Ordering::Release);
        self.shared.wake.notify_all();
    }
}

/// Takes task numbers until they run out. A panicking task counts as done (so nobody waits
/// for it forever) and marks the job.
fn work(job: &Job) {
    loop {
        let i = job.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.tasks {
            return;
        }
        // SAFETY: the job's poster keeps the closure alive while the job can be reached.
        let task = unsafe { &*job.task };
        if catch_unwind(AssertUnwindSafe(|| task(i))).is_err() {
            job.panicked.store(true, Ordering::Relaxed);
        }
        job.done.fetch_add(1, Ordering::Release);
    }
}

fn worker(shared: &Shared) {
    IN_WORKER.set(true);
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut patience = Patience::new();
        while shared.epoch.load(Ordering::Acquire) == seen {
            patience.spins = patience.spins.wrapping_add(1);
            let elapsed = patience.clock_due().then(|| start.elapsed());
            // Past the first few microseconds the core is offered to whoever else wants it
            // between checks (on a quiet machine nobody does, and the check comes straight
            // back; on a busy one, the thread that will post the next op may be waiting).
            if patience.past_spin(elapsed) {
                offer_core();
            }
            if elapsed.is_some_and(|e| e > SPIN) {
                let mut slot = shared.lock();
                shared.sleepers.fetch_add(1, Ordering::SeqCst);
                while slot.epoch == seen && !slot.shutdown {
                    slot = shared.wake.wait(slot).unwrap_or_else(|e| e.into_inner());
                }
                shared.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            std::hint::spin_loop();
        }
        let job = {
            let slot = shared.lock();
            if slot.shutdown {
                return;
            }
            seen = slot.epoch;
            if slot.job.is_null() {
                continue;
            }
            // SAFETY: the job is posted, and its poster does not retract it without this
            // lock, nor let it go while `joined` counts this worker.
            let job = unsafe { &*slot.job };
            job.joined.fetch_add(1, Ordering::Relaxed);
            #[cfg(target_arch = "wasm32")]
            WASM_JOINS.fetch_add(1, Ordering::Relaxed);
            job
        };
        work(job);
        job.joined.fetch_sub(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many ops of every size in a row (the way a decode step hands them over): every task
    /// runs exactly once per op, whoever takes it.
    #[test]
    fn every_task_runs_once_in_many_ops() {
        let team = Team::new(3).expect("threads");
        let counts: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
        for op in 0..20_000usize {
            let tasks = op % 64;
            assert!(team.run(tasks, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            }));
            for (i, c) in counts.iter().enumerate() {
                assert_eq!(
                    c.swap(0, Ordering::Relaxed),
                    usize::from(i < tasks),
                    "op {op}"
                );
            }
        }
    }

    /// Ops spaced further apart than the workers spin: they sleep and are woken.
    #[test]
    fn sleeping_workers_wake_for_the_next_op() {
        let team = Team::new(2).expect("threads");
        for _ in 0..3 {
            std::thread::sleep(SPIN * 4);
            let sum = AtomicUsize::new(0);
            assert!(team.run(100, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            }));
            assert_eq!(sum.into_inner(), 4950);
        }
    }

    /// A panicking task is raised to the caller after the op, and the team works after it.
    #[test]
    fn a_task_panic_reaches_the_caller_and_the_team_goes_on() {
        let team = Team::new(2).expect("threads");
        let ran = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            team.run(50, &|i| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert!(i != 17, "task 17 fails");
            })
        }));
        assert!(r.is_err());
        assert_eq!(ran.load(Ordering::Relaxed), 50);
        let n = AtomicUsize::new(0);
        assert!(team.run(10, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(n.into_inner(), 10);
    }

    /// Several callers at once: one has the team, the others are told to run their tasks
    /// another way; a task splitting its work again is told the same.
    #[test]
    fn a_taken_team_declines_and_nothing_is_lost() {
        let team = Team::new(2).expect("threads");
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..2_000 {
                        let task = |_: usize| {
                            total.fetch_add(1, Ordering::Relaxed);
                        };
                        if !team.run(8, &task) {
                            (0..8).for_each(task);
                        }
                    }
                });
            }
        });
        assert_eq!(total.into_inner(), 4 * 2_000 * 8);
        let nested = AtomicUsize::new(0);
        assert!(team.run(4, &|_| {
            let inner = |_: usize| {
                nested.fetch_add(1, Ordering::Relaxed);
            };
            // Declined on a worker; the caller's thread (not a worker) finds it busy.
            assert!(!team.run(3, &inner));
            (0..3).for_each(inner);
        }));
        assert_eq!(nested.into_inner(), 12);
    }
}
