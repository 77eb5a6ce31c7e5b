//! A Hugging Face `config.json` read into a [`GptConfig`]: the fields of `GPT2LMHeadModel` that
//! change the math are checked (each refusal names the field and the value), the rest ignored.

use std::path::Path;

use serde_json::{Map, Value};

use crate::nn::GptConfig;
use crate::{DType, Error, Result};

/// The architectures a GPT-2 folder may name (a `GPT2Model` folder has the same tensors; the
/// head is tied to the token embedding either way).
const GPT2_ARCHITECTURES: [&str; 2] = ["GPT2LMHeadModel", "GPT2Model"];

/// `activation_function`s that are GPT-2's tanh-form gelu, the one fitgrad's kernels compute:
/// `gelu_fast` is the same formula written with x (1 + 0.044715 x²).
const TANH_GELU: [&str; 3] = ["gelu_new", "gelu_pytorch_tanh", "gelu_fast"];

/// The configuration of a GPT-2 folder as fitgrad builds it: `cfg` for [`crate::nn::Gpt::new`]
/// (eps from `layer_norm_epsilon`), and the raw JSON kept for export.
#[derive(Clone, Debug)]
pub struct Gpt2Config {
    /// The model to build (dtype f32, no dropout: fine-tuning sets its own).
    pub cfg: GptConfig,
    /// The file it came from.
    pub path: String,
}

/// The JSON object of `config.json` in `dir`, or an error naming the file.
pub(crate) fn read_json(path: &Path) -> Result<Map<String, Value>> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: name.clone(),
        source,
    })?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(Error::Data {
            path: name,
            reason: "not a JSON object".into(),
        }),
        Err(e) => Err(Error::Data {
            path: name,
            reason: format!("not valid JSON: {e}"),
        }),
    }
}

impl Gpt2Config {
    /// Reads and checks `config.json` at `path`. Errors ([`Error::Data`] naming the file):
    /// another `model_type` or `architectures`, a missing or non-integer size, an activation
    /// other than the tanh-form gelu, an MLP width other than 4 x n_embd, untied embeddings,
    /// attention scaled otherwise than by 1 / sqrt(head dim), and the [`GptConfig`] checks.
    pub fn from_file(path: &Path) -> Result<Gpt2Config> {
        let json = read_json(path)?;
        Gpt2Config::from_json(&json, &path.display().to_string())
    }

    /// [`Gpt2Config::from_file`] of a parsed object; `source` names it in errors.
    pub fn from_json(json: &Map<String, Value>, source: &str) -> Result<Gpt2Config> {
        let bad = |reason: String| Error::Data {
            path: source.to_string(),
            reason,
        };
        let model_type = json.get("model_type").and_then(Value::as_str);
        if model_type != Some("gpt2") {
            return Err(bad(format!(
                "model_type {}: fitgrad loads model_type \"gpt2\" (GPT2LMHeadModel)",
                model_type.map_or("missing".to_string(), |m| format!("\"{m}\""))
            )));
        }
        if let Some(archs) = json.get("architectures") {
            let names: Vec<&str> = archs
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            if names.is_empty() || names.iter().any(|a| !GPT2_ARCHITECTURES.contains(a)) {
                return Err(bad(format!(
                    "architectures {archs}: fitgrad loads {} for model_type gpt2",
                    GPT2_ARCHITECTURES.join(" or ")
                )));
            }
        }
        let size = |keys: &[&str]| -> Result<usize> {
            let v = keys
                .iter()
                .find_map(|k| json.get(*k))
                .ok_or_else(|| bad(format!("no {} (a GPT-2 config has it)", keys.join(" or "))))?;
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| bad(format!("{} = {v} is not a size", keys[0])))
        };
        let flag = |key: &str, default: bool| -> Result<bool> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(bad(format!("{key} = {v} is not true or false"))),
            }
        };
        let mut cfg = GptConfig::new(
            size(&["vocab_size"])?,
            size(&["n_positions", "n_ctx"])?,
            size(&["n_layer"])?,
            size(&["n_head"])?,
            size(&["n_embd"])?,
        );
        cfg.dtype = DType::F32;
        if let Some(v) = json.get("layer_norm_epsilon") {
            let eps = v
                .as_f64()
                .ok_or_else(|| bad(format!("layer_norm_epsilon = {v} is not a number")))?;
            cfg.layer_norm_eps = eps as f32;
        }
        let act = match json.get("activation_function") {
            None => "gelu_new",
            Some(v) => v
                .as_str()
                .ok_or_else(|| bad(format!("activation_function = {v} is not a name")))?,
        };
        if !TANH_GELU.contains(&act) {
            return Err(bad(format!(
                "activation_function \"{act}\": fitgrad's gelu is the tanh form ({})",
                TANH_GELU.join(", ")
            )));
        }
        if let Some(inner) = json.get("n_inner").filter(|v| !v.is_null()) {
            if inner.as_u64() != Some(4 * cfg.dim as u64) {
                return Err(bad(format!(
                    "n_inner = {inner}: fitgrad's GPT-2 MLP is 4 x n_embd = {} wide",
                    4 * cfg.dim
                )));
            }
        }
        if !flag("tie_word_embeddings", true)? {
            return Err(bad(
                "tie_word_embeddings = false: fitgrad's GPT-2 head is the token embedding".into(),
            ));
        }
        if !flag("scale_attn_weights", true)? || flag("scale_attn_by_inverse_layer_idx", false)? {
            return Err(bad(
                "attention scores scaled otherwise than by 1 / sqrt(head dim) \
                 (scale_attn_weights false or scale_attn_by_inverse_layer_idx true)"
                    .into(),
            ));
        }
        cfg.validate().map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => bad(reason),
            e => e,
        })?;
        Ok(Gpt2Config {
            cfg,
            path: source.to_string(),
        })
    }
}

/// The `config.json` of a [`GptConfig`] as transformers writes a `GPT2LMHeadModel`'s (no
/// dropout: a loaded model fine-tunes without it unless asked).
pub(crate) fn gpt2_json(cfg: &GptConfig) -> Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "activation_function": "gelu_new",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.context,
        "n_ctx": cfg.context,
        "n_embd": cfg.dim,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_inner": null,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        "reorder_and_upcast_attn": false,
        "tie_word_embeddings": true,
        "use_cache": true,
        "torch_dtype": "float32",
    })
}
