//! A model's architecture from its `config.json` alone, without weights: what "will it fit?"
//! plans, and what a model initialised at random is built from. The configs of GPT-2 (124M,
//! 355M, 774M, 1.5B), Llama-3-8B and TinyLlama-1.1B ship in the crate under `configs/`, so a
//! size can be asked about without a download.

use super::config::read_json;
use super::{llama_config_from_json, Gpt2Config};
use crate::nn::{GptConfig, LlamaConfig};
use crate::{DType, Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// The configs shipped in the crate: (name, `config.json` text).
pub const SHIPPED_CONFIGS: &[(&str, &str)] = &[
    ("gpt2", include_str!("../../configs/gpt2.json")),
    (
        "gpt2-medium",
        include_str!("../../configs/gpt2-medium.json"),
    ),
    ("gpt2-large", include_str!("../../configs/gpt2-large.json")),
    ("gpt2-xl", include_str!("../../configs/gpt2-xl.json")),
    ("llama-3-8b", include_str!("../../configs/llama-3-8b.json")),
    (
        "tinyllama-1.1b",
        include_str!("../../configs/tinyllama-1.1b.json"),
    ),
];

/// An architecture fitgrad builds ([`crate::nn::Gpt`], [`crate::nn::Llama`]), read from a
/// `config.json`.
#[derive(Clone, Debug)]
pub enum ModelConfig {
    /// `GPT2LMHeadModel`.
    Gpt2(GptConfig),
    /// `LlamaForCausalLM`.
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// The config `name_or_path` names: one of [`SHIPPED_CONFIGS`] by name, else a
    /// `config.json` file or a folder holding one. Errors ([`Error::Data`] naming the file, or
    /// [`Error::Io`]): an unknown name that is no file, not JSON, a `model_type` other than
    /// "gpt2" or "llama", and each loader's checks of the fields.
    pub fn open(name_or_path: &str) -> Result<ModelConfig> {
        if let Some((name, text)) = SHIPPED_CONFIGS.iter().find(|(n, _)| *n == name_or_path) {
            let json = match serde_json::from_str::<Value>(text) {
                Ok(Value::Object(m)) => m,
                _ => unreachable!("the shipped configs are JSON objects"),
            };
            return ModelConfig::from_json(&json, &format!("the shipped config {name}"));
        }
        let path = Path::new(name_or_path);
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        if !file.is_file() {
            let names: Vec<&str> = SHIPPED_CONFIGS.iter().map(|(n, _)| *n).collect();
            return Err(Error::Data {
                path: name_or_path.to_string(),
                reason: format!(
                    "no such config file, and not a shipped config ({})",
                    names.join(", ")
                ),
            });
        }
        ModelConfig::from_json(&read_json(&file)?, &file.display().to_string())
    }

    /// [`ModelConfig::open`] of a parsed object; `source` names it in errors.
    pub fn from_json(json: &Map<String, Value>, source: &str) -> Result<ModelConfig> {
        match json.get("model_type").and_then(Value::as_str) {
            Some("llama") => Ok(ModelConfig::Llama(llama_config_from_json(json, source)?)),
            Some("gpt2") => Ok(ModelConfig::Gpt2(Gpt2Config::from_json(json, source)?.cfg)),
            other => Err(Error::Data {
                path: source.to_string(),
                reason: format!(
                    "model_type {}: fitgrad builds \"gpt2\" (GPT2LMHeadModel) and \"llama\" \
                     (LlamaForCausalLM)",
                    other.map_or("missing".to_string(), |m| format!("\"{m}\""))
                ),
            }),
        }
    }

    /// The same architecture with parameters of `dtype` and initialisation seed `seed`.
    pub fn with(mut self, dtype: DType, seed: u64) -> ModelConfig {
        match &mut self {
            ModelConfig::Gpt2(c) => (c.dtype, c.seed) = (dtype, seed),
            ModelConfig::Llama(c) => (c.dtype, c.seed) = (dtype, seed),
        }
        self
    }

    /// Token ids are `0..vocab_size()`.
    pub fn vocab_size(&self) -> usize {
        match self {
            ModelConfig::Gpt2(c) => c.vocab_size,
            ModelConfig::Llama(c) => c.vocab_size,
        }
    }

    /// The most positions the model takes, and the config field that says so.
    pub fn positions(&self) -> (usize, &'static str) {
        match self {
            ModelConfig::Gpt2(c) => (c.context, "n_positions"),
            ModelConfig::Llama(c) => (c.context, "max_position_embeddings"),
        }
    }

    /// Parameters of the model as built (each scalar once; a tied head is the embedding).
    pub fn num_parameters(&self) -> u64 {
        match self {
            ModelConfig::Gpt2(c) => {
                let (v, t, l, d) = (
                    c.vocab_size as u64,
                    c.context as u64,
                    c.layers as u64,
                    c.dim as u64,
                );
                (v + t) * d + l * (12 * d * d + 13 * d) + 2 * d
            }
            ModelConfig::Llama(c) => {
                let (d, f, v) = (c.dim as u64, c.intermediate as u64, c.vocab_size as u64);
                let (q, kv) = (
                    (c.heads * c.head_dim) as u64,
                    (c.kv_heads * c.head_dim) as u64,
                );
                let mut attn = d * q + 2 * d * kv + q * d;
                if c.attention_bias {
                    attn += q + 2 * kv + d;
                }
                let mut mlp = 3 * d * f;
                if c.mlp_bias {
                    mlp += 2 * f + d;
                }
                let head = if c.tie_embeddings { 0 } else { v * d };
                v * d + head + c.layers as u64 * (attn + mlp + 2 * d) + d
            }
        }
    }

    /// A one-line description.
    pub fn describe(&self) -> String {
        match self {
            ModelConfig::Gpt2(c) => format!(
                "GPT-2, {} layers, dim {}, {} heads, {} positions, vocabulary {}",
                c.layers, c.dim, c.heads, c.context, c.vocab_size
            ),
            ModelConfig::Llama(c) => format!(
                "Llama, {} layers, dim {}, {} heads over {} kv heads, {} positions, \
                 vocabulary {}{}",
                c.layers,
                c.dim,
                c.heads,
                c.kv_heads,
                c.context,
                c.vocab_size,
                if c.tie_embeddings { ", tied head" } else { "" }
            ),
        }
    }
}
