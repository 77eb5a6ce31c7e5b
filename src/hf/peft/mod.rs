//! LoRA adapters in PEFT's format, for GPT-2 and Llama: `adapter_config.json` (PEFT's
//! `LoraConfig` fields) and `adapter_model.safetensors` with `base_model.model.<module>.
//! lora_A.weight` (r, in) and `lora_B.weight` (out, r) tensors, `<module>` transformers' name
//! (`transformer.h.{i}.attn.c_attn`, `model.layers.{i}.self_attn.q_proj`, ...). GPT-2's layers are Conv1D,
//! which PEFT handles with `fan_in_fan_out = true`: that only transposes its merged update,
//! the factors keep nn.Linear's layouts, so they are [`Lora`](crate::nn::Lora)'s as they are.
//! Targets are matched as PEFT matches a list: a module whose full name is the target or ends
//! with `.target` (`c_proj` is both the attention's and the MLP's output projection).
//!
//! Everything about a file or a target is checked on the host, before any device work. Here:
//! the targets and saving a model's adapters; adapter.rs reads and applies a folder, merge.rs
//! merges one into its base's folder.

mod adapter;
mod merge;

pub use adapter::{read_adapter, read_llama_adapter, Adapter};
pub use merge::{merge_adapter, MergeBase};

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};

use crate::checkpoint::HostTensor;
use crate::hf::gpt2::LINEARS;
use crate::nn::{Gpt, GptConfig, Linear, Llama, LlamaConfig, LoraConfig, Module};
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
    crate::hf::files::write_safetensors(dir, ADAPTER_WEIGHTS, &host)?;
    let text = serde_json::to_string_pretty(&config_json(spec, base_model, gpt.fan_in_fan_out()))
        .expect("a JSON value serializes");
    crate::write_atomic(&dir.join(ADAPTER_CONFIG), text.as_bytes())
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
