//! Autoregressive generation for any [`LanguageModel`] ([`Gpt`](super::Gpt),
//! [`Llama`](super::Llama)) with a KV cache: each block keeps the keys and values of the
//! positions seen so far, so a new token runs through the blocks alone (one query over the
//! cached keys) instead of the whole context again. Knows no model: each implements
//! [`LanguageModel`] in its own files.

use super::attention::LayerKv;
use super::Module;
use crate::tensor::Rng;
use crate::{DType, Error, Result, SoftmaxOptions, Tensor};

/// What evaluation over windows and generation need from a causal language model.
pub trait LanguageModel: Module {
    /// Token ids are `0..vocab_size()`.
    fn vocab_size(&self) -> usize;
    /// The most positions a forward sees.
    fn context(&self) -> usize;
    /// The parameters' dtype.
    fn dtype(&self) -> DType;
    /// An empty KV cache for this model.
    fn kv_cache(&self) -> KvCache;
    /// Logits (B, T, V) of ids (B, T) at positions `cache.len()..`, attending over the cached
    /// positions too, whose keys and values are appended to `cache`; records no graph.
    fn forward_cached(
        &self,
        ids: &[u32],
        batch: usize,
        t: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor>;
    /// Mean next-token cross-entropy (f32, rank 0) of ids (B, T) against targets, every matmul
    /// in `dtype`.
    fn loss_in(
        &self,
        ids: &[u32],
        targets: &[u32],
        batch: usize,
        t: usize,
        dtype: DType,
    ) -> Result<Tensor>;
    /// Whether the model is in training mode.
    fn is_training(&self) -> bool;

    /// Checks that every id is below `vocab_size()`.
    fn check_vocab(&self, op: &'static str, ids: &[u32]) -> Result<()> {
        check_vocab(op, ids, self.vocab_size())
    }

    /// [`Gpt::generate_with`](super::Gpt::generate_with) for this model.
    fn generate_with(&self, prompt: &[u32], max_new: usize, sampling: &Sampling) -> Result<Vec<u32>>
    where
        Self: Sized,
    {
        generate(self, prompt, max_new, sampling)
    }
}

/// Checks that every id is below `v`.
pub(crate) fn check_vocab(op: &'static str, ids: &[u32], v: usize) -> Result<()> {
    match ids.iter().enumerate().find(|(_, &id)| id as usize >= v) {
        Some((i, id)) => Err(Error::InvalidArgument {
            op,
            reason: format!("id {id} at position {i} is out of range for a vocabulary of {v}"),
        }),
        None => Ok(()),
    }
}

/// Checks ids (B, T) for a model of `context` positions and vocabulary `v`, before any device
/// work; `max_t` is the most positions allowed (fewer than `context` behind a KV cache).
pub(crate) fn check_ids(
    op: &'static str,
    ids: &[u32],
    batch: usize,
    t: usize,
    max_t: usize,
    context: usize,
    v: usize,
) -> Result<()> {
    let bad = |reason: String| Err(Error::InvalidArgument { op, reason });
    if batch == 0 || t == 0 {
        return bad(format!("batch and t must be at least 1, got {batch} x {t}"));
    }
    if batch.checked_mul(t) != Some(ids.len()) {
        return bad(format!(
            "{} ids are not batch x t = {batch} x {t}",
            ids.len()
        ));
    }
    if t > max_t {
        return bad(if max_t == context {
            format!(
                "t = {t} passes the context of {context}; feed at most the last {context} tokens"
            )
        } else {
            format!(
                "t = {t} passes the {max_t} positions the cache leaves of the context of \
                 {context}; clear the cache and feed at most the last {context} tokens"
            )
        });
    }
    check_vocab(op, ids, v)
}

/// The keys and values each block of a model computed for the positions fed so far (each
/// (B, KV heads, T_seen, D)), for [`LanguageModel::forward_cached`]. Made by the model's
/// `kv_cache()`.
pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
    batch: usize,
}

impl KvCache {
    /// An empty cache for a model of `layers` blocks.
    pub(crate) fn with_layers(layers: usize) -> KvCache {
        KvCache {
            layers: (0..layers).map(|_| None).collect(),
            len: 0,
            batch: 0,
        }
    }

    pub(crate) fn layers_mut(&mut self) -> &mut [LayerKv] {
        &mut self.layers
    }

    /// The checks of a cached forward: a cache of this model (`layers`), the same batch.
    pub(crate) fn check(&self, op: &'static str, layers: usize, batch: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { op, reason });
        if self.layers.len() != layers {
            return bad(format!(
                "the cache holds {} layers, the model {layers}; make it with this model's kv_cache()",
                self.layers.len()
            ));
        }
        if !self.is_empty() && self.batch != batch {
            return bad(format!(
                "the cache holds a batch of {}, not {batch}",
                self.batch
            ));
        }
        Ok(())
    }

    /// Counts `t` more positions of a batch of `batch`.
    pub(crate) fn advance(&mut self, t: usize, batch: usize) {
        self.len += t;
        self.batch = batch;
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops every cached key and value (the next forward starts at position 0).
    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(|l| *l = None);
        self.len = 0;
        self.batch = 0;
    }
}

/// Puts the model back in the mode it was in when generation started, error or not.
struct RestoreMode<'a, M: Module> {
    model: &'a M,
    training: bool,
}

impl<M: Module> Drop for RestoreMode<'_, M> {
    fn drop(&mut self) {
        self.model.set_training(self.training);
    }
}

/// [`Gpt::generate_with`](super::Gpt::generate_with) for any [`LanguageModel`].
pub(crate) fn generate<M: LanguageModel>(
    model: &M,
    prompt: &[u32],
    max_new: usize,
    sampling: &Sampling,
) -> Result<Vec<u32>> {
    const OP: &str = "Gpt::generate";
    let bad = |reason: String| Error::InvalidArgument { op: OP, reason };
    let Sampling {
        temperature,
        top_k,
        top_p,
        seed,
    } = *sampling;
    if top_k == Some(0) || top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
        return Err(bad(format!(
            "top_k must be at least 1 and top_p in (0, 1], got {top_k:?} and {top_p:?}"
        )));
    }
    if prompt.is_empty() {
        return Err(bad("the prompt needs at least one token".into()));
    }
    let scale = 1.0 / temperature;
    if !(temperature.is_finite() && temperature > 0.0 && scale.is_finite()) {
        return Err(bad(format!(
            "temperature must be finite and > 0 (with a finite inverse), got {temperature}"
        )));
    }
    model.check_vocab(OP, prompt)?;
    let context = model.context();
    let _g = crate::no_grad();
    let _mode = RestoreMode {
        model,
        training: model.is_training(),
    };
    model.set_training(false);
    let mut rng = Rng::new(seed);
    let mut out = prompt.to_vec();
    let mut cache = model.kv_cache();
    // The cache covers out[start..start + cache.len()].
    let mut start = 0;
    // While planning (the whole run's plan), readbacks are zeros: any token will do, and
    // once the window has slid twice every later step repeats the same allocations.
    let planning = model
        .parameters()
        .first()
        .is_some_and(|p| p.device().is_planning());
    let mut slides = 0;
    for _ in 0..max_new {
        let n = out.len();
        let w = n.saturating_sub(context);
        let logits = if start == w && cache.len() + 1 == n - w {
            model.forward_cached(&out[n - 1..], 1, 1, &mut cache)?
        } else {
            // First step, or the window slid: every position moved.
            cache.clear();
            start = w;
            slides += usize::from(w > 0);
            model.forward_cached(&out[w..], 1, n - w, &mut cache)?
        };
        // The last position's distribution, (V).
        let t = logits.dims()[1];
        let mut probs = logits
            .narrow(1, t - 1, 1)?
            .softmax_masked(SoftmaxOptions::new().scale(scale))?
            .to_vec_f32()?;
        if planning {
            if slides >= 2 {
                break;
            }
            out.push(0);
            continue;
        }
        keep_top(&mut probs, top_k, top_p);
        out.push(sample(&probs, &mut rng).ok_or_else(|| {
            bad("the next-token probabilities are not finite (do the weights hold NaN?)".into())
        })?);
    }
    Ok(out)
}

/// How [`Gpt::generate_with`](super::Gpt::generate_with) picks each token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Logits are divided by it before the softmax (> 0).
    pub temperature: f32,
    /// Keep only the `k` most probable tokens (ties: the lower id first).
    pub top_k: Option<usize>,
    /// Keep the smallest most-probable set of tokens whose probabilities add up to `p`.
    pub top_p: Option<f32>,
    /// Seed of the host generator that draws the tokens.
    pub seed: u64,
}

impl Sampling {
    /// Plain sampling at `temperature`, no top-k or top-p.
    pub fn new(temperature: f32, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_k: None,
            top_p: None,
            seed,
        }
    }
}

/// Zeroes every probability outside the `top_k` largest and then outside the smallest set of
/// the largest whose sum reaches `top_p` of what is left (at least one token is kept).
fn keep_top(probs: &mut [f32], top_k: Option<usize>, top_p: Option<f32>) {
    if top_k.is_none() && top_p.is_none() {
        return;
    }
    // Most probable first, ties by id; NaN last (sample() then reports it).
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| {
        probs[b]
            .partial_cmp(&probs[a])
            .unwrap_or_else(|| probs[a].is_nan().cmp(&probs[b].is_nan()))
            .then(a.cmp(&b))
    });
    let mut keep = top_k.unwrap_or(probs.len()).min(probs.len());
    if let Some(p) = top_p {
        let total: f64 = order[..keep].iter().map(|&i| probs[i] as f64).sum();
        let mut acc = 0.0f64;
        let mut n = 0;
        while n < keep {
            acc += probs[order[n]] as f64;
            n += 1;
            if acc >= p as f64 * total {
                break;
            }
        }
        keep = n.max(1);
    }
    for &i in &order[keep..] {
        probs[i] = 0.0;
    }
}

/// An index drawn from `probs` (summing to about 1) by inverse transform; `None` when they are
/// not finite.
fn sample(probs: &[f32], rng: &mut Rng) -> Option<u32> {
    let total: f64 = probs.iter().map(|&p| p as f64).sum();
    if !(total.is_finite() && total > 0.0) {
        return None;
    }
    let u = rng.next_f64() * total;
    let mut acc = 0.0f64;
    for (i, &p) in probs.iter().enumerate() {
        acc += p as f64;
        if u < acc {
            return Some(i as u32);
        }
    }
    // Rounding left u at the very top: the last token with any mass.
    probs.iter().rposition(|&p| p > 0.0).map(|i| i as u32)
}

#[cfg(test)]
mod tests {
    use super::keep_top;

    #[test]
    fn top_k_and_top_p_keep_the_most_probable() {
        let p = [0.1f32, 0.4, 0.2, 0.2, 0.1];
        let run = |k, q| {
            let mut v = p;
            keep_top(&mut v, k, q);
            v
        };
        assert_eq!(run(None, None), p);
        assert_eq!(run(Some(1), None), [0.0, 0.4, 0.0, 0.0, 0.0]);
        // Ties by id: the first 0.2 before the second.
        assert_eq!(run(Some(2), None), [0.0, 0.4, 0.2, 0.0, 0.0]);
        assert_eq!(run(Some(9), None), p);
        // 0.4 + 0.2 reaches 0.55; 0.4 alone reaches 0.4.
        assert_eq!(run(None, Some(0.55)), [0.0, 0.4, 0.2, 0.0, 0.0]);
        assert_eq!(run(None, Some(0.35)), [0.0, 0.4, 0.0, 0.0, 0.0]);
        assert_eq!(run(None, Some(1.0)), p);
        // top-p of what top-k left: 0.4 of 0.4 + 0.2 + 0.2 = 0.8 passes 0.45 of it.
        assert_eq!(run(Some(3), Some(0.45)), [0.0, 0.4, 0.0, 0.0, 0.0]);
    }
}
