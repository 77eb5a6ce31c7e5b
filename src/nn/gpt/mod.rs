//! `Gpt`: a GPT-2 style decoder-only transformer (nanoGPT's layout): token and position
//! embeddings, embedding dropout, pre-LayerNorm blocks, a final LayerNorm and a head tied to
//! the token embedding. Each block can run under [`checkpoint`](crate::tensor::autograd::checkpoint),
//! as two segments, one per residual half (only their inputs kept; exact with dropout, see
//! src/tensor/autograd/replay.rs). The configuration is config.rs; the KV-cache forward and
//! generation are cached.rs, over src/nn/generate.rs.

mod cached;
mod config;

pub use config::GptConfig;

use crate::nn::attention::CausalSelfAttention;
use crate::nn::block::{FeedForward, GptBlock};
use crate::nn::generate;
use crate::nn::{Dropout, Embedding, LayerNorm, Linear, Module};
use crate::tensor::Rng;
use crate::AttentionKind;
use crate::{DType, Device, Error, MatmulOptions, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// GPT-2's init: weights N(0, 0.02), residual projections scaled by 1 / sqrt(2 * layers).
const INIT_STD: f32 = 0.02;

/// A GPT-2 style language model: ids (B, T) -> logits (B, T, V).
///
/// Parameters are named `wte.weight`, `wpe.weight`, `blocks.{i}.ln1.{weight,bias}`,
/// `blocks.{i}.attn.qkv.{weight,bias}`, `blocks.{i}.attn.proj.*`, `blocks.{i}.ln2.*`,
/// `blocks.{i}.mlp.fc.*`, `blocks.{i}.mlp.proj.*`, `ln_f.*`; the head is `wte.weight` itself
/// (logits = x · Wteᵀ), listed once.
///
/// ```no_run
/// # fn f(dev: &fitgrad::Device) -> fitgrad::Result<()> {
/// use fitgrad::nn::{Gpt, GptConfig, Module};
/// let mut cfg = GptConfig::new(65, 64, 4, 4, 128);
/// cfg.dropout = 0.1;
/// let gpt = Gpt::new(dev, cfg)?;
/// let ids = vec![1u32; 2 * 64];
/// let loss = gpt.loss(&ids[..], &ids[..], 2, 64)?; // mean over the 2 x 64 positions
/// loss.backward()?;
/// let text = gpt.generate(&[1, 2, 3], 20, 0.8, 42)?;
/// # Ok(()) }
/// ```
pub struct Gpt {
    /// (V, C): token embedding and, transposed, the head.
    wte: Embedding,
    /// (context, C)
    wpe: Embedding,
    drop: Dropout,
    /// Shared with the closures of checkpointed segments, which recompute a block in backward.
    blocks: Vec<Arc<GptBlock>>,
    ln_f: LayerNorm,
    cfg: GptConfig,
    checkpoint_blocks: AtomicBool,
    training: AtomicBool,
}

impl Gpt {
    /// A model with GPT-2's init from `cfg.seed`: weights and embeddings N(0, 0.02), the two
    /// residual projections of each block N(0, 0.02 / sqrt(2 * layers)), biases 0, LayerNorms
    /// 1 and 0. Starts in training mode.
    ///
    /// Errors, before any device work: [`Error::InvalidArgument`] for a size of 0, heads not
    /// dividing dim, dropout outside [0, 1), a vocabulary over 2^24 or a parameter count that
    /// overflows (each message says what to change).
    pub fn new(device: &Device, cfg: GptConfig) -> Result<Gpt> {
        cfg.validate()?;
        let (c, dtype) = (cfg.dim, cfg.dtype);
        // The largest tensors of each kind, named, against the adapter's buffers.
        let mut tensors = vec![
            ("wte.weight".to_string(), cfg.vocab_size * c, dtype.size()),
            ("wpe.weight".into(), cfg.context * c, dtype.size()),
        ];
        if cfg.layers > 0 {
            tensors.push(("blocks.0.mlp.fc.weight".into(), 4 * c * c, dtype.size()));
        }
        device.check_model_tensors(&tensors)?;
        let mut rng = Rng::new(cfg.seed);
        let mut seed = || rng.next_u64();
        let resid_std = INIT_STD / (2.0 * cfg.layers as f32).sqrt();
        let embedding = |n: usize, seed: u64| -> Result<Embedding> {
            let weight = Tensor::randn(device, &[n, c], 0.0, INIT_STD, seed, dtype)?;
            Ok(Embedding {
                weight: weight.with_requires_grad(),
                num_embeddings: n,
                dim: c,
            })
        };
        let linear = |i: usize, o: usize, std: f32, seed: u64| -> Result<Linear> {
            Ok(Linear {
                weight: Tensor::randn(device, &[o, i], 0.0, std, seed, dtype)?.with_requires_grad(),
                bias: Some(Tensor::zeros(device, &[o], dtype)?.with_requires_grad()),
                in_features: i,
                out_features: o,
                lora: None,
                quantized: None,
            })
        };
        let norm = || LayerNorm::with_options(device, c, cfg.layer_norm_eps, dtype);
        let wte = embedding(cfg.vocab_size, seed())?;
        let wpe = embedding(cfg.context, seed())?;
        let drop = Dropout::new(cfg.dropout, seed())?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            let attn = CausalSelfAttention::from_parts(
                linear(c, 3 * c, INIT_STD, seed())?,
                linear(c, c, resid_std, seed())?,
                Dropout::new(cfg.dropout, seed())?,
                cfg.heads,
                cfg.attention,
            );
            let mlp = FeedForward {
                fc: linear(c, 4 * c, INIT_STD, seed())?,
                proj: linear(4 * c, c, resid_std, seed())?,
                drop: Dropout::new(cfg.dropout, seed())?,
            };
            let block = Arc::new(GptBlock {
                ln1: norm()?,
                attn,
                ln2: norm()?,
                mlp,
            });
            // Inside residency::born_on_host each block goes to host memory once made.
            crate::residency::born(&block.parameters());
            blocks.push(block);
        }
        Ok(Gpt {
            wte,
            wpe,
            drop,
            blocks,
            ln_f: norm()?,
            checkpoint_blocks: AtomicBool::new(cfg.checkpoint_blocks),
            training: AtomicBool::new(true),
            cfg,
        })
    }

    /// The configuration, with `checkpoint_blocks` as it is now.
    pub fn gpt_config(&self) -> GptConfig {
        let mut cfg = self.cfg.clone();
        cfg.checkpoint_blocks = self.checkpoint_blocks();
        cfg
    }

    /// Whether each block runs under gradient checkpointing.
    pub fn checkpoint_blocks(&self) -> bool {
        self.checkpoint_blocks.load(Ordering::Relaxed)
    }

    /// Turns block checkpointing on or off for the next forwards (a trainer switching memory
    /// strategies). With it on, each residual half of a block (attention, MLP) keeps only its
    /// input for the backward pass and runs its forward again there, with the same dropout
    /// masks: loss and gradients are the same as without it, and the activation peak is about
    /// half a block's instead of every block's.
    pub fn set_checkpoint_blocks(&self, on: bool) {
        self.checkpoint_blocks.store(on, Ordering::Relaxed);
    }

    /// Whether dropout is active (see [`Module::set_training`]).
    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }

    /// The blocks, in order.
    pub fn blocks(&self) -> impl ExactSizeIterator<Item = &GptBlock> {
        self.blocks.iter().map(|b| b.as_ref())
    }

    /// Logits (B, T, V) of ids (B, T) given row-major in `ids`, in the parameters' dtype.
    ///
    /// Errors, before any device work: [`Error::InvalidArgument`] when `ids.len()` is not
    /// `batch * t`, `batch` or `t` is 0, `t` passes `context`, or an id is `vocab_size` or more.
    pub fn forward_ids(&self, ids: &[u32], batch: usize, t: usize) -> Result<Tensor> {
        self.logits(ids, batch, t, self.cfg.dtype)
    }

    /// [`Gpt::forward_ids`] with every matmul in `dtype` (f32 parameters run an f16 forward,
    /// cast inside the graph so gradients reach them in f32); the logits are returned in f32.
    pub fn forward_ids_in(
        &self,
        ids: &[u32],
        batch: usize,
        t: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        self.logits(ids, batch, t, dtype)?.cast(DType::F32)
    }

    /// Mean cross-entropy over the B·T positions of the logits of `ids` (B, T) against `targets`
    /// (B, T, row-major), in the parameters' dtype, rank 0.
    ///
    /// Errors, before any device work: those of [`Gpt::forward_ids`], and
    /// [`Error::InvalidArgument`] when `targets` is not `batch * t` long or holds an id of
    /// `vocab_size` or more.
    pub fn loss(&self, ids: &[u32], targets: &[u32], batch: usize, t: usize) -> Result<Tensor> {
        self.check_targets(targets, batch, t)?;
        let logits = self.forward_ids(ids, batch, t)?;
        let v = self.cfg.vocab_size;
        crate::nn::cross_entropy(&logits.reshape(&[batch * t, v])?, targets)
    }

    /// [`Gpt::loss`] with every matmul in `dtype` and the loss in f32 (from f32 logits, so a
    /// scaled loss cannot overflow f16).
    pub fn loss_in(
        &self,
        ids: &[u32],
        targets: &[u32],
        batch: usize,
        t: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        self.check_targets(targets, batch, t)?;
        let logits = self.forward_ids_in(ids, batch, t, dtype)?;
        let v = self.cfg.vocab_size;
        crate::nn::cross_entropy(&logits.reshape(&[batch * t, v])?, targets)
    }

    /// Builds an untrained model from a configuration that [`Module::config`] wrote (what a
    /// checkpoint stores; [`Checkpoint::rebuild`](crate::checkpoint::Checkpoint::rebuild)
    /// also loads the weights: `ckpt.rebuild(|cfg| Gpt::from_config(&dev, cfg))`). Errors:
    /// [`Error::InvalidArgument`] when the configuration is not a Gpt's or a value does not
    /// parse; those of [`Gpt::new`].
    pub fn from_config(
        device: &Device,
        map: &std::collections::BTreeMap<String, String>,
    ) -> Result<Gpt> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "Gpt::from_config",
            reason,
        };
        let get = |k: &str| {
            map.get(k)
                .ok_or_else(|| bad(format!("no model configuration '{k}' (not a Gpt)")))
        };
        if get("kind")? != "gpt" {
            return Err(bad(format!(
                "the configuration is of a '{}' model, not a gpt",
                get("kind")?
            )));
        }
        fn parse<T: std::str::FromStr>(
            v: &str,
            k: &str,
            bad: &dyn Fn(String) -> Error,
        ) -> Result<T> {
            v.parse().map_err(|_| bad(format!("bad {k} '{v}'")))
        }
        let num = |k: &str| -> Result<usize> { parse(get(k)?, k, &bad) };
        let mut cfg = GptConfig::new(
            num("vocab_size")?,
            num("context")?,
            num("layers")?,
            num("heads")?,
            num("dim")?,
        );
        cfg.dropout = parse(get("dropout")?, "dropout", &bad)?;
        cfg.checkpoint_blocks = parse(get("checkpoint_blocks")?, "checkpoint_blocks", &bad)?;
        cfg.seed = parse(get("seed")?, "seed", &bad)?;
        cfg.dtype = match get("dtype")?.as_str() {
            "f32" => DType::F32,
            "f16" => DType::F16,
            d => return Err(bad(format!("bad dtype '{d}'"))),
        };
        cfg.attention = match get("attention")?.as_str() {
            "auto" => AttentionKind::Auto,
            "fused" => AttentionKind::Fused,
            "composed" => AttentionKind::Composed,
            a => return Err(bad(format!("bad attention '{a}'"))),
        };
        // Files written before eps was configurable have none: theirs was the default.
        if let Some(eps) = map.get("layer_norm_eps") {
            cfg.layer_norm_eps = parse(eps, "layer_norm_eps", &bad)?;
        }
        Gpt::new(device, cfg)
    }

    /// Checks ids (B, T) against the model, before any device work; `max_t` is the most
    /// positions allowed.
    pub(crate) fn check_ids(
        &self,
        op: &'static str,
        ids: &[u32],
        batch: usize,
        t: usize,
        max_t: usize,
    ) -> Result<()> {
        let (context, v) = (self.cfg.context, self.cfg.vocab_size);
        generate::check_ids(op, ids, batch, t, max_t, context, v)
    }

    /// Checks that every id is below `vocab_size`.
    pub(crate) fn check_vocab(&self, op: &'static str, ids: &[u32]) -> Result<()> {
        generate::check_vocab(op, ids, self.cfg.vocab_size)
    }

    fn check_targets(&self, targets: &[u32], batch: usize, t: usize) -> Result<()> {
        if batch.checked_mul(t) != Some(targets.len()) {
            return Err(Error::InvalidArgument {
                op: "Gpt::loss",
                reason: format!(
                    "{} targets are not batch x t = {batch} x {t}",
                    targets.len()
                ),
            });
        }
        self.check_vocab("Gpt::loss", targets)
    }

    /// Token plus position embeddings of ids (B, T) at positions `start..start + T`, in
    /// `dtype`, then embedding dropout: (B, T, C).
    pub(crate) fn embed(
        &self,
        ids: &[u32],
        batch: usize,
        t: usize,
        start: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let positions: Vec<u32> = (start..start + t).map(|p| p as u32).collect();
        // (B, T, C) + (T, C), broadcast over the batch.
        let tok = self.wte.forward_ids(ids, &[batch, t])?;
        let x = tok.add(&self.wpe.forward_ids(&positions, &[t])?)?;
        self.drop.forward(&x.cast(dtype)?)
    }

    /// x (B, T, C) -> logits (B, T, V): the final LayerNorm, then x · Wteᵀ in `dtype`.
    pub(crate) fn head(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        self.ln_f.forward(x)?.matmul_with(
            &self.wte.weight.cast(dtype)?,
            &MatmulOptions {
                trans_b: true,
                ..Default::default()
            },
        )
    }

    /// Every Linear of the blocks with its parameter prefix (`blocks.{i}.attn.qkv`,
    /// `.attn.proj`, `.mlp.fc`, `.mlp.proj`), to add adapters or quantize weights. An
    /// [`Error::InvalidArgument`] while something else holds a block (a graph of a
    /// checkpointed forward that has not run backward).
    pub fn linears_mut(&mut self) -> Result<Vec<(String, &mut Linear)>> {
        let mut out = Vec::new();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let b = Arc::get_mut(b).ok_or_else(|| Error::InvalidArgument {
                op: "Gpt::linears_mut",
                reason: format!("block {i} is held by a recorded graph; run backward or drop it"),
            })?;
            let p = format!("blocks.{i}");
            out.push((format!("{p}.attn.qkv"), &mut b.attn.qkv));
            out.push((format!("{p}.attn.proj"), &mut b.attn.proj));
            out.push((format!("{p}.mlp.fc"), &mut b.mlp.fc));
            out.push((format!("{p}.mlp.proj"), &mut b.mlp.proj));
        }
        Ok(out)
    }

    /// Detaches every parameter from autograd (embeddings, norms, every Linear's weight and
    /// bias): no gradients, no optimizer state. Adapters added after (or before) stay
    /// trainable. Errors as [`Gpt::linears_mut`].
    pub fn freeze(&mut self) -> Result<()> {
        for (_, l) in self.linears_mut()? {
            l.freeze();
        }
        for b in &mut self.blocks {
            let b = Arc::get_mut(b).expect("checked by linears_mut");
            for n in [&mut b.ln1, &mut b.ln2] {
                n.weight = n.weight.detach();
                n.bias = n.bias.detach();
            }
        }
        self.ln_f.weight = self.ln_f.weight.detach();
        self.ln_f.bias = self.ln_f.bias.detach();
        self.wte.weight = self.wte.weight.detach();
        self.wpe.weight = self.wpe.weight.detach();
        Ok(())
    }

    pub(crate) fn block_list(&self) -> &[Arc<GptBlock>] {
        &self.blocks
    }

    /// Logits (B, T, V) in `dtype`.
    fn logits(&self, ids: &[u32], batch: usize, t: usize, dtype: DType) -> Result<Tensor> {
        self.check_ids("Gpt::forward_ids", ids, batch, t, self.cfg.context)?;
        let mut x = self.embed(ids, batch, t, 0, dtype)?;
        // Streamed blocks train checkpointed: the forward must keep no reference to a block's
        // weights, which leave the device after it (src/residency/).
        let streamed = self
            .blocks
            .first()
            .is_some_and(|b| b.ln1.weight.is_streamed());
        let checkpointed = self.checkpoint_blocks() || (streamed && crate::is_grad_enabled());
        for block in &self.blocks {
            let unit = block.ln1.weight.clone();
            x = if checkpointed {
                let (a, m) = (block.clone(), block.clone());
                crate::nn::unit::checkpoint_halves(
                    &x,
                    &unit,
                    block.half_parameters(),
                    move |h| a.attention_half(h, dtype),
                    move |h| m.mlp_half(h, dtype),
                )?
            } else {
                crate::residency::within(&unit, || block.forward_in(&x, dtype))?
            };
        }
        self.head(&x, dtype)
    }
}

impl Module for Gpt {
    /// Always an [`Error::InvalidArgument`]: a GPT reads host token ids. Use
    /// [`Gpt::forward_ids`].
    fn forward(&self, _x: &Tensor) -> Result<Tensor> {
        Err(Error::InvalidArgument {
            op: "Gpt::forward",
            reason: "a GPT looks up host token ids; call forward_ids(ids, batch, t)".into(),
        })
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let prefixed = |prefix: String, m: &dyn Module| {
            m.named_parameters()
                .into_iter()
                .map(move |(n, t)| (format!("{prefix}.{n}"), t))
        };
        let mut out: Vec<(String, Tensor)> = Vec::new();
        out.extend(prefixed("wte".into(), &self.wte));
        out.extend(prefixed("wpe".into(), &self.wpe));
        for (i, b) in self.blocks.iter().enumerate() {
            out.extend(prefixed(format!("blocks.{i}"), b.as_ref()));
        }
        out.extend(prefixed("ln_f".into(), &self.ln_f));
        out
    }

    /// Each block is a unit (`blocks.{i}`); the embeddings, the tied head and the final
    /// LayerNorm are in none.
    fn units(&self) -> Vec<(String, Vec<Tensor>)> {
        let blocks = self.blocks.iter().enumerate();
        blocks
            .map(|(i, b)| (format!("blocks.{i}"), b.parameters()))
            .collect()
    }

    fn config(&self) -> Vec<(String, String)> {
        let c = self.gpt_config();
        let attention = match c.attention {
            AttentionKind::Auto => "auto",
            AttentionKind::Fused => "fused",
            AttentionKind::Composed => "composed",
        };
        [
            ("kind", "gpt".to_string()),
            ("vocab_size", c.vocab_size.to_string()),
            ("context", c.context.to_string()),
            ("layers", c.layers.to_string()),
            ("heads", c.heads.to_string()),
            ("dim", c.dim.to_string()),
            // Display of f32 is the shortest string that parses back to the same bits.
            ("dropout", c.dropout.to_string()),
            ("checkpoint_blocks", c.checkpoint_blocks.to_string()),
            ("dtype", c.dtype.to_string()),
            ("seed", c.seed.to_string()),
            ("attention", attention.to_string()),
            ("layer_norm_eps", c.layer_norm_eps.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
        self.drop.set_training(training);
        for b in &self.blocks {
            b.set_training(training);
        }
    }
}
