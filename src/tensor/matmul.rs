//! Matrix products: `matmul`, the transposed forms backward needs, and the fused Linear forward.

use super::invariant;
use super::operand::staged_f32;
use super::{Shape, Tensor};
use crate::kernels::elementwise::{self, BinaryOp};
use crate::kernels::matmul::{self, Epilogue, Problem, Variant};
use crate::tensor::autograd::{self, grad_if, record};
use crate::{Activation, Error, Result};

/// Options of [`Tensor::matmul_with`], built from [`Default`] with the chained setters (new
/// options may be added):
///
/// ```no_run
/// # fn f(x: &fitgrad::Tensor, w: &fitgrad::Tensor, b: &fitgrad::Tensor) -> fitgrad::Result<()> {
/// use fitgrad::{Activation, MatmulOptions};
/// // x is (B, IN), w is (OUT, IN) as torch stores it, b is (OUT): relu(x · wᵀ + b) is (B, OUT).
/// let opts = MatmulOptions::new().trans_b(true).bias(b).activation(Activation::Relu);
/// let y = x.matmul_with(w, &opts)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct MatmulOptions<'a> {
    /// Use Aᵀ: `self` is stored (.., K, M).
    pub trans_a: bool,
    /// Use Bᵀ: `other` is stored (.., N, K).
    pub trans_b: bool,
    /// Added to every row of the result; shape (N).
    pub bias: Option<&'a Tensor>,
    /// Applied to the result (after the bias); relu and gelu are fused into the kernel's store.
    pub activation: Activation,
    /// Sums over K in blocks of 16 (each from zero, the block sums added in order), for a K that
    /// runs over a batch's rows: a weight gradient. A batch split at multiples of 16 rows
    /// (micro-batches, data-parallel ranks) then sums each block with the same bits, and only
    /// the few additions of block sums round differently.
    pub k_blocks: bool,
}

impl<'a> MatmulOptions<'a> {
    /// A plain product (as `Default`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads `self` transposed: it is stored (.., K, M).
    pub fn trans_a(mut self, trans_a: bool) -> Self {
        self.trans_a = trans_a;
        self
    }

    /// Reads `other` transposed: it is stored (.., N, K).
    pub fn trans_b(mut self, trans_b: bool) -> Self {
        self.trans_b = trans_b;
        self
    }

    /// Sums over K in blocks of 16 rows (see the field).
    pub fn k_blocks(mut self, k_blocks: bool) -> Self {
        self.k_blocks = k_blocks;
        self
    }

    /// Adds `bias` (shape (N)) to every row of the result.
    pub fn bias(mut self, bias: &'a Tensor) -> Self {
        self.bias = Some(bias);
        self
    }

    /// Applies `activation` to the result (with the bias added).
    pub fn activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }
}

impl Tensor {
    /// (.., M, K) · (.., K, N) -> (.., M, N). Leading (batch) dims must be equal (up to leading
    /// 1s), or one side may hold a single matrix shared by every batch (no leading dims, or all
    /// 1s): (B, H, T, D) · (B, H, D, T) -> (B, H, T, T), (B, T, D) · (D, N) -> (B, T, N),
    /// (1, 1, T, D) · (B, H, D, T) -> (B, H, T, T).
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        self.matmul_with(other, &MatmulOptions::default())
    }

    /// `matmul` with transposed operands (read in place, never copied), a bias and an
    /// activation: relu and gelu are fused into the same kernel, tanh and sigmoid run as their
    /// own op after it.
    ///
    /// Recorded for autograd with a fused relu (its backward needs only the output). A fused
    /// gelu's backward needs the pre-activation, so while recording it runs as matmul + bias,
    /// then a recorded gelu.
    pub fn matmul_with(&self, other: &Tensor, opts: &MatmulOptions) -> Result<Tensor> {
        let recording = autograd::is_grad_enabled()
            && (self.requires_grad()
                || other.requires_grad()
                || opts.bias.is_some_and(|b| b.requires_grad()));
        let plain = || {
            self.matmul_with(
                other,
                &MatmulOptions {
                    activation: Activation::None,
                    ..*opts
                },
            )
        };
        match opts.activation {
            Activation::Gelu if recording => return plain()?.gelu(),
            Activation::Tanh => return plain()?.tanh(),
            Activation::Sigmoid => return plain()?.sigmoid(),
            Activation::Silu => return plain()?.silu(),
            _ => {}
        }
        let (pb, out_dims) = self.matmul_problem(other, opts)?;
        let out = Tensor::uninit(self.device(), Shape::new(&out_dims)?, self.dtype())?;
        let variant = matmul::select(self.device(), &pb, self.dtype(), |v| {
            run_variant(v, &pb, self, other, opts.bias, &out)
        })?;
        run_variant(variant, &pb, self, other, opts.bias, &out)?;
        if !recording {
            return Ok(out);
        }
        let relu_out = (opts.activation == Activation::Relu).then(|| out.detach());
        let (ta, tb) = (opts.trans_a, opts.trans_b);
        let (a, b) = (self.detach(), other.detach());
        let mut inputs = vec![self, other];
        inputs.extend(opts.bias);
        Ok(record("matmul", out, &inputs, move || {
            Box::new(move |g, need| matmul_backward(g, &a, &b, ta, tb, relu_out.as_ref(), need))
        }))
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
        run_variant(variant, &pb, self, other, opts.bias, &out)?;
        match opts.activation {
            Activation::Tanh => out.tanh(),
            Activation::Sigmoid => out.sigmoid(),
            Activation::Silu => out.silu(),
            _ => Ok(out),
        }
    }

    /// The kernel variant `self.matmul_with(other, opts)` runs now: the autotuner's choice,
    /// timed now if its shape class was never timed (benchmark reports name it).
    #[doc(hidden)]
    pub fn matmul_chosen(&self, other: &Tensor, opts: &MatmulOptions) -> Result<Variant> {
        let (pb, dims) = self.matmul_problem(other, opts)?;
        let out = Tensor::uninit(self.device(), Shape::new(&dims)?, self.dtype())?;
        matmul::select(self.device(), &pb, self.dtype(), |v| {
            run_variant(v, &pb, self, other, opts.bias, &out)
        })
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
        // Leading (batch) dims: equal once left-padded with 1s, or one side holds a single
        // matrix (no leading dims, or all 1s) that every batch shares.
        let (a_lead, b_lead) = (&ad[..ad.len() - 2], &bd[..bd.len() - 2]);
        let single = |l: &[usize]| l.iter().product::<usize>() == 1;
        let rank = a_lead.len().max(b_lead.len());
        let pad = |l: &[usize]| {
            let mut p = vec![1; rank - l.len()];
            p.extend_from_slice(l);
            p
        };
        let (a_pad, b_pad) = (pad(a_lead), pad(b_lead));
        let lead = if a_pad == b_pad || single(b_lead) {
            a_pad
        } else if single(a_lead) {
            b_pad
        } else {
            return Err(err(
                "batch dims must be equal, or one side must hold a single matrix",
            ));
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
            k_blocks: opts.k_blocks,
            onto: false,
            a_batch: if single(a_lead) { 0 } else { m * k },
            b_batch: if single(b_lead) { 0 } else { k * n },
            bias: opts.bias.is_some(),
            epilogue: match opts.activation {
                Activation::Relu => Epilogue::Relu,
                Activation::Gelu => Epilogue::Gelu,
                // Applied by matmul_with as their own ops.
                Activation::None | Activation::Tanh | Activation::Sigmoid | Activation::Silu => {
                    Epilogue::None
                }
            },
        };
        Ok((pb, out_dims))
    }
}

/// Runs `variant` of the matmul `pb` into `out`, through an f32 temporary where packed f16 rows
/// need one.
fn run_variant(
    variant: Variant,
    pb: &Problem,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<()> {
    let dev = out.device();
    let staged = matmul::needs_f32_staging(dev, variant, pb, out.dtype());
    staged_f32(out, staged, |out| {
        matmul::run(dev, variant, pb, a, b, bias, out)
    })
}

/// Gradients of `C = act(op(A) · op(B) + bias)` for A, B and (when present) the bias, from the
/// output gradient `g` (.., M, N). Transposed operands get gradients in their stored layout, and
/// every product reads its operands in place (no transpose is materialized).
fn matmul_backward(
    g: &Tensor,
    a: &Tensor,
    b: &Tensor,
    ta: bool,
    tb: bool,
    relu_out: Option<&Tensor>,
    need: &[bool],
) -> Result<Vec<Option<Tensor>>> {
    let g = match relu_out {
        Some(y) => {
            let masked = Tensor::uninit(g.device(), g.shape().clone(), g.dtype())?;
            elementwise::binary(BinaryOp::ReluBackward, g, y, &masked)?;
            masked
        }
        None => g.clone(),
    };
    let mm_opts = |x: &Tensor, y: &Tensor, trans_a: bool, trans_b: bool, k_blocks: bool| {
        x.matmul_with(
            y,
            &MatmulOptions {
                trans_a,
                trans_b,
                k_blocks,
                ..Default::default()
            },
        )
    };
    let mm = |x: &Tensor, y: &Tensor, trans_a: bool, trans_b: bool| {
        mm_opts(x, y, trans_a, trans_b, false)
    };
    // A weight's gradient sums over the batch's rows: in blocks (`MatmulOptions::k_blocks`).
    let mm_rows = |x: &Tensor, y: &Tensor, trans_a: bool, trans_b: bool| {
        mm_opts(x, y, trans_a, trans_b, true)
    };
    let n = *g.dims().last().expect("matmul output has rank >= 2");
    let ga = grad_if(need[0], || {
        // dA = g · op(B)ᵀ, or its transpose when A is stored transposed.
        let r = match (ta, tb) {
            (false, false) => mm(&g, b, false, true), // (M,N)·(K,N)ᵀ
            (false, true) => mm(&g, b, false, false), // (M,N)·(N,K)
            (true, false) => mm(b, &g, false, true),  // stored (K,M) = (K,N)·(M,N)ᵀ
            (true, true) => mm(b, &g, true, true),    // stored (K,M) = (N,K)ᵀ·(M,N)ᵀ
        }?;
        sum_leading(r, a.dims())
    })?;
    let dev = g.device();
    let invariant = invariant::is_batch_invariant(dev);
    let k = *a.dims().last().expect("rank >= 2");
    let rows = g.numel() / n.max(1);
    let gb = if need[1] && invariant && !ta && b.rank() == 2 && a.numel() / k.max(1) == rows {
        // One matrix B for every row: its gradient folds the rows in order (`None`: onto the
        // gradient B holds, in place).
        let a2 = a.reshape(&[rows, k])?;
        let g2 = g.reshape(&[rows, n])?;
        let onto = invariant::fold_target(dev, 1);
        let r = if tb {
            invariant::fold_outer(&g2, &a2, [n, k], onto) // (N,K) = gᵀ·A
        } else {
            invariant::fold_outer(&a2, &g2, [k, n], onto) // (K,N) = Aᵀ·g
        }?;
        r.map(|r| r.reshape(b.dims())?.cast(b.dtype()))
            .transpose()?
    } else {
        grad_if(need[1], || {
            let shared_b = b.dims()[..b.rank() - 2].iter().product::<usize>() == 1 && g.rank() > 2;
            if shared_b && !ta {
                // B is shared by every batch: fold the batch into the rows, one product.
                let a2 = a.reshape(&[a.numel() / k.max(1), k])?;
                let g2 = g.reshape(&[rows, n])?;
                return if tb {
                    mm_rows(&g2, &a2, true, false) // (N,K) = gᵀ·A
                } else {
                    mm_rows(&a2, &g2, true, false) // (K,N) = Aᵀ·g
                }?
                .reshape(b.dims());
            }
            // dB = op(A)ᵀ · g, or its transpose when B is stored transposed.
            let r = match (ta, tb) {
                (false, false) => mm_rows(a, &g, true, false), // (M,K)ᵀ·(M,N)
                (true, false) => mm_rows(a, &g, false, false), // (K,M)·(M,N)
                (false, true) => mm_rows(&g, a, true, false),  // stored (N,K) = (M,N)ᵀ·(M,K)
                (true, true) => mm_rows(&g, a, true, true),    // stored (N,K) = (M,N)ᵀ·(K,M)ᵀ
            }?;
            sum_leading(r, b.dims())
        })?
    };
    let mut out = vec![ga, gb];
    if need.len() > 2 {
        // The bias: g summed over its rows (`None`: folded onto the bias's gradient in place).
        let g2 = g.reshape(&[rows, n])?;
        out.push(if !need[2] {
            None
        } else if invariant {
            let onto = invariant::fold_target(dev, 2);
            invariant::fold_rows(&g2, rows, &[n], onto)?
                .map(|r| r.cast(g.dtype()))
                .transpose()?
        } else {
            Some(g2.sum_axis(0, false)?)
        });
    }
    Ok(out)
}

/// A batched gradient (.., R, C) in the operand's shape `dims`: summed over the leading dims when
/// the operand was a single matrix shared by every batch, else only reshaped (its leading dims
/// may have fewer 1s than the output's).
fn sum_leading(r: Tensor, dims: &[usize]) -> Result<Tensor> {
    if r.dims() == dims {
        return Ok(r);
    }
    if r.numel() == dims.iter().product::<usize>() {
        return r.reshape(dims);
    }
    let rank = r.rank();
    let (rows, cols) = (r.dims()[rank - 2], r.dims()[rank - 1]);
    r.reshape(&[r.numel() / (rows * cols).max(1), rows, cols])?
        .sum_axis(0, false)?
        .reshape(dims)
}
