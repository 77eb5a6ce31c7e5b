//! Softmax, log-softmax and the fused softmax cross-entropy: validation here, kernels in
//! src/kernels/softmax.rs.

use super::{DType, Shape, Tensor};
use crate::autograd::{self, record};
use crate::kernels::softmax;
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
        softmax::softmax(self, rows, c, log, &out)?;
        let y = out.detach();
        Ok(record(op, out, &[self], || {
            Box::new(move |g, _| {
                // Rows along the last dim; a rank-0 tensor is one row of one.
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
                Ok(vec![Some(dx.reshape(&dims)?)])
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
        let (loss, grad) = self.cross_entropy_impl("cross_entropy", targets, true)?;
        let grad = grad.expect("asked for the gradient");
        Ok((Self::record_cross_entropy(loss, self, &grad), grad))
    }

    /// The loss of [`Tensor::cross_entropy`]. The gradient is written by the same kernel only
    /// when the loss is recorded for `backward()` (then it is the backward's saved tensor, and
    /// backward costs one scale of it).
    pub fn cross_entropy_loss(&self, targets: &[u32]) -> Result<Tensor> {
        let recording = autograd::is_grad_enabled() && self.requires_grad();
        let (loss, grad) = self.cross_entropy_impl("cross_entropy_loss", targets, recording)?;
        Ok(match grad {
            Some(grad) => Self::record_cross_entropy(loss, self, &grad),
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
            softmax::cross_entropy(self, &t, b, c, 1.0 / b as f32, grad.as_ref(), &rows)?;
        }
        let _g = autograd::no_grad();
        let loss = rows.mean()?;
        let loss = if self.dtype() == DType::F32 {
            loss
        } else {
            loss.to_dtype(self.dtype())?
        };
        Ok((loss, grad))
    }
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
