//! Layer norm over the last dim: validation and autograd here, fused kernels in
//! src/kernels/layer_norm.rs.

use super::operand::staged_f32;
use super::{DType, Shape, Tensor};
use crate::kernels::layer_norm;
use crate::kernels::softmax::needs_f32_staging;
use crate::tensor::autograd::{self, record};
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
        const OP: &str = "layer_norm";
        let dims = self.dims();
        let Some(&c) = dims.last() else {
            return Err(Error::Shape {
                op: OP,
                lhs: vec![],
                rhs: vec![],
                reason: "layer norm normalizes the last dim, which a rank-0 tensor lacks".into(),
            });
        };
        for (name, t) in [("weight", weight), ("bias", bias)] {
            let Some(t) = t else { continue };
            self.same_device_and_dtype(OP, t)?;
            if t.dims() != [c] {
                return Err(Error::Shape {
                    op: OP,
                    lhs: dims.to_vec(),
                    rhs: t.dims().to_vec(),
                    reason: format!("the {name} must be (C) = ({c}) for an input of (.., {c})"),
                });
            }
        }
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::InvalidArgument {
                op: OP,
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
        let b = match bias {
            Some(b) => b.detach(),
            None => Tensor::zeros(dev, &[c], dtype)?,
        };
        // y is (.., C); mean and rstd are (rows), f32.
        let y = Tensor::uninit(dev, self.shape().clone(), dtype)?;
        let mean = Tensor::uninit(dev, Shape::new(&[rows])?, DType::F32)?;
        let rstd = Tensor::uninit(dev, Shape::new(&[rows])?, DType::F32)?;
        if self.numel() > 0 {
            let staged = needs_f32_staging(dev, dtype, c);
            staged_f32(&y, staged, |y| {
                layer_norm::forward(self, &w, &b, rows, c, eps, y, &mean, &rstd)
            })?;
        }
        drop(b);
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let (has_w, has_b) = (weight.is_some(), bias.is_some());
        Ok(record(OP, y, &inputs, || {
            let x = self.detach();
            Box::new(move |g, need| {
                let mut grads = vec![None];
                if need[0] {
                    let dx = Tensor::uninit(x.device(), x.shape().clone(), dtype)?;
                    let staged = needs_f32_staging(x.device(), dtype, c);
                    staged_f32(&dx, staged, |dx| {
                        layer_norm::backward_dx(g, &x, &w, &mean, &rstd, rows, c, dx)
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
                    let cast = |t: Tensor| -> Result<Tensor> {
                        let _g = autograd::no_grad();
                        if dtype == DType::F32 {
                            Ok(t)
                        } else {
                            t.to_dtype(dtype)
                        }
                    };
                    if has_w {
                        grads.push(if need_w { Some(cast(dw)?) } else { None });
                    }
                    if has_b {
                        grads.push(if need_b { Some(cast(db)?) } else { None });
                    }
                } else {
                    grads.extend((0..usize::from(has_w) + usize::from(has_b)).map(|_| None));
                }
                Ok(grads)
            })
        }))
    }
}
