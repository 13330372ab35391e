//! A peer's news driven with made-up time: telemetry, pause and loss, and
//! how soon each makes the placer place again.

use std::time::{Duration, Instant};

use cairn_engine::placement::slowdown;
use cairn_engine::protocol::{Battery, Telemetry, Visibility};
use cairn_signal::protocol::PeerId;

use super::peers::{Replace, after_condition, after_loss, condition, runs_lost};
use super::placing::{DEBOUNCE, Debounce, URGENT_DEBOUNCE};
use super::*;

fn peer(name: &str) -> PeerId {
    PeerId(name.into())
}

fn serving(names: &[&str]) -> Placement {
    Placement {
        epoch: 1,
        stages: names
            .iter()
            .enumerate()
            .map(|(i, n)| StageView {
                peer: peer(n),
                start: i * 10,
                end: i * 10 + 10,
                direct: true,
            })
            .collect(),
        cost: None,
    }
}

/// When the debounce fed `replace` at `t0` fires (within a second).
fn fires_after(replace: Replace) -> Option<Duration> {
    let t0 = Instant::now();
    let mut d = Debounce::default();
    replace.poke(&mut d, t0);
    let due = d.poll_timeout()?;
    assert!(!d.fire(due - Duration::from_millis(1)), "fired early");
    assert!(d.fire(due));
    Some(due - t0)
}

#[test]
fn a_lost_stage_places_again_after_the_urgent_debounce() {
    let active = serving(&["a", "b"]);
    let r = after_loss(Some(&active), &peer("b"));
    assert_eq!(r, Replace::Now);
    assert_eq!(fires_after(r), Some(URGENT_DEBOUNCE));
    assert_eq!(URGENT_DEBOUNCE, Duration::from_millis(10));
}

#[test]
fn an_idle_peer_lost_places_again_after_the_debounce() {
    let active = serving(&["a", "b"]);
    let r = after_loss(Some(&active), &peer("idle"));
    assert_eq!(r, Replace::Soon);
    assert_eq!(fires_after(r), Some(DEBOUNCE));
    // Nothing served yet: a loss is no emergency either.
    assert_eq!(after_loss(None, &peer("a")), Replace::Soon);
}

#[test]
fn a_loss_fails_exactly_the_runs_on_that_peer() {
    let ab = [peer("a"), peer("b")];
    let c = [peer("c")];
    let bc = [peer("b"), peer("c")];
    let runs = [(1, &ab[..]), (2, &c[..]), (3, &bc[..])];
    assert_eq!(runs_lost(runs, &peer("b")), vec![1, 3]);
    assert_eq!(runs_lost(runs, &peer("c")), vec![2, 3]);
    assert!(runs_lost(runs, &peer("idle")).is_empty());
}

#[test]
fn an_urgent_loss_is_not_put_off_by_a_later_join() {
    let t0 = Instant::now();
    let mut d = Debounce::default();
    Replace::Now.poke(&mut d, t0);
    Replace::Soon.poke(&mut d, t0 + Duration::from_millis(5));
    assert_eq!(d.poll_timeout(), Some(t0 + URGENT_DEBOUNCE));
    Replace::No.poke(&mut d, t0);
    assert!(d.fire(t0 + URGENT_DEBOUNCE));
    assert_eq!(d.poll_timeout(), None);
}

fn report() -> Telemetry {
    Telemetry {
        pressure: Some("nominal".into()),
        utilization: 0.5,
        ..Telemetry::default()
    }
}

#[test]
fn a_throttled_or_background_worker_is_weighed_again() {
    let calm = condition(Some(&report()), false);
    assert_eq!(slowdown(&calm), 1.0);

    let hot = condition(
        Some(&Telemetry {
            throttled: Some(true),
            ..report()
        }),
        false,
    );
    assert!(hot.throttled);
    assert_eq!(slowdown(&hot), 4.0);
    assert_eq!(after_condition(&calm, &hot), Replace::Soon);

    let hidden = condition(
        Some(&Telemetry {
            visibility: Some(Visibility::Hidden),
            ..report()
        }),
        false,
    );
    assert!(hidden.background);
    assert_eq!(slowdown(&hidden), f64::INFINITY);
    assert_eq!(after_condition(&calm, &hidden), Replace::Soon);

    // Back in front: placed again, the worker counts as before.
    assert_eq!(after_condition(&hidden, &calm), Replace::Soon);
}

#[test]
fn a_pause_takes_a_worker_out_and_a_resume_brings_it_back() {
    let running = condition(Some(&report()), false);
    let paused = condition(Some(&report()), true);
    assert_eq!(slowdown(&paused), f64::INFINITY);
    assert_eq!(after_condition(&running, &paused), Replace::Soon);
    assert_eq!(after_condition(&paused, &running), Replace::Soon);
    // A worker that paused before reporting anything is out too.
    assert_eq!(slowdown(&condition(None, true)), f64::INFINITY);
}

#[test]
fn a_new_reading_of_the_same_weight_does_not_place_again() {
    let a = condition(Some(&report()), false);
    let b = condition(
        Some(&Telemetry {
            utilization: 0.9,
            tokens_per_s: 40.0,
            ..report()
        }),
        false,
    );
    assert_eq!(after_condition(&a, &b), Replace::No);
    assert_eq!(after_condition(&condition(None, false), &a), Replace::No);
}

#[test]
fn readings_that_are_not_numbers_leave_placement_alone() {
    let nan = Telemetry {
        utilization: f64::NAN,
        kernel_ms: f64::NAN,
        forward_ms: Some(f64::NAN),
        battery: Some(Battery {
            level: f64::NAN,
            charging: Some(false),
        }),
        ..report()
    };
    let c = condition(Some(&nan), false);
    // Unknown, as through JSON before: neither spared nor avoided.
    assert_eq!(c.battery_level, None);
    assert_eq!(slowdown(&c), 1.0);
    assert_eq!(
        after_condition(&condition(Some(&report()), false), &c),
        Replace::No
    );
    // A low battery still counts.
    let low = condition(
        Some(&Telemetry {
            battery: Some(Battery {
                level: 0.05,
                charging: Some(false),
            }),
            ..report()
        }),
        false,
    );
    assert_eq!(slowdown(&low), f64::INFINITY);
    assert_eq!(after_condition(&c, &low), Replace::Soon);
}
