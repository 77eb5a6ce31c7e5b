//! `Llama`: the Llama family's decoder (Hugging Face's `LlamaForCausalLM`): token embedding,
//! pre-RMSNorm blocks of grouped-query self-attention with rotary positions (rotate-half, no
//! position table) and a SwiGLU MLP, a final RMSNorm, and a head of its own or tied to the
//! embedding. Parameters carry transformers' names, so a folder loads and saves one to one.
//! Generation with a KV cache shares src/nn/generate.rs with [`Gpt`](super::Gpt). The
//! configuration is config.rs, the layers of a block block.rs.

mod block;
mod config;

pub use block::{LlamaAttention, LlamaBlock, LlamaMlp, RmsNorm};
pub use config::LlamaConfig;

use crate::nn::generate::{self, KvCache, LanguageModel};
use crate::nn::{Embedding, Linear, Module};
use crate::tensor::{Rng, Rope};
use crate::{DType, Device, Error, MatmulOptions, Result, Tensor};
use block::prefixed;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The init of a model built from a configuration alone: N(0, 0.02), as transformers'
/// `initializer_range` default.
const INIT_STD: f32 = 0.02;

/// A Llama-family language model: ids (B, T) -> logits (B, T, V).
///
/// Parameters are named as in transformers: `model.embed_tokens.weight`,
/// `model.layers.{i}.input_layernorm.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`
/// (and `.bias` with `attention_bias`), `model.layers.{i}.post_attention_layernorm.weight`,
/// `model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.norm.weight` and, untied,
/// `lm_head.weight`; every Linear weight is (out, in) as torch stores it.
pub struct Llama {
    embed_tokens: Embedding,
    /// Shared with the closures of checkpointed segments, which recompute a block in backward.
    layers: Vec<Arc<LlamaBlock>>,
    norm: RmsNorm,
    /// None when tied to the embedding.
    lm_head: Option<Linear>,
    cfg: LlamaConfig,
    training: AtomicBool,
    checkpoint_blocks: AtomicBool,
}

impl Llama {
    /// A model initialised from `cfg.seed` (weights N(0, 0.02), biases 0, norms 1), in
    /// training mode (Llama has no dropout; the mode is kept for the trainer).
    ///
    /// Errors, before any device work: those of [`LlamaConfig::validate`].
    pub fn new(device: &Device, cfg: LlamaConfig) -> Result<Llama> {
        cfg.validate()?;
        let (c, dtype) = (cfg.dim, cfg.dtype);
        // The largest tensors of each kind, named, against the adapter's buffers.
        let (q, kv) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        let mut tensors = vec![(
            "model.embed_tokens.weight".to_string(),
            cfg.vocab_size.saturating_mul(c),
        )];
        if !cfg.tie_embeddings {
            tensors.push(("lm_head.weight".into(), cfg.vocab_size.saturating_mul(c)));
        }
        if cfg.layers > 0 {
            let layer = "model.layers.0";
            tensors.extend([
                (
                    format!("{layer}.mlp.gate_proj.weight"),
                    cfg.intermediate.saturating_mul(c),
                ),
                (format!("{layer}.self_attn.q_proj.weight"), q * c),
                (format!("{layer}.self_attn.k_proj.weight"), kv * c),
            ]);
        }
        let sized: Vec<(String, usize, usize)> = tensors
            .into_iter()
            .map(|(n, e)| (n, e, dtype.size()))
            .collect();
        device.check_model_tensors(&sized)?;
        let mut rng = Rng::new(cfg.seed);
        let mut seed = || rng.next_u64();
        let mut linear = |i: usize, o: usize, bias: bool| -> Result<Linear> {
            Ok(Linear {
                weight: Tensor::randn(device, &[o, i], 0.0, INIT_STD, seed(), dtype)?
                    .with_requires_grad(),
                bias: if bias {
                    Some(Tensor::zeros(device, &[o], dtype)?.with_requires_grad())
                } else {
                    None
                },
                in_features: i,
                out_features: o,
                lora: None,
                quantized: None,
            })
        };
        let norm = || RmsNorm::new(device, c, cfg.rms_norm_eps, dtype);
        let (hd, kvd) = (cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim);
        let embed_tokens = Embedding {
            weight: Tensor::randn(
                device,
                &[cfg.vocab_size, c],
                0.0,
                INIT_STD,
                1 + cfg.seed,
                dtype,
            )?
            .with_requires_grad(),
            num_embeddings: cfg.vocab_size,
            dim: c,
        };
        let mut layers = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            let ab = cfg.attention_bias;
            let self_attn = LlamaAttention {
                q_proj: linear(c, hd, ab)?,
                k_proj: linear(c, kvd, ab)?,
                v_proj: linear(c, kvd, ab)?,
                o_proj: linear(hd, c, ab)?,
                heads: cfg.heads,
                kv_heads: cfg.kv_heads,
                head_dim: cfg.head_dim,
                kind: cfg.attention,
            };
            let mb = cfg.mlp_bias;
            let mlp = LlamaMlp {
                gate_proj: linear(c, cfg.intermediate, mb)?,
                up_proj: linear(c, cfg.intermediate, mb)?,
                down_proj: linear(cfg.intermediate, c, mb)?,
            };
            let block = Arc::new(LlamaBlock {
                input_layernorm: norm()?,
                self_attn,
                post_attention_layernorm: norm()?,
                mlp,
            });
            // Inside residency::born_on_host each block goes to host memory once made.
            crate::residency::born(&block.parameters());
            layers.push(block);
        }
        let lm_head = if cfg.tie_embeddings {
            None
        } else {
            Some(linear(c, cfg.vocab_size, false)?)
        };
        Ok(Llama {
            embed_tokens,
            layers,
            norm: norm()?,
            lm_head,
            training: AtomicBool::new(true),
            checkpoint_blocks: AtomicBool::new(false),
            cfg,
        })
    }

    /// Whether each block runs under gradient checkpointing (two segments, one per residual
    /// half, as [`Gpt`](crate::nn::Gpt)'s).
    pub fn checkpoint_blocks(&self) -> bool {
        self.checkpoint_blocks.load(Ordering::Relaxed)
    }

    /// Turns block checkpointing on or off for the next forwards.
    pub fn set_checkpoint_blocks(&self, on: bool) {
        self.checkpoint_blocks.store(on, Ordering::Relaxed);
    }

    /// Every Linear of the decoder layers by its transformers module name
    /// (`model.layers.{i}.self_attn.q_proj`, ...): q, k, v, o, gate, up, down per layer, in
    /// order (the head, when untied, is not among them).
    /// An [`Error::InvalidArgument`] while a recorded graph (a checkpointed forward that has
    /// not run backward) still holds a block.
    pub fn linears_mut(&mut self) -> Result<Vec<(String, &mut Linear)>> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter_mut().enumerate() {
            let l = Arc::get_mut(l).ok_or_else(|| Error::InvalidArgument {
                op: "Llama::linears_mut",
                reason: format!("block {i} is held by a recorded graph; run backward or drop it"),
            })?;
            let p = format!("model.layers.{i}");
            let a = &mut l.self_attn;
            out.push((format!("{p}.self_attn.q_proj"), &mut a.q_proj));
            out.push((format!("{p}.self_attn.k_proj"), &mut a.k_proj));
            out.push((format!("{p}.self_attn.v_proj"), &mut a.v_proj));
            out.push((format!("{p}.self_attn.o_proj"), &mut a.o_proj));
            let m = &mut l.mlp;
            out.push((format!("{p}.mlp.gate_proj"), &mut m.gate_proj));
            out.push((format!("{p}.mlp.up_proj"), &mut m.up_proj));
            out.push((format!("{p}.mlp.down_proj"), &mut m.down_proj));
        }
        Ok(out)
    }

    /// Detaches every parameter from autograd (embedding, norms, every Linear's weight and
    /// bias, the untied head): no gradients, no optimizer state. Adapters stay trainable.
    /// Errors as [`Llama::linears_mut`].
    pub fn freeze(&mut self) -> Result<()> {
        for (_, l) in self.linears_mut()? {
            l.freeze();
        }
        for l in &mut self.layers {
            let l = Arc::get_mut(l).expect("checked by linears_mut");
            for n in [&mut l.input_layernorm, &mut l.post_attention_layernorm] {
                n.weight = n.weight.detach();
            }
        }
        self.norm.weight = self.norm.weight.detach();
        self.embed_tokens.weight = self.embed_tokens.weight.detach();
        if let Some(h) = &mut self.lm_head {
            h.freeze();
        }
        Ok(())
    }

    /// The configuration.
    pub fn llama_config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Logits (B, T, V) of ids (B, T) given row-major, in the parameters' dtype.
    ///
    /// Errors, before any device work: [`Error::InvalidArgument`] when `ids.len()` is not
    /// `batch * t`, `batch` or `t` is 0, `t` passes `context`, or an id is `vocab_size` or more.
    pub fn forward_ids(&self, ids: &[u32], batch: usize, t: usize) -> Result<Tensor> {
        self.logits(ids, batch, t, 0, None, self.cfg.dtype)
    }

    /// Logits (B, T, V) in f32 with every matmul in `dtype`.
    pub fn forward_ids_in(
        &self,
        ids: &[u32],
        batch: usize,
        t: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        self.logits(ids, batch, t, 0, None, dtype)?.cast(DType::F32)
    }

    /// The mean next-token cross-entropy (f32, rank 0) of ids (B, T) against `targets`, every
    /// matmul in `dtype`. Errors: those of [`Llama::forward_ids`], and targets not `batch * t`
    /// long or out of the vocabulary ([`Error::InvalidArgument`]).
    pub fn loss_in(
        &self,
        ids: &[u32],
        targets: &[u32],
        batch: usize,
        t: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        if batch.checked_mul(t) != Some(targets.len()) {
            return Err(Error::InvalidArgument {
                op: "Llama::loss",
                reason: format!(
                    "{} targets are not batch x t = {batch} x {t}",
                    targets.len()
                ),
            });
        }
        self.check_vocab("Llama::loss", targets)?;
        let logits = self.forward_ids_in(ids, batch, t, dtype)?;
        crate::nn::cross_entropy(&logits.reshape(&[batch * t, self.cfg.vocab_size])?, targets)
    }

    /// Logits (B, T, V) of ids at positions `start..start + t`, each block's keys and values
    /// appended to `cache` when given.
    fn logits(
        &self,
        ids: &[u32],
        batch: usize,
        t: usize,
        start: usize,
        cache: Option<&mut KvCache>,
        dtype: DType,
    ) -> Result<Tensor> {
        generate::check_ids(
            "Llama::forward_ids",
            ids,
            batch,
            t,
            self.cfg.context - start,
            self.cfg.context,
            self.cfg.vocab_size,
        )?;
        let rope = Rope::new(
            self.embed_tokens.weight.device(),
            t,
            self.cfg.head_dim,
            self.cfg.rope_theta,
            start,
        )?;
        let mut x = self
            .embed_tokens
            .forward_ids(ids, &[batch, t])?
            .cast(dtype)?;
        match cache {
            None => {
                // Streamed blocks train checkpointed: the forward keeps no reference to a
                // block's weights, which leave the device after it (src/residency/).
                let streamed = self
                    .layers
                    .first()
                    .is_some_and(|b| b.input_layernorm.weight.is_streamed());
                let checkpointed =
                    self.checkpoint_blocks() || (streamed && crate::is_grad_enabled());
                for block in &self.layers {
                    x = if checkpointed {
                        block.checkpointed(&x, &rope, dtype)?
                    } else {
                        let unit = &block.input_layernorm.weight;
                        crate::residency::within(unit, || block.forward_in(&x, &rope, None, dtype))?
                    };
                }
            }
            Some(cache) => {
                for (block, kv) in self.layers.iter().zip(cache.layers_mut()) {
                    x = block.forward_in(&x, &rope, Some(kv), dtype)?;
                }
            }
        }
        let x = self.norm.forward(&x)?;
        let w = match &self.lm_head {
            Some(head) => &head.weight,
            None => &self.embed_tokens.weight,
        };
        x.matmul_with(&w.cast(dtype)?, &MatmulOptions::new().trans_b(true))
    }
}

impl LanguageModel for Llama {
    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn context(&self) -> usize {
        self.cfg.context
    }

    fn dtype(&self) -> DType {
        self.cfg.dtype
    }

    fn kv_cache(&self) -> KvCache {
        KvCache::with_layers(self.cfg.layers)
    }

    fn forward_cached(
        &self,
        ids: &[u32],
        batch: usize,
        t: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        cache.check("Llama::forward_cached", self.cfg.layers, batch)?;
        let _g = crate::no_grad();
        let start = cache.len();
        let logits = self.logits(ids, batch, t, start, Some(cache), self.cfg.dtype)?;
        cache.advance(t, batch);
        Ok(logits)
    }

    fn loss_in(
        &self,
        ids: &[u32],
        targets: &[u32],
        batch: usize,
        t: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        Llama::loss_in(self, ids, targets, batch, t, dtype)
    }

    fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }
}

impl Module for Llama {
    /// Always an [`Error::InvalidArgument`]: a Llama reads host token ids. Use
    /// [`Llama::forward_ids`].
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(Error::InvalidArgument {
            op: "Llama::forward",
            reason: "a Llama looks up host token ids; call forward_ids(ids, batch, t)".into(),
        })
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = prefixed("model.embed_tokens", &self.embed_tokens);
        for (i, b) in self.layers.iter().enumerate() {
            out.extend(prefixed(&format!("model.layers.{i}"), b.as_ref()));
        }
        out.extend(prefixed("model.norm", &self.norm));
        if let Some(head) = &self.lm_head {
            out.extend(prefixed("lm_head", head));
        }
        out
    }

    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }

    /// Each block is a unit (`model.layers.{i}`); the embedding, the final norm and the head
    /// are in none.
    fn units(&self) -> Vec<(String, Vec<Tensor>)> {
        let layers = self.layers.iter().enumerate();
        layers
            .map(|(i, b)| (format!("model.layers.{i}"), b.parameters()))
            .collect()
    }
}
