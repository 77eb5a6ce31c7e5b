//! `LlamaForCausalLM` folders into [`Llama`] and back: `config.json` checked field by field
//! (rope scaling refused by name), the weights under transformers' own names and (out, in)
//! layouts (rotate-half RoPE needs no permutation of q and k), the head tied or not, and the
//! checks (missing, extra, wrong shape) that come before any device work.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::config::read_json;
use super::files::{read_tensors, FileTensor, INDEX_FILE, WEIGHTS_FILE};
use super::tokenizer::TOKENIZER_FILE;
use crate::checkpoint::{list, Checkpoint, HostTensor, MODEL_PREFIX};
use crate::nn::{Llama, LlamaConfig, Module};
use crate::{DType, Device, Error, Result};

/// The architecture a Llama folder may name.
const ARCHITECTURE: &str = "LlamaForCausalLM";
/// The untied head.
const HEAD: &str = "lm_head.weight";
/// The token embedding, which a tied head is.
const EMBED: &str = "model.embed_tokens.weight";

/// Reads and checks a Llama `config.json` object into a [`LlamaConfig`] (dtype f32); `source`
/// names the file in errors. Refused, each with an [`Error::Data`] naming the field and the
/// value: another `model_type` or `architectures`, a missing or non-integer size, an activation
/// other than silu, any `rope_scaling` (or `rope_parameters` of a `rope_type` other than
/// `default`), `pretraining_tp` other than 1, and the [`LlamaConfig::validate`] checks. Both
/// transformers 4's `rope_theta` and 5's `rope_parameters` are read.
pub fn llama_config_from_json(json: &Map<String, Value>, source: &str) -> Result<LlamaConfig> {
    let bad = |reason: String| Error::Data {
        path: source.to_string(),
        reason,
    };
    let model_type = json.get("model_type").and_then(Value::as_str);
    if model_type != Some("llama") {
        return Err(bad(format!(
            "model_type {}: a Llama folder has model_type \"llama\" ({ARCHITECTURE})",
            model_type.map_or("missing".to_string(), |m| format!("\"{m}\""))
        )));
    }
    if let Some(archs) = json.get("architectures") {
        let names: Vec<&str> = archs
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if names.is_empty() || names.iter().any(|a| *a != ARCHITECTURE) {
            return Err(bad(format!(
                "architectures {archs}: fitgrad loads {ARCHITECTURE} for model_type llama"
            )));
        }
    }
    let size = |key: &str| -> Result<Option<usize>> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| bad(format!("{key} = {v} is not a size"))),
        }
    };
    let need = |key: &str| -> Result<usize> {
        size(key)?.ok_or_else(|| bad(format!("no {key} (a Llama config has it)")))
    };
    let number = |v: &Value, key: &str| -> Result<f32> {
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| bad(format!("{key} = {v} is not a number")))
    };
    let flag = |key: &str| -> Result<bool> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(bad(format!("{key} = {v} is not true or false"))),
        }
    };
    let heads = need("num_attention_heads")?;
    let dim = need("hidden_size")?;
    let mut cfg = LlamaConfig::new(
        need("vocab_size")?,
        dim,
        need("intermediate_size")?,
        need("num_hidden_layers")?,
        heads,
        size("num_key_value_heads")?.unwrap_or(heads),
        need("max_position_embeddings")?,
    );
    if let Some(d) = size("head_dim")? {
        cfg.head_dim = d;
    }
    if let Some(v) = json.get("rms_norm_eps") {
        cfg.rms_norm_eps = number(v, "rms_norm_eps")?;
    }
    let act = json
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("silu");
    if act != "silu" {
        return Err(bad(format!(
            "hidden_act \"{act}\": fitgrad's Llama MLP is SwiGLU with silu"
        )));
    }
    // RoPE: transformers 4 writes rope_theta and rope_scaling, 5 rope_parameters.
    if let Some(s) = json.get("rope_scaling").filter(|v| !v.is_null()) {
        let kind = s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .map_or("unnamed".to_string(), |t| t.to_string());
        return Err(bad(format!(
            "rope_scaling of type {kind}: fitgrad's RoPE has no scaling (rope_scaling must be null)"
        )));
    }
    if let Some(v) = json.get("rope_theta") {
        cfg.rope_theta = number(v, "rope_theta")?;
    }
    if let Some(p) = json.get("rope_parameters").filter(|v| !v.is_null()) {
        let kind = p
            .get("rope_type")
            .and_then(Value::as_str)
            .unwrap_or("default");
        if kind != "default" {
            return Err(bad(format!(
                "rope_parameters of rope_type \"{kind}\": fitgrad's RoPE has no scaling (only \
                 \"default\")"
            )));
        }
        if let Some(v) = p.get("rope_theta") {
            cfg.rope_theta = number(v, "rope_parameters.rope_theta")?;
        }
    }
    if let Some(tp) = json.get("pretraining_tp").filter(|v| !v.is_null()) {
        if tp.as_u64() != Some(1) {
            return Err(bad(format!(
                "pretraining_tp = {tp}: fitgrad computes the projections whole (1)"
            )));
        }
    }
    cfg.tie_embeddings = flag("tie_word_embeddings")?;
    cfg.attention_bias = flag("attention_bias")?;
    cfg.mlp_bias = flag("mlp_bias")?;
    cfg.validate().map_err(|e| match e {
        Error::InvalidArgument { reason, .. } => bad(reason),
        e => e,
    })?;
    Ok(cfg)
}

/// The `config.json` of a [`LlamaConfig`] as transformers writes a `LlamaForCausalLM`'s.
pub(crate) fn llama_json(cfg: &LlamaConfig) -> Value {
    serde_json::json!({
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.context,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": null,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": cfg.mlp_bias,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": true,
        "torch_dtype": match cfg.dtype {
            DType::F32 => "float32",
            DType::F16 => "float16",
        },
    })
}

/// Every parameter of a Llama of `cfg` with its dims, in [`Llama::named_parameters`]' order
/// (transformers' names).
fn entries(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (c, d) = (cfg.dim, cfg.head_dim);
    let (hd, kvd, i) = (cfg.heads * d, cfg.kv_heads * d, cfg.intermediate);
    let mut out = vec![(EMBED.to_string(), vec![cfg.vocab_size, c])];
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), vec![c]));
        for (name, o, n) in [("q", hd, c), ("k", kvd, c), ("v", kvd, c), ("o", c, hd)] {
            out.push((format!("{p}.self_attn.{name}_proj.weight"), vec![o, n]));
            if cfg.attention_bias {
                out.push((format!("{p}.self_attn.{name}_proj.bias"), vec![o]));
            }
        }
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![c]));
        for (name, o, n) in [("gate", i, c), ("up", i, c), ("down", c, i)] {
            out.push((format!("{p}.mlp.{name}_proj.weight"), vec![o, n]));
            if cfg.mlp_bias {
                out.push((format!("{p}.mlp.{name}_proj.bias"), vec![o]));
            }
        }
    }
    out.push(("model.norm.weight".into(), vec![c]));
    if !cfg.tie_embeddings {
        out.push((HEAD.into(), vec![cfg.vocab_size, c]));
    }
    out
}

/// Whether `name` is a buffer some Llama files hold beside the parameters (the rotary
/// frequencies, `model.layers.{i}.self_attn.rotary_emb.inv_freq`): recomputed, skipped.
fn is_buffer(name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq")
}

/// A Llama Hugging Face folder read and checked on the host: its configuration and weights,
/// ready to [`build`](PretrainedLlama::build) on a device.
pub struct PretrainedLlama {
    /// The configuration from `config.json` (`dtype` is the one the weights were read as).
    pub config: LlamaConfig,
    /// The folder.
    pub dir: PathBuf,
    weights: Checkpoint,
}

impl PretrainedLlama {
    /// Reads `dir`'s `config.json` and weights (`model.safetensors` or a sharded index; f32,
    /// f16 or bf16, converted to `dtype`).
    ///
    /// Errors, all before any device work, each an [`Error::Data`] naming the file (and the
    /// tensor): those of [`llama_config_from_json`]; no weights file; a damaged or truncated
    /// file; a tensor missing, extra, of another shape than the config gives, or of a dtype
    /// other than F32 / F16 / BF16; a value that overflows f16 when `dtype` is f16; with tied
    /// embeddings, an `lm_head.weight` other than the embedding. An [`Error::Io`] when a file
    /// cannot be read.
    pub fn open(dir: &Path, dtype: DType) -> Result<PretrainedLlama> {
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(Error::Data {
                path: dir.display().to_string(),
                reason: "no config.json: not a Hugging Face model folder".into(),
            });
        }
        let json = read_json(&config_path)?;
        let mut cfg = llama_config_from_json(&json, &config_path.display().to_string())?;
        cfg.dtype = dtype;
        let mut named = read_tensors(dir, dtype, &is_buffer)?;
        let mut weights = Checkpoint {
            source: dir.display().to_string(),
            ..Checkpoint::default()
        };
        let mut missing = Vec::new();
        for (name, dims) in entries(&cfg) {
            let Some(t) = named.remove(&name) else {
                missing.push(name);
                continue;
            };
            if t.tensor.dims != dims {
                return Err(Error::Data {
                    path: t.file,
                    reason: format!(
                        "tensor '{name}' is {:?}, the config's model needs {dims:?} (vocab_size \
                         {}, hidden_size {}, intermediate_size {}, {} heads and {} kv heads of \
                         dim {})",
                        t.tensor.dims,
                        cfg.vocab_size,
                        cfg.dim,
                        cfg.intermediate,
                        cfg.heads,
                        cfg.kv_heads,
                        cfg.head_dim
                    ),
                });
            }
            // Stored under the checkpoint's model prefix, which apply_model reads.
            weights
                .tensors
                .insert(format!("{MODEL_PREFIX}{name}"), t.tensor);
        }
        if !missing.is_empty() {
            let source = if dir.join(WEIGHTS_FILE).is_file() {
                WEIGHTS_FILE
            } else {
                INDEX_FILE
            };
            return Err(Error::Data {
                path: dir.join(source).display().to_string(),
                reason: format!(
                    "missing tensors {} for a {}-layer Llama{}",
                    list(&missing),
                    cfg.layers,
                    if cfg.tie_embeddings {
                        " with tied embeddings"
                    } else {
                        ""
                    }
                ),
            });
        }
        if cfg.tie_embeddings {
            if let Some(head) = named.remove(HEAD) {
                let embed = weights.tensors.get(&format!("{MODEL_PREFIX}{EMBED}"));
                if Some(&head.tensor) != embed {
                    return Err(Error::Data {
                        path: head.file,
                        reason: format!(
                            "tensor '{HEAD}' differs from {EMBED} although tie_word_embeddings \
                             is true"
                        ),
                    });
                }
            }
        }
        if let Some(FileTensor { file, .. }) = named.values().next() {
            let extra: Vec<String> = named.keys().cloned().collect();
            return Err(Error::Data {
                path: file.clone(),
                reason: format!(
                    "tensors {} are not parameters of this {}-layer Llama",
                    list(&extra),
                    cfg.layers
                ),
            });
        }
        Ok(PretrainedLlama {
            config: cfg,
            dir: dir.to_path_buf(),
            weights,
        })
    }

    /// The model on `device` with these weights.
    ///
    /// Errors: an [`Error::Limit`] when a tensor passes the adapter's storage-binding limit
    /// (before any device work), and those of [`Llama::new`].
    pub fn build(&self, device: &Device) -> Result<Llama> {
        let limit = device.info().limits.max_storage_buffer_binding_size;
        if let Some((_, t)) = self
            .weights
            .tensors
            .iter()
            .max_by_key(|(_, t)| t.bytes.len())
            .filter(|(_, t)| t.bytes.len() as u64 > limit)
        {
            return Err(Error::Limit {
                op: "PretrainedLlama::build",
                what: "a weight's size in bytes",
                value: t.bytes.len() as u64,
                limit,
            });
        }
        let model = Llama::new(device, self.config.clone())?;
        self.weights.apply_model(&model)?;
        Ok(model)
    }

    /// The weights on the host, by [`Llama`]'s parameter names (transformers' own), in the
    /// dtype they were read as.
    pub fn host_weights(&self) -> BTreeMap<String, HostTensor> {
        self.weights
            .tensors
            .iter()
            .filter_map(|(k, t)| Some((k.strip_prefix(MODEL_PREFIX)?.to_string(), t.clone())))
            .collect()
    }

    /// The folder's `tokenizer.json`, or an [`Error::Data`] naming the folder if it has none.
    pub fn tokenizer(&self) -> Result<super::Tokenizer> {
        super::tokenizer::folder_tokenizer(&self.dir)
    }
}

/// Writes `model` to `dir` as a `LlamaForCausalLM` folder that transformers loads:
/// `config.json`, `model.safetensors` (transformers' names and layouts, in the parameters'
/// dtype; a tied head omitted, as save_pretrained writes it) and, when given, a copy of
/// `tokenizer`. Each file is written atomically; `dir` is created if missing.
///
/// Errors: an [`Error::Io`] when `tokenizer` cannot be read (before the weights are read back)
/// or a file cannot be written; readback errors.
pub fn save_llama(model: &Llama, dir: &Path, tokenizer: Option<&Path>) -> Result<()> {
    let tokenizer = tokenizer
        .map(|p| {
            std::fs::read(p).map_err(|source| Error::Io {
                path: p.display().to_string(),
                source,
            })
        })
        .transpose()?;
    let host: BTreeMap<String, HostTensor> = model
        .named_parameters()
        .into_iter()
        .map(|(name, p)| Ok((name, HostTensor::read(&p)?)))
        .collect::<Result<_>>()?;
    save_host(model.llama_config(), &host, dir, tokenizer)
}

/// [`save_llama`] of weights on the host, by [`Llama`]'s names, with the tokenizer's bytes.
pub(crate) fn save_host(
    cfg: &LlamaConfig,
    host: &BTreeMap<String, HostTensor>,
    dir: &Path,
    tokenizer: Option<Vec<u8>>,
) -> Result<()> {
    let tensors: Vec<(String, HostTensor)> =
        host.iter().map(|(k, t)| (k.clone(), t.clone())).collect();
    super::files::write_safetensors(dir, WEIGHTS_FILE, &tensors)?;
    let text = serde_json::to_string_pretty(&llama_json(cfg)).expect("JSON serializes");
    crate::write_atomic(&dir.join("config.json"), text.as_bytes())?;
    if let Some(bytes) = tokenizer {
        crate::write_atomic(&dir.join(TOKENIZER_FILE), &bytes)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Map<String, Value> {
        let v = serde_json::json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 10,
            "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16,
            "rms_norm_eps": 1e-5, "rope_theta": 500.0, "rope_scaling": null
        });
        v.as_object().unwrap().clone()
    }

    fn with(key: &str, v: Value) -> Map<String, Value> {
        let mut m = base();
        m.insert(key.into(), v);
        m
    }

    #[test]
    fn config_fields_are_read_in_both_rope_forms() {
        let c = llama_config_from_json(&base(), "c").unwrap();
        assert_eq!(
            (c.heads, c.kv_heads, c.head_dim, c.rope_theta),
            (2, 1, 4, 500.0)
        );
        assert!(!c.tie_embeddings && !c.attention_bias);
        let m = with(
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": 7.0}),
        );
        assert_eq!(llama_config_from_json(&m, "c").unwrap().rope_theta, 7.0);
        // No kv heads given: one per query head.
        let mut m = base();
        m.remove("num_key_value_heads");
        assert_eq!(llama_config_from_json(&m, "c").unwrap().kv_heads, 2);
    }

    #[test]
    fn config_refusals_name_the_field() {
        let cases = [
            (
                with("model_type", "mistral".into()),
                "model_type \"mistral\"",
            ),
            (
                with("architectures", serde_json::json!(["LlamaModel"])),
                "architectures",
            ),
            (
                with(
                    "rope_scaling",
                    serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
                ),
                "\"llama3\"",
            ),
            (
                with(
                    "rope_scaling",
                    serde_json::json!({"type": "linear", "factor": 2.0}),
                ),
                "\"linear\"",
            ),
            (
                with("rope_parameters", serde_json::json!({"rope_type": "yarn"})),
                "\"yarn\"",
            ),
            (with("hidden_act", "gelu".into()), "hidden_act"),
            (with("num_key_value_heads", 3.into()), "num_key_value_heads"),
            (with("hidden_size", "8".into()), "hidden_size"),
            (with("pretraining_tp", 2.into()), "pretraining_tp"),
            (with("head_dim", 5.into()), "head_dim"),
        ];
        for (m, want) in cases {
            match llama_config_from_json(&m, "cfg.json") {
                Err(Error::Data { path, reason }) => {
                    assert_eq!(path, "cfg.json");
                    assert!(reason.contains(want), "{reason} lacks {want}");
                }
                other => panic!("{want}: {other:?}"),
            }
        }
    }

    #[test]
    fn entries_follow_the_config() {
        let mut c = llama_config_from_json(&base(), "c").unwrap();
        let n = entries(&c).len();
        assert_eq!(n, 1 + 9 + 1 + 1);
        c.tie_embeddings = true;
        c.attention_bias = true;
        assert_eq!(entries(&c).len(), n - 1 + 4);
        assert!(is_buffer("model.layers.0.self_attn.rotary_emb.inv_freq"));
    }
}
