//! The CUDA C kernels (kernels/*.cu), put together per module and compiled at run time by
//! NVRTC for the device's compute capability.

use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::result as nvrtc;

use super::launch::ModuleKey;
use crate::backend::BackendError;
use crate::options::{CudaOptions, DevHooks};
use crate::quant::GgmlType;

const COMMON: &str = include_str!("kernels/common.cuh");
const OPS: &str = include_str!("kernels/ops.cu");
const LINEAR: &str = include_str!("kernels/linear.cu");
const F32: &str = include_str!("kernels/f32.cuh");
const F16: &str = include_str!("kernels/f16.cuh");
const Q8_0: &str = include_str!("kernels/q8_0.cuh");
const Q4_0: &str = include_str!("kernels/q4_0.cuh");
const Q4_1: &str = include_str!("kernels/q4_1.cuh");
// Formats written per element (`kelem`): byte loads first, the shared 8-element step after.
macro_rules! per_element {
    ($file:literal) => {
        concat!(
            include_str!("kernels/bytes.cuh"),
            include_str!(concat!("kernels/", $file)),
            include_str!("kernels/welem.cuh"),
            include_str!("kernels/step8.cuh")
        )
    };
}
// Formats whose header also defines its own lane step (SUB, XS, load_x, row_dot).
macro_rules! own_step {
    ($file:literal) => {
        concat!(
            include_str!("kernels/bytes.cuh"),
            include_str!(concat!("kernels/", $file)),
            include_str!("kernels/welem.cuh")
        )
    };
}
const Q5_0: &str = own_step!("q5_0.cuh");
const Q5_1: &str = per_element!("q5_1.cuh");
const Q2_K: &str = per_element!("q2_k.cuh");
const Q3_K: &str = per_element!("q3_k.cuh");
const Q4_K: &str = own_step!("q4_k.cuh");
const Q5_K: &str = per_element!("q5_k.cuh");
const Q6_K: &str = own_step!("q6_k.cuh");

fn format_header(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => F32,
        GgmlType::F16 => F16,
        GgmlType::Q8_0 => Q8_0,
        GgmlType::Q4_0 => Q4_0,
        GgmlType::Q4_1 => Q4_1,
        GgmlType::Q5_0 => Q5_0,
        GgmlType::Q5_1 => Q5_1,
        GgmlType::Q2_K => Q2_K,
        GgmlType::Q3_K => Q3_K,
        GgmlType::Q4_K => Q4_K,
        GgmlType::Q5_K => Q5_K,
        GgmlType::Q6_K => Q6_K,
    }
}

/// What the source of a module depends on besides its key: one compiled module per variant
/// and architecture.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct Variant {
    /// The 4-bit matrix-vector kernels keep activations in f32 instead of int8 with dp4a.
    pub(crate) f32_activations: bool,
    /// A folder whose kernel files replace the built-in ones (a development hook).
    pub(crate) kernels: Option<PathBuf>,
}

impl Variant {
    pub(crate) fn new(cuda: &CudaOptions, dev: &DevHooks) -> Variant {
        Variant {
            f32_activations: !cuda.int8_dot,
            kernels: dev.cuda_kernels().map(PathBuf::from),
        }
    }
}

/// The whole source of one module: the shared header, the format's header where the module
/// reads weights, then the kernels.
pub(crate) fn source(key: ModuleKey, v: &Variant) -> String {
    let common = overridden(v, "common.cuh", COMMON);
    match key {
        ModuleKey::Ops => format!("{common}\n{}", overridden(v, "ops.cu", OPS)),
        ModuleKey::Weights(ty) => format!(
            "{}{common}\n{}\n{}",
            activation_define(v),
            overridden(
                v,
                &format!("{}.cuh", ty.name().to_ascii_lowercase()),
                format_header(ty)
            ),
            overridden(v, "linear.cu", LINEAR)
        ),
    }
}

/// The 4-bit matrix-vector kernels round each lane step's activations to int8 and sum with
/// dp4a unless told to keep them in f32 (`CudaOptions::int8_dot`, for comparisons on a GPU
/// machine).
fn activation_define(v: &Variant) -> &'static str {
    if v.f32_activations {
        "#define CAIRN_F32_ACTIVATIONS\n"
    } else {
        ""
    }
}

/// Kernel work on a GPU machine without rebuilding: where the variant names a folder (only
/// builds with the `dev-hooks` feature let it), its copy of a kernel file replaces the
/// built-in one (a missing file keeps the built-in).
fn overridden(v: &Variant, file: &str, builtin: &str) -> String {
    let Some(dir) = &v.kernels else {
        return builtin.to_string();
    };
    from_folder(dir, file).unwrap_or_else(|| builtin.to_string())
}

#[cfg(feature = "dev-hooks")]
fn from_folder(dir: &std::path::Path, file: &str) -> Option<String> {
    let path = dir.join(file);
    let s = std::fs::read_to_string(&path).ok()?;
    tracing::info!(path = %path.display(), "cuda kernel source from the kernel folder (dev hook)");
    Some(s)
}

/// Release builds never read kernel source from disk.
#[cfg(not(feature = "dev-hooks"))]
fn from_folder(_dir: &std::path::Path, _file: &str) -> Option<String> {
    None
}

pub(crate) fn module_name(key: ModuleKey) -> String {
    match key {
        ModuleKey::Ops => "cairn_ops.cu".into(),
        ModuleKey::Weights(ty) => format!("cairn_linear_{}.cu", ty.name().to_ascii_lowercase()),
    }
}

/// The architectures (as 10 * major + minor) this libnvrtc can compile for.
pub(crate) fn supported_archs() -> Vec<i32> {
    use cudarc::nvrtc::sys;
    let mut n: std::ffi::c_int = 0;
    // SAFETY: writes one int.
    if unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) } != sys::nvrtcResult::NVRTC_SUCCESS
        || n <= 0
    {
        return Vec::new();
    }
    let mut archs = vec![0 as std::ffi::c_int; n as usize];
    // SAFETY: `archs` holds the `n` ints the call writes.
    if unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) } != sys::nvrtcResult::NVRTC_SUCCESS
    {
        return Vec::new();
    }
    archs
}

/// The newest architecture NVRTC supports that the device runs: PTX for an older virtual
/// architecture runs on newer devices, never the other way round.
pub(crate) fn target_arch(device: (i32, i32), supported: &[i32]) -> Option<(i32, i32)> {
    let want = device.0 * 10 + device.1;
    supported
        .iter()
        .copied()
        .filter(|a| *a <= want)
        .max()
        .map(|a| (a / 10, a % 10))
}

/// NVRTC options: PTX for the device's own virtual architecture, precise division and square
/// root (the kernels are compared against the CPU reference), fused multiply-add allowed.
pub(crate) fn options(cc: (i32, i32)) -> Vec<String> {
    vec![
        format!("--gpu-architecture=compute_{}{}", cc.0, cc.1),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--fmad=true".into(),
    ]
}

/// Stack for the compiling thread: NVRTC is an LLVM-based compiler whose stack needs are not
/// documented, and test and runtime threads have 2 MiB.
const COMPILER_STACK: usize = 64 << 20;

/// `key`'s PTX for `cc`, compiled once per process: every device of that architecture (and
/// every test opening a fresh device) shares it. Compilations are serialised, one at a time
/// on a thread with a large stack.
pub(crate) fn ptx(
    key: ModuleKey,
    cc: (i32, i32),
    v: &Variant,
) -> Result<std::sync::Arc<Vec<u8>>, BackendError> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};
    type Cache = Mutex<HashMap<(ModuleKey, (i32, i32), Variant), Arc<Vec<u8>>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // Held across the compilation on purpose: one NVRTC compilation at a time.
    let mut c = cache
        .lock()
        .map_err(|_| BackendError::Gpu("nvrtc: cache lock poisoned".into()))?;
    let entry = (key, cc, v.clone());
    if let Some(p) = c.get(&entry) {
        return Ok(p.clone());
    }
    let variant = v.clone();
    let compiled = std::thread::Builder::new()
        .name("cairn-nvrtc".into())
        .stack_size(COMPILER_STACK)
        .spawn(move || compile(key, cc, &variant))
        .map_err(|e| BackendError::Gpu(format!("nvrtc: starting the compiler thread: {e}")))?
        .join()
        .map_err(|_| BackendError::Gpu("nvrtc: the compiler thread panicked".into()))??;
    let p = Arc::new(compiled);
    c.insert(entry, p.clone());
    Ok(p)
}

/// Compiles `key`'s module to NUL-terminated PTX.
pub(crate) fn compile(
    key: ModuleKey,
    cc: (i32, i32),
    v: &Variant,
) -> Result<Vec<u8>, BackendError> {
    let name = module_name(key);
    let err =
        |what: &str, e: nvrtc::NvrtcError| BackendError::Gpu(format!("nvrtc {what} {name}: {e:?}"));
    let src = CString::new(source(key, v))
        .map_err(|_| BackendError::Gpu(format!("nvrtc: {name} contains a NUL byte")))?;
    let cname = CString::new(name.clone())
        .map_err(|_| BackendError::Gpu("nvrtc: bad module name".into()))?;
    let prog = nvrtc::create_program(&src, Some(&cname)).map_err(|e| err("create", e))?;
    let opts = options(cc);
    // SAFETY: `prog` is a live program until destroyed below; options are plain strings.
    let compiled = unsafe { nvrtc::compile_program(prog, &opts) };
    let out = match compiled {
        Ok(()) => {
            // SAFETY: the program compiled.
            unsafe { nvrtc::get_ptx(prog) }
                .map(|ptx| {
                    let mut bytes: Vec<u8> = ptx.into_iter().map(|c| c as u8).collect();
                    if bytes.last() != Some(&0) {
                        bytes.push(0);
                    }
                    bytes
                })
                .map_err(|e| err("get_ptx", e))
        }
        Err(e) => {
            // SAFETY: the log of a live program; its buffer holds a NUL-terminated string.
            let log = unsafe { nvrtc::get_program_log(prog) }
                .ok()
                .map(|l| {
                    let bytes: Vec<u8> = l.into_iter().map(|c| c as u8).collect();
                    CStr::from_bytes_until_nul(&bytes)
                        .map(|s| s.to_string_lossy().into_owned())
                        .unwrap_or_default()
                })
                .unwrap_or_default();
            Err(BackendError::Gpu(format!(
                "nvrtc compile {name} ({}): {e:?}\n{log}",
                opts.join(" ")
            )))
        }
    };
    // SAFETY: destroys the program created above, once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_weight_module_has_its_format_and_the_weight_kernels() {
        for ty in GgmlType::ALL {
            let s = source(ModuleKey::Weights(ty), &Variant::default());
            assert!(s.contains("#define SUB"), "{ty:?}");
            for k in ["linear_matvec", "linear_matmat", "embed"] {
                assert!(s.contains(&format!("{k}(")), "{ty:?} lacks {k}");
            }
        }
        let ops = source(ModuleKey::Ops, &Variant::default());
        for k in [
            "matmul",
            "rmsnorm",
            "rope",
            "softmax",
            "silu_mul",
            "gelu_mul",
            "scale_cap",
            "add_bias",
            "add",
            "attention",
            "kv_store",
            "paged_attention",
            "paged_attention_split",
            "argmax",
            "sample",
            "copy_words",
        ] {
            assert!(ops.contains(&format!("{k}(")), "ops lacks {k}");
        }
        assert_eq!(
            module_name(ModuleKey::Weights(GgmlType::Q4_1)),
            "cairn_linear_q4_1.cu"
        );
        assert_eq!(options((9, 0))[0], "--gpu-architecture=compute_90");
    }

    /// `int8_dot: false` reaches the source as the define the 4-bit kernels test; only the
    /// weight modules get it.
    #[test]
    fn the_activation_option_selects_the_f32_kernels() {
        let f32 = Variant::new(
            &CudaOptions {
                int8_dot: false,
                ..Default::default()
            },
            &DevHooks::default(),
        );
        let define = "#define CAIRN_F32_ACTIVATIONS";
        let q4 = ModuleKey::Weights(GgmlType::Q4_0);
        assert!(source(q4, &f32).starts_with(define));
        assert!(!source(q4, &Variant::default()).contains(define));
        assert!(!source(ModuleKey::Ops, &f32).contains(define));
        assert_ne!(
            f32,
            Variant::default(),
            "variants must not share compiled modules"
        );
    }

    /// A kernel folder replaces the files it holds, and only in builds with `dev-hooks`.
    #[test]
    fn a_kernel_folder_replaces_its_files_only_with_dev_hooks() {
        let dir = std::env::temp_dir().join(format!("cairn-cuda-kernels-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ops.cu"), "// replaced ops\n").unwrap();
        let v = Variant::new(
            &CudaOptions::default(),
            &DevHooks {
                cuda_kernels: Some(dir.clone()),
            },
        );
        let ops = source(ModuleKey::Ops, &v);
        let linear = source(ModuleKey::Weights(GgmlType::F32), &v);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(ops.contains("// replaced ops"), DevHooks::COMPILED);
        assert_eq!(ops.contains("copy_words("), !DevHooks::COMPILED);
        assert!(
            linear.contains("linear_matvec("),
            "a file the folder lacks stays built in"
        );
    }

    #[test]
    fn the_target_is_the_newest_supported_arch_the_device_runs() {
        let archs = [75, 80, 86, 89, 90, 100, 120];
        assert_eq!(target_arch((9, 0), &archs), Some((9, 0)));
        assert_eq!(target_arch((8, 7), &archs), Some((8, 6)));
        assert_eq!(target_arch((12, 1), &archs), Some((12, 0)));
        assert_eq!(target_arch((6, 1), &archs), None);
    }

    /// NVRTC needs no GPU: where libnvrtc can be opened, every module compiles for the oldest
    /// and the newest architecture Cairn cares about.
    #[test]
    fn every_module_compiles_where_nvrtc_is_present() {
        if !super::super::driver::nvrtc_present() {
            eprintln!("libnvrtc not found; skipped");
            return;
        }
        let mut keys = vec![ModuleKey::Ops];
        for ty in GgmlType::ALL {
            keys.push(ModuleKey::Weights(ty));
        }
        let archs = supported_archs();
        assert!(!archs.is_empty());
        let oldest = archs.iter().min().map(|a| (a / 10, a % 10)).unwrap();
        for key in keys {
            for cc in [oldest, (9, 0)] {
                let ptx = compile(key, cc, &Variant::default()).unwrap_or_else(|e| panic!("{e}"));
                let text = String::from_utf8_lossy(&ptx);
                assert!(
                    text.contains(".entry"),
                    "{key:?} {cc:?}: no kernel in the PTX"
                );
            }
        }
    }
}
