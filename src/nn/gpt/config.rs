//! [`GptConfig`]: a [`Gpt`](super::Gpt)'s sizes and settings, every field a checkpoint needs to
//! rebuild the model, and the checks [`Gpt::new`](super::Gpt::new) makes before any device work.

use crate::nn::LAYER_NORM_EPS;
use crate::{AttentionKind, DType, Error, Result};

/// The most classes the cross-entropy kernel indexes exactly (targets travel as f32).
const MAX_VOCAB: usize = 1 << 24;

/// A [`Gpt`](super::Gpt)'s configuration: every field a checkpoint needs to rebuild the
/// model.
///
/// ```
/// use fitgrad::nn::GptConfig;
/// let mut cfg = GptConfig::new(50257, 1024, 12, 12, 768); // GPT-2 small
/// cfg.dropout = 0.1;
/// assert_eq!(cfg.num_parameters().unwrap(), 124_439_808);
/// ```
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    /// Token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// The most positions a forward sees (the position embedding's rows).
    pub context: usize,
    /// Number of blocks.
    pub layers: usize,
    /// Attention heads per block; must divide `dim`.
    pub heads: usize,
    /// Model width C.
    pub dim: usize,
    /// Dropout probability after the embeddings and on each residual branch, in [0, 1).
    pub dropout: f32,
    /// Run each block under gradient checkpointing (see
    /// [`Gpt::set_checkpoint_blocks`](super::Gpt::set_checkpoint_blocks)).
    pub checkpoint_blocks: bool,
    /// The parameters' dtype.
    pub dtype: DType,
    /// Seed of the initial weights and of the dropout masks.
    pub seed: u64,
    /// Which attention implementation the blocks run.
    pub attention: AttentionKind,
    /// Every LayerNorm's eps (torch's 1e-5 by default; Hugging Face GPT-2's `layer_norm_epsilon`).
    pub layer_norm_eps: f32,
}

impl GptConfig {
    /// `layers` blocks of width `dim` with `heads` heads over `context` positions of a
    /// `vocab_size` vocabulary; no dropout, no checkpointing, f32, seed 0, automatic attention.
    pub fn new(
        vocab_size: usize,
        context: usize,
        layers: usize,
        heads: usize,
        dim: usize,
    ) -> GptConfig {
        GptConfig {
            vocab_size,
            context,
            layers,
            heads,
            dim,
            dropout: 0.0,
            checkpoint_blocks: false,
            dtype: DType::F32,
            seed: 0,
            attention: AttentionKind::Auto,
            layer_norm_eps: LAYER_NORM_EPS,
        }
    }

    /// The model's scalar parameter count: `V·C + T·C + layers·(12·C² + 13·C) + 2·C` (the head
    /// is the token embedding). Errors: [`Error::InvalidArgument`] when it overflows `usize`.
    pub fn num_parameters(&self) -> Result<usize> {
        let c = self.dim;
        let count = || -> Option<usize> {
            let c2 = c.checked_mul(c)?;
            let block = c2.checked_mul(12)?.checked_add(c.checked_mul(13)?)?;
            self.vocab_size
                .checked_mul(c)?
                .checked_add(self.context.checked_mul(c)?)?
                .checked_add(self.layers.checked_mul(block)?)?
                .checked_add(c.checked_mul(2)?)
        };
        count().ok_or_else(|| Error::InvalidArgument {
            op: "GptConfig::num_parameters",
            reason: format!(
                "the parameter count of {} layers of dim {c} with a vocabulary of {} and a \
                 context of {} overflows; reduce dim, layers, vocab_size or context",
                self.layers, self.vocab_size, self.context
            ),
        })
    }

    /// Every check [`Gpt::new`](super::Gpt::new) makes before any device work.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "Gpt::new",
            reason,
        };
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("context", self.context),
            ("layers", self.layers),
            ("heads", self.heads),
            ("dim", self.dim),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(bad(format!("{name} must be at least 1, got 0")));
        }
        if !self.dim.is_multiple_of(self.heads) {
            let up = self.dim.div_ceil(self.heads) * self.heads;
            return Err(bad(format!(
                "heads = {} must divide dim = {}: use dim = {up} (a multiple of {}) or a head \
                 count that divides {}",
                self.heads, self.dim, self.heads, self.dim
            )));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(bad(format!(
                "dropout must be in [0, 1), got {}",
                self.dropout
            )));
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps >= 0.0) {
            return Err(bad(format!(
                "layer_norm_eps must be a finite number >= 0, got {}",
                self.layer_norm_eps
            )));
        }
        if self.vocab_size > MAX_VOCAB {
            return Err(bad(format!(
                "vocab_size = {} passes 2^24, the most classes the cross-entropy indexes exactly",
                self.vocab_size
            )));
        }
        if self.context > u32::MAX as usize {
            return Err(bad(format!(
                "context = {} passes 2^32 - 1 (positions are u32 ids)",
                self.context
            )));
        }
        self.num_parameters().map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => bad(reason),
            e => e,
        })?;
        Ok(())
    }
}
