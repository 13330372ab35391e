//! The exact solver (a dynamic programme over devices), the evaluation of a
//! given placement, and the alternatives shown beside the optimum.

use super::cost::{self, Role};
use super::{
    DeviceProfile, ModelCost, PlacementError, Prediction, Stage, StagePrediction, StageSplit,
};

/// Two costs closer than this (relative) count as equal; the placement with
/// fewer stages then wins. Far below any measurement's precision, far above
/// the rounding of summing the same terms in another order.
const TIE: f64 = 1e-12;

/// The roles the programme hands out, with the bit each sets in the state
/// (`Only` is the single-stage placement, solved beside the programme).
const ROLES: [(Role, usize); 3] = [(Role::Middle, 0), (Role::First, 1), (Role::Last, 2)];
const BOTH_ENDS: usize = 3;

/// Stages as the programme chose them: (candidate, role, layers, split), in device order.
type Chosen = Vec<(usize, Role, usize, StageSplit)>;

/// A partial placement's per-token cost, its number of stages, and its slowest stage's
/// per-token time.
#[derive(Clone, Copy, Debug)]
struct Value {
    cost: f64,
    stages: u32,
    /// The pipeline's bottleneck under concurrent requests: where placements tie on one
    /// token's latency (every cut of a model over identical devices does: the sum of the
    /// stages' times is the same), the one whose slowest stage is fastest keeps every stage
    /// busiest when several requests are in flight (the head makes an even layer cut uneven
    /// in time).
    slowest: f64,
}

const UNREACHED: Value = Value {
    cost: f64::INFINITY,
    stages: u32::MAX,
    slowest: f64::INFINITY,
};

/// Two slowest-stage times closer than this (relative) count as equal.
const SLOWEST_TIE: f64 = 1e-9;

impl Value {
    fn reached(self) -> bool {
        self.cost < f64::INFINITY
    }

    /// Strictly better: cheaper, or as cheap (within [`TIE`]) with fewer stages.
    fn better_than(self, other: Value) -> bool {
        if !self.reached() {
            return false;
        }
        if !other.reached() {
            return true;
        }
        let tolerance = TIE * self.cost.abs().max(other.cost.abs());
        if self.cost < other.cost - tolerance {
            true
        } else if self.cost > other.cost + tolerance {
            false
        } else if self.stages != other.stages {
            self.stages < other.stages
        } else {
            self.slowest < other.slowest - SLOWEST_TIE * self.slowest.abs().max(other.slowest.abs())
        }
    }
}

/// A device the solver may use, with its costs per role precomputed for each way it can
/// run a stage ([`cost::splits`]).
pub(super) struct Candidate<'a> {
    device: &'a DeviceProfile,
    ways: Vec<Way>,
    /// Per role of [`ROLES`]: the most layers the device holds in that role, whichever
    /// way it splits them.
    max_layers: [usize; 3],
    /// The per-token cost of holding the whole model alone, if it can, and the way.
    only: Option<(f64, StageSplit)>,
}

/// One way a candidate runs a stage, with its costs.
struct Way {
    split: StageSplit,
    /// One layer's decode time, slowdown included.
    layer_s: f64,
    /// Per role of [`ROLES`]: the per-token cost that does not depend on the number of
    /// layers (overhead, round trip, transfer).
    fixed_s: [f64; 3],
    /// Per role of [`ROLES`]: the most layers the device holds in that role this way (a
    /// tensor split holds more beside its layers: [`cost::split_extra_bytes`]).
    max_layers: [usize; 3],
}

impl Candidate<'_> {
    /// The cheaper way to run `n` layers in role `r` (an index of [`ROLES`]) among those
    /// whose memory holds them: its cost and its index in `ways`.
    fn cost(&self, r: usize, n: usize) -> (f64, usize) {
        let mut best = (f64::INFINITY, 0);
        for (w, way) in self.ways.iter().enumerate() {
            if n > way.max_layers[r] {
                continue;
            }
            let cost = way.fixed_s[r] + n as f64 * way.layer_s;
            if cost < best.0 {
                best = (cost, w);
            }
        }
        best
    }
}

pub(super) fn candidates<'a>(
    devices: &'a [DeviceProfile],
    model: &ModelCost,
    without: Option<&str>,
) -> Vec<Candidate<'a>> {
    devices
        .iter()
        .filter(|device| !cost::avoided(device) && Some(device.id.as_str()) != without)
        .filter(|device| cost::max_layers(device, model, Role::Middle, StageSplit::Layers) >= 1)
        .map(|device| {
            let ways: Vec<Way> = cost::splits(device)
                .iter()
                .filter_map(|&split| {
                    let timed = cost::split_as(device, split)?;
                    let fixed = |role| {
                        cost::decode_compute_s(&timed, role, 0)
                            + cost::decode_link_s(&timed, model, role)
                    };
                    Some(Way {
                        split,
                        layer_s: cost::decode_layer_s(&timed),
                        fixed_s: ROLES.map(|(role, _)| fixed(role)),
                        max_layers: ROLES
                            .map(|(role, _)| cost::max_layers(device, model, role, split)),
                    })
                })
                .collect();
            let only = cost::splits(device)
                .iter()
                .filter(|&&split| {
                    cost::max_layers(device, model, Role::Only, split) >= model.n_layers
                })
                .filter_map(|&split| {
                    let timed = cost::split_as(device, split)?;
                    let s = cost::decode_compute_s(&timed, Role::Only, model.n_layers)
                        + cost::decode_link_s(&timed, model, Role::Only);
                    Some((s, split))
                })
                .min_by(|a, b| a.0.total_cmp(&b.0));
            let max_layers: [usize; 3] =
                std::array::from_fn(|r| ways.iter().map(|w| w.max_layers[r]).max().unwrap_or(0));
            Candidate {
                device,
                ways,
                max_layers,
                only,
            }
        })
        .collect()
}

/// The programme: after deciding devices `0..i` (each unused, or given
/// `n >= 1` layers as first, middle or last stage), the cheapest way to have
/// placed `j` layers with the ends taken as in `s` (bit 0: first, bit 1:
/// last) and, when counting, with `c` stages. Since the per-token cost is a
/// sum of per-stage terms and only the ends are special, the order of the
/// middle stages does not change it, so devices can be decided in a fixed
/// order. O(devices × layers² × 3) per stage count.
struct Programme {
    layers: usize,
    /// 1 when stage counts are not tracked; else one more than the most stages.
    counts: usize,
    counting: bool,
    /// Values after the last device.
    values: Vec<Value>,
    /// Per device and state: how the device got there. 0 is unused, else
    /// `layers << 3 | way << 2 | role + 1` (way: its index in the candidate's `ways`, 0 or 1).
    choices: Vec<Vec<u32>>,
}

impl Programme {
    fn index(&self, count: usize, placed: usize, ends: usize) -> usize {
        (count * (self.layers + 1) + placed) * 4 + ends
    }

    fn run(candidates: &[Candidate], layers: usize, counting: bool) -> Programme {
        let counts = if counting {
            candidates.len().min(layers) + 1
        } else {
            1
        };
        let mut programme = Programme {
            layers,
            counts,
            counting,
            values: Vec::new(),
            choices: Vec::with_capacity(candidates.len()),
        };
        let size = counts * (layers + 1) * 4;
        let mut current = vec![UNREACHED; size];
        current[0] = Value {
            cost: 0.0,
            stages: 0,
            slowest: 0.0,
        };
        for (i, candidate) in candidates.iter().enumerate() {
            // Leaving the device unused keeps every state as it is.
            let mut next = current.clone();
            let mut choice = vec![0u32; size];
            // After i devices there are at most i stages; the last count
            // takes no more.
            let count_end = if counting { (counts - 1).min(i + 1) } else { 1 };
            for count in 0..count_end {
                let to_count = if counting { count + 1 } else { count };
                for placed in 0..layers {
                    for ends in 0..4 {
                        let from = current[programme.index(count, placed, ends)];
                        if !from.reached() {
                            continue;
                        }
                        for (r, &(_, bit)) in ROLES.iter().enumerate() {
                            if ends & bit != 0 {
                                continue;
                            }
                            let most = candidate.max_layers[r].min(layers - placed);
                            let first = programme.index(to_count, placed, ends | bit);
                            for n in 1..=most {
                                let (cost, way) = candidate.cost(r, n);
                                let value = Value {
                                    cost: from.cost + cost,
                                    stages: from.stages + 1,
                                    slowest: from.slowest.max(cost),
                                };
                                let to = first + n * 4;
                                if value.better_than(next[to]) {
                                    next[to] = value;
                                    choice[to] =
                                        ((n as u32) << 3) | ((way as u32) << 2) | (r as u32 + 1);
                                }
                            }
                        }
                    }
                }
            }
            programme.choices.push(choice);
            current = next;
        }
        programme.values = current;
        programme
    }

    /// The placement of all layers with both ends taken (and `count` stages,
    /// when counting), as (candidate, role, layers) in device order.
    fn placement(&self, candidates: &[Candidate], count: usize) -> Option<(Value, Chosen)> {
        let count = if self.counting { count } else { 0 };
        let value = *self.values.get(self.index(count, self.layers, BOTH_ENDS))?;
        if !value.reached() {
            return None;
        }
        let (mut count, mut placed, mut ends) = (count, self.layers, BOTH_ENDS);
        let mut stages = Vec::new();
        for (i, choice) in self.choices.iter().enumerate().rev() {
            let code = choice[self.index(count, placed, ends)];
            if code == 0 {
                continue;
            }
            let (role, bit) = ROLES[(code & 3) as usize - 1];
            let way = ((code >> 2) & 1) as usize;
            let n = (code >> 3) as usize;
            stages.push((i, role, n, candidates[i].ways[way].split));
            placed -= n;
            ends &= !bit;
            if self.counting {
                count -= 1;
            }
        }
        debug_assert_eq!((placed, ends), (0, 0));
        stages.reverse();
        Some((value, stages))
    }
}

/// Lays the chosen stages out in pipeline order: first, the middles in
/// device order, last; layer ranges contiguous from 0.
fn lay_out(candidates: &[Candidate], chosen: &[(usize, Role, usize, StageSplit)]) -> Vec<Stage> {
    let rank = |role: Role| match role {
        Role::Only | Role::First => 0,
        Role::Middle => 1,
        Role::Last => 2,
    };
    let mut ordered = chosen.to_vec();
    ordered.sort_by_key(|&(i, role, _, _)| (rank(role), i));
    let mut start = 0;
    ordered
        .into_iter()
        .map(|(i, _, n, split)| {
            let stage = Stage {
                device: candidates[i].device.id.clone(),
                start,
                end: start + n,
                split,
            };
            start += n;
            stage
        })
        .collect()
}

/// The best single-stage placement, if any device holds the whole model.
fn best_alone(candidates: &[Candidate], layers: usize) -> Option<(Value, Vec<Stage>)> {
    let mut best: Option<(Value, usize, StageSplit)> = None;
    for (i, candidate) in candidates.iter().enumerate() {
        let Some((cost, split)) = candidate.only else {
            continue;
        };
        let value = Value {
            cost,
            stages: 1,
            slowest: cost,
        };
        if best.is_none_or(|(b, _, _)| value.better_than(b)) {
            best = Some((value, i, split));
        }
    }
    best.map(|(value, i, split)| {
        (
            value,
            lay_out(candidates, &[(i, Role::Only, layers, split)]),
        )
    })
}

/// The cheapest placement over `candidates`, fewer stages on ties.
fn best(candidates: &[Candidate], layers: usize) -> Option<(f64, Vec<Stage>)> {
    let alone = best_alone(candidates, layers);
    let split = Programme::run(candidates, layers, false)
        .placement(candidates, 0)
        .map(|(value, chosen)| (value, lay_out(candidates, &chosen)));
    let winner = match (alone, split) {
        (Some(a), Some(s)) => Some(if s.0.better_than(a.0) { s } else { a }),
        (a, s) => a.or(s),
    };
    winner.map(|(value, stages)| (value.cost, stages))
}

/// The best placement with each possible number of stages.
pub(super) fn best_per_count(candidates: &[Candidate], layers: usize) -> Vec<(f64, Vec<Stage>)> {
    let mut found = Vec::new();
    if let Some((value, stages)) = best_alone(candidates, layers) {
        found.push((value.cost, stages));
    }
    let programme = Programme::run(candidates, layers, true);
    for count in 2..programme.counts {
        if let Some((value, chosen)) = programme.placement(candidates, count) {
            found.push((value.cost, lay_out(candidates, &chosen)));
        }
    }
    found
}

fn saturate(bytes: u128) -> u64 {
    u64::try_from(bytes).unwrap_or(u64::MAX)
}

/// Checks the inputs and says why nothing can be placed, if that is so.
fn check_inputs(devices: &[DeviceProfile], model: &ModelCost) -> Result<(), PlacementError> {
    cost::check_profiles(devices)?;
    cost::check_model(model)?;
    let avoided = devices.iter().filter(|d| cost::avoided(d)).count();
    if avoided == devices.len() {
        return Err(PlacementError::NoDevices {
            offered: devices.len(),
            avoided,
        });
    }
    Ok(())
}

fn does_not_fit(devices: &[DeviceProfile], model: &ModelCost) -> PlacementError {
    let usable: Vec<&DeviceProfile> = devices.iter().filter(|d| !cost::avoided(d)).collect();
    let per_layer = cost::per_layer_bytes(model);
    let needed = cost::stage_memory(model, Role::Only, model.n_layers, StageSplit::Layers, 1);
    let available: u128 = usable.iter().map(|d| u128::from(d.memory_bytes)).sum();
    let mut reason = if available < needed {
        format!("{} bytes short", needed - available)
    } else {
        format!(
            "enough in total but in no split: a layer ({per_layer} bytes of weights and KV) \
             is not divided between devices, every stage needs {} bytes of scratch, the \
             first also {} (embedding) and the last {} (output head)",
            model.scratch_bytes, model.first_extra_bytes, model.last_extra_bytes
        )
    };
    let too_small = usable
        .iter()
        .filter(|d| cost::max_layers(d, model, Role::Middle, StageSplit::Layers) == 0)
        .count();
    if too_small > 0 {
        reason += &format!("; {too_small} of the devices cannot hold even one layer");
    }
    PlacementError::DoesNotFit {
        needed_bytes: saturate(needed),
        available_bytes: saturate(available),
        devices: usable.len(),
        reason,
    }
}

/// The placement of minimum predicted per-token latency (exact), with that
/// latency as the solver summed it. Devices marked do-not-use (slowdown
/// infinite) and devices that cannot hold one layer are left out; among
/// equally fast placements the one with fewer stages is chosen, and the
/// result is the same for the same input.
pub fn place_with_cost(
    devices: &[DeviceProfile],
    model: &ModelCost,
) -> Result<(Vec<Stage>, f64), PlacementError> {
    check_inputs(devices, model)?;
    let candidates = candidates(devices, model, None);
    best(&candidates, model.n_layers)
        .map(|(cost, stages)| (stages, cost))
        .ok_or_else(|| does_not_fit(devices, model))
}

/// The placement of minimum predicted per-token latency (exact); see
/// [`place_with_cost`].
pub fn place(devices: &[DeviceProfile], model: &ModelCost) -> Result<Vec<Stage>, PlacementError> {
    place_with_cost(devices, model).map(|(stages, _)| stages)
}

/// Checks a placement (stages in pipeline order, contiguous, covering every
/// layer, each on a distinct known device that has the memory) and predicts
/// its per-token latency, throughput, and the time to prefill
/// `prompt_tokens` tokens.
pub fn evaluate(
    devices: &[DeviceProfile],
    model: &ModelCost,
    stages: &[Stage],
    prompt_tokens: usize,
) -> Result<Prediction, PlacementError> {
    cost::check_profiles(devices)?;
    cost::check_model(model)?;
    let layers = model.n_layers;
    let bad = |message: String| Err(PlacementError::BadStages(message));
    if stages.is_empty() {
        return bad(format!("no stages: layers 0..{layers} are not assigned"));
    }
    let mut on = Vec::with_capacity(stages.len());
    let mut next = 0;
    for (k, stage) in stages.iter().enumerate() {
        let (id, start, end) = (&stage.device, stage.start, stage.end);
        let Some(device) = devices.iter().find(|d| &d.id == id) else {
            return bad(format!(
                "stage {k} (layers {start}..{end}) is on unknown device {id:?}"
            ));
        };
        if let Some(earlier) = stages[..k].iter().position(|s| &s.device == id) {
            return bad(format!(
                "device {id:?} runs stages {earlier} and {k}; a device runs at most one stage"
            ));
        }
        if start >= end {
            return bad(format!(
                "stage {k} on {id:?} is empty (layers {start}..{end})"
            ));
        }
        if end > layers {
            return bad(format!(
                "stage {k} on {id:?} is out of range: layers {start}..{end}, the model has {layers}"
            ));
        }
        if start > next {
            return bad(format!(
                "gap: layers {next}..{start} are not assigned (before stage {k} on {id:?})"
            ));
        }
        if start < next {
            return bad(format!(
                "overlap: stage {k} on {id:?} starts at layer {start}, but layers up to {next} \
                 are already assigned (stages must be listed in layer order)"
            ));
        }
        if cost::avoided(device) {
            return bad(format!(
                "stage {k}: device {id:?} is marked do-not-use (slowdown infinite)"
            ));
        }
        let devices = cost::tensor_devices(device);
        let Some(device) = cost::split_as(device, stage.split) else {
            return bad(format!(
                "stage {k} on {id:?} asks for a {} split, which that worker does not offer",
                stage.split
            ));
        };
        next = end;
        on.push((device, devices));
    }
    if next < layers {
        return bad(format!(
            "gap: layers {next}..{layers} are not assigned (after the last stage)"
        ));
    }

    let count = stages.len();
    let mut predictions = Vec::with_capacity(count);
    let (mut s_per_token, mut prefill_s, mut batch_cycle_s) = (0.0, 0.0, 0.0);
    let concurrency = model.concurrency.max(1);
    for (k, (stage, (device, devices))) in stages.iter().zip(on).enumerate() {
        let role = Role::of(k, count);
        let n = stage.layers();
        let memory = cost::stage_memory(model, role, n, stage.split, devices);
        if memory > u128::from(device.memory_bytes) {
            let extra = cost::split_extra_bytes(model, role, stage.split, devices);
            return bad(format!(
                "stage {k} on {:?} needs {memory} bytes ({n} layers of {} bytes + {} for \
                 scratch{}{}), the device has {}",
                stage.device,
                cost::per_layer_bytes(model),
                cost::fixed_bytes(model, role),
                match role {
                    Role::Only => ", embedding and head",
                    Role::First => " and embedding",
                    Role::Last => " and head",
                    Role::Middle => "",
                },
                if extra > 0 {
                    format!(
                        " + {extra} the tensor split over {devices} devices holds on the \
                         others (their scratch{}; split by layers it needs {})",
                        match role {
                            Role::Only => ", embedding copies and head shares",
                            Role::First => " and embedding copies",
                            Role::Last => " and head shares",
                            Role::Middle => "",
                        },
                        memory - extra
                    )
                } else {
                    String::new()
                },
                device.memory_bytes
            ));
        }
        let compute_s = cost::decode_compute_s(&device, role, n);
        let link_s = cost::decode_link_s(&device, model, role);
        s_per_token += compute_s + link_s;
        prefill_s += cost::prefill_s(&device, model, role, n, prompt_tokens);
        batch_cycle_s += cost::batched_step_s(&device, model, role, n, concurrency);
        predictions.push(StagePrediction {
            device: stage.device.clone(),
            start: stage.start,
            end: stage.end,
            split: stage.split,
            memory_bytes: saturate(memory),
            memory_limit_bytes: device.memory_bytes,
            compute_s,
            link_s,
        });
    }
    Ok(Prediction {
        stages: predictions,
        s_per_token,
        tokens_per_s: 1.0 / s_per_token,
        prefill_s,
        prompt_tokens,
        aggregate_tokens_per_s: concurrency as f64 / batch_cycle_s,
        concurrency,
    })
}

/// Up to `limit` good placements other than the optimum, for a preview: the
/// best with each other number of stages and the best without each device
/// of the optimum. Distinct, sorted by predicted per-token latency (fewer
/// stages first on ties); empty when nothing can be placed.
pub fn alternatives(devices: &[DeviceProfile], model: &ModelCost, limit: usize) -> Vec<Vec<Stage>> {
    if limit == 0 {
        return Vec::new();
    }
    let Ok((optimum, _)) = place_with_cost(devices, model) else {
        return Vec::new();
    };
    let layers = model.n_layers;
    let mut found = best_per_count(&candidates(devices, model, None), layers);
    for stage in &optimum {
        found.extend(best(
            &candidates(devices, model, Some(&stage.device)),
            layers,
        ));
    }
    // Stable: equal costs keep the order above.
    found.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.len().cmp(&b.1.len())));
    let mut out: Vec<Vec<Stage>> = Vec::new();
    for (_, stages) in found {
        if stages != optimum && !out.contains(&stages) {
            out.push(stages);
            if out.len() == limit {
                break;
            }
        }
    }
    out
}
