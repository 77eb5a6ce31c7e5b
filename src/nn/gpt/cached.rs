//! [`Gpt`]'s side of generation: its KV-cache forward, `generate`, and the [`LanguageModel`]
//! impl through which src/nn/generate.rs samples from it (and evaluation runs windows).

use super::Gpt;
use crate::nn::generate::{generate, KvCache, LanguageModel, Sampling};
use crate::{DType, Result, Tensor};

impl LanguageModel for Gpt {
    fn vocab_size(&self) -> usize {
        self.gpt_config().vocab_size
    }

    fn context(&self) -> usize {
        self.gpt_config().context
    }

    fn dtype(&self) -> DType {
        self.gpt_config().dtype
    }

    fn kv_cache(&self) -> KvCache {
        Gpt::kv_cache(self)
    }

    fn forward_cached(
        &self,
        ids: &[u32],
        batch: usize,
        t: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        Gpt::forward_cached(self, ids, batch, t, cache)
    }

    fn loss_in(
        &self,
        ids: &[u32],
        targets: &[u32],
        batch: usize,
        t: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        Gpt::loss_in(self, ids, targets, batch, t, dtype)
    }

    fn is_training(&self) -> bool {
        Gpt::is_training(self)
    }
}

impl Gpt {
    /// An empty cache for this model.
    pub fn kv_cache(&self) -> KvCache {
        KvCache::with_layers(self.block_list().len())
    }

    /// Logits (B, T, V), in the parameters' dtype, of ids (B, T) at positions
    /// `cache.len()..cache.len() + T`, attending over the cached positions too; their keys and
    /// values are appended to `cache`. Equal (up to rounding) to the last T positions of
    /// [`Gpt::forward_ids`] on the whole sequence. Records no graph; dropout applies only in
    /// training mode.
    ///
    /// Errors, before any device work:
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for the id checks of
    /// `forward_ids`, `cache.len() + T` past `context`, a batch other than the cache's, or a
    /// cache of another model.
    pub fn forward_cached(
        &self,
        ids: &[u32],
        batch: usize,
        t: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        const OP: &str = "Gpt::forward_cached";
        let cfg = self.gpt_config();
        cache.check(OP, cfg.layers, batch)?;
        self.check_ids(OP, ids, batch, t, cfg.context - cache.len())?;
        let _g = crate::no_grad();
        let dtype = cfg.dtype;
        let mut x = self.embed(ids, batch, t, cache.len(), dtype)?;
        for (block, kv) in self.block_list().iter().zip(cache.layers_mut()) {
            x = crate::residency::within(&block.ln1.weight, || {
                block.forward_cached(&x, kv, dtype)
            })?;
        }
        cache.advance(t, batch);
        self.head(&x, dtype)
    }

    /// `prompt` followed by `max_new` tokens sampled one at a time from
    /// softmax(logits / `temperature`) with a host generator seeded by `seed` (the same seed, the
    /// same tokens on one adapter). Runs under `no_grad` in evaluation mode (the model's mode is
    /// restored afterwards).
    ///
    /// The model sees at most the last `context` tokens. While the sequence fits, each step runs
    /// only the newest token through the blocks against the KV cache; once it passes `context`
    /// the window slides by one token per step, which moves every position (the position
    /// embeddings are absolute), so the cache is rebuilt from the cropped window at each such
    /// step.
    ///
    /// Errors, before any device work:
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for an empty prompt, an id of
    /// `vocab_size` or more, or a temperature that is not finite and > 0 (or whose inverse is
    /// not finite); also when the model's probabilities are not finite (NaN weights).
    pub fn generate(
        &self,
        prompt: &[u32],
        max_new: usize,
        temperature: f32,
        seed: u64,
    ) -> Result<Vec<u32>> {
        self.generate_with(prompt, max_new, &Sampling::new(temperature, seed))
    }

    /// [`Gpt::generate`] with top-k and top-p (nucleus) filtering of each step's
    /// probabilities, as transformers applies them: temperature, then the `top_k` most
    /// probable tokens, then the smallest most-probable set whose mass reaches `top_p`
    /// (`top_k` 1 is greedy decoding). Errors: those of `generate`, and
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a `top_k` of 0 or a `top_p`
    /// outside (0, 1].
    pub fn generate_with(
        &self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
    ) -> Result<Vec<u32>> {
        generate(self, prompt, max_new, sampling)
    }
}
