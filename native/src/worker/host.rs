//! The host's thermal and power state, as Linux reports it in sysfs, for the
//! worker's telemetry: the coordinator gives a throttled or low-battery
//! device fewer layers (`placement::slowdown`).
//!
//! Thermal pressure uses the levels browsers and Apple platforms report: a
//! zone at or above its lowest `passive` trip point (where the kernel starts
//! cutting clocks) is `serious`, and within 5 °C of its `critical` (or `hot`)
//! trip point, where the machine is about to shut down, `critical`, which
//! takes the device out of placement altogether. Hosts without these files
//! (containers, other systems) report nothing, which counts as nominal.

use std::path::{Path, PathBuf};

use cairn_engine::protocol::{Battery, Thermal};
use cairn_engine::worker::Condition;

/// Reads sysfs under `root` (normally `/sys`; `CAIRN_SYSFS_ROOT` points it
/// elsewhere, which is how the tests drive a worker into throttling).
#[derive(Clone, Debug)]
pub struct HostCondition {
    root: PathBuf,
}

/// Margin below a critical trip point at which a zone counts as critical.
const CRITICAL_MARGIN_C: f64 = 5.0;

impl HostCondition {
    pub fn new(root: impl Into<PathBuf>) -> HostCondition {
        HostCondition { root: root.into() }
    }

    pub fn from_env() -> HostCondition {
        HostCondition::new(
            std::env::var_os("CAIRN_SYSFS_ROOT")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/sys")),
        )
    }

    /// What the host reports now: the hottest zone against its limit, the
    /// pressure (nominal, serious or critical) and whether it throttles, and
    /// the battery, each only where the host has it (no visibility: that is
    /// a browser tab's).
    pub fn read(&self) -> Condition {
        let mut out = Condition::default();
        let zones = thermal_zones(&self.root.join("class/thermal"));
        if let Some(hottest) = zones.iter().max_by(|a, b| a.temp_c.total_cmp(&b.temp_c)) {
            out.thermal = Some(Thermal {
                zone: hottest.kind.clone(),
                temp_c: hottest.temp_c,
                limit_c: hottest.limit_c(),
            });
            let pressure = zones
                .iter()
                .map(Zone::pressure)
                .max()
                .unwrap_or(Pressure::Nominal);
            out.pressure = Some(pressure.name().to_owned());
            out.throttled = Some(pressure >= Pressure::Serious);
        }
        out.battery = battery(&self.root.join("class/power_supply"));
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Pressure {
    Nominal,
    Serious,
    Critical,
}

impl Pressure {
    fn name(self) -> &'static str {
        match self {
            Pressure::Nominal => "nominal",
            Pressure::Serious => "serious",
            Pressure::Critical => "critical",
        }
    }
}

struct Zone {
    kind: String,
    temp_c: f64,
    /// Where the kernel starts throttling.
    passive_c: Option<f64>,
    /// Where the machine shuts down.
    critical_c: Option<f64>,
}

impl Zone {
    /// The temperature reported as this zone's limit.
    fn limit_c(&self) -> Option<f64> {
        self.passive_c
            .or(self.critical_c.map(|c| c - CRITICAL_MARGIN_C))
    }

    fn pressure(&self) -> Pressure {
        if self
            .critical_c
            .is_some_and(|c| self.temp_c >= c - CRITICAL_MARGIN_C)
        {
            Pressure::Critical
        } else if self.passive_c.is_some_and(|p| self.temp_c >= p) {
            Pressure::Serious
        } else {
            Pressure::Nominal
        }
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
}

/// Millidegrees Celsius, as sysfs writes them.
fn read_millic(path: &Path) -> Option<f64> {
    read_trimmed(path)?
        .parse::<i64>()
        .ok()
        .map(|m| m as f64 / 1000.0)
}

fn thermal_zones(dir: &Path) -> Vec<Zone> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut zones = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let is_zone = e
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with("thermal_zone"));
        if !is_zone {
            continue;
        }
        let Some(temp_c) = read_millic(&path.join("temp")) else {
            continue;
        };
        let mut passive: Option<f64> = None;
        let mut critical: Option<f64> = None;
        for i in 0..32 {
            let Some(kind) = read_trimmed(&path.join(format!("trip_point_{i}_type"))) else {
                break;
            };
            let Some(t) = read_millic(&path.join(format!("trip_point_{i}_temp"))) else {
                continue;
            };
            // Disabled trip points read as zero or less.
            if t <= 0.0 {
                continue;
            }
            match kind.as_str() {
                "passive" => passive = Some(passive.map_or(t, |p| p.min(t))),
                "critical" | "hot" => critical = Some(critical.map_or(t, |c| c.min(t))),
                _ => {}
            }
        }
        zones.push(Zone {
            kind: read_trimmed(&path.join("type")).unwrap_or_else(|| "unknown".into()),
            temp_c,
            passive_c: passive,
            critical_c: critical,
        });
    }
    zones
}

/// The first battery's charge and whether it is charging.
fn battery(dir: &Path) -> Option<Battery> {
    let mut supplies: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| read_trimmed(&p.join("type")).as_deref() == Some("Battery"))
        .collect();
    supplies.sort();
    let b = supplies.first()?;
    let level = read_trimmed(&b.join("capacity"))?.parse::<f64>().ok()? / 100.0;
    let charging = match read_trimmed(&b.join("status")).as_deref() {
        Some("Charging" | "Full") => Some(true),
        Some("Discharging" | "Not charging") => Some(false),
        _ => None,
    };
    Some(Battery {
        level: level.clamp(0.0, 1.0),
        charging,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zone(root: &Path, n: usize, kind: &str, temp: i64, trips: &[(&str, i64)]) {
        let z = root.join(format!("class/thermal/thermal_zone{n}"));
        std::fs::create_dir_all(&z).unwrap();
        std::fs::write(z.join("type"), format!("{kind}\n")).unwrap();
        std::fs::write(z.join("temp"), format!("{temp}\n")).unwrap();
        for (i, (t, v)) in trips.iter().enumerate() {
            std::fs::write(z.join(format!("trip_point_{i}_type")), t).unwrap();
            std::fs::write(z.join(format!("trip_point_{i}_temp")), v.to_string()).unwrap();
        }
    }

    #[test]
    fn nothing_to_read_reports_nothing() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(HostCondition::new(dir.path()).read(), Condition::default());
    }

    #[test]
    fn a_zone_at_its_passive_trip_is_throttling() {
        let dir = tempfile::tempdir().unwrap();
        zone(dir.path(), 0, "acpitz", 45_000, &[("critical", 110_000)]);
        zone(
            dir.path(),
            1,
            "x86_pkg_temp",
            70_000,
            &[("passive", 85_000), ("critical", 105_000)],
        );
        let host = HostCondition::new(dir.path());
        let r = host.read();
        assert_eq!(r.throttled, Some(false));
        let thermal = r.thermal.unwrap();
        assert_eq!(thermal.zone, "x86_pkg_temp");
        assert_eq!(thermal.limit_c, Some(85.0));
        zone(
            dir.path(),
            1,
            "x86_pkg_temp",
            86_500,
            &[("passive", 85_000), ("critical", 105_000)],
        );
        let r = host.read();
        assert_eq!(r.throttled, Some(true));
        assert_eq!(r.pressure.as_deref(), Some("serious"));
        zone(
            dir.path(),
            1,
            "x86_pkg_temp",
            101_000,
            &[("passive", 85_000), ("critical", 105_000)],
        );
        assert_eq!(host.read().pressure.as_deref(), Some("critical"));
    }

    #[test]
    fn near_the_critical_trip_is_critical() {
        let dir = tempfile::tempdir().unwrap();
        zone(dir.path(), 0, "gpu", 96_000, &[("critical", 100_000)]);
        let r = HostCondition::new(dir.path()).read();
        assert_eq!(r.throttled, Some(true));
        assert_eq!(r.pressure.as_deref(), Some("critical"));
        assert_eq!(r.thermal.unwrap().limit_c, Some(95.0));
        zone(
            dir.path(),
            0,
            "gpu",
            94_000,
            &[("critical", 100_000), ("passive", 0)],
        );
        let r = HostCondition::new(dir.path()).read();
        assert_eq!(r.throttled, Some(false));
        assert_eq!(r.pressure.as_deref(), Some("nominal"));
    }

    #[test]
    fn battery_level_and_charging() {
        let dir = tempfile::tempdir().unwrap();
        let ac = dir.path().join("class/power_supply/AC");
        let bat = dir.path().join("class/power_supply/BAT0");
        std::fs::create_dir_all(&ac).unwrap();
        std::fs::create_dir_all(&bat).unwrap();
        std::fs::write(ac.join("type"), "Mains\n").unwrap();
        std::fs::write(bat.join("type"), "Battery\n").unwrap();
        std::fs::write(bat.join("capacity"), "37\n").unwrap();
        std::fs::write(bat.join("status"), "Discharging\n").unwrap();
        let r = HostCondition::new(dir.path()).read();
        assert_eq!(
            r.battery,
            Some(Battery {
                level: 0.37,
                charging: Some(false)
            })
        );
        assert_eq!(r.throttled, None, "no thermal zones: {r:?}");
        std::fs::write(bat.join("capacity"), "garbage").unwrap();
        assert_eq!(HostCondition::new(dir.path()).read().battery, None);
    }
}
