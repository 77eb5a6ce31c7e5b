//! [`LlamaConfig`]: the fields of a Llama `config.json` that change the math, and the checks
//! [`Llama::new`](super::Llama::new) makes before any device work.

use crate::{AttentionKind, DType, Error, Result};

/// A [`Llama`](super::Llama)'s configuration: the fields of a Llama `config.json` that change
/// the math.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// Model width C (`hidden_size`).
    pub dim: usize,
    /// The MLP's inner width (`intermediate_size`).
    pub intermediate: usize,
    /// Blocks (`num_hidden_layers`).
    pub layers: usize,
    /// Query heads H (`num_attention_heads`).
    pub heads: usize,
    /// Key and value heads KV (`num_key_value_heads`), dividing H: H / KV query heads share
    /// each (grouped-query attention).
    pub kv_heads: usize,
    /// Head dim D (`head_dim`, C / H unless given); even.
    pub head_dim: usize,
    /// The most positions a forward sees (`max_position_embeddings`).
    pub context: usize,
    /// Every RMSNorm's eps (`rms_norm_eps`).
    pub rms_norm_eps: f32,
    /// RoPE's base (`rope_theta`).
    pub rope_theta: f32,
    /// The head is the embedding (`tie_word_embeddings`).
    pub tie_embeddings: bool,
    /// q, k, v and o projections with biases (`attention_bias`).
    pub attention_bias: bool,
    /// gate, up and down projections with biases (`mlp_bias`).
    pub mlp_bias: bool,
    /// The parameters' dtype.
    pub dtype: DType,
    /// Seed of the initial weights.
    pub seed: u64,
    /// Which attention implementation the blocks run.
    pub attention: AttentionKind,
}

impl LlamaConfig {
    /// `layers` blocks of width `dim`, `heads` query heads over `kv_heads` kv heads of dim
    /// `dim / heads`, an MLP of `intermediate`; transformers' defaults otherwise (eps 1e-6,
    /// theta 10000, untied, no biases), f32, seed 0.
    pub fn new(
        vocab_size: usize,
        dim: usize,
        intermediate: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
        context: usize,
    ) -> LlamaConfig {
        LlamaConfig {
            vocab_size,
            dim,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim: dim.checked_div(heads).unwrap_or(0),
            context,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            tie_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            dtype: DType::F32,
            seed: 0,
            attention: AttentionKind::Auto,
        }
    }

    /// Every check [`Llama::new`](super::Llama::new) makes before any device work.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "Llama::new",
            reason,
        };
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.dim),
            ("intermediate_size", self.intermediate),
            ("num_hidden_layers", self.layers),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.context),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(bad(format!("{name} must be at least 1, got 0")));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad(format!(
                "num_key_value_heads = {} must divide num_attention_heads = {}",
                self.kv_heads, self.heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(bad(format!(
                "head_dim = {} must be even (RoPE rotates its two halves)",
                self.head_dim
            )));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(bad(format!(
                "rms_norm_eps must be a finite number >= 0, got {}",
                self.rms_norm_eps
            )));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(bad(format!(
                "rope_theta must be a finite number > 0, got {}",
                self.rope_theta
            )));
        }
        if self.vocab_size > 1 << 24 {
            return Err(bad(format!(
                "vocab_size = {} passes 2^24, the most classes the cross-entropy indexes exactly",
                self.vocab_size
            )));
        }
        if self.context > 1 << 24 {
            return Err(bad(format!(
                "max_position_embeddings = {} passes 2^24 (f32 rotary angles)",
                self.context
            )));
        }
        Ok(())
    }
}
