//! The worker host: what a worker does with its coordinator's messages
//! besides stepping, the same for `cairn worker` and the browser tab.
//!
//! Sans-IO: [`WorkerHost`] takes the coordinator's messages and the device's
//! condition and says what to do ([`HostAction`]) and what to send (`Pause`,
//! `Resume`, `Telemetry`); [`ShardSlot`] loads a shard into a
//! [`StageServer`] from a source the carrier opened (a local file, HTTP
//! range requests, the browser's fetch). The carriers keep the I/O: links,
//! timers, where the stage runs (the native worker's stage thread, the
//! page's loop).

use crate::gguf::TensorSource;
use crate::model::{ModelError, Split};
use crate::placement::StageSplit;
use crate::protocol::{Battery, LayerRange, Message, Telemetry, Thermal, Visibility, error_code};

use super::stage::{Route, StageServer, load_stack_split};

/// A checked `LoadShard`: the layers to load, from where, and where their
/// outputs go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadPlan {
    /// The model's id (`gguf::model_id`); empty when the coordinator does not say.
    pub model: String,
    pub start: usize,
    pub end: usize,
    /// The URL serving the GGUF, where the worker has no copy of its own.
    pub source: String,
    pub route: Route,
    /// How placement split the stage over this worker's devices.
    pub split: StageSplit,
}

impl LoadPlan {
    /// The `LoadShard` message's plan, or why it is refused (a `BAD_REQUEST`).
    pub fn from_message(message: Message) -> Result<LoadPlan, String> {
        let Message::LoadShard {
            model_hash,
            layers,
            source,
            next,
            prev,
            split,
        } = message
        else {
            return Err(format!("{} is not a load-shard", message.kind()));
        };
        if layers.start >= layers.end {
            return Err(format!(
                "an empty layer range {}..{}",
                layers.start, layers.end
            ));
        }
        Ok(LoadPlan {
            model: model_hash,
            start: layers.start as usize,
            end: layers.end as usize,
            source,
            route: Route { next, prev },
            split,
        })
    }

    fn layers(&self) -> LayerRange {
        LayerRange {
            start: self.start as u32,
            end: self.end as u32,
        }
    }

    /// The `Error` a failed load answers.
    pub fn failed(&self, why: impl std::fmt::Display) -> Message {
        Message::Error {
            code: error_code::INTERNAL,
            text: format!("loading layers {}..{}: {why}", self.start, self.end),
        }
    }
}

/// What the carrier does with a message from the coordinator.
#[derive(Debug, PartialEq)]
pub enum HostAction {
    /// Load a shard: open its source, then [`ShardSlot::install`]; the link
    /// to `plan.route.next` can come up meanwhile.
    Load(LoadPlan),
    /// Send this back to the coordinator.
    Reply(Message),
    /// Hand it to the stage server.
    Stage(Message),
    /// The coordinator closes the link on purpose.
    Close { reason: String },
    /// The coordinator reports an error of its own; nothing to answer.
    PeerError { code: u16, text: String },
    /// Nothing to do (a stray `Hello`, a `Pong`, …).
    Ignore,
}

/// When a worker asks the coordinator to move its work away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PressureRule {
    /// Pause at `serious` or `critical` pressure (a browser tab: the
    /// platform asks it to calm down).
    Pause,
    /// Report it and keep serving: the coordinator weighs it (a native
    /// host's thermal state; placement gives a throttled host fewer layers).
    Report,
    /// Report it as `ignored` (the state under `pressure_observed`) and never
    /// pause for it: a machine known to be busy (tests, benchmarks).
    Ignore,
}

/// What a worker observes about its device, as it comes in.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Condition {
    /// `nominal`, `fair`, `serious` or `critical`.
    pub pressure: Option<String>,
    pub throttled: Option<bool>,
    pub thermal: Option<Thermal>,
    pub battery: Option<Battery>,
    /// A browser tab's visibility (none on native hosts).
    pub visibility: Option<Visibility>,
}

/// A worker's standing with its coordinator: the device's condition, the
/// pause it asked for, and the rules for both.
#[derive(Debug)]
pub struct WorkerHost {
    rule: PressureRule,
    condition: Condition,
    paused: Option<String>,
    /// The backend, where telemetry reports it.
    backend: Option<String>,
}

impl WorkerHost {
    pub fn new(rule: PressureRule) -> WorkerHost {
        WorkerHost {
            rule,
            condition: Condition::default(),
            paused: None,
            backend: None,
        }
    }

    /// Reports `backend` in telemetry (browsers do; natives say it in `Hello`).
    pub fn with_backend(mut self, backend: impl Into<String>) -> WorkerHost {
        self.backend = Some(backend.into());
        self
    }

    /// What to do with a message from the coordinator.
    pub fn on_message(&mut self, message: Message) -> HostAction {
        match message {
            m @ Message::LoadShard { .. } => match LoadPlan::from_message(m) {
                Ok(plan) => HostAction::Load(plan),
                Err(text) => HostAction::Reply(Message::Error {
                    code: error_code::BAD_REQUEST,
                    text,
                }),
            },
            Message::Close { reason } => HostAction::Close { reason },
            Message::Error { code, text } => HostAction::PeerError { code, text },
            Message::Hello(_)
            | Message::Pong { .. }
            | Message::ProbeAck { .. }
            | Message::Telemetry(_)
            | Message::Pause { .. }
            | Message::Resume => HostAction::Ignore,
            other => HostAction::Stage(other),
        }
    }

    /// Why the worker asked to pause, while it does.
    pub fn paused(&self) -> Option<&str> {
        self.paused.as_deref()
    }

    pub fn condition(&self) -> &Condition {
        &self.condition
    }

    /// Takes a new reading of the device; the `Pause` or `Resume` to send
    /// when it changes whether the worker should serve.
    pub fn set_condition(&mut self, condition: Condition) -> Option<Message> {
        self.condition = condition;
        self.update_pause()
    }

    /// Changes only the visibility (a browser's `visibilitychange`).
    pub fn set_visibility(&mut self, visibility: Visibility) -> Option<Message> {
        self.condition.visibility = Some(visibility);
        self.update_pause()
    }

    /// Changes only the pressure (a browser's pressure observer).
    pub fn set_pressure(&mut self, pressure: impl Into<String>) -> Option<Message> {
        self.condition.pressure = Some(pressure.into());
        self.update_pause()
    }

    /// Changes only the battery (browsers read it now and then).
    pub fn set_battery(&mut self, battery: Option<Battery>) {
        self.condition.battery = battery;
    }

    /// What a new coordinator link hears first after `Hello`: the pause
    /// still in force.
    pub fn on_link_up(&self) -> Option<Message> {
        self.paused.as_ref().map(|reason| Message::Pause {
            reason: reason.clone(),
        })
    }

    /// Why the worker should not serve now, if it should not.
    fn pause_reason(&self) -> Option<String> {
        if self.condition.visibility == Some(Visibility::Hidden) {
            return Some("the tab is in the background".to_owned());
        }
        match (&self.condition.pressure, self.rule) {
            (Some(p), PressureRule::Pause) if matches!(p.as_str(), "serious" | "critical") => {
                Some(format!("compute pressure is {p}"))
            }
            _ => None,
        }
    }

    fn update_pause(&mut self) -> Option<Message> {
        let reason = self.pause_reason();
        if reason == self.paused {
            return None;
        }
        let was_paused = self.paused.is_some();
        self.paused = reason;
        match &self.paused {
            Some(reason) => Some(Message::Pause {
                reason: reason.clone(),
            }),
            None if was_paused => Some(Message::Resume),
            None => None,
        }
    }

    /// The stage's telemetry with the device's condition added.
    pub fn telemetry(&self, mut t: Telemetry) -> Telemetry {
        let c = &self.condition;
        match self.rule {
            PressureRule::Ignore => {
                // The coordinator throttles a peer whose `pressure` is serious or
                // critical; the state is still reported, under another field.
                t.pressure = Some("ignored".into());
                t.pressure_observed = c.pressure.clone();
            }
            PressureRule::Pause | PressureRule::Report => t.pressure = c.pressure.clone(),
        }
        t.throttled = c.throttled;
        t.thermal = c.thermal.clone();
        t.battery = c.battery;
        t.visibility = c.visibility;
        t.paused = self.paused.clone();
        t.backend = self.backend.clone();
        t
    }
}

/// The shard a stage server holds and which model and layers it is, so the
/// same `LoadShard` again only drops the caches.
#[derive(Debug, Default)]
pub struct ShardSlot {
    loaded: Option<(String, usize, usize)>,
}

impl ShardSlot {
    /// Whether `server` already holds what `plan` asks for.
    pub fn holds(&self, server: &StageServer, plan: &LoadPlan) -> bool {
        server.layers().is_some()
            && self.loaded.as_ref() == Some(&(plan.model.clone(), plan.start, plan.end))
    }

    /// When `server` already holds what `plan` asks for: drops its caches,
    /// takes the new route and answers `ShardLoaded` (the source need not be
    /// read). `None`: [`ShardSlot::load`] it.
    pub fn reuse(&mut self, server: &mut StageServer, plan: &LoadPlan) -> Option<Message> {
        if !self.holds(server, plan) {
            return None;
        }
        server.clear_requests();
        server.set_route(plan.route.clone());
        Some(Message::ShardLoaded {
            layers: plan.layers(),
            weight_bytes: 0,
            load_ms: 0,
        })
    }

    /// Loads what `plan` asks for from `src` (the old shard goes first) and
    /// answers the coordinator: `ShardLoaded` or `Error`.
    pub async fn load(
        &mut self,
        server: &mut StageServer,
        plan: LoadPlan,
        src: &dyn TensorSource,
    ) -> Message {
        self.clear(server);
        let devices = server.devices().to_vec();
        // `--split auto` follows placement; `layers` or `tensor` is the worker's own choice.
        let split = match (server.split(), plan.split) {
            (Split::Auto, StageSplit::Layers) => Split::Layers,
            (Split::Auto, StageSplit::Tensor) => Split::Tensor,
            (own, _) => own,
        };
        let mut loaded = load_stack_split(&devices, src, plan.start, plan.end, split).await;
        if let Err(ModelError::TensorSplit(why)) = &loaded {
            // The worker still serves these layers, split the other way.
            tracing::warn!(%why, "splitting the stage by layers instead");
            loaded = load_stack_split(&devices, src, plan.start, plan.end, Split::Layers).await;
        }
        match loaded {
            Ok((stack, loaded)) => {
                server.set_stack(stack);
                server.set_route(plan.route);
                self.loaded = Some((plan.model, plan.start, plan.end));
                loaded
            }
            Err(e) => plan.failed(e),
        }
    }

    /// Frees the shard (before a new one loads, or when the worker leaves).
    pub fn clear(&mut self, server: &mut StageServer) {
        server.clear();
        self.loaded = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;
    use crate::model::synthetic::SyntheticModel;
    use crate::protocol::Hop;
    use crate::worker::tests::cpu;

    fn load(start: u32, end: u32, next: Option<&str>) -> Message {
        Message::LoadShard {
            model_hash: "m1".into(),
            layers: LayerRange { start, end },
            source: "http://coordinator/model.gguf".into(),
            next: next.map(|peer| Hop {
                peer: peer.into(),
                layers: LayerRange { start: end, end: 4 },
            }),
            prev: None,
            split: StageSplit::Layers,
        }
    }

    #[test]
    fn load_shard_becomes_a_plan_and_an_empty_range_is_refused() {
        let mut host = WorkerHost::new(PressureRule::Pause);
        let HostAction::Load(plan) = host.on_message(load(1, 3, Some("w2"))) else {
            panic!("a load-shard is a load");
        };
        assert_eq!((plan.model.as_str(), plan.start, plan.end), ("m1", 1, 3));
        assert_eq!(
            plan.route.next.as_ref().map(|h| h.peer.as_str()),
            Some("w2")
        );
        assert_eq!(plan.source, "http://coordinator/model.gguf");
        match host.on_message(load(3, 3, None)) {
            HostAction::Reply(Message::Error { code, text }) => {
                assert_eq!(code, error_code::BAD_REQUEST);
                assert!(text.contains("3..3"), "{text}");
            }
            other => panic!("an empty range is refused, got {other:?}"),
        }
        let failed = plan.failed("no such file");
        assert_eq!(
            failed,
            Message::Error {
                code: error_code::INTERNAL,
                text: "loading layers 1..3: no such file".into()
            }
        );
    }

    #[test]
    fn close_steps_and_chatter_go_their_ways() {
        let mut host = WorkerHost::new(PressureRule::Report);
        assert_eq!(
            host.on_message(Message::Close {
                reason: "bye".into()
            }),
            HostAction::Close {
                reason: "bye".into()
            }
        );
        assert_eq!(
            host.on_message(Message::Error {
                code: 5,
                text: "oops".into()
            }),
            HostAction::PeerError {
                code: 5,
                text: "oops".into()
            }
        );
        let end = Message::EndRequest { request: 9 };
        assert_eq!(host.on_message(end.clone()), HostAction::Stage(end));
        let calibrate = Message::Calibrate {
            config: "{}".into(),
        };
        assert_eq!(
            host.on_message(calibrate.clone()),
            HostAction::Stage(calibrate)
        );
        for chatter in [
            Message::Pong {
                nonce: 1,
                sent_us: 2,
            },
            Message::Telemetry(Box::default()),
            Message::Resume,
        ] {
            assert_eq!(host.on_message(chatter), HostAction::Ignore);
        }
    }

    #[test]
    fn a_hidden_tab_pauses_and_resumes_once() {
        let mut host = WorkerHost::new(PressureRule::Pause);
        assert_eq!(host.set_visibility(Visibility::Visible), None);
        assert_eq!(host.on_link_up(), None);
        let pause = host.set_visibility(Visibility::Hidden);
        assert!(
            matches!(&pause, Some(Message::Pause { reason }) if reason.contains("background")),
            "{pause:?}"
        );
        assert_eq!(
            host.set_visibility(Visibility::Hidden),
            None,
            "already paused"
        );
        assert!(host.paused().is_some());
        // A new link hears the pause still in force.
        assert_eq!(host.on_link_up(), pause);
        assert_eq!(
            host.set_visibility(Visibility::Visible),
            Some(Message::Resume)
        );
        assert_eq!(host.set_visibility(Visibility::Visible), None);
        assert_eq!(host.paused(), None);
    }

    #[test]
    fn pressure_pauses_only_under_the_pause_rule() {
        let mut tab = WorkerHost::new(PressureRule::Pause);
        assert_eq!(tab.set_pressure("fair"), None);
        assert!(matches!(
            tab.set_pressure("serious"),
            Some(Message::Pause { reason }) if reason == "compute pressure is serious"
        ));
        // Another reason while paused is another pause.
        assert!(matches!(
            tab.set_pressure("critical"),
            Some(Message::Pause { reason }) if reason == "compute pressure is critical"
        ));
        assert_eq!(tab.set_pressure("nominal"), Some(Message::Resume));

        for rule in [PressureRule::Report, PressureRule::Ignore] {
            let mut host = WorkerHost::new(rule);
            assert_eq!(host.set_pressure("critical"), None, "{rule:?}");
            assert_eq!(host.paused(), None);
        }
        let mut native = WorkerHost::new(PressureRule::Report);
        let hot = Condition {
            pressure: Some("critical".into()),
            throttled: Some(true),
            ..Condition::default()
        };
        assert_eq!(native.set_condition(hot), None);
    }

    #[test]
    fn telemetry_carries_the_condition() {
        let battery = Some(Battery {
            level: 0.4,
            charging: Some(false),
        });
        let mut tab = WorkerHost::new(PressureRule::Pause).with_backend("wgpu");
        tab.set_battery(battery);
        tab.set_visibility(Visibility::Hidden);
        tab.set_pressure("fair");
        let stage = Telemetry {
            utilization: 0.25,
            kernel_ms: 3.0,
            ..Telemetry::default()
        };
        let t = tab.telemetry(stage.clone());
        assert_eq!(
            (t.utilization, t.kernel_ms),
            (0.25, 3.0),
            "the stage's figures stay"
        );
        assert_eq!(t.pressure.as_deref(), Some("fair"));
        assert_eq!(t.pressure_observed, None);
        assert_eq!(t.battery, battery);
        assert_eq!(t.visibility, Some(Visibility::Hidden));
        assert_eq!(t.paused.as_deref(), Some("the tab is in the background"));
        assert_eq!(t.backend.as_deref(), Some("wgpu"));

        let mut busy = WorkerHost::new(PressureRule::Ignore);
        busy.set_pressure("serious");
        let t = busy.telemetry(stage.clone());
        assert_eq!(t.pressure.as_deref(), Some("ignored"));
        assert_eq!(t.pressure_observed.as_deref(), Some("serious"));

        let mut native = WorkerHost::new(PressureRule::Report);
        let thermal = Thermal {
            zone: "x86_pkg_temp".into(),
            temp_c: 90.0,
            limit_c: Some(85.0),
        };
        native.set_condition(Condition {
            pressure: Some("serious".into()),
            throttled: Some(true),
            thermal: Some(thermal.clone()),
            ..Condition::default()
        });
        let t = native.telemetry(stage);
        assert_eq!(t.pressure.as_deref(), Some("serious"));
        assert_eq!((t.throttled, t.thermal), (Some(true), Some(thermal)));
        assert_eq!((t.visibility, t.paused, t.backend), (None, None, None));
    }

    fn plan(model: &str, start: usize, end: usize, next: Option<&str>) -> LoadPlan {
        LoadPlan {
            model: model.into(),
            start,
            end,
            source: String::new(),
            route: Route {
                next: next.map(|peer| Hop {
                    peer: peer.into(),
                    layers: LayerRange { start: 0, end: 1 },
                }),
                prev: None,
            },
            split: StageSplit::Layers,
        }
    }

    #[test]
    fn the_same_shard_again_keeps_its_weights_and_takes_the_new_route() {
        pollster::block_on(async {
            let mut cfg = ModelConfig::synthetic("135m").expect("135m shape");
            cfg.n_layers = 4;
            cfg.vocab_size = 512;
            let model = SyntheticModel::new(&cfg, 3);
            let mut server = StageServer::new(cpu());
            let mut slot = ShardSlot::default();

            let first = plan("m1", 0, 2, None);
            assert_eq!(slot.reuse(&mut server, &first), None, "nothing loaded yet");
            match slot.load(&mut server, first.clone(), &model).await {
                Message::ShardLoaded {
                    layers,
                    weight_bytes,
                    ..
                } => {
                    assert_eq!((layers.start, layers.end), (0, 2));
                    assert!(weight_bytes > 0);
                }
                other => panic!("expected shard-loaded, got {other:?}"),
            }
            assert_eq!(server.layers(), Some((0, 2)));

            let again = plan("m1", 0, 2, Some("w2"));
            assert_eq!(
                slot.reuse(&mut server, &again),
                Some(Message::ShardLoaded {
                    layers: LayerRange { start: 0, end: 2 },
                    weight_bytes: 0,
                    load_ms: 0
                })
            );
            assert_eq!(server.route(), &again.route);

            // Other layers, or the same layers of another model, load afresh.
            assert_eq!(slot.reuse(&mut server, &plan("m1", 2, 4, None)), None);
            assert_eq!(slot.reuse(&mut server, &plan("m2", 0, 2, None)), None);
            let failed = slot.load(&mut server, plan("m1", 2, 9, None), &model).await;
            assert!(matches!(failed, Message::Error { code, .. } if code == error_code::INTERNAL));
            assert_eq!(server.layers(), None, "a failed load leaves nothing");
            assert_eq!(slot.reuse(&mut server, &first), None);
        });
    }
}
