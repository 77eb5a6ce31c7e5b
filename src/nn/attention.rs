//! `CausalSelfAttention`: multi-head causal self-attention as in GPT-2, with one fused QKV
//! projection, the heads split out with reshape / permute / narrow, and an output projection
//! followed by residual dropout. The cached form appends the new keys and values to a per-layer
//! KV cache and attends the new queries over all of them.

use super::{Dropout, Linear, Module};
use crate::{Activation, DType, Error, Result, Tensor};
use crate::{AttentionKind, AttentionOptions};

/// Multi-head causal self-attention: x (B, T, C) -> (B, T, C) with `heads` heads of size
/// C / heads. Built by [`Gpt::new`](super::Gpt::new).
pub struct CausalSelfAttention {
    /// C -> 3C: the queries, keys and values of every head in one matmul (q, k, v in that order
    /// along the output, each head's D columns contiguous inside them, as GPT-2's `c_attn`).
    pub qkv: Linear,
    /// C -> C, applied to the heads joined back together (GPT-2's `c_proj`).
    pub proj: Linear,
    /// Residual dropout after the output projection.
    pub drop: Dropout,
    /// Number of heads; divides C.
    pub heads: usize,
    /// Which attention implementation runs.
    pub kind: AttentionKind,
}

/// The cached keys and values of one layer: each (B, H, T_seen, D).
pub(crate) type LayerKv = Option<(Tensor, Tensor)>;

impl CausalSelfAttention {
    pub(crate) fn from_parts(
        qkv: Linear,
        proj: Linear,
        drop: Dropout,
        heads: usize,
        kind: AttentionKind,
    ) -> CausalSelfAttention {
        CausalSelfAttention {
            qkv,
            proj,
            drop,
            heads,
            kind,
        }
    }

    /// x (B, T, C) -> (B, T, C), every matmul in `dtype` (x must have it; parameters of another
    /// dtype are cast inside the graph). Query t sees positions 0..=t.
    pub fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let (q, k, v) = self.heads_of(x, dtype)?;
        let y = attend(&q, &k, &v, true, self.kind)?;
        self.join(&y, dtype)
    }

    /// `forward_in` for T new positions after those in `kv`: their keys and values are
    /// appended to `kv` (along T), and each new query sees every cached position and the new
    /// ones up to itself.
    pub(crate) fn forward_cached(
        &self,
        x: &Tensor,
        kv: &mut LayerKv,
        dtype: DType,
    ) -> Result<Tensor> {
        let (q, k, v) = self.heads_of(x, dtype)?;
        let (k, v) = match kv.take() {
            // (B, H, T_seen + T, D)
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
            None => (k, v),
        };
        let y = attend(&q, &k, &v, true, self.kind)?;
        *kv = Some((k, v));
        self.join(&y, dtype)
    }

    /// q, k and v of x (B, T, C), each (B, H, T, D).
    fn heads_of(&self, x: &Tensor, dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
        let c = self.qkv.in_features;
        let &[b, t, xc] = x.dims() else {
            return Err(self.shape_error(x));
        };
        if xc != c {
            return Err(self.shape_error(x));
        }
        let (h, d) = (self.heads, c / self.heads);
        // (B, T, 3C) seen as (B, T, 3H, D), heads to the front: (B, 3H, T, D); then q, k and v
        // are the first, second and third H of axis 1.
        let qkv = self
            .qkv
            .forward_in(x, Activation::None, dtype)?
            .reshape(&[b, t, 3 * h, d])?
            .permute(&[0, 2, 1, 3])?;
        Ok((
            qkv.narrow(1, 0, h)?,
            qkv.narrow(1, h, h)?,
            qkv.narrow(1, 2 * h, h)?,
        ))
    }

    /// The heads y (B, H, T, D) joined back to (B, T, C), projected, then dropout.
    fn join(&self, y: &Tensor, dtype: DType) -> Result<Tensor> {
        let &[b, h, t, d] = y.dims() else {
            unreachable!("attention output is (B, H, T, D)")
        };
        let y = y.permute(&[0, 2, 1, 3])?.reshape(&[b, t, h * d])?;
        let y = self.proj.forward_in(&y, Activation::None, dtype)?;
        self.drop.forward(&y)
    }

    fn shape_error(&self, x: &Tensor) -> Error {
        Error::Shape {
            op: "CausalSelfAttention::forward",
            lhs: x.dims().to_vec(),
            rhs: vec![self.qkv.in_features],
            reason: format!(
                "the input must be (batch, time, {}), rank 3",
                self.qkv.in_features
            ),
        }
    }
}

crate::module! {
    impl Module for CausalSelfAttention {
        params { qkv, proj, drop }
        /// x (B, T, C) -> (B, T, C) in the parameters' dtype.
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.forward_in(x, self.qkv.weight.dtype())
        }
    }
}

/// softmax(q · kᵀ / sqrt(D), causal) · v: q is (B, H, T_q, D), k and v (B, KV, T_k, D) with KV
/// dividing H (grouped-query heads), the result (B, H, T_q, D). Self-attention (T_q = T_k)
/// runs [`Tensor::attention_with`] with `kind` (the fused kernels where they can run); a block
/// of new queries against a longer cached key sequence (generation with a KV cache) runs the
/// composed ops on the kv heads repeated for their groups, where causal query i sees keys up to
/// i + T_k - T_q.
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    kind: AttentionKind,
) -> Result<Tensor> {
    if q.dims().get(2) == k.dims().get(2) {
        return q.attention_with(k, v, &AttentionOptions::new().causal(causal).kind(kind));
    }
    let d = q.dims().last().copied().unwrap_or(1).max(1);
    let group = match (q.dims().get(1), k.dims().get(1)) {
        (Some(&h), Some(&kv)) if kv > 0 && h % kv == 0 => h / kv,
        _ => 1,
    };
    let (k, v) = (
        &crate::tensor::repeat_kv(k, group)?,
        &crate::tensor::repeat_kv(v, group)?,
    );
    // scores are (B, H, T_q, T_k)
    let scores = q.matmul_with(k, &crate::MatmulOptions::new().trans_b(true))?;
    let w = scores.softmax_masked(
        crate::SoftmaxOptions::new()
            .scale(1.0 / (d as f32).sqrt())
            .causal(causal),
    )?;
    w.matmul(v)
}
