use std::time::Instant;

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::StageSplit;
use super::solve::{best_per_count, candidates};
use super::*;

/// Relative tolerance for comparing latencies summed in different orders.
const REL: f64 = 1e-9;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= REL * a.abs().max(b.abs())
}

fn device(id: &str, memory_bytes: u64, decode_s_per_layer: f64) -> DeviceProfile {
    DeviceProfile {
        id: id.into(),
        memory_bytes,
        decode_s_per_layer,
        prefill_s_per_layer_token: decode_s_per_layer / 10.0,
        call_overhead_s: 1e-4,
        head_s: 0.0,
        link_rtt_s: 2e-3,
        link_bytes_per_s: 1e8,
        relayed: false,
        slowdown: 1.0,
        tensor: None,
    }
}

fn model(n_layers: usize) -> ModelCost {
    ModelCost {
        n_layers,
        layer_weight_bytes: 100,
        kv_bytes_per_layer: 20,
        first_extra_bytes: 300,
        last_extra_bytes: 400,
        scratch_bytes: 50,
        activation_bytes: 8192,
        token_bytes: 4,
        concurrency: 1,
    }
}

/// Per-token latency straight from the spec's formula; `None` when a stage
/// is over its device's memory.
fn spec_latency(on: &[&DeviceProfile], layers: &[usize], model: &ModelCost) -> Option<f64> {
    let k = on.len();
    let mut total = 0.0;
    for (i, (d, &n)) in on.iter().zip(layers).enumerate() {
        let (first, last) = (i == 0, i == k - 1);
        let memory = n as u128 * u128::from(model.layer_weight_bytes + model.kv_bytes_per_layer)
            + if first {
                u128::from(model.first_extra_bytes)
            } else {
                0
            }
            + if last {
                u128::from(model.last_extra_bytes)
            } else {
                0
            }
            + u128::from(model.scratch_bytes);
        if memory > u128::from(d.memory_bytes) {
            return None;
        }
        let input = if first {
            model.token_bytes
        } else {
            model.activation_bytes
        };
        let output = if last {
            model.token_bytes
        } else {
            model.activation_bytes
        };
        let over = |bytes: u64| {
            if bytes == 0 {
                0.0
            } else {
                bytes as f64 / d.link_bytes_per_s
            }
        };
        // Chained: the hop to the next stage (none for a lone stage);
        // relayed: to the coordinator and back.
        let link = if d.relayed {
            d.link_rtt_s + over(input + output)
        } else if k == 1 {
            0.0
        } else {
            d.link_rtt_s / 2.0 + over(output)
        };
        let head = if last { d.head_s * d.slowdown } else { 0.0 };
        total += link + d.call_overhead_s + head + n as f64 * d.decode_s_per_layer * d.slowdown;
    }
    Some(total)
}

/// Every ordered sequence of distinct usable devices and every composition
/// of the layers: the best latency for each number of stages (index k).
fn brute_force(devices: &[DeviceProfile], model: &ModelCost) -> Vec<Option<f64>> {
    fn walk(
        devices: &[DeviceProfile],
        model: &ModelCost,
        used: &mut Vec<usize>,
        layers: &mut Vec<usize>,
        remaining: usize,
        best: &mut Vec<Option<f64>>,
    ) {
        if remaining == 0 {
            let on: Vec<&DeviceProfile> = used.iter().map(|&i| &devices[i]).collect();
            if let Some(latency) = spec_latency(&on, layers, model) {
                let slot = &mut best[used.len()];
                if slot.is_none_or(|b| latency < b) {
                    *slot = Some(latency);
                }
            }
            return;
        }
        for d in 0..devices.len() {
            if used.contains(&d) || !devices[d].slowdown.is_finite() {
                continue;
            }
            for n in 1..=remaining {
                used.push(d);
                layers.push(n);
                walk(devices, model, used, layers, remaining - n, best);
                used.pop();
                layers.pop();
            }
        }
    }
    let mut best = vec![None; devices.len() + 1];
    walk(
        devices,
        model,
        &mut Vec::new(),
        &mut Vec::new(),
        model.n_layers,
        &mut best,
    );
    best
}

fn overall(per_count: &[Option<f64>]) -> Option<f64> {
    per_count.iter().flatten().copied().reduce(f64::min)
}

fn layers_on(stages: &[Stage], id: &str) -> usize {
    stages
        .iter()
        .filter(|s| s.device == id)
        .map(Stage::layers)
        .sum()
}

fn arb_case() -> impl Strategy<Value = (Vec<DeviceProfile>, ModelCost)> {
    let device = (
        0u64..1600,
        prop_oneof![Just(1e-3), 0.0..1e-2f64],
        0.0..1e-3f64,
        prop_oneof![Just(0.0), 0.0..1e-3f64],
        prop_oneof![Just(0.0), 0.0..1e-2f64],
        prop_oneof![Just(f64::INFINITY), 1e4..1e9f64],
        prop_oneof![4 => Just(1.0), 1 => Just(1.5), 1 => Just(4.0), 1 => Just(f64::INFINITY)],
        prop_oneof![Just(0.0), 0.0..2e-2f64],
    );
    let model = (
        1usize..=8,
        50u64..150,
        0u64..50,
        0u64..300,
        0u64..300,
        0u64..100,
        0u64..5000,
        0u64..8,
    );
    (
        prop::collection::vec((device, prop::bool::weighted(0.3)), 1..=4),
        model,
    )
        .prop_map(|(devices, m)| {
            let devices = devices
                .into_iter()
                .enumerate()
                .map(
                    |(i, ((memory, decode, prefill, overhead, rtt, bw, slow, head), relayed))| {
                        DeviceProfile {
                            id: format!("d{i}"),
                            memory_bytes: memory,
                            decode_s_per_layer: decode,
                            prefill_s_per_layer_token: prefill,
                            call_overhead_s: overhead,
                            head_s: head,
                            link_rtt_s: rtt,
                            link_bytes_per_s: bw,
                            relayed,
                            slowdown: slow,
                            tensor: None,
                        }
                    },
                )
                .collect();
            let model = ModelCost {
                n_layers: m.0,
                layer_weight_bytes: m.1,
                kv_bytes_per_layer: m.2,
                first_extra_bytes: m.3,
                last_extra_bytes: m.4,
                scratch_bytes: m.5,
                activation_bytes: m.6,
                token_bytes: m.7,
                concurrency: 1,
            };
            (devices, model)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn place_equals_brute_force((devices, model) in arb_case()) {
        let brute = brute_force(&devices, &model);
        let expected = overall(&brute);
        match (place_with_cost(&devices, &model), expected) {
            (Ok((stages, cost)), Some(best)) => {
                prop_assert!(close(cost, best), "solver {cost} vs brute force {best}: {stages:?}");
                let prediction = evaluate(&devices, &model, &stages, 16).unwrap();
                prop_assert!(close(prediction.s_per_token, best));
                prop_assert!(close(prediction.s_per_token, cost));
                prop_assert!(stages.iter().all(|s| devices.iter().any(|d| d.id == s.device && d.slowdown.is_finite())));
            }
            (Err(PlacementError::DoesNotFit { .. } | PlacementError::NoDevices { .. }), None) => {}
            (got, expected) => prop_assert!(false, "solver {got:?}, brute force {expected:?}"),
        }
    }

    #[test]
    fn best_per_count_equals_brute_force((devices, model) in arb_case()) {
        let brute = brute_force(&devices, &model);
        let solved = best_per_count(&candidates(&devices, &model, None), model.n_layers);
        for (k, expected) in brute.iter().enumerate() {
            let got: Vec<f64> = solved.iter().filter(|(_, s)| s.len() == k).map(|(c, _)| *c).collect();
            match expected {
                Some(best) => {
                    prop_assert_eq!(got.len(), 1, "{} stages", k);
                    prop_assert!(close(got[0], *best), "{} stages: {} vs {}", k, got[0], best);
                }
                None => prop_assert!(got.is_empty(), "{} stages: solver found {:?}", k, got),
            }
        }
    }

    #[test]
    fn alternatives_are_valid_distinct_sorted((devices, model) in arb_case()) {
        let alternatives = alternatives(&devices, &model, 5);
        prop_assert!(alternatives.len() <= 5);
        let Ok((optimum, best)) = place_with_cost(&devices, &model) else {
            prop_assert!(alternatives.is_empty());
            return Ok(());
        };
        let mut previous = best;
        for (i, stages) in alternatives.iter().enumerate() {
            prop_assert!(stages != &optimum);
            prop_assert!(!alternatives[..i].contains(stages));
            let cost = evaluate(&devices, &model, stages, 1).unwrap().s_per_token;
            prop_assert!(cost >= previous * (1.0 - REL), "not sorted: {cost} after {previous}");
            previous = cost;
        }
    }
}

#[test]
fn sixty_four_devices_and_a_hundred_layers_solve_in_under_100_ms() {
    let mut rng = StdRng::seed_from_u64(64);
    let model = ModelCost {
        n_layers: 100,
        layer_weight_bytes: 200 << 20,
        kv_bytes_per_layer: 16 << 20,
        first_extra_bytes: 500 << 20,
        last_extra_bytes: 500 << 20,
        scratch_bytes: 256 << 20,
        activation_bytes: 16384,
        token_bytes: 4,
        concurrency: 1,
    };
    let devices: Vec<DeviceProfile> = (0..64)
        .map(|i| DeviceProfile {
            id: format!("device-{i}"),
            memory_bytes: rng.random_range(1u64 << 30..24u64 << 30),
            decode_s_per_layer: rng.random_range(1e-4..5e-3),
            prefill_s_per_layer_token: rng.random_range(1e-5..5e-4),
            call_overhead_s: rng.random_range(0.0..1e-3),
            head_s: rng.random_range(0.0..5e-3),
            link_rtt_s: rng.random_range(1e-4..2e-2),
            link_bytes_per_s: rng.random_range(1e6..1e9),
            relayed: rng.random_range(0..4) == 0,
            slowdown: [1.0, 1.0, 1.5, 2.0, 4.0][rng.random_range(0..5)],
            tensor: None,
        })
        .collect();
    let started = Instant::now();
    let (stages, cost) = place_with_cost(&devices, &model).unwrap();
    let elapsed = started.elapsed();
    eprintln!(
        "64 devices x 100 layers: {} stages, {:.3} ms/token, solved in {elapsed:?}",
        stages.len(),
        cost * 1e3
    );
    assert!(elapsed.as_millis() < 100, "took {elapsed:?}");
    let prediction = evaluate(&devices, &model, &stages, 128).unwrap();
    assert!(close(prediction.s_per_token, cost));

    let started = Instant::now();
    let others = alternatives(&devices, &model, 8);
    eprintln!("alternatives: {} in {:?}", others.len(), started.elapsed());
    assert!(!others.is_empty());
}

#[test]
fn a_device_too_small_for_one_layer_is_left_out() {
    let model = model(10);
    let mut tiny = device("tiny", 119, 1e-6);
    tiny.link_rtt_s = 0.0;
    // Alone, big pays no link at all; a hop must be cheap to be worth it.
    let mut big = device("big", 10_000, 1e-3);
    big.link_rtt_s = 1e-4;
    let devices = [big, tiny];
    let stages = place(&devices, &model).unwrap();
    assert_eq!(layers_on(&stages, "tiny"), 0);
    assert_eq!(layers_on(&stages, "big"), 10);
    // With room for one layer as the last stage, being fast, it gets used.
    let mut devices = devices;
    devices[1].memory_bytes = 120 + 400 + 50;
    assert_eq!(layers_on(&place(&devices, &model).unwrap(), "tiny"), 1);
}

#[test]
fn a_do_not_use_device_is_left_out() {
    let model = model(10);
    let mut fast = device("fast", 10_000, 1e-6);
    fast.slowdown = slowdown(&DeviceCondition {
        paused: true,
        ..Default::default()
    });
    assert_eq!(fast.slowdown, f64::INFINITY);
    let devices = [device("slow", 10_000, 1e-2), fast];
    assert_eq!(
        place(&devices, &model).unwrap(),
        vec![Stage {
            device: "slow".into(),
            start: 0,
            end: 10,
            split: StageSplit::Layers,
        }]
    );
    let err = place(&devices[1..], &model).unwrap_err();
    assert_eq!(
        err,
        PlacementError::NoDevices {
            offered: 1,
            avoided: 1
        }
    );
    assert!(
        evaluate(
            &devices,
            &model,
            &[Stage {
                device: "fast".into(),
                start: 0,
                end: 10,
                split: StageSplit::Layers,
            }],
            1
        )
        .unwrap_err()
        .to_string()
        .contains("do-not-use")
    );
}

#[test]
fn a_throttled_device_gets_fewer_layers_than_an_identical_one() {
    let throttled = slowdown(&DeviceCondition {
        throttled: true,
        ..Default::default()
    });
    assert_eq!(throttled, 4.0);
    let model = ModelCost {
        first_extra_bytes: 0,
        last_extra_bytes: 0,
        ..model(100)
    };
    // Memory binds: each holds 70 of 100 layers, so both are needed.
    let memory = 70 * 120 + 50;
    for (a, b) in [("hot", "cool"), ("cool", "hot")] {
        let mut devices = [device(a, memory, 1e-3), device(b, memory, 1e-3)];
        devices.iter_mut().find(|d| d.id == "hot").unwrap().slowdown = throttled;
        let stages = place(&devices, &model).unwrap();
        assert_eq!(
            (layers_on(&stages, "hot"), layers_on(&stages, "cool")),
            (30, 70)
        );
    }
    // Room to spare: the throttled one is not used at all.
    let mut devices = [device("hot", 100_000, 1e-3), device("cool", 100_000, 1e-3)];
    devices[0].slowdown = throttled;
    let stages = place(&devices, &model).unwrap();
    assert_eq!(
        (layers_on(&stages, "hot"), layers_on(&stages, "cool")),
        (0, 100)
    );
}

#[test]
fn ties_prefer_fewer_stages_and_are_deterministic() {
    let model = model(12);
    let in_process = |id: &str| DeviceProfile {
        call_overhead_s: 0.0,
        link_rtt_s: 0.0,
        link_bytes_per_s: f64::INFINITY,
        ..device(id, 100_000, 1e-3)
    };
    let devices = [in_process("a"), in_process("b"), in_process("c")];
    let stages = place(&devices, &model).unwrap();
    assert_eq!(stages.len(), 1);
    assert_eq!(stages, place(&devices, &model).unwrap());
}

#[test]
fn stages_are_first_then_middles_in_device_order_then_last() {
    let model = ModelCost {
        first_extra_bytes: 5_000,
        last_extra_bytes: 10_000,
        ..model(40)
    };
    // Only "e" can be first and only "h" last; all four are needed for memory.
    let small = 12 * 120 + 50;
    let devices = [
        device("m1", small, 1e-3),
        device("h", small + 10_000, 1e-3),
        device("m2", small, 1e-3),
        device("e", small + 5_000, 1e-3),
    ];
    let stages = place(&devices, &model).unwrap();
    let order: Vec<&str> = stages.iter().map(|s| s.device.as_str()).collect();
    assert_eq!(order, ["e", "m1", "m2", "h"]);
    assert_eq!(stages[0].start, 0);
    assert!(stages.windows(2).all(|w| w[0].end == w[1].start));
    assert_eq!(stages[3].end, 40);
}

#[test]
fn nothing_fits_says_what_is_short() {
    let model = model(10);
    let devices = [device("a", 500, 1e-3), device("b", 10, 1e-3)];
    let err = place(&devices, &model).unwrap_err();
    let PlacementError::DoesNotFit {
        needed_bytes,
        available_bytes,
        devices: usable,
        ..
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(
        (*needed_bytes, *available_bytes, *usable),
        (10 * 120 + 750, 510, 2)
    );
    let message = err.to_string();
    assert!(message.contains("1440 bytes short"), "{message}");
    assert!(
        message.contains("1 of the devices cannot hold even one layer"),
        "{message}"
    );

    // Enough in total, but every stage needs its own scratch.
    let devices = [device("a", 1000, 1e-3), device("b", 1000, 1e-3)];
    let message = place(&devices, &model).unwrap_err().to_string();
    assert!(message.contains("in no split"), "{message}");

    assert_eq!(
        place(&[], &model).unwrap_err(),
        PlacementError::NoDevices {
            offered: 0,
            avoided: 0
        }
    );
}

#[test]
fn bad_profiles_and_models_are_refused() {
    let model = model(4);
    let mut nan = device("nan", 10_000, f64::NAN);
    let err = place(std::slice::from_ref(&nan), &model).unwrap_err();
    assert!(matches!(err, PlacementError::BadProfile { ref device, .. } if device == "nan"));
    nan.decode_s_per_layer = 1e-3;
    nan.prefill_s_per_layer_token = 1e-4;
    nan.link_bytes_per_s = 0.0;
    assert!(
        place(std::slice::from_ref(&nan), &model)
            .unwrap_err()
            .to_string()
            .contains("link_bytes_per_s")
    );
    let twice = [device("x", 10_000, 1e-3), device("x", 10_000, 1e-3)];
    assert!(
        place(&twice, &model)
            .unwrap_err()
            .to_string()
            .contains("more than one device")
    );
    assert!(matches!(
        place(
            &[device("a", 10_000, 1e-3)],
            &ModelCost {
                n_layers: 0,
                ..model
            }
        ),
        Err(PlacementError::BadModel(_))
    ));
}

fn bad_stages(
    devices: &[DeviceProfile],
    model: &ModelCost,
    stages: &[(&str, usize, usize)],
) -> String {
    let stages: Vec<Stage> = stages
        .iter()
        .map(|&(device, start, end)| Stage::new(device, start, end))
        .collect();
    match evaluate(devices, model, &stages, 1) {
        Err(PlacementError::BadStages(message)) => message,
        other => panic!("expected BadStages, got {other:?}"),
    }
}

#[test]
fn evaluate_refuses_bad_placements_with_specific_errors() {
    let model = model(10);
    let devices = [
        device("a", 10_000, 1e-3),
        device("b", 10_000, 1e-3),
        device("small", 1_000, 1e-3),
    ];
    type Case<'a> = (&'a [(&'a str, usize, usize)], &'a str);
    let cases: &[Case] = &[
        (&[], "no stages"),
        (&[("a", 0, 4), ("b", 5, 10)], "gap: layers 4..5"),
        (&[("a", 1, 10)], "gap: layers 0..1"),
        (&[("a", 0, 4), ("b", 4, 9)], "gap: layers 9..10"),
        (&[("a", 0, 5), ("b", 4, 10)], "overlap"),
        (&[("a", 0, 5), ("b", 5, 10), ("small", 2, 4)], "overlap"),
        (&[("a", 0, 5), ("zz", 5, 10)], "unknown device \"zz\""),
        (
            &[("a", 0, 3), ("b", 3, 6), ("a", 6, 10)],
            "device \"a\" runs stages 0 and 2",
        ),
        (&[("a", 0, 5), ("b", 5, 5), ("small", 5, 10)], "empty"),
        (&[("a", 0, 5), ("b", 5, 11)], "out of range"),
        (
            &[("a", 0, 5), ("small", 5, 10)],
            "stage 1 on \"small\" needs 1050 bytes",
        ),
    ];
    for (stages, expected) in cases {
        let message = bad_stages(&devices, &model, stages);
        assert!(
            message.contains(expected),
            "{stages:?}: {message:?} lacks {expected:?}"
        );
    }
}

#[test]
fn evaluate_predicts_by_the_formula() {
    let model = model(10);
    let a = device("a", 10_000, 1e-3);
    let mut b = device("b", 10_000, 2e-3);
    b.slowdown = 1.5;
    b.link_bytes_per_s = f64::INFINITY;
    let stages = [
        Stage {
            device: "a".into(),
            start: 0,
            end: 4,
            split: StageSplit::Layers,
        },
        Stage {
            device: "b".into(),
            start: 4,
            end: 10,
            split: StageSplit::Layers,
        },
    ];
    let p = evaluate(&[a.clone(), b.clone()], &model, &stages, 100).unwrap();
    // Chained: each stage pays the hop its output takes.
    let a_link = 1e-3 + 8192.0 / 1e8;
    let a_compute = 1e-4 + 4.0 * 1e-3;
    let b_link = 1e-3;
    let b_compute = 1e-4 + 6.0 * 2e-3 * 1.5;
    assert!(close(p.stages[0].link_s, a_link) && close(p.stages[0].compute_s, a_compute));
    assert!(close(p.stages[1].link_s, b_link) && close(p.stages[1].compute_s, b_compute));
    assert!(close(
        p.s_per_token,
        a_link + a_compute + b_link + b_compute
    ));
    assert!(close(p.tokens_per_s, 1.0 / p.s_per_token));
    assert_eq!(p.stages[0].memory_bytes, 4 * 120 + 300 + 50);
    assert_eq!(p.stages[1].memory_bytes, 6 * 120 + 400 + 50);
    assert_eq!(p.stages[1].memory_limit_bytes, 10_000);
    let prefill_a = 1e-4 + 4.0 * 1e-4 * 100.0 + 2e-3 + (100.0 * 4.0 + 100.0 * 8192.0) / 1e8;
    let prefill_b = 1e-4 + 6.0 * 2e-4 * 100.0 * 1.5 + 1e-3;
    assert!(
        close(p.prefill_s, prefill_a + prefill_b),
        "{} vs {}",
        p.prefill_s,
        prefill_a + prefill_b
    );
    assert_eq!(p.prompt_tokens, 100);
    // Relayed (a browser): its input and output both cross its coordinator link.
    let relayed_b = DeviceProfile {
        relayed: true,
        ..b.clone()
    };
    let r = evaluate(&[a.clone(), relayed_b], &model, &stages, 100).unwrap();
    assert!(close(r.stages[1].link_s, 2e-3), "{}", r.stages[1].link_s);
    assert!(close(r.stages[0].link_s, a_link));
    // One chained device alone feeds itself: no link time per token.
    let whole = [Stage {
        device: "a".into(),
        start: 0,
        end: 10,
        split: StageSplit::Layers,
    }];
    assert_eq!(
        evaluate(std::slice::from_ref(&a), &model, &whole, 1)
            .unwrap()
            .stages[0]
            .link_s,
        0.0
    );

    // serde_json without `float_roundtrip` may parse a float 1 ulp off.
    let back: Prediction = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back.stages.len(), 2);
    assert_eq!(back.stages[1].memory_bytes, p.stages[1].memory_bytes);
    assert!(close(back.s_per_token, p.s_per_token) && close(back.prefill_s, p.prefill_s));
}

#[test]
fn slowdown_policy() {
    let condition = |f: fn(&mut DeviceCondition)| {
        let mut c = DeviceCondition::default();
        f(&mut c);
        slowdown(&c)
    };
    assert_eq!(condition(|_| {}), 1.0);
    assert_eq!(condition(|c| c.paused = true), f64::INFINITY);
    assert_eq!(condition(|c| c.background = true), f64::INFINITY);
    assert_eq!(
        condition(|c| c.pressure = Some("critical".into())),
        f64::INFINITY
    );
    assert_eq!(condition(|c| c.battery_level = Some(0.19)), f64::INFINITY);
    assert_eq!(
        condition(|c| {
            c.battery_level = Some(0.19);
            c.charging = Some(true);
        }),
        1.0
    );
    assert_eq!(condition(|c| c.pressure = Some("Serious".into())), 4.0);
    assert_eq!(condition(|c| c.throttled = true), 4.0);
    assert_eq!(condition(|c| c.pressure = Some("fair".into())), 1.5);
    assert_eq!(condition(|c| c.pressure = Some("nominal".into())), 1.0);
    assert_eq!(condition(|c| c.battery_level = Some(0.45)), 2.0);
    assert_eq!(condition(|c| c.battery_level = Some(0.5)), 1.0);
    assert_eq!(
        condition(|c| {
            c.battery_level = Some(0.45);
            c.pressure = Some("fair".into());
        }),
        2.0
    );
    assert_eq!(
        condition(|c| {
            c.battery_level = Some(0.3);
            c.throttled = true;
        }),
        4.0
    );
}

#[test]
fn screening_leaves_out_only_the_devices_whose_numbers_cannot_be_believed() {
    let good = device("good", 1 << 40, 1e-3);
    let mut nan = device("nan", 1 << 40, f64::NAN);
    nan.call_overhead_s = 0.0;
    let negative = device("negative", 1 << 40, -1e-3);
    let slow = device("absurd", 1 << 40, 1e6);
    let mut no_link = device("no-link", 1 << 40, 1e-3);
    no_link.link_bytes_per_s = 0.0;
    let twin = device("good", 1 << 40, 1e-9);
    let all = vec![good.clone(), nan, negative, slow, no_link, twin];
    // Unscreened, one bad device fails the whole placement.
    assert!(place(&all, &model(30)).is_err());

    let (kept, refused) = screen(all);
    assert_eq!(kept, vec![good]);
    let ids: Vec<&str> = refused.iter().map(|r| r.device.as_str()).collect();
    assert_eq!(ids, ["nan", "negative", "absurd", "no-link", "good"]);
    assert!(refused[0].reason.contains("NaN"), "{:?}", refused[0]);
    assert!(refused[2].reason.contains("over the"), "{:?}", refused[2]);
    assert!(
        refused[4].reason.contains("more than one"),
        "{:?}",
        refused[4]
    );
    let placed = place(&kept, &model(30)).expect("the good device serves");
    assert_eq!(layers_on(&placed, "good"), 30);
}

/// The aggregate at a concurrency: weight-bound layers (prefill per token far below a decode
/// step) batch almost for free; compute-bound ones (prefill per token near a decode step)
/// gain little; never more than the concurrency times one stream, never less than one.
#[test]
fn aggregate_throughput_follows_the_roofline_of_each_stage() {
    let devices = vec![device("a", 1 << 40, 0.001), device("b", 1 << 40, 0.001)];
    let mut m = model(8);
    for (concurrency, cheap_prefill) in [(4usize, true), (4, false), (1, true)] {
        m.concurrency = concurrency;
        let mut d = devices.clone();
        for x in &mut d {
            x.prefill_s_per_layer_token = if cheap_prefill { 1e-5 } else { 0.0009 };
        }
        let stages = vec![
            Stage {
                device: "a".into(),
                start: 0,
                end: 4,
                split: StageSplit::Layers,
            },
            Stage {
                device: "b".into(),
                start: 4,
                end: 8,
                split: StageSplit::Layers,
            },
        ];
        let p = evaluate(&d, &m, &stages, 16).unwrap();
        let gain = p.aggregate_tokens_per_s / p.tokens_per_s;
        assert_eq!(p.concurrency, concurrency);
        assert!(
            gain <= concurrency as f64 + 1e-9,
            "{concurrency} at once: gain {gain}"
        );
        if concurrency == 1 {
            assert!((gain - 1.0).abs() < 1e-9, "one stream: gain {gain}");
        } else if cheap_prefill {
            assert!(gain > 3.0, "weight-bound: gain {gain}");
        } else {
            assert!(gain < 1.5, "compute-bound: gain {gain}");
        }
    }
}

/// A worker over several GPUs that also offers a tensor split (its `tensor` timings: each
/// layer faster, every call dearer, for the sums between devices) gets its stage split that
/// way where that predicts the faster token and by layers where it does not; predictions use
/// the chosen way's timings; a stage asking for a split its worker does not offer is refused,
/// and so are tensor timings that cannot be believed.
#[test]
fn a_worker_splits_its_stage_the_way_that_predicts_the_faster_token() {
    let mut gpus = device("gpus", 1 << 20, 1e-4);
    gpus.tensor = Some(SplitTiming {
        decode_s_per_layer: 0.6e-4,
        prefill_s_per_layer_token: 0.6e-5,
        call_overhead_s: 5e-4,
        head_s: 0.0,
        devices: 2,
    });
    let alone = |stages: &[Stage]| stages.iter().map(|s| s.split).collect::<Vec<_>>();
    // 32 layers: by layers 1e-4 + 32 x 1e-4 = 3.3 ms, by tensors 0.5 + 32 x 0.06 = 2.42 ms.
    let long = model(32);
    let placed = place(std::slice::from_ref(&gpus), &long).unwrap();
    assert_eq!(alone(&placed), [StageSplit::Tensor]);
    let p = evaluate(std::slice::from_ref(&gpus), &long, &placed, 1).unwrap();
    assert!(close(p.stages[0].compute_s, 5e-4 + 32.0 * 0.6e-4));
    assert_eq!(p.stages[0].split, StageSplit::Tensor);
    // 4 layers: by layers 0.5 ms, by tensors 0.74 ms.
    let short = model(4);
    let placed = place(std::slice::from_ref(&gpus), &short).unwrap();
    assert_eq!(alone(&placed), [StageSplit::Layers]);
    // Inside a placement of several stages: the GPUs' worker holds what its memory allows
    // and splits it by tensors; the other device has no choice. By tensors it holds 18
    // layers (2,900 - 350 for the first stage's scratch and embedding - 350 for their copies
    // on the second GPU, over 120 a layer), by layers 21; the other device's layers cost
    // 0.15 ms, so 18 at 0.06 and 14 there beat 21 at 0.1 and 11 there.
    let mut small = gpus.clone();
    small.memory_bytes = 2_900;
    small.link_rtt_s = 2e-4;
    let mut other = device("other", 1 << 20, 0.15e-3);
    other.link_rtt_s = 2e-4;
    let devices = [small, other];
    let (placed, s_per_token) = place_with_cost(&devices, &long).unwrap();
    assert_eq!(placed.len(), 2, "{placed:?}");
    for stage in &placed {
        let want = if stage.device == "gpus" {
            assert_eq!(stage.layers(), 18, "{placed:?}");
            StageSplit::Tensor
        } else {
            StageSplit::Layers
        };
        assert_eq!(stage.split, want, "{placed:?}");
    }
    let p = evaluate(&devices, &long, &placed, 1).unwrap();
    assert!(close(p.s_per_token, s_per_token));
    // The other device offers no tensor split.
    let mut asked = placed.clone();
    for s in &mut asked {
        s.split = StageSplit::Tensor;
    }
    match evaluate(&devices, &long, &asked, 1) {
        Err(PlacementError::BadStages(m)) => assert!(m.contains("tensor split"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Tensor timings that cannot be believed leave the worker out, naming the field.
    let mut liar = gpus.clone();
    liar.id = "liar".into();
    liar.tensor = Some(SplitTiming {
        decode_s_per_layer: f64::NAN,
        ..SplitTiming::default()
    });
    let (kept, refused) = screen(vec![gpus, liar]);
    assert_eq!(kept.len(), 1);
    assert!(
        refused[0].reason.contains("tensor.decode_s_per_layer"),
        "{refused:?}"
    );
}

/// A tensor split holds more than its layers on every device but the first: its own scratch,
/// a copy of the embedding (first stage) and a share of the head (last stage). A worker whose
/// memory holds the model by layers but not those extras gets the layer split although the
/// tensor split predicts the faster token; a manual tensor placement there is refused, saying
/// what the split adds (the preview's reason); with room for them the tensor split wins again.
#[test]
fn a_tensor_split_counts_its_copies_on_every_device() {
    let mut gpus = device("gpus", 1 << 20, 1e-4);
    gpus.tensor = Some(SplitTiming {
        decode_s_per_layer: 0.6e-4,
        prefill_s_per_layer_token: 0.6e-5,
        call_overhead_s: 5e-4,
        head_s: 0.0,
        devices: 2,
    });
    // 32 layers alone: 32 x 120 + 50 scratch + 300 embedding + 400 head = 4,590 bytes by
    // layers; by tensors over two the second device adds 50 + 300 + 400 / 2 = 550.
    let long = model(32);
    let by = |memory: u64, devices: u32| {
        let mut d = gpus.clone();
        d.memory_bytes = memory;
        if let Some(t) = &mut d.tensor {
            t.devices = devices;
        }
        d
    };
    let splits = |d: &DeviceProfile| {
        place(std::slice::from_ref(d), &long)
            .unwrap()
            .iter()
            .map(|s| s.split)
            .collect::<Vec<_>>()
    };
    assert_eq!(splits(&by(5_140, 2)), [StageSplit::Tensor]);
    let tight = by(5_139, 2);
    assert_eq!(splits(&tight), [StageSplit::Layers]);
    let p = evaluate(
        std::slice::from_ref(&tight),
        &long,
        &[Stage::new("gpus", 0, 32)],
        1,
    )
    .unwrap();
    assert_eq!(p.stages[0].memory_bytes, 4_590);
    let asked = [Stage {
        split: StageSplit::Tensor,
        ..Stage::new("gpus", 0, 32)
    }];
    match evaluate(std::slice::from_ref(&tight), &long, &asked, 1) {
        Err(PlacementError::BadStages(m)) => {
            assert!(m.contains("needs 5140 bytes"), "{m}");
            assert!(m.contains("550 the tensor split over 2 devices"), "{m}");
            assert!(m.contains("split by layers it needs 4590"), "{m}");
        }
        other => panic!("{other:?}"),
    }
    let roomy = by(5_140, 2);
    let p = evaluate(std::slice::from_ref(&roomy), &long, &asked, 1).unwrap();
    assert_eq!(p.stages[0].memory_bytes, 5_140);
    // Over four devices: three more of each, and a quarter of the head on each of them.
    assert_eq!(splits(&by(5_140, 4)), [StageSplit::Layers]);
    assert_eq!(splits(&by(4_590 + 3 * 350 + 300, 4)), [StageSplit::Tensor]);
    // A worker that did not say how many (0): taken as two.
    assert_eq!(splits(&by(5_140, 0)), [StageSplit::Tensor]);
    assert_eq!(splits(&by(5_139, 0)), [StageSplit::Layers]);
}

/// Where cuts tie on one token's latency (identical devices: the stages' times always sum to
/// the same), the one with the fastest slowest stage wins: the last stage's head counts, so
/// the first stage takes more layers, and under concurrent requests neither stage waits on
/// the other (issue 19: the even cut left the first of two GPUs 0.76 to 0.79 busy).
#[test]
fn latency_ties_go_to_the_cut_whose_slowest_stage_is_fastest() {
    let m = model(32);
    let mut devices = vec![device("a", 3_400, 1e-3), device("b", 3_400, 1e-3)];
    for d in &mut devices {
        d.head_s = 4e-3;
    }
    let stages = place(&devices, &m).unwrap();
    assert_eq!(stages.len(), 2, "{stages:?}");
    let slowest = |stages: &[Stage]| {
        let p = evaluate(&devices, &m, stages, 1).unwrap();
        let s = p
            .stages
            .iter()
            .map(|s| s.compute_s + s.link_s)
            .fold(0.0, f64::max);
        (p.s_per_token, s)
    };
    let (latency, chosen) = slowest(&stages);
    let mut best = f64::INFINITY;
    for first in 8..=25 {
        let cut = |device: &str, start, end| Stage::new(device, start, end);
        for (x, y) in [("a", "b"), ("b", "a")] {
            let manual = [cut(x, 0, first), cut(y, first, 32)];
            if let Ok(p) = evaluate(&devices, &m, &manual, 1) {
                assert!(
                    close(p.s_per_token, latency),
                    "cut at {first}: the latencies tie"
                );
                best = best.min(slowest(&manual).1);
            }
        }
    }
    assert!(
        close(chosen, best),
        "slowest stage {chosen} s, best cut's {best} s: {stages:?}"
    );
    assert!(layers_on(&stages, &stages[0].device) > 16, "{stages:?}");
}
