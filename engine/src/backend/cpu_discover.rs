//! The `cpu` device: what the host's processor and memory are, as the cpu backend reports
//! them, and opening it with its thread count.

use crate::backend::{BackendKind, Device};
use crate::device::info::DeviceLimits;
use crate::device::{DeviceInfo, Support, Vendor};
use crate::options::EngineOptions;

/// The cpu device; its threads are the process's one pool, started here on first use with
/// `cpu_threads` (a later device with another count shares the pool already running).
pub(crate) fn open(info: DeviceInfo, opts: &EngineOptions) -> Device {
    crate::kernels::linear::start_pool(opts.cpu_threads);
    Device::new_cpu_with(
        info,
        crate::backend::cpu::CpuBackend::with_f32_linear(opts.cpu_f32_linear),
    )
}

/// Total system memory, and whether the OS reported it.
pub(crate) fn system_memory() -> Option<(u64, bool)> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some((kb * 1024, true))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The one `cpu` device: the host's cores and memory.
pub(crate) fn describe() -> DeviceInfo {
    let cores = {
        #[cfg(not(target_arch = "wasm32"))]
        {
            std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
        }
        #[cfg(target_arch = "wasm32")]
        {
            1
        }
    };
    let (memory_bytes, memory_exact) = system_memory().unwrap_or((4 << 30, false));
    DeviceInfo {
        id: "cpu".into(),
        name: cpu_name().unwrap_or_else(|| format!("{} CPU", std::env::consts::ARCH)),
        vendor: Vendor(cpu_vendor().unwrap_or_else(|| "unknown".into())),
        backend: BackendKind::Cpu,
        api: "cpu".into(),
        device_type: "cpu".into(),
        driver: format!(
            "cairn cpu backend ({}, {})",
            std::env::consts::ARCH,
            crate::backend::cpu::isa_name()
        ),
        memory_bytes,
        memory_exact,
        memory_budget_bytes: None,
        support: Support::Full,
        support_reason: "reference backend: every kernel, multi-threaded".into(),
        features: Vec::new(),
        limits: DeviceLimits::default(),
        cores: Some(cores),
        cuda: None,
    }
}

fn cpuinfo_field(key: &str) -> Option<String> {
    #[cfg(target_os = "linux")]
    {
        let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        let line = text.lines().find(|l| l.starts_with(key))?;
        Some(line.split_once(':')?.1.trim().to_string())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = key;
        None
    }
}

fn cpu_name() -> Option<String> {
    cpuinfo_field("model name")
}

fn cpu_vendor() -> Option<String> {
    let v = cpuinfo_field("vendor_id")?;
    Some(
        match v.as_str() {
            "GenuineIntel" => "Intel",
            "AuthenticAMD" => "AMD",
            other => other,
        }
        .to_string(),
    )
}
