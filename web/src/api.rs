//! The package on its own: open the engine on the page's WebGPU (or the CPU), run a kernel,
//! or load a GGUF model over HTTP range requests and generate from it.
//!
//! ```js
//! import init, { Engine } from "./pkg/cairn_web.js";
//! await init();
//! const engine = await Engine.open();          // WebGPU where present, else the CPU
//! const c = await engine.matmul(a, b, m, k, n); // Float32Array, m×n
//! const model = await engine.loadModel("/models/SmolLM2-135M-Instruct.Q4_1.gguf");
//! const text = await model.generate("1, 2, 3,", 8);
//! ```

use std::rc::Rc;
use std::sync::Arc;

use cairn_engine::backend::Device;
use cairn_engine::kernels::{MatMul, Op, SampleParams};
use cairn_engine::model::Shard;
use cairn_engine::model::generate::{GenerateOptions, generate};
use cairn_engine::model::shard::DEFAULT_MAX_BATCH;
use cairn_engine::tokenizer::Tokenizer;
use cairn_engine::{BackendKind, Selection, Support};
use js_sys::Promise;
use wasm_bindgen::prelude::*;
use wasm_bindgen_futures::future_to_promise;

use crate::fetch;

fn js_err(e: impl std::fmt::Display) -> JsValue {
    JsError::new(&e.to_string()).into()
}

/// Compares this build's SIMD CPU kernels (simd128 where the package was built with it)
/// with the scalar reference: the browser's own check, since wasm tests have no harness in
/// a page. Says which instruction sets it compared and how many results ("simd128: N
/// comparisons, T of them prefill tiles").
#[wasm_bindgen(js_name = checkCpuKernels)]
pub fn check_cpu_kernels() -> Result<String, JsValue> {
    let check = cairn_engine::backend::cpu::check_kernels().map_err(js_err)?;
    let isas = if check.isas.is_empty() {
        "scalar only".to_owned()
    } else {
        check.isas.join(", ")
    };
    Ok(format!(
        "{isas}: {} comparisons, {} of them prefill tiles",
        check.comparisons, check.tiles
    ))
}

/// Compares the matrix-vector kernels of every family the page's WebGPU adapter can run
/// (`rows`, `stream`, `subgroup`, `int8`) with the reference on the CPU: what the native kernel
/// tests do, in the browser's own WGSL compiler. Resolves to "FAMILIES: N comparisons on
/// ADAPTER"; rejects naming the first product that differs, or when there is no adapter.
#[wasm_bindgen(js_name = checkGpuKernels)]
pub fn check_gpu_kernels() -> Promise {
    future_to_promise(async move {
        let discovery = cairn_engine::discover().await;
        let info = discovery
            .devices
            .iter()
            .find(|d| d.backend == BackendKind::Wgpu && d.support != Support::Unsupported)
            .cloned()
            .ok_or_else(|| js_err("no WebGPU adapter in this browser"))?;
        drop(discovery);
        let options = cairn_engine::EngineOptions::default();
        let check = cairn_engine::backend::wgpu::check::check_matvec_kernels(&options, &info.id)
            .await
            .map_err(js_err)?;
        Ok(JsValue::from_str(&format!(
            "{}: {} comparisons on {}",
            check.families.join(", "),
            check.comparisons,
            if info.name.is_empty() {
                &info.id
            } else {
                &info.name
            }
        )))
    })
}

/// The engine on one device.
#[wasm_bindgen]
pub struct Engine {
    device: Arc<Device>,
}

#[wasm_bindgen]
impl Engine {
    /// Opens `backend` (`"webgpu"` or `"cpu"`), or WebGPU where the browser has it and the
    /// CPU otherwise. Software WebGPU adapters are used too: the page asked for WebGPU.
    pub async fn open(backend: Option<String>) -> Result<Engine, JsValue> {
        let discovery = cairn_engine::discover().await;
        let want_cpu = backend
            .as_deref()
            .is_some_and(|b| b.eq_ignore_ascii_case("cpu"));
        let gpu = discovery
            .devices
            .iter()
            .find(|d| d.backend == BackendKind::Wgpu && d.support != Support::Unsupported)
            .cloned();
        let device = match gpu {
            Some(info) if !want_cpu => discovery.open_info(info).await.map_err(js_err)?,
            None if backend
                .as_deref()
                .is_some_and(|b| !b.eq_ignore_ascii_case("cpu")) =>
            {
                return Err(js_err("no WebGPU adapter in this browser"));
            }
            _ => discovery
                .open(&Selection {
                    backend: Some("cpu".into()),
                    device: None,
                })
                .await
                .map_err(js_err)?,
        };
        Ok(Engine {
            device: Arc::new(device),
        })
    }

    /// `wgpu` or `cpu`.
    #[wasm_bindgen(getter)]
    pub fn backend(&self) -> String {
        self.device.kind().name().to_owned()
    }

    /// The device's name.
    #[wasm_bindgen(getter)]
    pub fn name(&self) -> String {
        self.device.info().name.clone()
    }

    /// Everything the engine knows about the device, as JSON.
    #[wasm_bindgen(js_name = deviceInfo)]
    pub fn device_info(&self) -> String {
        serde_json::to_string(self.device.info()).unwrap_or_default()
    }

    /// `c = a · b` with `a` m×k and `b` k×n (row-major f32): the engine's matmul kernel.
    /// Resolves to a `Float32Array` of m×n.
    pub fn matmul(&self, a: Vec<f32>, b: Vec<f32>, m: u32, k: u32, n: u32) -> Promise {
        let device = Arc::clone(&self.device);
        future_to_promise(async move {
            let (mu, ku, nu) = (m as usize, k as usize, n as usize);
            if a.len() != mu * ku || b.len() != ku * nu {
                return Err(js_err(format!(
                    "matmul: a has {} values and b {}, expected {} and {}",
                    a.len(),
                    b.len(),
                    mu * ku,
                    ku * nu
                )));
            }
            let ab = device
                .upload("a", bytemuck::cast_slice(&a))
                .map_err(js_err)?;
            let bb = device
                .upload("b", bytemuck::cast_slice(&b))
                .map_err(js_err)?;
            let cb = device.alloc("c", (mu * nu * 4) as u64).map_err(js_err)?;
            device
                .run(&[Op::MatMul(MatMul {
                    a: &ab,
                    b: &bb,
                    c: &cb,
                    m,
                    n,
                    k,
                })])
                .map_err(js_err)?;
            let c = device.read_f32(&cb).await.map_err(js_err)?;
            Ok(js_sys::Float32Array::from(&c[..]).into())
        })
    }

    /// Loads the whole model at `url` (a GGUF served with range requests; pieces are kept in
    /// Cache Storage). Resolves to a [`Model`].
    #[wasm_bindgen(js_name = loadModel)]
    pub fn load_model(&self, url: String) -> Promise {
        let device = Arc::clone(&self.device);
        future_to_promise(async move {
            let header = fetch::fetch_header(&url, None).await.map_err(js_err)?;
            let spec = header.file.tokenizer_spec().map_err(js_err)?;
            let tokenizer = Tokenizer::from_spec(&spec).map_err(js_err)?;
            let n_layers = cairn_engine::model::ModelConfig::from_gguf(&header.file)
                .map_err(js_err)?
                .n_layers;
            let (bytes, _) = fetch::fetch_shard(&url, &header, 0, n_layers)
                .await
                .map_err(js_err)?;
            let src = bytes.into_source(header.file.clone());
            let shard = Shard::load(
                device.clone(),
                &src,
                0,
                n_layers,
                DEFAULT_MAX_BATCH,
                &mut |_, _| {},
            )
            .map_err(js_err)?;
            device.sync().await.map_err(js_err)?;
            Ok(Model {
                inner: Rc::new(ModelInner { shard, tokenizer }),
            }
            .into())
        })
    }
}

struct ModelInner {
    shard: Shard,
    tokenizer: Tokenizer,
}

/// A whole model loaded on an [`Engine`]'s device.
#[wasm_bindgen]
pub struct Model {
    inner: Rc<ModelInner>,
}

#[wasm_bindgen]
impl Model {
    /// Layers in the model.
    #[wasm_bindgen(getter)]
    pub fn layers(&self) -> u32 {
        self.inner.shard.config().n_layers as u32
    }

    /// Tokens `prompt` encodes to (as `generate` takes it): for benchmarks that time a
    /// prompt's prefill.
    #[wasm_bindgen(js_name = countTokens)]
    pub fn count_tokens(&self, prompt: String) -> Result<u32, JsValue> {
        let ids = self
            .inner
            .tokenizer
            .encode_prompt(&prompt, true)
            .map_err(js_err)?;
        Ok(ids.len() as u32)
    }

    /// Greedy continuation of `prompt` (taken as raw text, no chat template), up to
    /// `max_tokens` tokens. Resolves to the generated text.
    pub fn generate(&self, prompt: String, max_tokens: u32) -> Promise {
        let inner = Rc::clone(&self.inner);
        future_to_promise(async move {
            let ids = inner
                .tokenizer
                .encode_prompt(&prompt, true)
                .map_err(js_err)?;
            let opts = GenerateOptions {
                max_tokens: max_tokens as usize,
                sample: SampleParams::default(),
                stop_at_eog: true,
            };
            let (out, _) = generate(&inner.shard, &inner.tokenizer, &ids, &opts, &mut |_| {})
                .await
                .map_err(js_err)?;
            let text = inner.tokenizer.decode(&out).map_err(js_err)?;
            Ok(JsValue::from_str(&text))
        })
    }
}
