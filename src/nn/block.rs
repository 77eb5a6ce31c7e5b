//! `GptBlock`: a pre-LayerNorm transformer block, x + attn(ln1(x)), then h + mlp(ln2(h)), and
//! its `FeedForward` (C -> 4C, gelu, 4C -> C, residual dropout).

use super::attention::{CausalSelfAttention, LayerKv};
use super::{Dropout, LayerNorm, Linear, Module};
use crate::{Activation, DType, Result, Tensor};

/// The block's MLP: x (.., C) -> (.., C) through 4C hidden units with gelu.
pub struct FeedForward {
    /// C -> 4C (GPT-2's `c_fc`).
    pub fc: Linear,
    /// 4C -> C (GPT-2's `c_proj`), a residual projection.
    pub proj: Linear,
    /// Residual dropout after the projection.
    pub drop: Dropout,
}

impl FeedForward {
    /// x (.., C) -> (.., C), every matmul in `dtype`.
    pub fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        // The gelu is never fused into the matmul's epilogue: a recorded matmul runs it as a
        // separate op anyway, and the same op both times keeps a checkpointed block's first
        // forward (no graph) bitwise equal to its recomputation and to an unchecked forward.
        let h = self.fc.forward_in(x, Activation::None, dtype)?.gelu()?;
        self.drop
            .forward(&self.proj.forward_in(&h, Activation::None, dtype)?)
    }
}

crate::module! {
    impl Module for FeedForward {
        params { fc, proj, drop }
        /// x (.., C) -> (.., C) in the parameters' dtype.
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.forward_in(x, self.fc.weight.dtype())
        }
    }
}

/// One GPT-2 block: x (B, T, C) -> h = x + attn(ln1(x)) -> h + mlp(ln2(h)), (B, T, C).
pub struct GptBlock {
    /// Before attention.
    pub ln1: LayerNorm,
    /// Causal self-attention with its residual dropout.
    pub attn: CausalSelfAttention,
    /// Before the MLP.
    pub ln2: LayerNorm,
    /// The feed-forward part with its residual dropout.
    pub mlp: FeedForward,
}

impl GptBlock {
    /// x (B, T, C) -> (B, T, C), every matmul in `dtype` (x must have it).
    pub fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        self.mlp_half(&self.attention_half(x, dtype)?, dtype)
    }

    /// The block's first residual half: x (B, T, C) -> x + attn(ln1(x)). A checkpointed GPT
    /// runs each half as its own segment, so backward recomputes half a block at a time.
    pub fn attention_half(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        x.add(&self.attn.forward_in(&self.ln1.forward(x)?, dtype)?)
    }

    /// The block's second residual half: h (B, T, C) -> h + mlp(ln2(h)).
    pub fn mlp_half(&self, h: &Tensor, dtype: DType) -> Result<Tensor> {
        h.add(&self.mlp.forward_in(&self.ln2.forward(h)?, dtype)?)
    }

    /// The parameters of [`attention_half`](Self::attention_half) (ln1, attn) and of
    /// [`mlp_half`](Self::mlp_half) (ln2, mlp), the inputs of each checkpointed segment.
    pub fn half_parameters(&self) -> [Vec<Tensor>; 2] {
        let mut attn = self.ln1.parameters();
        attn.extend(self.attn.parameters());
        let mut mlp = self.ln2.parameters();
        mlp.extend(self.mlp.parameters());
        [attn, mlp]
    }

    /// `forward_in` of new positions after those cached in `kv` (which gets their keys and
    /// values).
    pub(crate) fn forward_cached(
        &self,
        x: &Tensor,
        kv: &mut LayerKv,
        dtype: DType,
    ) -> Result<Tensor> {
        let h = x.add(&self.attn.forward_cached(&self.ln1.forward(x)?, kv, dtype)?)?;
        self.mlp_half(&h, dtype)
    }
}

crate::module! {
    impl Module for GptBlock {
        params { ln1, attn, ln2, mlp }
        /// x (B, T, C) -> (B, T, C) in the parameters' dtype.
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.forward_in(x, self.ln1.weight.dtype())
        }
    }
}
