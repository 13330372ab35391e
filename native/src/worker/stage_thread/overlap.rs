//! The stage loop with passes in flight across steps (a stage split by layers over several
//! devices, [`StageServer::overlap`] above 1).
//!
//! The loop of `stage_thread.rs` runs one pass at a time: every step waiting joins it, and
//! the steps its outputs give join the next, so over two devices one always waits for the
//! other. Here the requests' steps are cut into as many groups as the stage has pieces, each
//! group's pass runs on a thread of its own ([`StageServer::begin_forwards`]), and as soon as
//! a pass is over its outputs go on (a request's next step comes back into the queue when
//! this stage is its own next) and the next group's pass starts: while one group's pass is
//! on the second device, the next group's is on the first.
//!
//! What the loop does with a step is unchanged: each pass is a pass of
//! [`StageServer::step_forwards`] over the steps it holds, prompts part-way through their
//! prefill join the next pass to start, a request's end while its pass runs gives its blocks
//! back when the pass is over, and a device's failure stops the stage as before.

use cairn_engine::model::shard::MAX_BATCH_SEQS;
use cairn_engine::protocol::Message;
use cairn_engine::worker::{ShardSlot, StageServer};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::{Context, Job, Taken, step_of};

impl Context {
    /// Serves steps with passes in flight, `first` the first, until none is in flight or
    /// waiting; false when the stage stops (a device failed, or the queue closed).
    pub(super) fn serve_overlapped(
        &self,
        server: &mut StageServer,
        slot: &mut ShardSlot,
        rx: &mut mpsc::UnboundedReceiver<Job>,
        first: Message,
    ) -> bool {
        let mut waiting: Vec<Message> = vec![first];
        loop {
            // Everything queued: steps wait for a pass, other jobs are served now.
            while let Ok(job) = rx.try_recv() {
                self.take(server, slot, job, &mut waiting);
            }
            if !self.finish(server, false) {
                return false;
            }
            let most = server.overlap();
            while server.passes_in_flight() < most && (!waiting.is_empty() || server.has_partial())
            {
                let group = next_group(server, &mut waiting, most);
                if group.is_empty() && !server.has_partial() {
                    // Every waiting step's request has a pass in flight, or too few wait yet.
                    break;
                }
                self.count_pass(server);
                let seqs = group.len();
                let jobs = self.jobs.clone();
                let outs = server.begin_forwards(group, move || {
                    let _ = jobs.send(Job::PassDone);
                });
                let in_flight = server.passes_in_flight();
                debug!(seqs, in_flight, "pass begun");
                if in_flight == most && !self.overlap_told.replace(true) {
                    info!(
                        passes = in_flight,
                        "passes in flight across steps: one on each device"
                    );
                }
                for out in outs {
                    self.dispatch(out);
                }
            }
            if server.passes_in_flight() == 0 && waiting.is_empty() && !server.has_partial() {
                return true;
            }
            // A job, or the end of a pass (`Job::PassDone`).
            match rx.blocking_recv() {
                Some(job) => self.take(server, slot, job, &mut waiting),
                None => {
                    while server.passes_in_flight() > 0 {
                        self.finish(server, true);
                    }
                    return false;
                }
            }
        }
    }

    fn take(
        &self,
        server: &mut StageServer,
        slot: &mut ShardSlot,
        job: Job,
        waiting: &mut Vec<Message>,
    ) {
        match step_of(server, job) {
            Taken::Step(m) => waiting.push(m),
            Taken::Dropped => {}
            Taken::Other(job) => self.other(server, slot, job),
        }
    }

    /// Ends the passes that are over (`wait`: the oldest, waiting for it when none is) and
    /// sends their outputs on; false when a device failed one: the worker is told, and the
    /// passes still in flight are let finish and dropped (their requests are the
    /// coordinator's to recover, as `serve_batch`'s are).
    fn finish(&self, server: &mut StageServer, wait: bool) -> bool {
        let outs = server.finish_passes(wait);
        if let Some(index) = server.take_failed_device() {
            warn!(index, "a device of this worker failed a pass");
            while server.passes_in_flight() > 0 {
                server.finish_passes(true);
            }
            let _ = self.failed.send(index);
            return false;
        }
        for out in outs {
            self.dispatch(out);
        }
        true
    }
}

/// The next pass's steps, out of `waiting`: an even share of the requests (those waiting and
/// those in flight) over `pieces` groups, each request at most once, none whose pass is in
/// flight; the rest keep waiting in order. Short of a share, none while a pass is in flight:
/// the steps it gives back join them (else the passes would stay as small as they once
/// were, each taking the one or two steps that came back since the last began: on two cpu
/// devices, 4 at once ran passes of 1.3 sequences).
fn next_group(server: &StageServer, waiting: &mut Vec<Message>, pieces: usize) -> Vec<Message> {
    let request = |m: &Message| match m {
        Message::Forward { request, .. } => Some(*request),
        _ => None,
    };
    let total = waiting.len() + server.requests_in_flight();
    let share = total.div_ceil(pieces.max(1)).clamp(1, MAX_BATCH_SEQS);
    let mut group: Vec<Message> = Vec::with_capacity(share);
    let mut rest = Vec::with_capacity(waiting.len());
    for m in waiting.drain(..) {
        let r = request(&m);
        // (Only `Forward`s wait here; anything else is the pass's to drop.)
        let free =
            r.is_none_or(|r| !server.in_flight(r) && !group.iter().any(|g| request(g) == Some(r)));
        if free && group.len() < share {
            group.push(m);
        } else {
            rest.push(m);
        }
    }
    if group.len() < share && server.passes_in_flight() > 0 {
        group.append(&mut rest);
        *waiting = group;
        return Vec::new();
    }
    *waiting = rest;
    group
}
