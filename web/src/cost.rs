//! What lending this device costs its owner, in words, before and while it serves: its share
//! of the model to download and hold (the coordinator's estimate from `/join/cost`), the
//! memory the tab offers, and the battery.

use cairn_engine::placement::BATTERY_AVOID_BELOW;
use cairn_engine::protocol::Battery;
use serde_json::Value;

/// The memory a tab offers the cluster: half what the device reports, and no more than a
/// quarter of the machine where the browser says its size (but up to 1 GiB of that quarter
/// even when the device reports less).
pub fn memory_budget(device_bytes: u64, env: &Value) -> u64 {
    let mut budget = device_bytes / 2;
    if let Some(gib) = env["deviceMemoryGiB"].as_f64() {
        let quarter = (gib * (1u64 << 30) as f64 / 4.0) as u64;
        budget = budget.min(quarter).max(quarter.min(1 << 30));
    }
    budget
}

/// Megabytes as people read them on a phone (decimal, whole above 10).
fn mb(bytes: u64) -> String {
    let v = bytes as f64 / 1e6;
    if v >= 10.0 {
        format!("{v:.0} MB")
    } else {
        format!("{v:.1} MB")
    }
}

/// "about X MB", or "about X–Y MB" when the two differ by more than a tenth.
fn about(low: u64, high: u64) -> String {
    if high <= low + low / 10 {
        format!("about {}", mb(high))
    } else {
        format!("about {}–{}", mb(low).trim_end_matches(" MB"), mb(high))
    }
}

/// The download and memory lines from the coordinator's estimate (`/join/cost`), or `None`
/// when there is none (a page not served by a coordinator).
pub fn share_lines(estimate: &Value, budget: u64) -> Option<(String, String)> {
    let range = |k: &str| Some((estimate[k]["low"].as_u64()?, estimate[k]["high"].as_u64()?));
    let (l_low, l_high) = range("layers")?;
    let (d_low, d_high) = range("download_bytes")?;
    let (m_low, m_high) = range("memory_bytes")?;
    let n = estimate["model_layers"].as_u64()?;
    let devices = estimate["devices"].as_u64().unwrap_or(0);
    if l_high == 0 {
        let text = format!(
            "nothing: the {} this tab can offer is too little for one layer of this model, \
             so the cluster will probably not use this device.",
            mb(budget)
        );
        return Some((text.clone(), text));
    }
    let layers = if l_low == l_high {
        format!("{l_high} of its {n} layers")
    } else {
        format!("{l_low} to {l_high} of its {n} layers")
    };
    let split = match devices {
        0 => "no other device serves yet".to_owned(),
        1 => "it splits them by speed between the device serving now and this one".to_owned(),
        d => format!("it splits them by speed between the {d} devices serving now and this one"),
    };
    let download = format!(
        "{}, once: this device's share of the model, {layers} ({split}). Kept for next time.",
        about(d_low, d_high)
    );
    let memory = format!(
        "{} while serving (the weights, the memory of the conversation and working buffers), \
         of the {} this tab offers at most.",
        about(m_low, m_high),
        mb(budget)
    );
    Some((download, memory))
}

/// The battery and heat line before joining.
pub fn power_line(battery: Option<&Battery>) -> String {
    let now = match battery {
        Some(b) => format!(
            " Battery now: {:.0} %{}.",
            b.level * 100.0,
            match b.charging {
                Some(true) => ", charging",
                Some(false) => ", not charging",
                None => "",
            }
        ),
        None => String::new(),
    };
    format!(
        "the graphics chip works whenever someone asks the cluster something: the device may \
         warm up and the battery drain faster. Below {:.0} % and not charging, the cluster \
         stops using it.{now} Plug it in if you can.",
        BATTERY_AVOID_BELOW * 100.0
    )
}

/// Why the cluster leaves the device alone for its battery, if it does.
pub fn battery_low(battery: Option<&Battery>) -> Option<String> {
    let b = battery?;
    (b.level < BATTERY_AVOID_BELOW && b.charging != Some(true)).then(|| {
        format!(
            "battery low ({:.0} %, not charging): the cluster uses this device again once it \
             charges",
            b.level * 100.0
        )
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn estimate(layers: (u64, u64), devices: u64) -> Value {
        json!({
            "model_layers": 30, "model_bytes": 116_000_000u64, "devices": devices,
            "layers": {"low": layers.0, "high": layers.1},
            "download_bytes": {"low": layers.0 * 3_000_000, "high": layers.1 * 3_000_000 + 20_000_000},
            "memory_bytes": {"low": layers.0 * 4_000_000 + 5_000_000,
                             "high": layers.1 * 4_000_000 + 25_000_000},
        })
    }

    #[test]
    fn the_share_is_a_range_with_its_reason() {
        let (download, memory) = share_lines(&estimate((10, 30), 2), 1 << 30).expect("lines");
        assert!(
            download.starts_with("about 30–110 MB, once")
                && download.contains("10 to 30 of its 30 layers")
                && download.contains("between the 2 devices serving now and this one"),
            "{download}"
        );
        assert!(
            memory.starts_with("about 45–145 MB while serving") && memory.contains("1074 MB"),
            "{memory}"
        );
    }

    #[test]
    fn equal_ends_read_as_one_figure_and_no_room_says_so() {
        let (download, _) = share_lines(&estimate((30, 30), 0), 1 << 30).expect("lines");
        assert!(
            download.starts_with("about 90–110 MB, once") && download.contains(" 30 of its 30 "),
            "{download}"
        );
        assert_eq!(about(100_000_000, 105_000_000), "about 105 MB");
        assert_eq!(about(5_000_000, 9_000_000), "about 5.0–9.0 MB");
        assert!(
            download.contains("no other device serves yet"),
            "{download}"
        );
        let (download, _) = share_lines(&estimate((0, 0), 0), 5_000_000).expect("lines");
        assert!(download.contains("too little for one layer"), "{download}");
        assert_eq!(share_lines(&Value::Null, 1 << 30), None);
    }

    #[test]
    fn a_tab_offers_half_the_device_and_at_most_a_quarter_of_the_machine() {
        const GIB: u64 = 1 << 30;
        assert_eq!(memory_budget(8 * GIB, &Value::Null), 4 * GIB);
        let phone = json!({"deviceMemoryGiB": 4.0});
        assert_eq!(memory_budget(8 * GIB, &phone), GIB);
        // A device reporting little still gets what a quarter of the machine allows.
        assert_eq!(
            memory_budget(GIB / 2, &json!({"deviceMemoryGiB": 8.0})),
            GIB
        );
        assert_eq!(
            memory_budget(GIB / 2, &json!({"deviceMemoryGiB": 1.0})),
            GIB / 4
        );
    }

    #[test]
    fn a_low_battery_not_charging_is_told() {
        let low = |level, charging| battery_low(Some(&Battery { level, charging }));
        assert!(low(0.15, Some(false)).is_some_and(|t| t.contains("15 %")));
        assert_eq!(low(0.15, Some(true)), None);
        assert_eq!(low(0.5, Some(false)), None);
        assert_eq!(battery_low(None), None);
        assert!(
            power_line(Some(&Battery {
                level: 0.64,
                charging: Some(false)
            }))
            .contains("Battery now: 64 %, not charging.")
        );
    }
}
