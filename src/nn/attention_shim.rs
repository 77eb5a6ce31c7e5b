//! Scaled dot-product attention from existing ops, until the fused attention op lands: scores
//! `q · kᵀ` (K read transposed in place by the matmul), a scaled (causal) softmax, then `· v`.
//! The fused op replaces this file; its callers keep the same signature.

use crate::{MatmulOptions, Result, SoftmaxOptions, Tensor};

/// Which attention implementation a model asks for. Until the fused kernel is part of the crate,
/// every kind runs the composed ops (matmul, masked softmax, matmul), which keep the (B, H, T, T)
/// weights for the backward pass.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttnKindLocal {
    /// The fused kernel where the adapter runs it, else the composed ops.
    #[default]
    Auto,
    /// The fused kernel (one pass, no (T, T) weights kept).
    Fused,
    /// Matmul, masked softmax, matmul.
    Composed,
}

/// softmax(q · kᵀ / sqrt(D), causal) · v: q is (B, H, T_q, D), k and v (B, H, T_k, D), the result
/// (B, H, T_q, D). With `causal`, query i sees keys up to i + T_k - T_q (a block of new queries
/// at the end of a longer cached key sequence).
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
    kind: AttnKindLocal,
) -> Result<Tensor> {
    // Every kind is composed here (see AttnKindLocal).
    let _ = kind;
    let d = q.dims().last().copied().unwrap_or(1).max(1);
    // scores are (B, H, T_q, T_k)
    let scores = q.matmul_with(
        k,
        &MatmulOptions {
            trans_b: true,
            ..Default::default()
        },
    )?;
    let w = scores.softmax_masked(
        SoftmaxOptions::new()
            .scale(1.0 / (d as f32).sqrt())
            .causal(causal),
    )?;
    w.matmul(v)
}
