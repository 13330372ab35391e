//! Device discovery, capability detection and backend selection.

pub(crate) mod info;
#[cfg(not(target_arch = "wasm32"))]
mod vulkan_memory;

use std::time::Duration;

pub use info::{CudaProps, DeviceInfo, Support, Vendor};

use crate::backend::{BackendError, BackendKind, Device, wgpu::WgpuBackend};

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
    /// Backends compiled in that found no device, each with the reason (`cuda` without a
    /// driver, say), for messages such as the tests' "skipped" lines.
    pub unavailable: Vec<(BackendKind, String)>,
    adapters: Vec<(String, wgpu::Adapter)>,
}

fn wgpu_instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    if std::env::var_os("WGPU_BACKEND").is_none() {
        desc.backends = wgpu::Backends::all();
    }
    wgpu::Instance::new(desc)
}

/// Enumerates every adapter wgpu sees on the compiled-in backends, plus the CPU.
pub async fn discover() -> Discovery {
    let start = web_time_now();
    let instance = wgpu_instance();
    #[cfg_attr(not(target_arch = "wasm32"), allow(unused_mut))]
    let mut adapters: Vec<wgpu::Adapter> = instance.enumerate_adapters(wgpu::Backends::all()).await;
    #[cfg(target_arch = "wasm32")]
    if adapters.is_empty() {
        // Browsers hand out one adapter through request_adapter only.
        if let Ok(a) = instance
            .request_adapter(&wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            })
            .await
        {
            adapters.push(a);
        }
    }
    let mut devices = Vec::new();
    let mut kept = Vec::new();
    for (index, adapter) in adapters.into_iter().enumerate() {
        let info = info::describe_adapter(&adapter, index, &devices);
        kept.push((info.id.clone(), adapter));
        devices.push(info);
    }
    #[cfg(all(feature = "vulkan", not(target_arch = "wasm32")))]
    for (info, adapter) in crate::backend::vulkan::discover(&kept, &devices) {
        kept.push((info.id.clone(), adapter));
        devices.push(info);
    }
    #[cfg_attr(
        not(all(feature = "cuda", not(target_arch = "wasm32"))),
        allow(unused_mut)
    )]
    let mut unavailable = Vec::new();
    #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
    {
        let (cuda, why) = crate::backend::cuda::discover();
        devices.extend(cuda);
        if let Some(why) = why {
            unavailable.push((BackendKind::Cuda, why));
        }
    }
    devices.push(info::describe_cpu());
    Discovery {
        devices,
        elapsed: web_time_now().saturating_sub(start),
        unavailable,
        adapters: kept,
    }
}

#[cfg(not(target_arch = "wasm32"))]
pub fn discover_blocking() -> Discovery {
    pollster::block_on(discover())
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

    pub async fn open_info(&self, info: DeviceInfo) -> Result<Device, SelectError> {
        match info.backend {
            BackendKind::Cpu => Ok(Device::new_cpu(info)),
            #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
            BackendKind::Cuda => match crate::backend::cuda::open(&info) {
                Ok(b) => Ok(Device::new_cuda(info, b)),
                Err(source) => Err(SelectError::Open {
                    id: info.id.clone(),
                    name: info.name.clone(),
                    source: Box::new(source),
                }),
            },
            _ => {
                let adapter = self
                    .adapters
                    .iter()
                    .find(|(id, _)| *id == info.id)
                    .map(|(_, a)| a)
                    .ok_or_else(|| SelectError::UnknownDevice {
                        asked: info.id.clone(),
                        within: String::new(),
                        available: self.available(),
                    })?;
                let opened = match info.backend {
                    #[cfg(all(feature = "vulkan", not(target_arch = "wasm32")))]
                    BackendKind::Vulkan => crate::backend::vulkan::open(adapter, &info),
                    _ => WgpuBackend::open(adapter, &info).await,
                };
                let backend = opened.map_err(|source| SelectError::Open {
                    id: info.id.clone(),
                    name: info.name.clone(),
                    source: Box::new(source),
                })?;
                Ok(Device::new_wgpu(info, backend))
            }
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn open_blocking(&self, sel: &Selection) -> Result<Device, SelectError> {
        pollster::block_on(self.open(sel))
    }
}
