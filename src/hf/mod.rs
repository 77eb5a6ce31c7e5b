//! Hugging Face model folders: `config.json`, `model.safetensors` (or sharded with
//! `model.safetensors.index.json`) and `tokenizer.json`, loaded as their authors saved them and
//! written back so transformers loads them. GPT-2 (`GPT2LMHeadModel`) loads into [`Gpt`],
//! Llama (`LlamaForCausalLM`) into [`Llama`]; [`model_type`] tells a folder's kind.
//!
//! ```no_run
//! # fn f(dev: &fitgrad::Device) -> fitgrad::Result<()> {
//! use fitgrad::hf::PretrainedGpt;
//! let folder = PretrainedGpt::open("gpt2".as_ref(), fitgrad::DType::F32)?; // host only
//! let tok = folder.tokenizer()?;
//! let gpt = folder.build(dev)?;
//! let ids = tok.encode("Hello")?;
//! let logits = gpt.forward_ids(&ids, 1, ids.len())?; // (1, T, V)
//! fitgrad::hf::save_gpt2(&gpt, "out".as_ref(), Some(&folder.dir.join("tokenizer.json")))?;
//! # Ok(()) }
//! ```
//!
//! [`Gpt`]: crate::nn::Gpt
//! [`Llama`]: crate::nn::Llama

mod arch;
mod config;
mod files;
mod gpt2;
mod llama;
mod peft;
mod tokenizer;

pub use arch::{ModelConfig, SHIPPED_CONFIGS};
pub use config::Gpt2Config;
pub use files::{INDEX_FILE, WEIGHTS_FILE};
pub use gpt2::{save_gpt2, PretrainedGpt};
pub use llama::{llama_config_from_json, save_llama, PretrainedLlama};
pub use peft::{
    adapter_of, add_lora, merge_adapter, read_adapter, read_llama_adapter, resolve_llama_targets,
    resolve_model_targets, resolve_targets, save_adapter, Adapter, LoraBase, LoraSpec, MergeBase,
    Target, ADAPTER_CONFIG, ADAPTER_WEIGHTS,
};

/// The `model_type` of the folder `dir`'s `config.json` ("gpt2", "llama", ...), read before
/// anything else so a caller can pick the loader. Errors ([`crate::Error::Data`] naming the
/// folder or file): no `config.json`, not a JSON object, no `model_type` string.
pub fn model_type(dir: &std::path::Path) -> crate::Result<String> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Err(crate::Error::Data {
            path: dir.display().to_string(),
            reason: "no config.json: not a Hugging Face model folder".into(),
        });
    }
    let json = config::read_json(&path)?;
    json.get("model_type")
        .and_then(serde_json::Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| crate::Error::Data {
            path: path.display().to_string(),
            reason: "no model_type (\"gpt2\" or \"llama\")".into(),
        })
}
pub use tokenizer::{Tokenizer, END_OF_TEXT, TOKENIZER_FILE};
