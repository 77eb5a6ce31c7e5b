//! LoRA adapters in PEFT's format, for GPT-2 and Llama: `adapter_config.json` (PEFT's
//! `LoraConfig` fields) and `adapter_model.safetensors` with `base_model.model.<module>.
//! lora_A.weight` (r, in) and `lora_B.weight` (out, r) tensors, `<module>` transformers' name
//! (`transformer.h.{i}.attn.c_attn`, `model.layers.{i}.self_attn.q_proj`, ...). GPT-2's layers are Conv1D,
//! which PEFT handles with `fan_in_fan_out = true`: that only transposes its merged update,
//! the factors keep nn.Linear's layouts, so they are [`Lora`](crate::nn::Lora)'s as they are.
//! Targets are matched as PEFT matches a list: a module whose full name is the target or ends
//! with `.target` (`c_proj` is both the attention's and the MLP's output projection).
//!
//! Everything about a file or a target is checked on the host, before any device work.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use super::config::read_json;
use super::files::convert;
use super::gpt2::{save_host, PretrainedGpt, LINEARS};
use super::llama::{save_host as save_llama_host, PretrainedLlama};
use crate::checkpoint::{parse_safetensors, HostTensor};
use crate::nn::{Gpt, GptConfig, Linear, Llama, LlamaConfig, Lora, LoraConfig, Module};
use crate::{DType, Error, Result, Tensor};

/// The adapter's weights in its folder.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// The adapter's configuration in its folder.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// What PEFT puts before a module's name in the adapter file.
const PREFIX: &str = "base_model.model.";
/// The module names a GPT-2 target may be.
const MODULES: &str = "c_attn, c_proj, c_fc (or attn.c_proj, mlp.c_proj, h.0.attn.c_attn, ...)";
/// The module names a Llama target may be.
const LLAMA_MODULES: &str =
    "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or layers.0.self_attn.q_proj, ...)";

/// A model whose Linears take LoRA adapters under transformers' module names.
pub trait LoraBase: Module {
    /// Every Linear that can take an adapter, in [`LoraBase::lora_linears`]' order.
    fn lora_modules(&self) -> Vec<Target>;
    /// The architecture's name and its module names, for errors.
    fn lora_names(&self) -> (&'static str, &'static str);
    /// The Linears by [`Target::ours`].
    fn lora_linears(&mut self) -> Result<Vec<(String, &mut Linear)>>;
    /// Detaches every parameter of the base (adapters stay trainable).
    fn freeze_base(&mut self) -> Result<()>;
    /// PEFT's `fan_in_fan_out`: whether transformers stores the targets' weights as (in, out)
    /// (GPT-2's Conv1D) rather than nn.Linear's (out, in).
    fn fan_in_fan_out(&self) -> bool;
}

impl LoraBase for Gpt {
    fn lora_modules(&self) -> Vec<Target> {
        all_modules(&self.gpt_config())
    }
    fn lora_names(&self) -> (&'static str, &'static str) {
        ("GPT-2", MODULES)
    }
    fn lora_linears(&mut self) -> Result<Vec<(String, &mut Linear)>> {
        self.linears_mut()
    }
    fn freeze_base(&mut self) -> Result<()> {
        self.freeze()
    }
    fn fan_in_fan_out(&self) -> bool {
        true
    }
}

impl LoraBase for Llama {
    fn lora_modules(&self) -> Vec<Target> {
        llama_modules(self.llama_config())
    }
    fn lora_names(&self) -> (&'static str, &'static str) {
        ("Llama", LLAMA_MODULES)
    }
    fn lora_linears(&mut self) -> Result<Vec<(String, &mut Linear)>> {
        self.linears_mut()
    }
    fn freeze_base(&mut self) -> Result<()> {
        self.freeze()
    }
    fn fan_in_fan_out(&self) -> bool {
        false
    }
}

/// A LoRA adapter's settings in PEFT's terms.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSpec {
    /// r, lora_alpha, lora_dropout.
    pub config: LoraConfig,
    /// `target_modules`: module names (PEFT's GPT-2 default is `["c_attn"]`).
    pub targets: Vec<String>,
}

impl Default for LoraSpec {
    /// PEFT's defaults for GPT-2: r 8, alpha 8, no dropout, `c_attn`.
    fn default() -> LoraSpec {
        LoraSpec {
            config: LoraConfig::default(),
            targets: vec!["c_attn".into()],
        }
    }
}

/// One adapted layer: transformers' module name, the Linear's prefix in the model, (in, out).
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// `transformer.h.{i}.attn.c_attn`, ...
    pub module: String,
    /// `blocks.{i}.attn.qkv`, ...
    pub ours: String,
    /// Input width.
    pub in_features: usize,
    /// Output width.
    pub out_features: usize,
}

/// Every Linear of a GPT-2 of `cfg` as a [`Target`], in [`Gpt::linears_mut`]'s order.
fn all_modules(cfg: &GptConfig) -> Vec<Target> {
    let c = cfg.dim;
    let mut out = Vec::new();
    for i in 0..cfg.layers {
        for (hf, ours, o, inp) in LINEARS {
            out.push(Target {
                module: format!("transformer.h.{i}.{hf}"),
                ours: format!("blocks.{i}.{ours}"),
                in_features: inp * c,
                out_features: o * c,
            });
        }
    }
    out
}

/// Every Linear of a Llama of `cfg`'s decoder layers as a [`Target`] (the model's names are
/// transformers'), in [`Llama::linears_mut`]'s order.
fn llama_modules(cfg: &LlamaConfig) -> Vec<Target> {
    let (c, hd, kvd) = (
        cfg.dim,
        cfg.heads * cfg.head_dim,
        cfg.kv_heads * cfg.head_dim,
    );
    let mut out = Vec::new();
    for i in 0..cfg.layers {
        for (name, inp, o) in [
            ("self_attn.q_proj", c, hd),
            ("self_attn.k_proj", c, kvd),
            ("self_attn.v_proj", c, kvd),
            ("self_attn.o_proj", hd, c),
            ("mlp.gate_proj", c, cfg.intermediate),
            ("mlp.up_proj", c, cfg.intermediate),
            ("mlp.down_proj", cfg.intermediate, c),
        ] {
            let module = format!("model.layers.{i}.{name}");
            out.push(Target {
                ours: module.clone(),
                module,
                in_features: inp,
                out_features: o,
            });
        }
    }
    out
}

fn matches(module: &str, target: &str) -> bool {
    module == target || module.ends_with(&format!(".{target}"))
}

/// The layers `spec` adapts in a GPT-2 of `cfg`, each checked against the rank. Errors
/// ([`Error::InvalidArgument`], before any device work): no targets, a target that matches no
/// module (naming it and the names there are), and those of [`LoraConfig::check`] for each
/// matched layer (a rank of 0 or above its smaller width).
pub fn resolve_targets(cfg: &GptConfig, spec: &LoraSpec) -> Result<Vec<Target>> {
    resolve(all_modules(cfg), ("GPT-2", MODULES), spec)
}

/// [`resolve_targets`] for a Llama of `cfg` (targets q_proj, ..., down_proj).
pub fn resolve_llama_targets(cfg: &LlamaConfig, spec: &LoraSpec) -> Result<Vec<Target>> {
    resolve(llama_modules(cfg), ("Llama", LLAMA_MODULES), spec)
}

/// [`resolve_targets`] for the model `m`.
pub fn resolve_model_targets<M: LoraBase>(m: &M, spec: &LoraSpec) -> Result<Vec<Target>> {
    resolve(m.lora_modules(), m.lora_names(), spec)
}

/// The modules of `modules` that `spec` targets, checked; `names`: the architecture and its
/// module names, for errors.
fn resolve(modules: Vec<Target>, names: (&str, &str), spec: &LoraSpec) -> Result<Vec<Target>> {
    let (arch, hint) = names;
    let bad = |reason: String| Error::InvalidArgument {
        op: "LoRA targets",
        reason,
    };
    if spec.targets.is_empty() {
        return Err(bad(format!("no target modules: name some of {hint}")));
    }
    for t in &spec.targets {
        if !modules.iter().any(|m| matches(&m.module, t)) {
            return Err(bad(format!(
                "target '{t}' matches no module of this {arch}; its LoRA-able modules are \
                 {hint}"
            )));
        }
    }
    let chosen: Vec<Target> = modules
        .into_iter()
        .filter(|m| spec.targets.iter().any(|t| matches(&m.module, t)))
        .collect();
    for m in &chosen {
        spec.config
            .check(&m.module, m.in_features, m.out_features)?;
    }
    Ok(chosen)
}

/// Freezes `gpt` (a GPT-2 or a Llama) and adds a fresh adapter (A from `seed` and the layer's
/// index, B zero) to every layer `spec` targets; returns them. Errors: those of
/// [`resolve_targets`] (before any device work) and of [`Gpt::linears_mut`].
pub fn add_lora<M: LoraBase>(gpt: &mut M, spec: &LoraSpec, seed: u64) -> Result<Vec<Target>> {
    let targets = resolve_model_targets(gpt, spec)?;
    gpt.freeze_base()?;
    for (i, (name, linear)) in gpt.lora_linears()?.into_iter().enumerate() {
        if targets.iter().any(|t| t.ours == name) {
            let s = crate::tensor::Rng::new(seed ^ (i as u64).wrapping_mul(0x9e37_79b9)).next_u64();
            linear.add_lora(&spec.config, s)?;
        }
    }
    Ok(targets)
}

/// `adapter_config.json` for `spec` over the base `base_model` (a path or hub name), whose
/// weights are stored (in, out) when `fan_in_fan_out`.
fn config_json(spec: &LoraSpec, base_model: &str, fan_in_fan_out: bool) -> Value {
    json!({
        "alpha_pattern": {},
        "auto_mapping": null,
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "inference_mode": true,
        "init_lora_weights": true,
        "layers_pattern": null,
        "layers_to_transform": null,
        "lora_alpha": spec.config.alpha,
        "lora_dropout": spec.config.dropout,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": spec.config.r,
        "rank_pattern": {},
        "revision": null,
        "target_modules": spec.targets,
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": false,
    })
}

/// Writes the adapters of `gpt` (added by [`add_lora`] or [`Adapter::apply`]) to `dir` as PEFT
/// saves them: `adapter_model.safetensors` (f32 or the parameters' dtype) and
/// `adapter_config.json`, each atomically; `dir` is created if missing. `base_model` goes in
/// the configuration's `base_model_name_or_path`. An [`Error::InvalidArgument`] when `gpt`
/// lacks an adapter `spec` targets.
pub fn save_adapter<M: LoraBase>(
    gpt: &M,
    spec: &LoraSpec,
    dir: &Path,
    base_model: &str,
) -> Result<()> {
    let targets = resolve_model_targets(gpt, spec)?;
    let params: BTreeMap<String, Tensor> = gpt.named_parameters().into_iter().collect();
    let mut host = Vec::new();
    for t in &targets {
        for f in ["lora_A", "lora_B"] {
            let p = params
                .get(&format!("{}.{f}.weight", t.ours))
                .ok_or_else(|| Error::InvalidArgument {
                    op: "save_adapter",
                    reason: format!("{} has no LoRA adapter", t.module),
                })?;
            host.push((
                format!("{PREFIX}{}.{f}.weight", t.module),
                HostTensor::read(p)?,
            ));
        }
    }
    super::files::write_safetensors(dir, ADAPTER_WEIGHTS, &host)?;
    let text = serde_json::to_string_pretty(&config_json(spec, base_model, gpt.fan_in_fan_out()))
        .expect("a JSON value serializes");
    crate::write_atomic(&dir.join(ADAPTER_CONFIG), text.as_bytes())
}

/// An adapter read from a PEFT folder and checked against a base, on the host.
#[derive(Clone, Debug)]
pub struct Adapter {
    /// Its settings.
    pub spec: LoraSpec,
    /// The layers it adapts in the base.
    pub targets: Vec<Target>,
    /// `lora_A` (r, in) and `lora_B` (out, r) f32 of each target, in order.
    pub factors: Vec<(HostTensor, HostTensor)>,
}

fn spec_from_json(cfg: &Map<String, Value>, source: &str) -> Result<LoraSpec> {
    let bad = |reason: String| Error::Data {
        path: source.to_string(),
        reason,
    };
    let get = |k: &str| cfg.get(k).filter(|v| !v.is_null());
    match get("peft_type").and_then(Value::as_str) {
        Some("LORA") => {}
        other => return Err(bad(format!("peft_type {other:?}: only LORA adapters load"))),
    }
    for k in ["use_dora", "use_rslora"] {
        if get(k).and_then(Value::as_bool) == Some(true) {
            return Err(bad(format!(
                "{k} = true: only plain LoRA (alpha / r) loads"
            )));
        }
    }
    for k in ["rank_pattern", "alpha_pattern"] {
        if get(k)
            .and_then(Value::as_object)
            .is_some_and(|m| !m.is_empty())
        {
            return Err(bad(format!(
                "{k}: per-layer ranks and alphas are not supported"
            )));
        }
    }
    for k in ["modules_to_save", "layers_to_transform", "layers_pattern"] {
        if get(k).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(bad(format!("{k} is set: only LoRA factors load")));
        }
    }
    if let Some(b) = get("bias").and_then(Value::as_str).filter(|&b| b != "none") {
        return Err(bad(format!("bias = '{b}': only bias = 'none' loads")));
    }
    let r = get("r")
        .and_then(Value::as_u64)
        .ok_or_else(|| bad("no integer r".into()))? as usize;
    let alpha = get("lora_alpha")
        .and_then(Value::as_f64)
        .ok_or_else(|| bad("no number lora_alpha".into()))? as f32;
    let dropout = get("lora_dropout").and_then(Value::as_f64).unwrap_or(0.0) as f32;
    let targets = match get("target_modules") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad("target_modules holds a non-string".into()))
            })
            .collect::<Result<Vec<_>>>()?,
        Some(Value::String(s)) => {
            return Err(bad(format!(
                "target_modules is the pattern '{s}': list the module names instead"
            )))
        }
        _ => return Err(bad("no target_modules".into())),
    };
    Ok(LoraSpec {
        config: LoraConfig { r, alpha, dropout },
        targets,
    })
}

/// Reads the PEFT adapter in `dir` and checks it against a GPT-2 of `cfg`, on the host.
///
/// Errors, before any device work: an [`Error::Io`] for a missing file; an [`Error::Data`]
/// naming the file for a configuration that is not LoRA (or uses DoRA, rsLoRA, per-layer
/// ranks, saved modules, patterns, a bias), a damaged weights file, a tensor missing, extra
/// (an adapter of another base's modules) or of another shape (another base's widths, or
/// another rank), a dtype other than F32 / F16 / BF16; the errors of [`resolve_targets`].
pub fn read_adapter(dir: &Path, cfg: &GptConfig) -> Result<Adapter> {
    read_adapter_of(dir, all_modules(cfg), ("GPT-2", MODULES))
}

/// [`read_adapter`] checked against a Llama of `cfg`.
pub fn read_llama_adapter(dir: &Path, cfg: &LlamaConfig) -> Result<Adapter> {
    read_adapter_of(dir, llama_modules(cfg), ("Llama", LLAMA_MODULES))
}

/// [`read_adapter`] against a base of `modules` (`names` for errors).
fn read_adapter_of(dir: &Path, modules: Vec<Target>, names: (&str, &str)) -> Result<Adapter> {
    let cfg_path = dir.join(ADAPTER_CONFIG);
    if !cfg_path.is_file() {
        return Err(Error::Data {
            path: dir.display().to_string(),
            reason: format!("no {ADAPTER_CONFIG}: not a PEFT adapter folder"),
        });
    }
    let spec = spec_from_json(&read_json(&cfg_path)?, &cfg_path.display().to_string())?;
    let targets = resolve(modules, names, &spec)?;
    let path = dir.join(ADAPTER_WEIGHTS);
    let source = path.display().to_string();
    let bytes = std::fs::read(&path).map_err(|e| Error::Io {
        path: source.clone(),
        source: e,
    })?;
    let (st, _) = parse_safetensors(&bytes, &source)?;
    let bad = |reason: String| Error::Data {
        path: source.clone(),
        reason,
    };
    let mut found: BTreeMap<String, HostTensor> = BTreeMap::new();
    for (name, view) in st.tensors() {
        let t = convert(view.dtype(), view.shape(), view.data(), DType::F32)
            .map_err(|r| bad(format!("tensor '{name}': {r}")))?;
        // PEFT writes the adapter's name into keys only for non-default adapters.
        found.insert(name.replace(".default.weight", ".weight"), t);
    }
    let r = spec.config.r;
    let mut factors = Vec::new();
    for t in &targets {
        let mut take = |f: &str, dims: [usize; 2]| -> Result<HostTensor> {
            let key = format!("{PREFIX}{}.{f}.weight", t.module);
            let h = found
                .remove(&key)
                .ok_or_else(|| bad(format!("no tensor '{key}' for the target {}", t.module)))?;
            if h.dims != dims {
                return Err(bad(format!(
                    "tensor '{key}' is {:?}, this base's {} with r = {r} needs {dims:?}: an \
                     adapter for another base",
                    h.dims, t.module
                )));
            }
            Ok(h)
        };
        let a = take("lora_A", [r, t.in_features])?;
        let b = take("lora_B", [t.out_features, r])?;
        factors.push((a, b));
    }
    if !found.is_empty() {
        let extra: Vec<&String> = found.keys().collect();
        return Err(bad(format!(
            "tensors {extra:?} are not LoRA factors of this base's targeted modules: an \
             adapter for another base"
        )));
    }
    Ok(Adapter {
        spec,
        targets,
        factors,
    })
}

impl Adapter {
    /// Freezes `gpt` and adds these factors (trainable, in the parameters' dtype) to its
    /// target layers. Errors: [`Error::InvalidArgument`] for a model of another shape than the
    /// one the adapter was read for, or a layer that has an adapter.
    pub fn apply<M: LoraBase>(&self, gpt: &mut M, seed: u64) -> Result<()> {
        let targets = resolve_model_targets(gpt, &self.spec)?;
        if targets != self.targets {
            return Err(Error::InvalidArgument {
                op: "Adapter::apply",
                reason: format!(
                    "the adapter was read for a {} of another shape",
                    gpt.lora_names().0
                ),
            });
        }
        gpt.freeze_base()?;
        let mut by_name: BTreeMap<&str, &(HostTensor, HostTensor)> = self
            .targets
            .iter()
            .map(|t| t.ours.as_str())
            .zip(&self.factors)
            .collect();
        for (i, (name, linear)) in gpt.lora_linears()?.into_iter().enumerate() {
            let Some((a, b)) = by_name.remove(name.as_str()) else {
                continue;
            };
            if linear.lora.is_some() {
                return Err(Error::InvalidArgument {
                    op: "Adapter::apply",
                    reason: format!("{name} already has an adapter"),
                });
            }
            let dev = linear
                .bias
                .as_ref()
                .unwrap_or(&linear.weight)
                .device()
                .clone();
            let dtype = linear.weight.dtype();
            let up = |h: &HostTensor| -> Result<Tensor> {
                let t = h.to_device(&dev)?;
                let t = if dtype == DType::F32 {
                    t
                } else {
                    t.to_dtype(dtype)?
                };
                Ok(t.detach().with_requires_grad())
            };
            let s = seed ^ (i as u64).wrapping_mul(0x9e37_79b9);
            let lora = Lora::from_factors(up(a)?, up(b)?, &self.spec.config, s)?;
            linear.lora = Some(std::sync::Arc::new(lora));
        }
        Ok(())
    }

    /// The base's weights with `scaling · B A` added to every target (f32 on the host, in
    /// f64 sums), by the model's names.
    pub fn merged_weights<B: MergeBase + ?Sized>(
        &self,
        base: &B,
    ) -> Result<BTreeMap<String, HostTensor>> {
        let mut w = base.base_weights();
        let s = self.spec.config.scaling() as f64;
        for (t, (a, b)) in self.targets.iter().zip(&self.factors) {
            let key = format!("{}.weight", t.ours);
            let h = w.get_mut(&key).ok_or_else(|| Error::InvalidArgument {
                op: "merge_adapter",
                reason: format!("the base has no '{key}'"),
            })?;
            let (a, b) = (a.to_f32(), b.to_f32());
            let mut v = h.to_f32();
            let (r, k) = (self.spec.config.r, t.in_features);
            for o in 0..t.out_features {
                for i in 0..k {
                    let d: f64 = (0..r)
                        .map(|j| b[o * r + j] as f64 * a[j * k + i] as f64)
                        .sum();
                    v[o * k + i] = (v[o * k + i] as f64 + s * d) as f32;
                }
            }
            let bytes = match h.dtype {
                DType::F32 => bytemuck::cast_slice(&v).to_vec(),
                DType::F16 => {
                    let halves: Vec<half::f16> =
                        v.iter().map(|&x| half::f16::from_f32(x)).collect();
                    bytemuck::cast_slice(&halves).to_vec()
                }
            };
            *h = HostTensor::new(h.dtype, &h.dims, bytes)?;
        }
        Ok(w)
    }
}

/// A model folder an adapter merges into: its weights on the host by the model's parameter
/// names, and a writer of a folder of its kind (a GPT-2's or a Llama's) that transformers
/// loads, with the base's tokenizer when it has one.
pub trait MergeBase {
    /// The base's weights on the host, by the model's parameter names.
    fn base_weights(&self) -> BTreeMap<String, HostTensor>;
    /// Writes `weights` (the base's names and shapes) to `dir` as a folder of the base's kind.
    fn write_folder(&self, weights: &BTreeMap<String, HostTensor>, dir: &Path) -> Result<()>;
}

impl MergeBase for PretrainedGpt {
    fn base_weights(&self) -> BTreeMap<String, HostTensor> {
        self.host_weights().clone()
    }
    fn write_folder(&self, weights: &BTreeMap<String, HostTensor>, dir: &Path) -> Result<()> {
        save_host(&self.config, weights, dir, tokenizer_bytes(&self.dir)?)
    }
}

impl MergeBase for PretrainedLlama {
    fn base_weights(&self) -> BTreeMap<String, HostTensor> {
        self.host_weights()
    }
    fn write_folder(&self, weights: &BTreeMap<String, HostTensor>, dir: &Path) -> Result<()> {
        save_llama_host(&self.config, weights, dir, tokenizer_bytes(&self.dir)?)
    }
}

/// The bytes of `dir`'s `tokenizer.json`, if it has one.
fn tokenizer_bytes(dir: &Path) -> Result<Option<Vec<u8>>> {
    let tok = dir.join(super::TOKENIZER_FILE);
    if !tok.is_file() {
        return Ok(None);
    }
    std::fs::read(&tok).map(Some).map_err(|source| Error::Io {
        path: tok.display().to_string(),
        source,
    })
}

/// Writes `base` with `adapter` merged into its weights to `dir` as a folder of the base's
/// kind that transformers loads (as [`save_gpt2`](super::save_gpt2) or
/// [`save_llama`](super::save_llama) writes one), with the base's tokenizer when it has one.
/// Host only: the merge is into the folder's weights as read, never into a quantized copy.
pub fn merge_adapter<B: MergeBase + ?Sized>(base: &B, adapter: &Adapter, dir: &Path) -> Result<()> {
    base.write_folder(&adapter.merged_weights(base)?, dir)
}

/// Reads back the adapters of `gpt` for `spec`'s targets as an [`Adapter`] (to merge them into
/// a folder after training).
pub fn adapter_of<M: LoraBase>(gpt: &M, spec: &LoraSpec) -> Result<Adapter> {
    let targets = resolve_model_targets(gpt, spec)?;
    let params: BTreeMap<String, Tensor> = gpt.named_parameters().into_iter().collect();
    let mut factors = Vec::new();
    for t in &targets {
        let get = |f: &str| -> Result<HostTensor> {
            let p = params
                .get(&format!("{}.{f}.weight", t.ours))
                .ok_or_else(|| Error::InvalidArgument {
                    op: "adapter_of",
                    reason: format!("{} has no LoRA adapter", t.module),
                })?;
            let p = if p.dtype() == DType::F32 {
                p.clone()
            } else {
                p.to_dtype(DType::F32)?
            };
            HostTensor::read(&p)
        };
        factors.push((get("lora_A")?, get("lora_B")?));
    }
    Ok(Adapter {
        spec: spec.clone(),
        targets,
        factors,
    })
}
