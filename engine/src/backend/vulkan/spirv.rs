//! The same WGSL kernels as SPIR-V, compiled by naga with this backend's choices and handed
//! to the driver through wgpu's passthrough (no second validation, no bounds checks).
//!
//! Changes against what wgpu's own WGSL path produces:
//! - the parameters at binding 0 are a uniform with a dynamic offset, so one bind group per
//!   set of buffers serves every step whatever its parameters; or, with
//!   `VulkanOptions::push_constants` (`--vulkan-push-constants`), push constants (naga's `Immediate` address space), which
//!   the kernels read as zeros on lavapipe and on the H100 alike (not yet understood), so they
//!   are off by default;
//! - no bounds checks and no loop-bounding or division guards: the kernels index within
//!   shapes that `validate_op` has already checked against the buffers' sizes;
//! - `linear_matvec` is replaced by its subgroup twin where the device has subgroups.

use cairn_shaders::Kernel;
use naga::back::spv;
use naga::valid::{Capabilities, ValidationFlags, Validator};

use crate::backend::wgpu::{Compiled, PARAM_BYTES, ParamMode};
use crate::backend::{BackendError, Result};

/// Compiles kernels for one device.
#[derive(Debug, Clone)]
pub(crate) struct SpirvKernels {
    /// The device has wgpu's SUBGROUP feature (basic, vote, arithmetic, ballot and shuffle
    /// operations in compute shaders), so subgroup kernel variants may be used.
    pub(crate) subgroups: bool,
    /// Parameters as push constants instead of a dynamic-offset uniform.
    pub(crate) push_constants: bool,
    /// The device was opened with cooperative matrices and f16 (`WgpuPrefill::Coop`), so
    /// `linear_gemm_coop` may be used.
    pub(crate) coop: bool,
    /// How workgroup memory is zeroed (naga's polyfill, the driver, or not at all:
    /// `VulkanOptions::zero_init`, resolved for the device).
    pub(crate) zero_init: spv::ZeroInitializeWorkgroupMemoryMode,
    /// Parameters at a fixed uniform offset in each bind group, as the wgpu backend binds
    /// them, instead of a dynamic offset (`VulkanOptions::fixed_params`).
    pub(crate) fixed_params: bool,
}

/// A kernel translated to SPIR-V, with what its pipeline layout needs.
pub(crate) struct SpirvModule {
    pub(crate) words: Vec<u32>,
    pub(crate) workgroup_size: [u32; 3],
    /// `(binding, read_only)` of every storage buffer, in binding order.
    pub(crate) storage: Vec<(u32, bool)>,
}

fn compile_error(label: &str, what: impl std::fmt::Display) -> BackendError {
    BackendError::Gpu(format!("compiling {label} to SPIR-V: {what}"))
}

impl SpirvKernels {
    /// The kernel this device runs for `kernel`.
    fn variant(&self, kernel: Kernel) -> Kernel {
        if self.subgroups && kernel == cairn_shaders::LINEAR_MATVEC {
            cairn_shaders::LINEAR_MATVEC_SUBGROUP
        } else {
            kernel
        }
    }

    /// WGSL to SPIR-V for `kernel` (joined with the weight `format` it takes).
    pub(crate) fn translate(
        &self,
        kernel: Kernel,
        format: Option<&str>,
        shape: cairn_shaders::WideShape,
    ) -> Result<SpirvModule> {
        let kernel = self.variant(kernel);
        let label = format!(
            "{}{}",
            kernel.name,
            format.map(|f| format!("_{f}")).unwrap_or_default()
        );
        let src = cairn_shaders::source_shaped(kernel, format, shape).ok_or_else(|| {
            BackendError::Unsupported(format!("{}: no kernel for format {format:?}", kernel.name))
        })?;
        let mut module = naga::front::wgsl::parse_str(&src)
            .map_err(|e| compile_error(&label, e.emit_to_string(&src)))?;

        let mut storage = Vec::new();
        let mut params = 0;
        for (_, var) in module.global_variables.iter_mut() {
            match (var.space, &var.binding) {
                (naga::AddressSpace::Uniform, Some(b)) if b.group == 0 && b.binding == 0 => {
                    if self.push_constants {
                        var.space = naga::AddressSpace::Immediate;
                        var.binding = None;
                    }
                    params += 1;
                }
                (naga::AddressSpace::Storage { access }, Some(b)) if b.group == 0 => {
                    storage.push((b.binding, !access.contains(naga::StorageAccess::STORE)));
                }
                (_, Some(b)) => {
                    return Err(compile_error(
                        &label,
                        format!(
                            "unexpected resource at group {} binding {}",
                            b.group, b.binding
                        ),
                    ));
                }
                _ => {}
            }
        }
        if params != 1 {
            return Err(compile_error(
                &label,
                "expected one uniform Params at binding 0",
            ));
        }
        storage.sort_unstable();

        let caps = Capabilities::IMMEDIATES
            | Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | if self.subgroups {
                Capabilities::SUBGROUP
            } else {
                Capabilities::empty()
            }
            | if self.coop {
                Capabilities::COOPERATIVE_MATRIX | Capabilities::SHADER_FLOAT16
            } else {
                Capabilities::empty()
            };
        let info = Validator::new(ValidationFlags::all(), caps)
            .validate(&module)
            .map_err(|e| compile_error(&label, e.emit_to_string(&src)))?;
        let entry = module
            .entry_points
            .iter()
            .find(|e| e.name == "main")
            .ok_or_else(|| compile_error(&label, "no `main` entry point"))?;
        let workgroup_size = entry.workgroup_size;

        let options = spv::Options {
            // SPIR-V 1.3 is what Vulkan 1.1 accepts, and has the subgroup instructions.
            lang_version: (1, 3),
            flags: spv::WriterFlags::empty(),
            // Keep the WGSL @group/@binding numbers.
            fake_missing_bindings: true,
            bounds_check_policies: naga::proc::BoundsCheckPolicies::default(),
            force_loop_bounding: false,
            emit_int_div_checks: false,
            zero_initialize_workgroup_memory: self.zero_init,
            ..Default::default()
        };
        let pipeline = spv::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: "main".into(),
        };
        let words = spv::write_vec(&module, &info, &options, Some(&pipeline))
            .map_err(|e| compile_error(&label, e))?;
        Ok(SpirvModule {
            words,
            workgroup_size,
            storage,
        })
    }

    /// The kernel as a pipeline on `device`, parameters in push constants.
    pub(crate) fn compile(
        &self,
        device: &wgpu::Device,
        kernel: Kernel,
        format: Option<&'static str>,
        shape: cairn_shaders::WideShape,
    ) -> Result<Compiled> {
        let m = self.translate(kernel, format, shape)?;
        let label = format!(
            "{}{} (spir-v)",
            self.variant(kernel).name,
            format.map(|f| format!("_{f}")).unwrap_or_default()
        );
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let [x, y, z] = m.workgroup_size;
        // SAFETY: the SPIR-V was just produced by naga from a module that naga validated, for
        // the capabilities this device was opened with (subgroups only when it has them);
        // its resources match the pipeline layout built below from the same module.
        let module = unsafe {
            device.create_shader_module_passthrough(wgpu::ShaderModuleDescriptorPassthrough {
                label: Some(&label),
                entry_points: vec![wgpu::PassthroughShaderEntryPoint {
                    name: "main".into(),
                    workgroup_size: (x, y, z),
                }]
                .into(),
                spirv: Some(m.words.into()),
                ..Default::default()
            })
        };
        let uniform = (!self.push_constants).then_some(wgpu::BindGroupLayoutEntry {
            binding: 0,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: !self.fixed_params,
                min_binding_size: wgpu::BufferSize::new(u64::from(PARAM_BYTES)),
            },
            count: None,
        });
        let storage = m
            .storage
            .iter()
            .map(|&(binding, read_only)| wgpu::BindGroupLayoutEntry {
                binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            });
        let entries: Vec<wgpu::BindGroupLayoutEntry> = uniform.into_iter().chain(storage).collect();
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some(&label),
            entries: &entries,
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(&label),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: if self.push_constants { PARAM_BYTES } else { 0 },
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&label),
            layout: Some(&pipeline_layout),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(BackendError::Gpu(format!("compiling {label}: {e}")));
        }
        Ok(Compiled {
            pipeline,
            layout,
            params: if self.push_constants {
                ParamMode::Immediates
            } else if self.fixed_params {
                ParamMode::Uniform
            } else {
                ParamMode::DynamicUniform
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packed-integer kernels reach the driver as Vulkan's integer dot product (`OpSDot`,
    /// not naga's shifts-and-multiplies polyfill: naga writes it when no capability list holds
    /// it back, as here), and without SPIR-V's Int8 capability, which wgpu does not enable on
    /// the devices it opens (naga's `pack4xI8` needs it; the wide walk packs bytes itself).
    #[test]
    fn packed_dot_kernels_use_opsdot_without_int8() {
        const OP_CAPABILITY: u32 = 17;
        const OP_SDOT: u32 = 4450;
        const CAPABILITY_INT8: u32 = 39;
        let k = SpirvKernels {
            subgroups: true,
            push_constants: false,
            coop: false,
            zero_init: spv::ZeroInitializeWorkgroupMemoryMode::Polyfill,
            fixed_params: false,
        };
        for kernel in [
            cairn_shaders::LINEAR_MATVEC_STREAM_I8_SUBGROUP,
            cairn_shaders::LINEAR_MATVEC_WIDE_I8,
            cairn_shaders::LINEAR_MATVEC_FUSED_WIDE_I8,
        ] {
            for format in ["Q4_1", "Q8_0"] {
                let m = k
                    .translate(kernel, Some(format), Default::default())
                    .expect("translate");
                let (mut sdot, mut caps, mut i) = (0, Vec::new(), 5);
                while i < m.words.len() {
                    let (len, op) = ((m.words[i] >> 16) as usize, m.words[i] & 0xffff);
                    if op == OP_SDOT {
                        sdot += 1;
                    }
                    if op == OP_CAPABILITY {
                        caps.push(m.words[i + 1]);
                    }
                    i += len.max(1);
                }
                assert!(sdot >= 2, "{} {format}: {sdot} OpSDot", kernel.name);
                assert!(
                    !caps.contains(&CAPABILITY_INT8),
                    "{} {format}: Int8",
                    kernel.name
                );
            }
        }
    }

    /// The wide walk translates in every kind of shape it takes (one and several row groups,
    /// one to eight chunks in flight, the smallest and largest workgroups), plain and fused,
    /// on f32 and on packed integers; shapes outside the ranges are refused, not compiled.
    #[test]
    fn wide_walk_shapes_translate() {
        let k = SpirvKernels {
            subgroups: true,
            push_constants: false,
            coop: false,
            zero_init: spv::ZeroInitializeWorkgroupMemoryMode::Polyfill,
            fixed_params: false,
        };
        let shapes = [
            (4, 32, 1),
            (8, 256, 4),
            (12, 64, 3),
            (16, 128, 8),
            (8, 1024, 1),
        ];
        for (rows, wg, unroll) in shapes {
            let shape = cairn_shaders::WideShape { rows, wg, unroll };
            for kernel in [
                cairn_shaders::LINEAR_MATVEC_WIDE,
                cairn_shaders::LINEAR_MATVEC_WIDE_I8,
                cairn_shaders::LINEAR_MATVEC_FUSED_WIDE,
                cairn_shaders::LINEAR_MATVEC_FUSED_WIDE_I8,
            ] {
                for format in cairn_shaders::formats(kernel).into_iter().take(3) {
                    if let Err(e) = k.translate(kernel, format, shape) {
                        panic!("{} {format:?} {shape:?}: {e}", kernel.name);
                    }
                }
            }
        }
        for (rows, wg, unroll) in [(6, 64, 1), (8, 48, 1), (8, 2048, 1), (8, 64, 0), (8, 64, 9)] {
            let shape = cairn_shaders::WideShape { rows, wg, unroll };
            assert!(
                k.translate(cairn_shaders::LINEAR_MATVEC_WIDE, Some("Q4_1"), shape)
                    .is_err(),
                "{shape:?} was taken"
            );
        }
    }

    /// Every kernel and format translates, with and without subgroups, and keeps its storage
    /// bindings; no device needed.
    #[test]
    fn every_kernel_translates_to_spirv() {
        for (subgroups, push_constants, coop) in [
            (false, false, false),
            (true, false, false),
            (true, true, false),
            (true, false, true),
        ] {
            let k = SpirvKernels {
                subgroups,
                push_constants,
                coop,
                zero_init: spv::ZeroInitializeWorkgroupMemoryMode::None,
                fixed_params: false,
            };
            for kernel in cairn_shaders::ALL {
                if (!subgroups
                    && (kernel.subgroups || *kernel == cairn_shaders::LINEAR_MATVEC_SUBGROUP))
                    || (kernel.coop.is_some() && !coop)
                {
                    continue;
                }
                let formats = cairn_shaders::formats(*kernel);
                for format in formats {
                    let m = match k.translate(*kernel, format, Default::default()) {
                        Ok(m) => m,
                        Err(e) => panic!("{} {format:?} subgroups={subgroups}: {e}", kernel.name),
                    };
                    assert_eq!(m.words[0], 0x0723_0203, "SPIR-V magic");
                    if let Some(dir) = std::env::var_os("CAIRN_DUMP_SPIRV") {
                        let name = format!(
                            "{}_{}_{subgroups}.spv",
                            kernel.name,
                            format.unwrap_or("none")
                        );
                        let bytes: Vec<u8> = m.words.iter().flat_map(|w| w.to_le_bytes()).collect();
                        let _ = std::fs::write(std::path::Path::new(&dir).join(name), bytes);
                    }
                    assert!(!m.storage.is_empty(), "{}: no storage buffers", kernel.name);
                    assert!(m.storage.iter().all(|(b, _)| *b >= 1));
                }
            }
        }
    }
}
