//! Matrix products: `matmul`, the transposed forms backward needs, and the fused Linear forward.

use super::{Shape, Tensor};
use crate::kernels::matmul::{self, Activation, Problem, Variant};
use crate::{Error, Result};

/// Options of [`Tensor::matmul_with`].
#[derive(Clone, Copy, Debug, Default)]
pub struct MatmulOptions<'a> {
    /// Use Aᵀ: `self` is stored (.., K, M).
    pub trans_a: bool,
    /// Use Bᵀ: `other` is stored (.., N, K).
    pub trans_b: bool,
    /// Added to every row of the result; shape (N).
    pub bias: Option<&'a Tensor>,
    pub activation: Activation,
}

impl Tensor {
    /// (.., M, K) · (.., K, N) -> (.., M, N). Leading (batch) dims must be equal, or one side
    /// may have none (a matrix shared by every batch).
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        self.matmul_with(other, &MatmulOptions::default())
    }

    /// `matmul` with transposed operands (read in place, never copied), a bias and an
    /// activation fused into the same kernel.
    pub fn matmul_with(&self, other: &Tensor, opts: &MatmulOptions) -> Result<Tensor> {
        let (pb, out_dims) = self.matmul_problem(other, opts)?;
        let out = Tensor::uninit(self.device(), Shape::new(&out_dims)?, self.dtype())?;
        let variant = matmul::select(self.device(), &pb, self, other, opts.bias, &out)?;
        matmul::run(self.device(), variant, &pb, self, other, opts.bias, &out)?;
        Ok(out)
    }

    /// `matmul_with` forcing one kernel variant (tests and benchmarks).
    #[doc(hidden)]
    pub fn matmul_variant(
        &self,
        other: &Tensor,
        opts: &MatmulOptions,
        variant: Variant,
    ) -> Result<Tensor> {
        let (pb, out_dims) = self.matmul_problem(other, opts)?;
        let out = Tensor::uninit(self.device(), Shape::new(&out_dims)?, self.dtype())?;
        matmul::run(self.device(), variant, &pb, self, other, opts.bias, &out)?;
        Ok(out)
    }

    pub(crate) fn matmul_problem(
        &self,
        other: &Tensor,
        opts: &MatmulOptions,
    ) -> Result<(Problem, Vec<usize>)> {
        const OP: &str = "matmul";
        self.same_device_and_dtype(OP, other)?;
        let err = |reason: &str| Error::Shape {
            op: OP,
            lhs: self.dims().to_vec(),
            rhs: other.dims().to_vec(),
            reason: reason.to_string(),
        };
        let (ad, bd) = (self.dims(), other.dims());
        if ad.len() < 2 || bd.len() < 2 {
            return Err(err("both operands need rank >= 2"));
        }
        let (a_rows, a_cols) = (ad[ad.len() - 2], ad[ad.len() - 1]);
        let (b_rows, b_cols) = (bd[bd.len() - 2], bd[bd.len() - 1]);
        let (m, k) = if opts.trans_a {
            (a_cols, a_rows)
        } else {
            (a_rows, a_cols)
        };
        let (kb, n) = if opts.trans_b {
            (b_cols, b_rows)
        } else {
            (b_rows, b_cols)
        };
        if k != kb {
            return Err(err(&format!("inner dims differ: {k} and {kb}")));
        }
        let (a_lead, b_lead) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
        let lead = match (a_lead.is_empty(), b_lead.is_empty()) {
            (_, true) => a_lead,
            (true, false) => b_lead,
            (false, false) if a_lead == b_lead => a_lead,
            _ => return Err(err("batch dims must be equal, or one side must have none")),
        };
        if let Some(bias) = opts.bias {
            self.same_device_and_dtype(OP, bias)?;
            if bias.dims() != [n] {
                return Err(Error::Shape {
                    op: "matmul bias",
                    lhs: vec![m, n],
                    rhs: bias.dims().to_vec(),
                    reason: format!("bias must have shape [{n}]"),
                });
            }
        }
        let mut out_dims = lead.to_vec();
        out_dims.extend([m, n]);
        let pb = Problem {
            batch: lead.iter().product(),
            m,
            n,
            k,
            trans_a: opts.trans_a,
            trans_b: opts.trans_b,
            a_batch: if a_lead.is_empty() { 0 } else { m * k },
            b_batch: if b_lead.is_empty() { 0 } else { k * n },
            bias: opts.bias.is_some(),
            activation: opts.activation,
        };
        Ok((pb, out_dims))
    }
}
