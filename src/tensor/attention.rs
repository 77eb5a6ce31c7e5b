//! Scaled dot-product self-attention over (B, H, T, D): the fused flash-style kernels of
//! src/kernels/attention.rs with their backward rule, the same math composed from matmul and
//! softmax_masked, and the choice between them.

use super::operand::staged_f32;
use super::{DType, MatmulOptions, Shape, SoftmaxOptions, Tensor};
use crate::autograd::record;
use crate::kernels::attention::{self as kernel, Choice, Dims, Plan};
use crate::kernels::softmax::needs_f32_staging;
use crate::{Error, Result};

const OP: &str = "attention";

/// Which implementation [`Tensor::attention_with`] runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttentionKind {
    /// Fused where the fused kernels can run (head dim and workgroup memory), composed
    /// otherwise.
    #[default]
    Auto,
    /// The fused kernels; an [`Error::InvalidArgument`] saying why where they cannot run.
    Fused,
    /// matmul, softmax_masked, matmul: stores the (B, H, T, T) scores and weights.
    Composed,
}

/// The options of [`Tensor::attention_with`]. The default is causal attention, fused where
/// it can run.
///
/// ```no_run
/// # fn f(q: &fitgrad::Tensor, k: &fitgrad::Tensor, v: &fitgrad::Tensor) -> fitgrad::Result<()> {
/// use fitgrad::{AttentionKind, AttentionOptions};
/// let o = q.attention_with(k, v, &AttentionOptions::new().kind(AttentionKind::Fused))?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AttentionOptions {
    /// Query i sees keys j <= i only (default true).
    pub causal: bool,
    /// Fused, composed, or the fused one where it can run (default).
    pub kind: AttentionKind,
}

impl Default for AttentionOptions {
    fn default() -> Self {
        AttentionOptions {
            causal: true,
            kind: AttentionKind::Auto,
        }
    }
}

impl AttentionOptions {
    /// Causal, [`AttentionKind::Auto`] (as `Default`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Turns the causal mask on or off.
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets the implementation.
    pub fn kind(mut self, kind: AttentionKind) -> Self {
        self.kind = kind;
        self
    }
}

impl Tensor {
    /// Scaled dot-product self-attention `softmax(q kᵀ / sqrt(D), causal) v`: `self` is q,
    /// (B, H, T, D), k and v are (B, KV, T, D) with KV dividing H, all of one dtype and device;
    /// the output is (B, H, T, D) in that dtype. KV < H is grouped-query attention: query head
    /// h reads kv head h / (H / KV); the fused kernels read the shared heads in place (no
    /// copy of K or V) and sum their gradients over the group in a fixed order. Causal query i sees keys j <= i (softmax_masked's rule with T_q = T_k).
    /// Queries and keys have the same length T (a separate T_k, as for a KV cache, is not
    /// supported yet).
    ///
    /// Runs the fused kernels where they can (head dims 1..=128 whose tiles fit the adapter's
    /// workgroup memory), [`Tensor::attention_composed`] otherwise; see
    /// [`Tensor::attention_with`].
    pub fn attention(&self, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
        self.attention_with(k, v, &AttentionOptions::new().causal(causal))
    }

    /// The same result as [`Tensor::attention`] from existing ops: the scores `q kᵀ`
    /// (B, H, T, T; a batched matmul reading k transposed in place), `softmax_masked` with the
    /// scale 1 / sqrt(D) and the causal mask, then a batched matmul with v. It stores the
    /// scores and the weights (2 B H T² elements), and autograd keeps the weights: the
    /// reference of the fused kernels, and their fallback.
    pub fn attention_composed(&self, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
        self.attention_with(
            k,
            v,
            &AttentionOptions::new()
                .causal(causal)
                .kind(AttentionKind::Composed),
        )
    }

    /// [`Tensor::attention`] with the implementation chosen by `opts.kind`.
    ///
    /// The fused forward walks K and V in tiles with an online softmax, so the (B, H, T, T)
    /// scores are never stored: it writes the output and one f32 log-sum-exp per query
    /// (B, H, T). Autograd saves q, k, v, the output and the log-sum-exp only; the backward
    /// recomputes the probabilities tile by tile in two passes (the queries' gradient, then the
    /// keys' and values'), each workgroup writing its own rows: no atomics, so results are
    /// bitwise reproducible. Accumulation is in f32 for f16 inputs.
    ///
    /// Errors, before any device work: a q, k or v that is not rank 4, or k or v not
    /// (B, KV, T, D) as above ([`Error::Shape`]); another dtype ([`Error::DType`]) or device
    /// ([`Error::DeviceMismatch`]); more than 2^32 - 1 elements ([`Error::Limit`]);
    /// [`AttentionKind::Fused`] where the fused kernels cannot run ([`Error::InvalidArgument`]
    /// naming the reason). An empty input (B, H, T or D of 0) gives an empty output.
    pub fn attention_with(
        &self,
        k: &Tensor,
        v: &Tensor,
        opts: &AttentionOptions,
    ) -> Result<Tensor> {
        self.attention_impl(k, v, opts, Choice::Auto)
    }

    /// The fused attention's workgroup-tiled kernels (those of GPUs) with their workgroup
    /// memory capped at `workgroup_bytes`, so tests run the tiles of a smaller adapter (tests
    /// and benchmarks).
    #[doc(hidden)]
    pub fn attention_fused_within(
        &self,
        k: &Tensor,
        v: &Tensor,
        causal: bool,
        workgroup_bytes: u32,
    ) -> Result<Tensor> {
        let opts = AttentionOptions::new()
            .causal(causal)
            .kind(AttentionKind::Fused);
        self.attention_impl(k, v, &opts, Choice::Tiles(Some(workgroup_bytes)))
    }

    /// The fused attention's subgroup kernels (those of CPU adapters with subgroups), or an
    /// [`Error::InvalidArgument`] saying why the adapter cannot run them (tests and benchmarks).
    #[doc(hidden)]
    pub fn attention_fused_subgroup(&self, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
        let opts = AttentionOptions::new()
            .causal(causal)
            .kind(AttentionKind::Fused);
        self.attention_impl(k, v, &opts, Choice::Subgroup)
    }

    fn attention_impl(
        &self,
        k: &Tensor,
        v: &Tensor,
        opts: &AttentionOptions,
        choice: Choice,
    ) -> Result<Tensor> {
        let dims = check(self, k, v, opts.causal)?;
        let plan = || kernel::plan_for(self.device(), dims.d, choice);
        let fused = match opts.kind {
            AttentionKind::Composed => None,
            AttentionKind::Auto => plan().ok(),
            // An empty head dim needs no kernel.
            AttentionKind::Fused if dims.d == 0 => None,
            AttentionKind::Fused => Some(plan().map_err(|reason| Error::InvalidArgument {
                op: OP,
                reason: format!("the fused kernels cannot run: {reason}"),
            })?),
        };
        if dims.bh == 0 || dims.t == 0 || dims.d == 0 {
            return empty(self, k, v);
        }
        match fused {
            Some(plan) => fused_attention(self, k, v, dims, plan),
            None => composed(self, k, v, dims),
        }
    }
}

/// Validates q, k and v and returns the problem's dims.
fn check(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Dims> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 4 {
            return Err(Error::Shape {
                op: OP,
                lhs: q.dims().to_vec(),
                rhs: t.dims().to_vec(),
                reason: format!(
                    "{name} must be (B, H, T, D), rank 4; it has rank {}",
                    t.rank()
                ),
            });
        }
    }
    q.same_device_and_dtype(OP, k)?;
    q.same_device_and_dtype(OP, v)?;
    let [b, h, t, d] = [0, 1, 2, 3].map(|i| q.dims()[i]);
    let kv = k.dims()[1];
    for (name, x) in [("k", k), ("v", v)] {
        let [xb, xh, xt, xd] = [0, 1, 2, 3].map(|i| x.dims()[i]);
        if (xb, xt, xd) != (b, t, d) || x.dims() != k.dims() || !h.is_multiple_of(xh) {
            return Err(Error::Shape {
                op: OP,
                lhs: q.dims().to_vec(),
                rhs: x.dims().to_vec(),
                reason: format!(
                    "{name} must be (B, KV, T, D) with q's B, T and D (keys as long as the \
                     queries), k's shape, and KV heads dividing q's H = {h}"
                ),
            });
        }
    }
    // The kernels index elements with u32.
    let elements = b
        .checked_mul(h)
        .and_then(|bh| bh.checked_mul(t))
        .and_then(|bht| bht.checked_mul(d))
        .filter(|&n| n <= u32::MAX as usize);
    if elements.is_none() {
        return Err(Error::Limit {
            op: OP,
            what: "element count (B * H * T * D)",
            value: (b as u64)
                .saturating_mul(h as u64)
                .saturating_mul(t as u64)
                .saturating_mul(d as u64),
            limit: u32::MAX as u64,
        });
    }
    Ok(Dims {
        bh: b * h,
        t,
        d,
        causal,
        // An empty q (H = 0) may have no kv heads either.
        group: h.checked_div(kv).unwrap_or(1),
    })
}

/// The empty output of an empty input, and empty gradients.
fn empty(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let out = Tensor::zeros(q.device(), q.dims(), q.dtype())?;
    let (dev, dtype) = (q.device().clone(), q.dtype());
    let dims = [q.dims().to_vec(), k.dims().to_vec(), v.dims().to_vec()];
    Ok(record(OP, out, &[q, k, v], move || {
        Box::new(move |_, need| {
            need.iter()
                .zip(&dims)
                .map(|(&n, dims)| n.then(|| Tensor::zeros(&dev, dims, dtype)).transpose())
                .collect()
        })
    }))
}

/// k or v (B, KV, T, D) with each kv head repeated for the `group` query heads that read it:
/// (B, KV group, T, D), head h of the result is head h / group of `x`. A copy in memory, for
/// the composed path only (the fused kernels read the shared heads in place); its backward
/// sums the group's gradients.
pub fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let &[b, kv, t, d] = x.dims() else {
        return Err(Error::Shape {
            op: "repeat_kv",
            lhs: x.dims().to_vec(),
            rhs: vec![],
            reason: "keys and values must be (B, KV, T, D), rank 4".into(),
        });
    };
    let one = x.reshape(&[b, kv, 1, t * d])?;
    let copies: Vec<&Tensor> = std::iter::repeat_n(&one, group).collect();
    Tensor::cat(&copies, 2)?.reshape(&[b, kv * group, t, d])
}

/// matmul, softmax_masked, matmul: autograd records each.
fn composed(q: &Tensor, k: &Tensor, v: &Tensor, dims: Dims) -> Result<Tensor> {
    let trans_b = MatmulOptions {
        trans_b: true,
        ..Default::default()
    };
    let (k, v) = (&repeat_kv(k, dims.group)?, &repeat_kv(v, dims.group)?);
    // scores are (B, H, T, T)
    let scores = q.matmul_with(k, &trans_b)?;
    let weights = scores.softmax_masked(
        SoftmaxOptions::new()
            .scale(kernel::scale(dims.d))
            .causal(dims.causal),
    )?;
    drop(scores);
    weights.matmul(v)
}

/// The fused forward, and its backward rule.
fn fused_attention(q: &Tensor, k: &Tensor, v: &Tensor, dims: Dims, plan: Plan) -> Result<Tensor> {
    let dev = q.device();
    let dtype = q.dtype();
    let shape = q.shape().clone();
    let kv_shape = k.shape().clone();
    // out is (B, H, T, D); lse is (B, H, T), f32.
    let out = Tensor::uninit(dev, shape.clone(), dtype)?;
    let lse = Tensor::uninit(dev, Shape::new(&q.dims()[..3])?, DType::F32)?;
    // Packed f16 rows of odd D straddle words: such outputs are written to f32 and cast.
    let staged = needs_f32_staging(dev, dtype, dims.d);
    staged_f32(&out, staged, |o| {
        kernel::forward(q, k, v, dims, plan, o, &lse)
    })?;
    let y = out.detach();
    Ok(record(OP, out, &[q, k, v], || {
        let (q, k, v) = (q.detach(), k.detach(), v.detach());
        Box::new(move |g, need| {
            let dev = q.device();
            let g = if g.dtype() == dtype {
                g.clone()
            } else {
                g.to_dtype(dtype)?
            };
            // Pass 1 always runs: pass 2 needs its delta (B, H, T), f32.
            let delta = Tensor::uninit(dev, lse.shape().clone(), DType::F32)?;
            let dq = Tensor::uninit(dev, shape.clone(), dtype)?;
            staged_f32(&dq, staged, |dq| {
                kernel::backward_dq(&q, &k, &v, &y, &g, &lse, dims, plan, dq, &delta)
            })?;
            let (mut dk, mut dv) = (None, None);
            if need[1] || need[2] {
                let gk = Tensor::uninit(dev, kv_shape.clone(), dtype)?;
                let gv = Tensor::uninit(dev, kv_shape.clone(), dtype)?;
                staged_f32(&gk, staged, |gk| {
                    staged_f32(&gv, staged, |gv| {
                        kernel::backward_dkv(&q, &k, &v, &g, &lse, &delta, dims, plan, gk, gv)
                    })
                })?;
                dk = need[1].then_some(gk);
                dv = need[2].then_some(gv);
            }
            Ok(vec![need[0].then_some(dq), dk, dv])
        })
    }))
}
