//! Devices of every backend merged into one list, and selection: which device a request
//! names, or the best one. Each backend discovers and describes its own devices
//! (`backend::wgpu::discover`, `backend::vulkan`, `backend::cuda`, `backend::cpu_discover`).

pub(crate) mod info;

use std::time::Duration;

pub use info::{CudaProps, DeviceInfo, Support, Vendor};

use crate::backend::{self, BackendError, BackendKind, Device, wgpu::WgpuBackend};
use crate::options::EngineOptions;

/// What the user asked for: a backend by name, a device by id, both, or neither (automatic).
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub backend: Option<String>,
    pub device: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    #[error("no backend named '{asked}'; available: {available}")]
    UnknownBackend { asked: String, available: String },
    #[error("backend '{backend}' was not compiled in; rebuild with `--features {backend}`")]
    NotCompiled { backend: String },
    #[error("no device with id '{asked}'{within}; available: {available}")]
    UnknownDevice {
        asked: String,
        within: String,
        available: String,
    },
    #[error("backend '{backend}' has no usable device; available: {available}")]
    NoDevice { backend: String, available: String },
    #[error("device {id} ({name}) is unsupported: {reason}")]
    Unsupported {
        id: String,
        name: String,
        reason: String,
    },
    #[error("opening {id} ({name}): {source}")]
    Open {
        id: String,
        name: String,
        source: Box<BackendError>,
    },
}

/// Everything discovery found, with how long it took.
pub struct Discovery {
    pub devices: Vec<DeviceInfo>,
    pub elapsed: Duration,
    /// Backends that found no device, each with the reason (`cuda` without a driver, or not
    /// compiled in, say), for messages such as the tests' "skipped" lines.
    pub unavailable: Vec<(BackendKind, String)>,
    adapters: Vec<(String, wgpu::Adapter)>,
    /// Given to every device this discovery opens.
    options: EngineOptions,
}

/// Enumerates every device of every backend with the default options.
pub async fn discover() -> Discovery {
    discover_with(EngineOptions::default()).await
}

/// Enumerates every device: each backend lists its own (wgpu adapters, their raw-Vulkan
/// twins, CUDA devices, the CPU); devices opened from the result get `options`.
pub async fn discover_with(options: EngineOptions) -> Discovery {
    let start = web_time_now();
    let mut devices = Vec::new();
    let mut adapters = Vec::new();
    let mut unavailable = Vec::new();
    for (info, adapter) in backend::wgpu::discover::discover(&options).await {
        adapters.push((info.id.clone(), adapter));
        devices.push(info);
    }
    let (vulkan, why) = backend::vulkan::discover(&adapters, &devices);
    for (info, adapter) in vulkan {
        adapters.push((info.id.clone(), adapter));
        devices.push(info);
    }
    unavailable.extend(why.map(|w| (BackendKind::Vulkan, w)));
    let (cuda, why) = backend::cuda::discover();
    devices.extend(cuda);
    unavailable.extend(why.map(|w| (BackendKind::Cuda, w)));
    devices.push(backend::cpu_discover::describe());
    Discovery {
        devices,
        elapsed: web_time_now().saturating_sub(start),
        unavailable,
        adapters,
        options,
    }
}

/// The cpu device alone, without asking the other backends for theirs: where probing
/// them is pointless or cannot work (a browser's Web Worker running the CPU fallback).
pub fn open_cpu(options: &EngineOptions) -> Device {
    backend::cpu_discover::open(backend::cpu_discover::describe(), options)
}

#[cfg(not(target_arch = "wasm32"))]
pub fn discover_blocking() -> Discovery {
    pollster::block_on(discover())
}

#[cfg(not(target_arch = "wasm32"))]
pub fn discover_blocking_with(options: EngineOptions) -> Discovery {
    pollster::block_on(discover_with(options))
}

fn web_time_now() -> Duration {
    use std::sync::OnceLock;
    static T0: OnceLock<web_time::Instant> = OnceLock::new();
    T0.get_or_init(web_time::Instant::now).elapsed()
}

impl Discovery {
    /// Devices in the order automatic selection prefers them.
    pub fn ranked(&self) -> Vec<&DeviceInfo> {
        let mut v: Vec<&DeviceInfo> = self.devices.iter().collect();
        v.sort_by_key(|d| std::cmp::Reverse(d.rank()));
        v
    }

    fn available(&self) -> String {
        self.devices
            .iter()
            .map(|d| format!("{} ({}, {})", d.id, d.backend, d.name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Picks the device `sel` names, or the best one: real GPUs first, then the CPU backend.
    /// Software adapters (lavapipe, SwiftShader) are used only when asked for by backend or
    /// id, since the CPU backend outruns them.
    pub fn choose(&self, sel: &Selection) -> Result<&DeviceInfo, SelectError> {
        let backend = match sel.backend.as_deref().map(str::to_ascii_lowercase) {
            None => None,
            Some(b) => Some(match b.as_str() {
                "wgpu" | "gpu" | "webgpu" => BackendKind::Wgpu,
                "cpu" => BackendKind::Cpu,
                "vulkan" if BackendKind::Vulkan.compiled() => BackendKind::Vulkan,
                "cuda" if BackendKind::Cuda.compiled() => BackendKind::Cuda,
                "cuda" | "vulkan" => return Err(SelectError::NotCompiled { backend: b }),
                _ => {
                    return Err(SelectError::UnknownBackend {
                        asked: b,
                        available: "wgpu, cpu (cuda and vulkan behind cargo features)".into(),
                    });
                }
            }),
        };
        if let Some(id) = &sel.device {
            let found = self
                .devices
                .iter()
                .find(|d| &d.id == id && backend.is_none_or(|b| d.backend == b));
            return match found {
                Some(d) if d.support == Support::Unsupported => Err(SelectError::Unsupported {
                    id: d.id.clone(),
                    name: d.name.clone(),
                    reason: d.support_reason.clone(),
                }),
                Some(d) => Ok(d),
                None => Err(SelectError::UnknownDevice {
                    asked: id.clone(),
                    within: backend
                        .map(|b| format!(" on backend {b}"))
                        .unwrap_or_default(),
                    available: self.available(),
                }),
            };
        }
        let usable = |d: &&DeviceInfo| d.support != Support::Unsupported;
        let pick = match backend {
            Some(b) => self
                .ranked()
                .into_iter()
                .filter(usable)
                .find(|d| d.backend == b),
            None => self
                .ranked()
                .into_iter()
                .filter(usable)
                .find(|d| d.backend == BackendKind::Cpu || !d.is_software()),
        };
        pick.ok_or_else(|| SelectError::NoDevice {
            backend: backend.map_or("any".into(), |b| b.name().into()),
            available: self.available(),
        })
    }

    /// Opens the device `sel` names (or the best one).
    pub async fn open(&self, sel: &Selection) -> Result<Device, SelectError> {
        let info = self.choose(sel)?.clone();
        self.open_info(info).await
    }

    /// What devices opened from here on are given (the kernel tests open a device once per
    /// kernel variant).
    pub fn options_mut(&mut self) -> &mut EngineOptions {
        &mut self.options
    }

    pub async fn open_info(&self, info: DeviceInfo) -> Result<Device, SelectError> {
        let opts = &self.options;
        let opened = match info.backend {
            BackendKind::Cpu => return Ok(backend::cpu_discover::open(info, opts)),
            BackendKind::Cuda => backend::cuda::open(&info, opts),
            BackendKind::Vulkan => match self.adapter(&info) {
                Err(e) if BackendKind::Vulkan.compiled() => return Err(e),
                // Without the backend compiled in, its stand-in refuses by name, whatever
                // the id asked for.
                adapter => backend::vulkan::open(adapter.ok(), &info, opts),
            },
            BackendKind::Wgpu => WgpuBackend::open(self.adapter(&info)?, &info)
                .await
                .map(|b| Device::new_wgpu(info.clone(), b.with_options(&opts.wgpu, &info))),
        };
        opened.map_err(|source| SelectError::Open {
            id: info.id.clone(),
            name: info.name.clone(),
            source: Box::new(source),
        })
    }

    /// The wgpu adapter behind a `wgpu` or `vulkan` device.
    fn adapter(&self, info: &DeviceInfo) -> Result<&wgpu::Adapter, SelectError> {
        self.adapters
            .iter()
            .find(|(id, _)| *id == info.id)
            .map(|(_, a)| a)
            .ok_or_else(|| SelectError::UnknownDevice {
                asked: info.id.clone(),
                within: String::new(),
                available: self.available(),
            })
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn open_blocking(&self, sel: &Selection) -> Result<Device, SelectError> {
        pollster::block_on(self.open(sel))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every backend that lists no device says why, and one that lists devices does not.
    #[test]
    fn a_backend_without_devices_says_why() {
        let found = discover_blocking();
        for kind in [BackendKind::Vulkan, BackendKind::Cuda] {
            let listed = found.devices.iter().any(|d| d.backend == kind);
            let why = found.unavailable.iter().find(|(b, _)| *b == kind);
            assert_eq!(listed, why.is_none(), "{kind}: {why:?}");
            if !kind.compiled() {
                let (_, why) = why.expect("a reason");
                assert!(why.contains("not compiled in"), "{kind}: {why}");
            }
        }
        assert_eq!(
            found.devices.last().map(|d| d.backend),
            Some(BackendKind::Cpu)
        );
    }

    /// The cpu device alone is the one discovery lists, opened without the other backends.
    #[test]
    fn open_cpu_opens_the_discovered_cpu_device() {
        let listed = discover_blocking()
            .devices
            .pop()
            .expect("discovery lists the cpu");
        let opened = open_cpu(&EngineOptions::default());
        assert_eq!(opened.kind(), BackendKind::Cpu);
        assert_eq!(opened.info().id, listed.id);
        assert_eq!(opened.info().name, listed.name);
    }

    /// A backend left out of the build refuses to open a device with an error naming the
    /// feature, rather than being absent from the code.
    #[test]
    fn a_backend_not_compiled_in_refuses_to_open() {
        let found = discover_blocking();
        let cpu = found.devices.last().cloned().expect("the cpu device");
        for kind in [BackendKind::Vulkan, BackendKind::Cuda] {
            if kind.compiled() {
                continue;
            }
            let mut info = cpu.clone();
            info.backend = kind;
            info.id = format!("{kind}:0");
            let err = match pollster::block_on(found.open_info(info)) {
                Ok(_) => panic!("{kind} opened in a build without it"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(&format!("--features {kind}")), "{kind}: {err}");
        }
    }

    /// Discovery's options reach the backends: wgpu enumerates on the backends they name
    /// (Metal, which Linux lacks: no adapter), and devices it opens get them.
    #[cfg(target_os = "linux")]
    #[test]
    fn discovery_uses_its_options() {
        let options = EngineOptions {
            wgpu_backends: Some(wgpu::Backends::METAL),
            cpu_threads: Some(2),
            ..Default::default()
        };
        let found = discover_blocking_with(options.clone());
        assert!(
            found
                .devices
                .iter()
                .all(|d| !matches!(d.backend, BackendKind::Wgpu | BackendKind::Vulkan)),
            "{:?}",
            found.devices.iter().map(|d| &d.id).collect::<Vec<_>>()
        );
        assert_eq!(found.options, options);
        let dev = found
            .open_blocking(&Selection {
                backend: Some("cpu".into()),
                device: None,
            })
            .expect("the cpu device opens");
        assert_eq!(dev.kind(), BackendKind::Cpu);
    }
}
