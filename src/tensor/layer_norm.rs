//! Layer norm and RMS norm over the last dim: validation and autograd here, fused kernels in
//! src/kernels/layer_norm.rs (RMS norm is layer norm without the mean and the bias).

use super::operand::staged_f32;
use super::{DType, Shape, Tensor};
use crate::kernels::layer_norm;
use crate::kernels::softmax::needs_f32_staging;
use crate::tensor::autograd::record;
use crate::{Error, Result};

impl Tensor {
    /// Layer norm over the last dim, as torch's `layer_norm(x, (C,), weight, bias, eps)`:
    /// `self` is (.., C) and each row becomes `(x - mean) / sqrt(var + eps) * weight + bias`
    /// with the biased variance. `weight` and `bias` are (C) in `self`'s dtype; `None` means
    /// ones and zeros. One fused kernel per row computes the statistics in f32 (two passes, a
    /// fixed order: bitwise reproducible) and writes the output in `self`'s dtype; only the
    /// rows' mean and 1 / std (f32) are kept for the backward.
    ///
    /// Errors, before any device work: a rank-0 `self` or a weight or bias not of shape (C)
    /// ([`Error::Shape`]), a dtype other than `self`'s ([`Error::DType`]), another device
    /// ([`Error::DeviceMismatch`]), `eps` negative or not finite ([`Error::InvalidArgument`]).
    pub fn layer_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        self.normalize("layer_norm", false, weight, bias, eps)
    }

    /// RMS norm over the last dim, as Llama's `RMSNorm`: `self` is (.., C) and each row becomes
    /// `x / sqrt(mean(x^2) + eps) * weight`. `weight` is (C) in `self`'s dtype (`None`: ones).
    /// Computed in f32 whatever the storage, by the fused kernels of [`Tensor::layer_norm`]
    /// (no mean, no bias): bitwise reproducible, only 1 / rms per row (f32) kept for the
    /// backward.
    ///
    /// Errors, before any device work: those of [`Tensor::layer_norm`].
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        self.normalize("rms_norm", true, weight, None, eps)
    }

    fn normalize(
        &self,
        op: &'static str,
        rms: bool,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        let dims = self.dims();
        let Some(&c) = dims.last() else {
            return Err(Error::Shape {
                op,
                lhs: vec![],
                rhs: vec![],
                reason: format!("{op} normalizes the last dim, which a rank-0 tensor lacks"),
            });
        };
        for (name, t) in [("weight", weight), ("bias", bias)] {
            let Some(t) = t else { continue };
            self.same_device_and_dtype(op, t)?;
            if t.dims() != [c] {
                return Err(Error::Shape {
                    op,
                    lhs: dims.to_vec(),
                    rhs: t.dims().to_vec(),
                    reason: format!("the {name} must be (C) = ({c}) for an input of (.., {c})"),
                });
            }
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("eps must be finite and >= 0, got {eps}"),
            });
        }
        let rows = self.numel().checked_div(c).unwrap_or(0);
        let dev = self.device();
        let dtype = self.dtype();
        // Absent affine parameters are ones and zeros, so one kernel serves every case.
        let w = match weight {
            Some(w) => w.detach(),
            None => Tensor::ones(dev, &[c], dtype)?,
        };
        // RMS norm reads no bias: the weight stands in for the binding.
        let b = match bias {
            Some(b) => b.detach(),
            None if rms => w.clone(),
            None => Tensor::zeros(dev, &[c], dtype)?,
        };
        // y is (.., C); mean and rstd are (rows), f32.
        let y = Tensor::uninit(dev, self.shape().clone(), dtype)?;
        let mean = Tensor::uninit(dev, Shape::new(&[rows])?, DType::F32)?;
        let rstd = Tensor::uninit(dev, Shape::new(&[rows])?, DType::F32)?;
        if self.numel() > 0 {
            let staged = needs_f32_staging(dev, dtype, c);
            staged_f32(&y, staged, |y| {
                layer_norm::forward(rms, self, &w, &b, rows, c, eps, y, &mean, &rstd)
            })?;
        }
        drop(b);
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let (has_w, has_b) = (weight.is_some(), bias.is_some());
        Ok(record(op, y, &inputs, || {
            let x = self.detach();
            Box::new(move |g, need| {
                let mut grads = vec![None];
                if need[0] {
                    let dx = Tensor::uninit(x.device(), x.shape().clone(), dtype)?;
                    let staged = needs_f32_staging(x.device(), dtype, c);
                    staged_f32(&dx, staged, |dx| {
                        layer_norm::backward_dx(rms, g, &x, &w, &mean, &rstd, rows, c, dx)
                    })?;
                    grads[0] = Some(dx);
                }
                let need_w = has_w && need[1];
                let need_b = has_b && need[1 + usize::from(has_w)];
                if need_w || need_b {
                    let shape = Shape::new(&[c])?;
                    let dw = Tensor::uninit(x.device(), shape.clone(), DType::F32)?;
                    let db = Tensor::uninit(x.device(), shape, DType::F32)?;
                    // Partial column sums per chunk of rows, (chunks, C) f32, freed at once.
                    let partials = match layer_norm::dwdb_partials(rows, c) {
                        Some(dims) => {
                            let s = Shape::new(&dims)?;
                            let f32_tensor = |s| Tensor::uninit(x.device(), s, DType::F32);
                            Some([f32_tensor(s.clone())?, f32_tensor(s)?])
                        }
                        None => None,
                    };
                    layer_norm::backward_dwdb(
                        g,
                        &x,
                        &mean,
                        &rstd,
                        rows,
                        c,
                        partials.as_ref(),
                        &dw,
                        &db,
                    )?;
                    drop(partials);
                    // Computed in f32; the parameters' gradients take their dtype.
                    if has_w {
                        grads.push(if need_w { Some(dw.cast(dtype)?) } else { None });
                    }
                    if has_b {
                        grads.push(if need_b { Some(db.cast(dtype)?) } else { None });
                    }
                } else {
                    grads.extend((0..usize::from(has_w) + usize::from(has_b)).map(|_| None));
                }
                Ok(grads)
            })
        }))
    }
}
