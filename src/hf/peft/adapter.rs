//! Reading an adapter folder: [`Adapter`] (its settings, targets and factors), read from
//! `adapter_config.json` and `adapter_model.safetensors` and checked against a base on the
//! host, and put onto a model ([`Adapter::apply`]).

use super::{
    all_modules, llama_modules, resolve, resolve_model_targets, LoraBase, LoraSpec, Target,
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, LLAMA_MODULES, MODULES, PREFIX,
};
use crate::checkpoint::{parse_safetensors, HostTensor};
use crate::hf::config::read_json;
use crate::hf::files::convert;
use crate::nn::{GptConfig, LlamaConfig, Lora, LoraConfig};
use crate::{DType, Error, Result, Tensor};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

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
/// another rank), a dtype other than F32 / F16 / BF16; the errors of
/// [`resolve_targets`](super::resolve_targets).
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
}
