use serde::{Deserialize, Serialize};

/// What a device reports about its state, beyond its calibrated speed.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DeviceCondition {
    /// The OS or the device says it is thermally throttled.
    pub throttled: bool,
    /// Thermal pressure: `"nominal"`, `"fair"`, `"serious"` or `"critical"`
    /// (the levels of Apple's `ProcessInfo.ThermalState` and the browser
    /// Compute Pressure API); other values count as nominal.
    pub pressure: Option<String>,
    /// Charge as a fraction, `0.0..=1.0` (as the Battery Status API reports it).
    pub battery_level: Option<f64>,
    /// `None` (unknown) counts as not charging.
    pub charging: Option<bool>,
    /// A tab in the background or an app not in front: the OS may freeze it.
    pub background: bool,
    /// The device asked to stop serving (`Message::Pause`).
    pub paused: bool,
}

/// Below this battery level, not charging, a device is not used.
pub const BATTERY_AVOID_BELOW: f64 = 0.20;
/// Below this battery level, not charging, a device is used sparingly.
pub const BATTERY_SPARE_BELOW: f64 = 0.50;

/// The factor a device's compute time is multiplied by in placement, from
/// its condition. The policy:
///
/// - paused, in the background, pressure `critical`, or battery below 20 %
///   and not charging: `f64::INFINITY`, the device is not used;
/// - otherwise the largest of these that apply: pressure `serious` or
///   throttled 4.0, pressure `fair` 1.5, battery below 50 % and not charging
///   2.0;
/// - otherwise 1.0.
///
/// A factor above 1 makes the solver give the device fewer layers (or none)
/// than its measured speed alone would; it is a preference, not a
/// prediction of how slow the device will really be.
pub fn slowdown(condition: &DeviceCondition) -> f64 {
    let pressure = condition
        .pressure
        .as_deref()
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    let charging = condition.charging.unwrap_or(false);
    let battery_below =
        |limit: f64| !charging && condition.battery_level.is_some_and(|level| level < limit);

    if condition.paused
        || condition.background
        || pressure == "critical"
        || battery_below(BATTERY_AVOID_BELOW)
    {
        return f64::INFINITY;
    }
    let mut factor = 1.0_f64;
    if pressure == "serious" || condition.throttled {
        factor = factor.max(4.0);
    }
    if pressure == "fair" {
        factor = factor.max(1.5);
    }
    if battery_below(BATTERY_SPARE_BELOW) {
        factor = factor.max(2.0);
    }
    factor
}
