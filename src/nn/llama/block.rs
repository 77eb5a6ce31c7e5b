//! The layers of a [`Llama`](super::Llama) block: [`RmsNorm`], grouped-query attention with
//! rotary positions ([`LlamaAttention`], reading shared kv heads in place), the SwiGLU
//! [`LlamaMlp`], and [`LlamaBlock`], run whole, against a KV cache, or checkpointed in two
//! halves.

use crate::nn::{Linear, Module};
use crate::tensor::Rope;
use crate::{Activation, AttentionKind, DType, Device, Error, Result, Tensor};
use std::sync::Arc;

/// RMSNorm over the last dim with a weight (Llama's `LlamaRMSNorm`), see [`Tensor::rms_norm`].
pub struct RmsNorm {
    /// (C), ones at init.
    pub weight: Tensor,
    /// Added to the mean square.
    pub eps: f32,
}

impl RmsNorm {
    /// Ones of width `dim` in `dtype`.
    pub fn new(device: &Device, dim: usize, eps: f32, dtype: DType) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: Tensor::ones(device, &[dim], dtype)?.with_requires_grad(),
            eps,
        })
    }
}

impl Module for RmsNorm {
    /// x (.., C) in any dtype; a weight of another dtype is cast inside the graph.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.rms_norm(Some(&self.weight.cast(x.dtype())?), self.eps)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".into(), self.weight.clone())]
    }
}

/// Grouped-query self-attention with rotary positions: q, k, v and o projections
/// (transformers' `q_proj`, `k_proj`, `v_proj`, `o_proj`).
pub struct LlamaAttention {
    /// C -> H D
    pub q_proj: Linear,
    /// C -> KV D
    pub k_proj: Linear,
    /// C -> KV D
    pub v_proj: Linear,
    /// H D -> C
    pub o_proj: Linear,
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    pub(super) head_dim: usize,
    pub(super) kind: AttentionKind,
}

impl LlamaAttention {
    /// x (B, T, C) at positions `rope`'s -> (B, T, C); `kv` holds the cached keys and values
    /// (B, KV, T_seen, D) when generating, and gets these positions' appended.
    fn forward_in(
        &self,
        x: &Tensor,
        rope: &Rope,
        kv: Option<&mut crate::nn::attention::LayerKv>,
        dtype: DType,
    ) -> Result<Tensor> {
        let &[b, t, _] = x.dims() else {
            return Err(Error::Shape {
                op: "LlamaAttention::forward",
                lhs: x.dims().to_vec(),
                rhs: vec![],
                reason: "the input must be (batch, time, hidden), rank 3".into(),
            });
        };
        let d = self.head_dim;
        // (B, T, N D) -> (B, N, T, D)
        let split = |y: Tensor, n: usize| y.reshape(&[b, t, n, d])?.permute(&[0, 2, 1, 3]);
        let q = split(
            self.q_proj.forward_in(x, Activation::None, dtype)?,
            self.heads,
        )?;
        let k = split(
            self.k_proj.forward_in(x, Activation::None, dtype)?,
            self.kv_heads,
        )?;
        let v = split(
            self.v_proj.forward_in(x, Activation::None, dtype)?,
            self.kv_heads,
        )?;
        let (q, k) = (q.rope_with(rope)?, k.rope_with(rope)?);
        let y = match kv {
            None => crate::nn::attention::attend(&q, &k, &v, true, self.kind)?,
            Some(kv) => {
                let (k, v) = match kv.take() {
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                    None => (k, v),
                };
                let y = crate::nn::attention::attend(&q, &k, &v, true, self.kind)?;
                *kv = Some((k, v));
                y
            }
        };
        let y = y.permute(&[0, 2, 1, 3])?.reshape(&[b, t, self.heads * d])?;
        self.o_proj.forward_in(&y, Activation::None, dtype)
    }
}

/// The SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
pub struct LlamaMlp {
    /// C -> I
    pub gate_proj: Linear,
    /// C -> I
    pub up_proj: Linear,
    /// I -> C
    pub down_proj: Linear,
}

impl LlamaMlp {
    fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let gate = self.gate_proj.forward_in(x, Activation::None, dtype)?;
        let up = self.up_proj.forward_in(x, Activation::None, dtype)?;
        self.down_proj
            .forward_in(&gate.swiglu(&up)?, Activation::None, dtype)
    }
}

/// One decoder layer: `h = x + attn(norm1(x))`, `out = h + mlp(norm2(h))`.
pub struct LlamaBlock {
    /// Before the attention.
    pub input_layernorm: RmsNorm,
    /// Grouped-query self-attention with rotary positions.
    pub self_attn: LlamaAttention,
    /// Before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// The SwiGLU MLP.
    pub mlp: LlamaMlp,
}

impl LlamaBlock {
    pub(super) fn forward_in(
        &self,
        x: &Tensor,
        rope: &Rope,
        kv: Option<&mut crate::nn::attention::LayerKv>,
        dtype: DType,
    ) -> Result<Tensor> {
        let a = self
            .self_attn
            .forward_in(&self.input_layernorm.forward(x)?, rope, kv, dtype)?;
        self.mlp_half(&x.add(&a)?, dtype)
    }

    /// The first residual half: x + attention(norm(x)), no cache.
    fn attention_half(&self, x: &Tensor, rope: &Rope, dtype: DType) -> Result<Tensor> {
        let a = self
            .self_attn
            .forward_in(&self.input_layernorm.forward(x)?, rope, None, dtype)?;
        x.add(&a)
    }

    /// The second residual half: h + mlp(norm(h)).
    fn mlp_half(&self, h: &Tensor, dtype: DType) -> Result<Tensor> {
        let m = self
            .mlp
            .forward_in(&self.post_attention_layernorm.forward(h)?, dtype)?;
        h.add(&m)
    }

    /// The parameters of each half, the inputs of its checkpointed segment.
    fn half_parameters(&self) -> [Vec<Tensor>; 2] {
        let mut attn = self.input_layernorm.parameters();
        attn.extend(self.self_attn.parameters());
        let mut mlp = self.post_attention_layernorm.parameters();
        mlp.extend(self.mlp.parameters());
        [attn, mlp]
    }

    /// x -> the block's output with each half checkpointed
    /// ([`checkpoint_halves`](crate::nn::unit::checkpoint_halves)).
    pub(super) fn checkpointed(
        self: &Arc<Self>,
        x: &Tensor,
        rope: &Rope,
        dtype: DType,
    ) -> Result<Tensor> {
        let (a, m, r) = (self.clone(), self.clone(), rope.clone());
        crate::nn::unit::checkpoint_halves(
            x,
            &self.input_layernorm.weight,
            self.half_parameters(),
            move |h| a.attention_half(h, &r, dtype),
            move |h| m.mlp_half(h, dtype),
        )
    }
}

pub(super) fn prefixed(prefix: &str, m: &dyn Module) -> Vec<(String, Tensor)> {
    m.named_parameters()
        .into_iter()
        .map(|(n, t)| (format!("{prefix}.{n}"), t))
        .collect()
}

crate::module! {
    impl Module for LlamaAttention {
        params { q_proj, k_proj, v_proj, o_proj }
        /// Always an error: the attention needs its positions; run the whole
        /// [`Llama`](super::Llama).
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let _ = x;
            Err(Error::InvalidArgument {
                op: "LlamaAttention::forward",
                reason: "the attention needs its positions: run the Llama".into(),
            })
        }
    }
}

crate::module! {
    impl Module for LlamaMlp {
        params { gate_proj, up_proj, down_proj }
        /// x (.., C) -> (.., C) in the parameters' dtype.
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.forward_in(x, self.gate_proj.weight.dtype())
        }
    }
}

crate::module! {
    impl Module for LlamaBlock {
        params { input_layernorm, self_attn, post_attention_layernorm, mlp }
        /// Always an error: the block needs its positions; run the whole
        /// [`Llama`](super::Llama).
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let _ = x;
            Err(Error::InvalidArgument {
                op: "LlamaBlock::forward",
                reason: "the block needs its positions: run the Llama".into(),
            })
        }
    }
}
