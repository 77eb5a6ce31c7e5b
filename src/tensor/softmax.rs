//! Softmax, log-softmax, softmax with a fused scale and causal / additive mask, and the fused
//! softmax cross-entropy: validation here, kernels in src/kernels/softmax.rs.

use super::operand::staged_f32;
use super::{invariant, DType, Shape, Tensor};
use crate::kernels::softmax::{self, Fused};
use crate::tensor::autograd::{self, expand, record};
use crate::{Error, Result};

/// Largest class count whose indices f32 holds exactly (targets travel to the GPU as f32).
const MAX_CLASSES: usize = 1 << 24;

impl Tensor {
    /// Softmax along the last dim, computed in f32 with the row max subtracted: rows holding
    /// -inf give 0 there, values like 1e30 work, a row that is all -inf (or holds NaN or +inf)
    /// gives NaN, as in torch. Every leading dim counts as a row; a rank-0 tensor is one row of
    /// one. Deterministic.
    pub fn softmax(&self) -> Result<Tensor> {
        self.row_softmax("softmax", false)
    }

    /// log(softmax(x)) along the last dim, computed as `(x - max) - log(sum(exp(x - max)))`, so
    /// it stays finite where softmax underflows to 0. Same edge cases as [`Tensor::softmax`].
    pub fn log_softmax(&self) -> Result<Tensor> {
        self.row_softmax("log_softmax", true)
    }

    fn row_softmax(&self, op: &'static str, log: bool) -> Result<Tensor> {
        check_u32_elements(op, self)?;
        let c = self.dims().last().copied().unwrap_or(1);
        let rows = self.numel().checked_div(c).unwrap_or(0);
        let out = Tensor::uninit(self.device(), self.shape().clone(), self.dtype())?;
        let staged = softmax::needs_f32_staging(self.device(), out.dtype(), c);
        staged_f32(&out, staged, |out| {
            softmax::softmax(self, rows, c, log, None, out)
        })?;
        let y = out.detach();
        Ok(record(op, out, &[self], || {
            Box::new(move |g, _| Ok(vec![Some(softmax_backward(g, &y, log)?)]))
        }))
    }

    /// `softmax(scale * self + mask)` along the last dim in one kernel pass per row, with
    /// columns past the causal limit at -inf: the attention weights of queries (.., T_q) over
    /// keys (.., T_k), `self` being (.., T_q, T_k).
    ///
    /// - `scale` (> 0, finite; default 1) multiplies `self` before the mask is added.
    /// - `causal`: query i (the second-to-last index) sees keys k <= i + T_k - T_q: the usual
    ///   lower triangle when T_q = T_k, and a block of queries at the end of a longer key
    ///   sequence (a KV cache) when T_q < T_k. Needs rank >= 2. Masked columns are never read.
    /// - `mask`: added to `scale * self`, of `self`'s dtype, its shape broadcast to `self`'s
    ///   (aligned on the right, each dim equal or 1: (T_q, T_k), (B, 1, T_q, T_k), (B, 1, 1, T_k)
    ///   ...); -inf entries mask a column out.
    ///
    /// A row whose values are all -inf (masked entirely) gives zeros, not NaN; a NaN or +inf
    /// gives NaN, as in [`Tensor::softmax`]. Statistics in f32; deterministic.
    ///
    /// Backward: dx = scale * y * (dy - sum(dy * y)), so masked positions get 0. The mask gets
    /// no gradient (it is a constant, as torch's attention masks are in practice): a mask that
    /// requires grad is read, never differentiated.
    ///
    /// Errors, before any device work: [`Error::InvalidArgument`] for a scale that is not
    /// finite and > 0, [`Error::Shape`] for causal on rank < 2 or a mask shape that does not
    /// broadcast to `self`'s, [`Error::DType`] for a mask of another dtype,
    /// [`Error::DeviceMismatch`] for one on another device.
    pub fn softmax_masked(&self, opts: SoftmaxOptions) -> Result<Tensor> {
        const OP: &str = "softmax_masked";
        let SoftmaxOptions {
            scale,
            causal,
            mask,
        } = opts;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("scale = {scale} must be finite and > 0"),
            });
        }
        let dims = self.dims().to_vec();
        if causal && dims.len() < 2 {
            return Err(Error::Shape {
                op: OP,
                lhs: dims,
                rhs: vec![],
                reason: "a causal mask needs (.., T_q, T_k), rank >= 2".into(),
            });
        }
        check_u32_elements(OP, self)?;
        // The input as (d0, d1, T_q, T_k), leading dims padded with 1.
        let mut d4 = [1usize; 4];
        d4[4 - dims.len()..].copy_from_slice(&dims);
        let mask = match mask {
            Some(m) => Some(mask_view(OP, self, &m, &d4)?),
            None => None,
        };
        let c = d4[3];
        let rows = self.numel().checked_div(c).unwrap_or(0);
        let out = Tensor::uninit(self.device(), self.shape().clone(), self.dtype())?;
        let fused = Fused {
            scale,
            causal,
            mask: mask.as_ref().map(|(m, s)| (m, *s)),
            d1: d4[1] as u32,
            tq: d4[2] as u32,
        };
        let staged = softmax::needs_f32_staging(self.device(), out.dtype(), c);
        staged_f32(&out, staged, |out| {
            softmax::softmax(self, rows, c, false, Some(&fused), out)
        })?;
        let y = out.detach();
        Ok(record(OP, out, &[self], || {
            Box::new(move |g, _| {
                let dx = softmax_backward(g, &y, false)?;
                Ok(vec![Some(if scale == 1.0 {
                    dx
                } else {
                    dx.mul_scalar(scale)?
                })])
            })
        }))
    }

    /// Mean softmax cross-entropy of logits `self` (B, C) against class indices `targets`
    /// (B values, each < C), and its gradient with respect to the logits, from one kernel pass
    /// per row (plus the mean over rows):
    /// - loss: rank 0, in the logits' dtype, `mean_b (logsumexp(x_b) - x_b[t_b])`;
    /// - grad: (B, C), in the logits' dtype, `(softmax(x_b) - onehot(t_b)) / B`.
    ///
    /// Targets are host data (labels come from the dataset) and are checked here: a target of C
    /// or more is an [`Error::InvalidArgument`], never a read past the row. An empty batch gives
    /// a NaN loss (a mean over nothing), as in torch. All statistics are f32.
    ///
    /// When `self` requires grad the loss is recorded too, with `grad` saved for its backward.
    pub fn cross_entropy(&self, targets: &[u32]) -> Result<(Tensor, Tensor)> {
        let (loss, grad) = self.cross_entropy_impl("cross_entropy", targets, true, false)?;
        let grad = grad.expect("asked for the gradient");
        Ok((Self::record_cross_entropy(loss, self, &grad), grad))
    }

    /// The loss of [`Tensor::cross_entropy`]. The gradient is written by the same kernel only
    /// when the loss is recorded for `backward()` (then it is the backward's saved tensor, and
    /// backward costs one scale of it).
    pub fn cross_entropy_loss(&self, targets: &[u32]) -> Result<Tensor> {
        let recording = autograd::is_grad_enabled() && self.requires_grad();
        let (loss, grad) =
            self.cross_entropy_impl("cross_entropy_loss", targets, recording, recording)?;
        Ok(match grad {
            Some(grad) => {
                let loss = Self::record_cross_entropy(loss, self, &grad);
                invariant::took_weight(&loss);
                loss
            }
            None => loss,
        })
    }

    fn record_cross_entropy(loss: Tensor, logits: &Tensor, grad: &Tensor) -> Tensor {
        let grad = grad.detach();
        // d loss / d logits is `grad` (already divided by B); scaled by the loss's gradient.
        record("cross_entropy", loss, &[logits], move || {
            Box::new(move |g, _| Ok(vec![Some(grad.mul(g)?)]))
        })
    }

    fn cross_entropy_impl(
        &self,
        op: &'static str,
        targets: &[u32],
        want_grad: bool,
        weigh: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let dims = self.dims();
        if dims.len() != 2 {
            return Err(Error::Shape {
                op,
                lhs: dims.to_vec(),
                rhs: vec![targets.len()],
                reason: "logits must be (batch, classes)".into(),
            });
        }
        let (b, c) = (dims[0], dims[1]);
        if targets.len() != b {
            return Err(Error::Shape {
                op,
                lhs: dims.to_vec(),
                rhs: vec![targets.len()],
                reason: format!("{} targets for a batch of {b}", targets.len()),
            });
        }
        if c > MAX_CLASSES {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("{c} classes; class indices are exact in f32 only up to 2^24"),
            });
        }
        if let Some((i, &t)) = targets.iter().enumerate().find(|(_, &t)| t as usize >= c) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("target {t} at position {i} is out of range for {c} classes"),
            });
        }
        check_u32_elements(op, self)?;
        // Under a batch-invariant trainer each row weighs 1 / the whole batch (sample scope).
        let count = if weigh {
            invariant::sample_count(op, b)?
        } else {
            None
        };
        let dev = self.device();
        // out is (B,): each row's loss, f32.
        let rows = Tensor::uninit(dev, Shape::new(&[b])?, DType::F32)?;
        let grad = if want_grad {
            Some(Tensor::uninit(dev, self.shape().clone(), self.dtype())?)
        } else {
            None
        };
        if b > 0 {
            let t: Vec<f32> = targets.iter().map(|&t| t as f32).collect();
            let t = Tensor::from_slice(dev, &t, &[b])?;
            let inv_b = 1.0 / count.unwrap_or(b) as f32;
            match &grad {
                Some(g) => {
                    let staged = softmax::needs_f32_staging(dev, g.dtype(), c);
                    staged_f32(g, staged, |g| {
                        softmax::cross_entropy(self, &t, b, c, inv_b, Some(g), &rows)
                    })?
                }
                None => softmax::cross_entropy(self, &t, b, c, inv_b, None, &rows)?,
            }
        }
        let _g = autograd::no_grad();
        let loss = rows.mean()?;
        let loss = match count {
            Some(n) if n != b => loss.mul_scalar(b as f32 / n as f32)?,
            _ => loss,
        };
        let loss = if self.dtype() == DType::F32 {
            loss
        } else {
            loss.to_dtype(self.dtype())?
        };
        Ok((loss, grad))
    }
}

/// The options of [`Tensor::softmax_masked`]: `y = softmax(scale * x + mask)` with an optional
/// causal mask. The default is a plain softmax (scale 1, no mask) whose all -inf rows give 0.
/// Built from [`SoftmaxOptions::new`] with the chained setters (new options may be added).
///
/// ```no_run
/// # fn f(scores: &fitgrad::Tensor) -> fitgrad::Result<()> {
/// use fitgrad::SoftmaxOptions;
/// // scores are (B, H, T, T): causal attention weights of a head of size 64.
/// let w = scores.softmax_masked(SoftmaxOptions::new().scale(0.125).causal(true))?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct SoftmaxOptions {
    /// Multiplies the input before the mask is added; finite and > 0 (default 1).
    pub scale: f32,
    /// Query i (second-to-last index) sees keys k <= i + T_k - T_q only.
    pub causal: bool,
    /// Added to the scaled input; the input's dtype, broadcast to its shape. Gets no gradient.
    pub mask: Option<Tensor>,
}

impl Default for SoftmaxOptions {
    fn default() -> Self {
        SoftmaxOptions {
            scale: 1.0,
            causal: false,
            mask: None,
        }
    }
}

impl SoftmaxOptions {
    /// Scale 1, no mask (as `Default`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the scale (checked by `softmax_masked`).
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = scale;
        self
    }

    /// Turns the causal mask on or off.
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets the additive mask.
    pub fn mask(mut self, mask: Tensor) -> Self {
        self.mask = Some(mask);
        self
    }
}

/// The backward of softmax (`log` false) or log-softmax along the last dim, from the output
/// `y` and its gradient `g` (same shape; rank 0 is one row of one).
fn softmax_backward(g: &Tensor, y: &Tensor, log: bool) -> Result<Tensor> {
    let dims = g.dims().to_vec();
    let (g2, y2) = if dims.is_empty() {
        (g.reshape(&[1])?, y.reshape(&[1])?)
    } else {
        (g.clone(), y.clone())
    };
    let last = g2.rank() - 1;
    let dx = if log {
        // y = log softmax: dx = g - softmax * sum(g)
        g2.sub(&y2.exp()?.mul(&g2.sum_axis(last, true)?)?)?
    } else {
        // y = softmax: dx = y * (g - sum(g * y))
        y2.mul(&g2.sub(&g2.mul(&y2)?.sum_axis(last, true)?)?)?
    };
    dx.reshape(&dims)
}

/// Checks `mask` against `x` (viewed as `d4` = (d0, d1, T_q, T_k)) and returns it contiguous
/// along T_k (a mask broadcast along T_k is expanded, a small copy) with its strides along d0,
/// d1 and T_q, 0 where it is broadcast.
fn mask_view(
    op: &'static str,
    x: &Tensor,
    mask: &Tensor,
    d4: &[usize; 4],
) -> Result<(Tensor, [u32; 3])> {
    if mask.device() != x.device() {
        return Err(Error::DeviceMismatch { op });
    }
    if mask.dtype() != x.dtype() {
        return Err(Error::DType {
            op,
            expected: x.dtype(),
            got: mask.dtype(),
        });
    }
    let md = mask.dims();
    let bad = |reason: String| Error::Shape {
        op,
        lhs: x.dims().to_vec(),
        rhs: md.to_vec(),
        reason,
    };
    if md.len() > x.rank() {
        return Err(bad(format!(
            "the mask has rank {}, more than the input's {}",
            md.len(),
            x.rank()
        )));
    }
    let mut m4 = [1usize; 4];
    m4[4 - md.len()..].copy_from_slice(md);
    if let Some(k) = (0..4).find(|&k| m4[k] != d4[k] && m4[k] != 1) {
        return Err(bad(format!(
            "the mask must broadcast to the input: dim {} is {}, the input's is {}",
            k + md.len() - 4,
            m4[k],
            d4[k]
        )));
    }
    let _g = autograd::no_grad();
    let mask = if m4[3] == 1 && d4[3] != 1 {
        // The kernel reads the mask along T_k; a mask constant along it is rare, so copy it.
        m4[3] = d4[3];
        expand(mask, &m4)?
    } else {
        mask.detach()
    };
    // Contiguous strides of the 4-D mask, 0 along broadcast dims.
    let st = [m4[1] * m4[2] * m4[3], m4[2] * m4[3], m4[3]];
    let mut ms = [0u32; 3];
    for k in 0..3 {
        if m4[k] != 1 {
            ms[k] = st[k] as u32;
        }
    }
    check_u32_elements(op, &mask)?;
    Ok((mask, ms))
}

/// The kernels index elements with u32.
fn check_u32_elements(op: &'static str, t: &Tensor) -> Result<()> {
    if t.numel() > u32::MAX as usize {
        return Err(Error::Limit {
            op,
            what: "element count",
            value: t.numel() as u64,
            limit: u32::MAX as u64,
        });
    }
    Ok(())
}
