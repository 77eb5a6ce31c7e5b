//! Batch norm (fused kernels in src/kernels/batch_norm.rs for training; running statistics in
//! eval) and group norm (each sample's channel groups normalized by the layer norm kernel as
//! rows, then the per-channel affine). Both take (N, C, ..).

use super::{invariant, DType, Shape, Tensor};
use crate::kernels::batch_norm::{self, Channels};
use crate::kernels::reduce;
use crate::tensor::autograd::{self, record};
use crate::{Error, Result};

/// The arguments of [`Tensor::batch_norm`] besides the input, as torch's `batch_norm`.
#[derive(Clone, Copy, Debug)]
pub struct BatchNormOptions<'a> {
    /// Running mean and variance, f32 (C): updated in place in training, used in eval. Buffers,
    /// not parameters: they get no gradient.
    pub running: Option<(&'a Tensor, &'a Tensor)>,
    /// Scale and shift (C) in the input's dtype; `None` means ones and zeros.
    pub weight: Option<&'a Tensor>,
    /// The shift (C), in the input's dtype; `None` means zeros.
    pub bias: Option<&'a Tensor>,
    /// Batch statistics (and the running update) when true, the running statistics when false.
    pub training: bool,
    /// The running statistics' step: new = (1 - momentum) old + momentum batch (torch: 0.1).
    pub momentum: f32,
    /// Added to the variance before the square root (torch: 1e-5).
    pub eps: f32,
}

impl Default for BatchNormOptions<'_> {
    fn default() -> Self {
        BatchNormOptions {
            running: None,
            weight: None,
            bias: None,
            training: true,
            momentum: 0.1,
            eps: 1e-5,
        }
    }
}

/// (N, C, spatial elements) of an input of rank 2 to 4.
fn channels(x: &Tensor, op: &'static str) -> Result<[usize; 3]> {
    let d = x.dims();
    if d.len() < 2 {
        return Err(Error::Shape {
            op,
            lhs: d.to_vec(),
            rhs: vec![],
            reason: "normalization takes (N, C, ..)".into(),
        });
    }
    Ok([d[0], d[1], d[2..].iter().product()])
}

/// Checks that `t` is (C) with `x`'s device and `dtype`.
fn per_channel(
    x: &Tensor,
    t: &Tensor,
    c: usize,
    dtype: DType,
    op: &'static str,
    what: &str,
) -> Result<()> {
    if t.device() != x.device() {
        return Err(Error::DeviceMismatch { op });
    }
    if t.dtype() != dtype {
        return Err(Error::DType {
            op,
            expected: dtype,
            got: t.dtype(),
        });
    }
    if t.dims() != [c] {
        return Err(Error::Shape {
            op,
            lhs: x.dims().to_vec(),
            rhs: t.dims().to_vec(),
            reason: format!("the {what} must be (C) = ({c})"),
        });
    }
    Ok(())
}

fn check_eps(op: &'static str, eps: f32) -> Result<()> {
    if !(eps.is_finite() && eps >= 0.0) {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("eps must be finite and >= 0, got {eps}"),
        });
    }
    Ok(())
}

impl Tensor {
    /// Batch norm of (N, C, ..) per channel, as torch's `batch_norm`. In training the
    /// statistics are the batch's (biased variance, over N and the spatial dims, f32, two
    /// passes in a fixed order), the running ones move by `momentum` with the unbiased
    /// variance, and only each channel's mean and rstd are kept for the backward; in eval the
    /// running statistics normalize. The output has the input's dtype.
    ///
    /// Errors, before any device work: rank < 2, a weight, bias or running statistic not (C),
    /// training with one value per channel ([`Error::Shape`]), dtypes (the affine parameters
    /// in the input's, the running statistics f32: [`Error::DType`]), eval without running
    /// statistics, eps or momentum out of range ([`Error::InvalidArgument`]).
    pub fn batch_norm(&self, opts: &BatchNormOptions) -> Result<Tensor> {
        const OP: &str = "batch_norm";
        let [n, c, hw] = channels(self, OP)?;
        let dtype = self.dtype();
        for (t, what) in [(opts.weight, "weight"), (opts.bias, "bias")] {
            if let Some(t) = t {
                per_channel(self, t, c, dtype, OP, what)?;
            }
        }
        if let Some((rm, rv)) = opts.running {
            per_channel(self, rm, c, DType::F32, OP, "running mean")?;
            per_channel(self, rv, c, DType::F32, OP, "running variance")?;
        }
        check_eps(OP, opts.eps)?;
        if !(0.0..=1.0).contains(&opts.momentum) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("momentum must be in [0, 1], got {}", opts.momentum),
            });
        }
        if !opts.training {
            let Some((rm, rv)) = opts.running else {
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: "eval mode normalizes with running statistics; none were given".into(),
                });
            };
            return self.batch_norm_eval(rm, rv, opts, c);
        }
        if n * hw < 2 && self.numel() > 0 {
            return Err(Error::Shape {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: vec![],
                reason: "training needs more than one value per channel".into(),
            });
        }
        let ch = Channels {
            n,
            c,
            hw,
            eps: opts.eps,
        };
        let dev = self.device();
        let w = match opts.weight {
            Some(w) => w.detach(),
            None => Tensor::ones(dev, &[c], dtype)?,
        };
        let b = match opts.bias {
            Some(b) => b.detach(),
            None => Tensor::zeros(dev, &[c], dtype)?,
        };
        // stats is (2, C) f32: mean, rstd.
        let stats = Tensor::uninit(dev, Shape::new(&[2, c])?, DType::F32)?;
        let running = opts.running.map(|(rm, rv)| (rm, rv, opts.momentum));
        batch_norm::stats(self, &ch, running, &stats)?;
        let y = Tensor::uninit(dev, self.shape().clone(), dtype)?;
        batch_norm::apply(self, &w, &b, &stats, &ch, &y)?;
        drop(b);
        let mut inputs = vec![self];
        inputs.extend(opts.weight);
        inputs.extend(opts.bias);
        let (has_w, has_b) = (opts.weight.is_some(), opts.bias.is_some());
        Ok(record(OP, y, &inputs, || {
            let x = self.detach();
            Box::new(move |g, need| {
                let dev = x.device();
                // sums is (2, C) f32: the bias's gradient, then the weight's.
                let sums = Tensor::uninit(dev, Shape::new(&[2, c])?, DType::F32)?;
                batch_norm::sums(g, &x, &stats, &ch, &sums)?;
                let dx = autograd::grad_if(need[0], || {
                    let dx = Tensor::uninit(dev, x.shape().clone(), dtype)?;
                    batch_norm::backward_dx(g, &x, &w, &stats, &sums, &ch, &dx)?;
                    Ok(dx)
                })?;
                let row = |i: usize| -> Result<Tensor> {
                    let _ng = autograd::no_grad();
                    let r = sums.narrow(0, i, 1)?.reshape(&[c])?;
                    if dtype == DType::F32 {
                        Ok(r)
                    } else {
                        r.to_dtype(dtype)
                    }
                };
                let mut grads = vec![dx];
                if has_w {
                    grads.push(autograd::grad_if(need[1], || row(1))?);
                }
                if has_b {
                    grads.push(autograd::grad_if(need[1 + usize::from(has_w)], || row(0))?);
                }
                Ok(grads)
            })
        }))
    }

    /// Eval-mode batch norm, composed (and so recorded) from broadcast ops:
    /// y = (x - running_mean) (w / sqrt(running_var + eps)) + b, per channel.
    fn batch_norm_eval(
        &self,
        rm: &Tensor,
        rv: &Tensor,
        opts: &BatchNormOptions,
        c: usize,
    ) -> Result<Tensor> {
        let mut bdims = vec![1, c];
        bdims.extend(std::iter::repeat_n(1, self.rank() - 2));
        let dtype = self.dtype();
        let (mean, scale) = {
            let _ng = autograd::no_grad();
            let rstd = rv.add_scalar(opts.eps)?.sqrt()?.rdiv_scalar(1.0)?;
            (rm.to_dtype(dtype)?, rstd.to_dtype(dtype)?)
        };
        let scale = match opts.weight {
            Some(w) => scale.mul(w)?,
            None => scale,
        };
        let y = self
            .sub(&mean.reshape(&bdims)?)?
            .mul(&scale.reshape(&bdims)?)?;
        match opts.bias {
            Some(b) => y.add(&b.reshape(&bdims)?),
            None => Ok(y),
        }
    }

    /// Group norm of (N, C, ..) as torch's `group_norm`: each sample's C / groups channel
    /// groups are normalized together (biased variance, f32) by the fused layer norm kernel,
    /// then scaled and shifted per channel by `weight` and `bias` (C, the input's dtype; `None`
    /// means ones and zeros). No statistic mixes samples, so micro-batches give the same result
    /// as the whole batch.
    ///
    /// Errors, before any device work: rank < 2, groups 0 or not dividing C, a weight or bias
    /// not (C) ([`Error::Shape`]), dtypes ([`Error::DType`]), eps ([`Error::InvalidArgument`]).
    pub fn group_norm(
        &self,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        const OP: &str = "group_norm";
        let [n, c, hw] = channels(self, OP)?;
        if groups == 0 || !c.is_multiple_of(groups) {
            return Err(Error::Shape {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: vec![groups],
                reason: format!("groups {groups} must be >= 1 and divide the channels {c}"),
            });
        }
        for (t, what) in [(weight, "weight"), (bias, "bias")] {
            if let Some(t) = t {
                per_channel(self, t, c, self.dtype(), OP, what)?;
            }
        }
        check_eps(OP, eps)?;
        // Rows of (N groups, C / groups HW): one layer norm row per sample and group.
        let y = self
            .reshape(&[n * groups, (c / groups) * hw])?
            .layer_norm(None, None, eps)?
            .reshape(&[n, c, hw])?;
        channel_affine(&y, weight, bias)?.reshape(self.dims())
    }
}

/// y = x w + b per channel of x (N, C, HW), with w and b (C) or `None` (ones, zeros), recorded
/// as one op: its weight and bias gradients sum each sample's positions, then add up the
/// samples in order ([`channel_sums`]).
fn channel_affine(x: &Tensor, weight: Option<&Tensor>, bias: Option<&Tensor>) -> Result<Tensor> {
    let (n, c, hw) = (x.dims()[0], x.dims()[1], x.dims()[2]);
    if weight.is_none() && bias.is_none() {
        return Ok(x.clone());
    }
    let y = {
        let _ng = autograd::no_grad();
        let y = match weight {
            Some(w) => x.mul(&w.reshape(&[1, c, 1])?)?,
            None => x.clone(),
        };
        match bias {
            Some(b) => y.add(&b.reshape(&[1, c, 1])?)?,
            None => y,
        }
    };
    let mut inputs = vec![x];
    inputs.extend(weight);
    inputs.extend(bias);
    let wi = weight.map(|_| 1);
    let bi = bias.map(|_| 1 + usize::from(weight.is_some()));
    Ok(record("group_norm_affine", y, &inputs, || {
        let xs = x.detach();
        let w = weight.map(Tensor::detach);
        Box::new(move |g, need| {
            let dx = autograd::grad_if(need[0], || match &w {
                Some(w) => g.mul(&w.reshape(&[1, c, 1])?),
                None => Ok(g.clone()),
            })?;
            let mut out = vec![dx];
            if let Some(i) = wi {
                out.push(match need[i] {
                    true => channel_sums(&g.mul(&xs)?, [n, c, hw], i)?,
                    false => None,
                });
            }
            if let Some(i) = bi {
                out.push(match need[i] {
                    true => channel_sums(g, [n, c, hw], i)?,
                    false => None,
                });
            }
            Ok(out)
        })
    }))
}

/// The per-channel gradient (C, t's dtype) of input `input` from t (N, C, HW): each sample's
/// positions summed (in an order fixed by HW alone), then the samples added one after another,
/// in batch-invariant mode onto the gradient the input holds, in place (then `None`;
/// src/tensor/invariant.rs).
fn channel_sums(t: &Tensor, [n, c, hw]: [usize; 3], input: usize) -> Result<Option<Tensor>> {
    let dev = t.device();
    let per_sample = Tensor::uninit(dev, Shape::new(&[n, c])?, DType::F32)?;
    reduce::reduce(t, n * c, hw, 1, 1.0, &per_sample)?;
    let onto = invariant::fold_target(dev, input);
    let r = invariant::fold_rows(&per_sample, n, &[c], onto)?;
    drop(per_sample);
    r.map(|r| r.cast(t.dtype())).transpose()
}
