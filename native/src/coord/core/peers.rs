//! What a peer's news means for the placement, without IO: the condition
//! placement weighs from a worker's telemetry and pause, whether a change
//! of it, or a peer's loss, calls for placing again and how soon, and which
//! runs a lost peer takes down.

use std::time::Instant;

use cairn_engine::placement::{DeviceCondition, slowdown};
use cairn_engine::protocol::{Telemetry, Visibility};
use cairn_signal::protocol::PeerId;

use super::placing::Debounce;
use super::view::Placement;

/// What the placer should do after a peer's news.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replace {
    /// Nothing placement weighs changed (the dashboard still refreshes).
    No,
    /// Place again after the debounce.
    Soon,
    /// Requests wait without a placement: place again after the short one.
    Now,
}

impl Replace {
    /// Feeds the placer's debounce.
    pub fn poke(self, debounce: &mut Debounce, now: Instant) {
        match self {
            Replace::No => {}
            Replace::Soon => debounce.poke(now, false),
            Replace::Now => debounce.poke(now, true),
        }
    }
}

/// What placement weighs besides measured speed, from a worker's last
/// report (none yet: a nominal device) and whether it asked to pause.
///
/// Readings that are not numbers (a NaN battery level) count as unknown,
/// as they did when the report went through JSON.
pub fn condition(telemetry: Option<&Telemetry>, paused: bool) -> DeviceCondition {
    let battery = telemetry.and_then(|t| t.battery);
    DeviceCondition {
        throttled: telemetry.and_then(|t| t.throttled) == Some(true),
        pressure: telemetry.and_then(|t| t.pressure.clone()),
        battery_level: battery.map(|b| b.level).filter(|l| l.is_finite()),
        charging: battery.and_then(|b| b.charging),
        background: telemetry.and_then(|t| t.visibility) == Some(Visibility::Hidden),
        paused,
    }
}

/// A worker's condition went from `was` to `now` (a report, a pause or a
/// resume): placement cares when its weight changes (throttling, pressure,
/// battery, visibility, pause), not on every reading.
pub fn after_condition(was: &DeviceCondition, now: &DeviceCondition) -> Replace {
    if slowdown(was) == slowdown(now) {
        Replace::No
    } else {
        Replace::Soon
    }
}

/// `peer` is gone: when it held layers of the active placement, requests
/// wait on a new one, so it is placed at once.
pub fn after_loss(active: Option<&Placement>, peer: &PeerId) -> Replace {
    if active.is_some_and(|a| a.stages.iter().any(|s| &s.peer == peer)) {
        Replace::Now
    } else {
        Replace::Soon
    }
}

/// The runs (request id, its stages' peers) that fail with `peer`.
pub fn runs_lost<'a>(
    runs: impl IntoIterator<Item = (u64, &'a [PeerId])>,
    peer: &PeerId,
) -> Vec<u64> {
    runs.into_iter()
        .filter(|(_, peers)| peers.contains(peer))
        .map(|(id, _)| id)
        .collect()
}
