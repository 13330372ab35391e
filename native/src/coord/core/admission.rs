//! Which requests run and which wait: at most `parallel` run at once (the concurrency the
//! stages' key/value pools were sized for), the rest wait in arrival order, and a bounded
//! queue refuses beyond its length instead of holding unbounded memory. Sans-IO: the shell
//! (pipeline.rs) tells it arrivals, ends and cancellations, and starts whom it names.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What an arriving request is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Run now.
    Run,
    /// Wait; `ahead` requests are before it.
    Queued { ahead: usize },
    /// The queue is full.
    Refused { queued: usize },
}

#[derive(Debug)]
pub struct Admission {
    parallel: usize,
    max_queue: usize,
    running: Vec<u64>,
    queue: VecDeque<(u64, Instant)>,
    /// The longest a request that has started waited, over the last few starts.
    recent_waits: VecDeque<Duration>,
}

/// Starts over which the recent wait is reported.
const RECENT: usize = 32;

impl Admission {
    pub fn new(parallel: usize, max_queue: usize) -> Admission {
        Admission {
            parallel: parallel.max(1),
            max_queue,
            running: Vec::new(),
            queue: VecDeque::new(),
            recent_waits: VecDeque::new(),
        }
    }

    pub fn arrive(&mut self, id: u64, now: Instant) -> Admit {
        if self.running.len() < self.parallel && self.queue.is_empty() {
            self.running.push(id);
            self.note_wait(Duration::ZERO);
            return Admit::Run;
        }
        if self.queue.len() >= self.max_queue {
            return Admit::Refused {
                queued: self.queue.len(),
            };
        }
        self.queue.push_back((id, now));
        Admit::Queued {
            ahead: self.queue.len() - 1,
        }
    }

    /// `id` is over (finished, failed or cancelled, running or waiting); the requests that
    /// start now, oldest first.
    pub fn leave(&mut self, id: u64, now: Instant) -> Vec<u64> {
        self.running.retain(|&r| r != id);
        self.queue.retain(|&(q, _)| q != id);
        let mut started = Vec::new();
        while self.running.len() < self.parallel {
            let Some((next, since)) = self.queue.pop_front() else {
                break;
            };
            self.running.push(next);
            self.note_wait(now.saturating_duration_since(since));
            started.push(next);
        }
        started
    }

    fn note_wait(&mut self, wait: Duration) {
        if self.recent_waits.len() == RECENT {
            self.recent_waits.pop_front();
        }
        self.recent_waits.push_back(wait);
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    pub fn parallel(&self) -> usize {
        self.parallel
    }

    /// How long the oldest waiting request has waited.
    pub fn oldest_wait(&self, now: Instant) -> Duration {
        self.queue.front().map_or(Duration::ZERO, |&(_, since)| {
            now.saturating_duration_since(since)
        })
    }

    /// The mean wait of the last requests to start.
    pub fn mean_recent_wait(&self) -> Duration {
        if self.recent_waits.is_empty() {
            return Duration::ZERO;
        }
        self.recent_waits.iter().sum::<Duration>() / self.recent_waits.len() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_parallel_run_and_the_rest_start_in_arrival_order() {
        let t0 = Instant::now();
        let mut a = Admission::new(2, 3);
        assert_eq!(a.arrive(1, t0), Admit::Run);
        assert_eq!(a.arrive(2, t0), Admit::Run);
        assert_eq!(a.arrive(3, t0), Admit::Queued { ahead: 0 });
        assert_eq!(a.arrive(4, t0), Admit::Queued { ahead: 1 });
        assert_eq!(a.arrive(5, t0), Admit::Queued { ahead: 2 });
        assert_eq!(a.arrive(6, t0), Admit::Refused { queued: 3 });
        assert_eq!((a.running(), a.queued()), (2, 3));
        // A waiting request cancelled leaves no gap and starts nothing.
        assert!(a.leave(4, t0).is_empty());
        let t1 = t0 + Duration::from_secs(2);
        assert_eq!(a.oldest_wait(t1), Duration::from_secs(2));
        assert_eq!(a.leave(1, t1), vec![3]);
        assert_eq!(a.mean_recent_wait(), Duration::from_secs(2) / 3);
        assert_eq!(a.leave(2, t1), vec![5]);
        assert_eq!(a.leave(3, t1), Vec::<u64>::new());
        assert_eq!((a.running(), a.queued()), (1, 0));
        // A newcomer does not pass anyone waiting: with a free place and an empty queue it
        // runs at once.
        assert_eq!(a.arrive(7, t1), Admit::Run);
        assert_eq!(a.arrive(8, t1), Admit::Queued { ahead: 0 });
    }

    #[test]
    fn no_request_waits_forever_behind_later_ones() {
        // Fairness under churn: with one place and a stream of arrivals, each request
        // starts once exactly the ones before it have left.
        let t0 = Instant::now();
        let mut a = Admission::new(1, 100);
        let mut started = vec![];
        assert_eq!(a.arrive(0, t0), Admit::Run);
        started.push(0);
        for id in 1..50u64 {
            a.arrive(id, t0);
            if id % 2 == 0 {
                let prev = *started.last().unwrap();
                started.extend(a.leave(prev, t0));
            }
        }
        while let Some(&prev) = started.last() {
            let next = a.leave(prev, t0);
            if next.is_empty() {
                break;
            }
            started.extend(next);
        }
        assert_eq!(started, (0..50).collect::<Vec<_>>());
    }
}
