//! The LoRA tests' fixtures: the tiny GPT-2 and Llama bases, the fitgrad-trained adapters
//! PEFT loaded, and the ids whose logits they hold.

use std::path::{Path, PathBuf};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn base_dir() -> PathBuf {
    fixtures().join("hf/gpt2-tiny")
}

/// The fitgrad-trained adapter PEFT loaded for the fixture.
pub fn adapter_dir() -> PathBuf {
    fixtures().join("lora/gpt2-tiny-adapter")
}

/// The tiny Llama base (grouped-query attention) of the Llama adapter fixture.
pub fn llama_base_dir() -> PathBuf {
    fixtures().join("hf/llama-tiny-gqa")
}

/// The fitgrad-trained adapter over [`llama_base_dir`] PEFT loaded for the fixture.
pub fn llama_adapter_dir() -> PathBuf {
    fixtures().join("lora/llama-tiny-gqa-adapter")
}

/// The sequence whose logits the fixtures hold (the hf fixtures' `logits_ids`).
pub fn logits_ids() -> Vec<u32> {
    ids_of("hf/expected.json")
}

/// The sequence whose logits the Llama fixtures hold.
pub fn llama_logits_ids() -> Vec<u32> {
    ids_of("hf/expected_llama.json")
}

/// The `logits_ids` of a fixture's expected figures.
fn ids_of(file: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(fixtures().join(file)).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["logits_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}
