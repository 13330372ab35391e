//! The `wgpu` backend: WGSL kernels on Vulkan, Metal, DX12 or the browser's WebGPU.
//!
//! A `run` becomes one command buffer and one queue submission: all dispatches of a decode
//! step share a compute pass (split only around buffer copies), with their parameters packed
//! into one uniform buffer at 256-byte slots.

mod plan;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{BackendError, Buffer, Result, Storage};
use crate::device::DeviceInfo;
use crate::kernels::Op;
use plan::Step;

const PARAM_SLOT: u64 = 256;

pub struct WgpuBackend {
    device: wgpu::Device,
    queue: wgpu::Queue,
    limits: wgpu::Limits,
    pipelines: Mutex<HashMap<(&'static str, Option<&'static str>), wgpu::ComputePipeline>>,
    params: Mutex<Option<wgpu::Buffer>>,
    /// Errors wgpu reports asynchronously (validation, out of memory, device loss), surfaced
    /// by the next call instead of aborting the process.
    errors: Arc<Mutex<Vec<String>>>,
    lost: Arc<Mutex<Option<String>>>,
}

impl WgpuBackend {
    pub(crate) async fn open(adapter: &wgpu::Adapter, info: &DeviceInfo) -> Result<WgpuBackend> {
        let wanted = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::SHADER_F16;
        let required_features = adapter.features() & wanted;
        // Ask for everything the adapter allows: weight matrices need large storage bindings.
        let required_limits = adapter.limits();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some(&format!("cairn {}", info.id)),
                required_features,
                required_limits: required_limits.clone(),
                memory_hints: wgpu::MemoryHints::Performance,
                ..Default::default()
            })
            .await
            .map_err(|e| BackendError::Gpu(format!("request_device: {e}")))?;
        let errors: Arc<Mutex<Vec<String>>> = Default::default();
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            tracing::error!(error = %e, "wgpu error");
            if let Ok(mut v) = sink.lock() {
                v.push(e.to_string());
            }
        }));
        let lost: Arc<Mutex<Option<String>>> = Default::default();
        let lost_sink = lost.clone();
        device.set_device_lost_callback(move |reason, msg| {
            tracing::error!(?reason, %msg, "GPU device lost");
            if let Ok(mut l) = lost_sink.lock() {
                *l = Some(format!("{reason:?}: {msg}"));
            }
        });
        Ok(WgpuBackend {
            device,
            queue,
            limits: required_limits,
            pipelines: Mutex::new(HashMap::new()),
            params: Mutex::new(None),
            errors,
            lost,
        })
    }

    pub(crate) fn max_binding_bytes(&self) -> u64 {
        self.limits
            .max_buffer_size
            .min(self.limits.max_storage_buffer_binding_size)
    }

    fn check_errors(&self) -> Result<()> {
        if let Some(l) = self.lost.lock().ok().and_then(|l| l.clone()) {
            return Err(BackendError::DeviceLost(l));
        }
        let mut errs = self
            .errors
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?;
        if errs.is_empty() {
            return Ok(());
        }
        let msg = errs.join("; ");
        errs.clear();
        Err(BackendError::Gpu(msg))
    }

    pub(crate) fn alloc(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
        let size = bytes.max(4).div_ceil(4) * 4;
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if let Some(e) = block_on_native(scope.pop()) {
            return Err(BackendError::OutOfMemory {
                device: "wgpu".into(),
                label: label.into(),
                bytes,
                reason: e.to_string(),
            });
        }
        Ok(buf)
    }

    pub(crate) fn write(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<()> {
        if !offset.is_multiple_of(4) {
            return Err(BackendError::Unsupported(format!(
                "GPU writes must start at a multiple of 4 bytes, not {offset}"
            )));
        }
        let whole = data.len() / 4 * 4;
        if whole > 0 {
            self.queue.write_buffer(buf, offset, &data[..whole]);
        }
        if whole < data.len() {
            // The copy unit is 4 bytes: the tail goes out zero-padded (inside the allocation,
            // which is rounded up to 4).
            let mut tail = [0u8; 4];
            tail[..data.len() - whole].copy_from_slice(&data[whole..]);
            self.queue.write_buffer(buf, offset + whole as u64, &tail);
        }
        self.check_errors()
    }

    fn pipeline(
        &self,
        kernel: cairn_shaders::Kernel,
        format: Option<&'static str>,
    ) -> Result<wgpu::ComputePipeline> {
        let mut cache = self
            .pipelines
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?;
        if let Some(p) = cache.get(&(kernel.name, format)) {
            return Ok(p.clone());
        }
        let src = cairn_shaders::source(kernel, format).ok_or_else(|| {
            BackendError::Unsupported(format!("{}: no kernel for format {format:?}", kernel.name))
        })?;
        let label = format!(
            "{}{}",
            kernel.name,
            format.map(|f| format!("_{f}")).unwrap_or_default()
        );
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(&label),
                source: wgpu::ShaderSource::Wgsl(src.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(&label),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = block_on_native(scope.pop()) {
            return Err(BackendError::Gpu(format!("compiling {label}: {e}")));
        }
        cache.insert((kernel.name, format), pipeline.clone());
        Ok(pipeline)
    }

    fn param_buffer(&self, bytes: u64) -> Result<wgpu::Buffer> {
        let mut slot = self
            .params
            .lock()
            .map_err(|_| BackendError::Gpu("poisoned".into()))?;
        match &*slot {
            Some(b) if b.size() >= bytes => Ok(b.clone()),
            _ => {
                let size = bytes.next_power_of_two().max(PARAM_SLOT * 64);
                let b = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("cairn params"),
                    size,
                    usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                *slot = Some(b.clone());
                Ok(b)
            }
        }
    }

    pub(crate) fn run(&self, ops: &[Op<'_>]) -> Result<()> {
        self.check_errors()?;
        let max_dim = self.limits.max_compute_workgroups_per_dimension;
        let steps = ops
            .iter()
            .map(|op| plan::plan(op, max_dim))
            .collect::<Result<Vec<_>>>()?;
        let n_dispatch = steps
            .iter()
            .filter(|s| matches!(s, Step::Dispatch { .. }))
            .count() as u64;
        let slot = PARAM_SLOT.max(u64::from(self.limits.min_uniform_buffer_offset_alignment));
        let params_buf = self.param_buffer((n_dispatch.max(1)) * slot)?;
        let mut param_bytes = vec![0u8; (n_dispatch.max(1) * slot) as usize];

        let mut bind_groups = Vec::with_capacity(steps.len());
        let mut di = 0u64;
        for step in &steps {
            if let Step::Dispatch {
                kernel,
                format,
                buffers,
                params,
                ..
            } = step
            {
                let pipeline = self.pipeline(*kernel, *format)?;
                let off = di * slot;
                param_bytes[off as usize..][..32].copy_from_slice(bytemuck::cast_slice(params));
                let mut entries = vec![wgpu::BindGroupEntry {
                    binding: 0,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &params_buf,
                        offset: off,
                        size: wgpu::BufferSize::new(32),
                    }),
                }];
                for (i, b) in buffers.iter().enumerate() {
                    entries.push(wgpu::BindGroupEntry {
                        binding: i as u32 + 1,
                        resource: raw(b)?.as_entire_binding(),
                    });
                }
                let bg = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: Some(kernel.name),
                    layout: &pipeline.get_bind_group_layout(0),
                    entries: &entries,
                });
                bind_groups.push(Some((pipeline, bg)));
                di += 1;
            } else {
                bind_groups.push(None);
            }
        }
        self.queue.write_buffer(&params_buf, 0, &param_bytes);

        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("cairn run"),
            });
        let mut i = 0;
        while i < steps.len() {
            if let Step::Copy {
                src,
                src_offset,
                dst,
                dst_offset,
                bytes,
            } = &steps[i]
            {
                enc.copy_buffer_to_buffer(raw(src)?, *src_offset, raw(dst)?, *dst_offset, *bytes);
                i += 1;
                continue;
            }
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("cairn ops"),
                timestamp_writes: None,
            });
            while i < steps.len() {
                let Step::Dispatch { groups, .. } = &steps[i] else {
                    break;
                };
                if let Some((pipeline, bg)) = &bind_groups[i] {
                    pass.set_pipeline(pipeline);
                    pass.set_bind_group(0, bg, &[]);
                    pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                }
                i += 1;
            }
        }
        self.queue.submit([enc.finish()]);
        self.check_errors()
    }

    pub(crate) async fn read(&self, buf: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        self.check_errors()?;
        let start = offset / 4 * 4;
        let end = (offset + len).div_ceil(4) * 4;
        let size = (end - start).max(4);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("cairn readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("cairn read"),
            });
        if end > start {
            enc.copy_buffer_to_buffer(buf, start, &staging, 0, end - start);
        }
        self.queue.submit([enc.finish()]);
        let (tx, rx) = futures::channel::oneshot::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.await
            .map_err(|_| BackendError::DeviceLost("readback was cancelled".into()))?
            .map_err(|e| BackendError::Gpu(format!("mapping readback: {e}")))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| BackendError::Gpu(format!("mapped range: {e}")))?;
        let skip = (offset - start) as usize;
        let out = view[skip..skip + len as usize].to_vec();
        drop(view);
        staging.unmap();
        self.check_errors()?;
        Ok(out)
    }

    pub(crate) async fn sync(&self) -> Result<()> {
        let (tx, rx) = futures::channel::oneshot::channel();
        self.queue.on_submitted_work_done(move || {
            let _ = tx.send(());
        });
        self.wait()?;
        rx.await
            .map_err(|_| BackendError::DeviceLost("sync was cancelled".into()))?;
        self.check_errors()
    }

    /// Native: drive the device until queued work finishes. In a browser the event loop does.
    fn wait(&self) -> Result<()> {
        #[cfg(not(target_arch = "wasm32"))]
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| BackendError::Gpu(format!("poll: {e}")))?;
        Ok(())
    }
}

fn raw(b: &Buffer) -> Result<&wgpu::Buffer> {
    match &b.storage {
        Storage::Wgpu(w) => Ok(w),
        _ => Err(BackendError::ForeignBuffer {
            label: b.label().to_string(),
        }),
    }
}

/// Error scopes resolve immediately on native backends; in a browser they resolve later, so
/// there the check is skipped and errors arrive through the uncaptured-error handler.
fn block_on_native<F: std::future::Future<Output = Option<wgpu::Error>>>(
    f: F,
) -> Option<wgpu::Error> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        pollster::block_on(f)
    }
    #[cfg(target_arch = "wasm32")]
    {
        drop(f);
        None
    }
}
