//! Hugging Face model folders: `config.json`, `model.safetensors` (or sharded with
//! `model.safetensors.index.json`) and `tokenizer.json`, loaded as their authors saved them and
//! written back so transformers loads them. GPT-2 (`GPT2LMHeadModel`) loads into [`Gpt`].
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

mod config;
mod files;
mod gpt2;
mod peft;
mod tokenizer;

pub use config::Gpt2Config;
pub use files::{INDEX_FILE, WEIGHTS_FILE};
pub use gpt2::{save_gpt2, PretrainedGpt};
pub use peft::{
    adapter_of, add_lora, merge_adapter, read_adapter, resolve_targets, save_adapter, Adapter,
    LoraSpec, Target, ADAPTER_CONFIG, ADAPTER_WEIGHTS,
};
pub use tokenizer::{Tokenizer, TOKENIZER_FILE};
