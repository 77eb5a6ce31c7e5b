//! The ops a user calls on tensors: validation here, kernels in src/kernels/.

use super::{DType, Shape, Tensor};
use crate::kernels::elementwise::{self, BinaryOp, UnaryOp};
use crate::kernels::{nonfinite, reduce, reduce_max, transpose};
use crate::tensor::autograd::{self, expand, grad_if, record, sum_to};
use crate::{Device, Error, Result};

/// Largest axis length whose indices f32 holds exactly (argmax returns f32 indices).
const MAX_EXACT_INDEX: usize = 1 << 24;

impl Tensor {
    pub(crate) fn same_device_and_dtype(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.device() != other.device() {
            return Err(Error::DeviceMismatch { op });
        }
        if self.dtype() != other.dtype() {
            return Err(Error::DType {
                op,
                expected: self.dtype(),
                got: other.dtype(),
            });
        }
        Ok(())
    }

    pub(super) fn binary(
        &self,
        op: BinaryOp,
        name: &'static str,
        other: &Tensor,
    ) -> Result<Tensor> {
        self.same_device_and_dtype(name, other)?;
        let shape = Shape::broadcast(name, self.shape(), other.shape())?;
        let out = Tensor::uninit(self.device(), shape, self.dtype())?;
        elementwise::binary(op, self, other, &out)?;
        Ok(out)
    }

    /// Elementwise `self + other`, broadcasting like numpy.
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        let out = self.binary(BinaryOp::Add, "add", other)?;
        let (da, db) = (self.dims().to_vec(), other.dims().to_vec());
        Ok(record("add", out, &[self, other], || {
            Box::new(move |g, need| {
                Ok(vec![
                    grad_if(need[0], || sum_to(g, &da))?,
                    grad_if(need[1], || sum_to(g, &db))?,
                ])
            })
        }))
    }

    /// `self - other`, broadcast as [`Tensor::add`].
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        let out = self.binary(BinaryOp::Sub, "sub", other)?;
        let (da, db) = (self.dims().to_vec(), other.dims().to_vec());
        Ok(record("sub", out, &[self, other], || {
            Box::new(move |g, need| {
                Ok(vec![
                    grad_if(need[0], || sum_to(g, &da))?,
                    grad_if(need[1], || sum_to(g, &db)?.neg())?,
                ])
            })
        }))
    }

    /// `self * other`, elementwise, broadcast as [`Tensor::add`].
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        let out = self.binary(BinaryOp::Mul, "mul", other)?;
        Ok(record("mul", out, &[self, other], || {
            let (a, b) = (self.detach(), other.detach());
            Box::new(move |g, need| {
                Ok(vec![
                    grad_if(need[0], || sum_to(&g.mul(&b)?, a.dims()))?,
                    grad_if(need[1], || sum_to(&g.mul(&a)?, b.dims()))?,
                ])
            })
        }))
    }

    /// `self / other`, elementwise, broadcast as [`Tensor::add`].
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        let out = self.binary(BinaryOp::Div, "div", other)?;
        let saved = out.detach();
        Ok(record("div", out, &[self, other], || {
            let (a_dims, b) = (self.dims().to_vec(), other.detach());
            Box::new(move |g, need| {
                // d(a/b)/da = 1/b; d(a/b)/db = -(a/b)/b.
                Ok(vec![
                    grad_if(need[0], || sum_to(&g.div(&b)?, &a_dims))?,
                    grad_if(need[1], || {
                        sum_to(&g.mul(&saved)?.div(&b)?.neg()?, b.dims())
                    })?,
                ])
            })
        }))
    }

    /// An activation's backward as one kernel: `op(g, y)` with y the saved input or output.
    pub(super) fn activation_backward(op: BinaryOp, g: &Tensor, y: &Tensor) -> Result<Tensor> {
        let out = Tensor::uninit(g.device(), g.shape().clone(), g.dtype())?;
        elementwise::binary(op, g, y, &out)?;
        Ok(out)
    }

    fn unary(&self, op: UnaryOp, s: f32) -> Result<Tensor> {
        let out = Tensor::uninit(self.device(), self.shape().clone(), self.dtype())?;
        elementwise::unary(op, self, s, &out)?;
        Ok(out)
    }

    /// A unary op whose gradient is the output's gradient times a constant.
    fn linear_unary(&self, name: &'static str, op: UnaryOp, s: f32, slope: f32) -> Result<Tensor> {
        let out = self.unary(op, s)?;
        Ok(record(name, out, &[self], || {
            Box::new(move |g, _| {
                Ok(vec![Some(if slope == 1.0 {
                    g.clone()
                } else {
                    g.mul_scalar(slope)?
                })])
            })
        }))
    }

    /// A unary op whose backward needs its input (`save_output` false) or output (true).
    pub(super) fn saving_unary(
        &self,
        name: &'static str,
        op: UnaryOp,
        s: f32,
        save_output: bool,
        rule: fn(&Tensor, &Tensor, f32) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let out = self.unary(op, s)?;
        let saved = if save_output {
            out.detach()
        } else {
            self.detach()
        };
        Ok(record(name, out, &[self], || {
            Box::new(move |g, _| Ok(vec![Some(rule(g, &saved, s)?)]))
        }))
    }

    /// `self + s`.
    pub fn add_scalar(&self, s: f32) -> Result<Tensor> {
        self.linear_unary("add_scalar", UnaryOp::AddScalar, s, 1.0)
    }

    /// `self - s`.
    pub fn sub_scalar(&self, s: f32) -> Result<Tensor> {
        self.linear_unary("sub_scalar", UnaryOp::SubScalar, s, 1.0)
    }

    /// `self * s`.
    pub fn mul_scalar(&self, s: f32) -> Result<Tensor> {
        self.linear_unary("mul_scalar", UnaryOp::MulScalar, s, s)
    }

    /// `self / s`.
    pub fn div_scalar(&self, s: f32) -> Result<Tensor> {
        self.linear_unary("div_scalar", UnaryOp::DivScalar, s, 1.0 / s)
    }

    /// `s - self`.
    pub fn rsub_scalar(&self, s: f32) -> Result<Tensor> {
        self.linear_unary("rsub_scalar", UnaryOp::RSubScalar, s, -1.0)
    }

    /// `s / self`.
    pub fn rdiv_scalar(&self, s: f32) -> Result<Tensor> {
        let out = self.unary(UnaryOp::RDivScalar, s)?;
        let y = out.detach();
        Ok(record("rdiv_scalar", out, &[self], || {
            let x = self.detach();
            // d(s/x)/dx = -(s/x)/x
            Box::new(move |g, _| Ok(vec![Some(g.mul(&y)?.div(&x)?.neg()?)]))
        }))
    }

    /// `-self`.
    pub fn neg(&self) -> Result<Tensor> {
        self.linear_unary("neg", UnaryOp::Neg, 0.0, -1.0)
    }

    /// `max(self, 0)`; NaN stays NaN.
    pub fn relu(&self) -> Result<Tensor> {
        self.saving_unary("relu", UnaryOp::Relu, 0.0, true, |g, y, _| {
            Tensor::activation_backward(BinaryOp::ReluBackward, g, y)
        })
    }

    /// GELU, tanh approximation (torch's `approximate="tanh"`):
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`. Finite for every finite x.
    pub fn gelu(&self) -> Result<Tensor> {
        self.saving_unary("gelu", UnaryOp::Gelu, 0.0, false, |g, x, _| {
            Tensor::activation_backward(BinaryOp::GeluBackward, g, x)
        })
    }

    /// tanh, computed without overflow (+-1 for large |x|).
    pub fn tanh(&self) -> Result<Tensor> {
        self.saving_unary("tanh", UnaryOp::Tanh, 0.0, true, |g, y, _| {
            Tensor::activation_backward(BinaryOp::TanhBackward, g, y)
        })
    }

    /// 1 / (1 + exp(-x)), computed without overflow for either sign.
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.saving_unary("sigmoid", UnaryOp::Sigmoid, 0.0, true, |g, y, _| {
            Tensor::activation_backward(BinaryOp::SigmoidBackward, g, y)
        })
    }

    /// SiLU (swish), `x * sigmoid(x)`, computed without overflow for either sign.
    pub fn silu(&self) -> Result<Tensor> {
        self.saving_unary("silu", UnaryOp::Silu, 0.0, false, |g, x, _| {
            Tensor::activation_backward(BinaryOp::SiluBackward, g, x)
        })
    }

    /// The SwiGLU product `silu(self) * up` (Llama's MLP: `down(silu(gate(x)) * up(x))`), one
    /// kernel; `self` (the gate) and `up` broadcast as [`Tensor::add`]. The backward gives the
    /// gate `g * up * silu'(gate)` and `up` `g * silu(gate)`.
    pub fn swiglu(&self, up: &Tensor) -> Result<Tensor> {
        let out = self.binary(BinaryOp::Swiglu, "swiglu", up)?;
        Ok(record("swiglu", out, &[self, up], || {
            let (a, b) = (self.detach(), up.detach());
            Box::new(move |g, need| {
                Ok(vec![
                    grad_if(need[0], || {
                        let gb = g.mul(&b)?;
                        // gb has the output's shape; the gate broadcasts into it.
                        let ga = Tensor::activation_backward(BinaryOp::SiluBackward, &gb, &a)?;
                        sum_to(&ga, a.dims())
                    })?,
                    grad_if(need[1], || sum_to(&g.mul(&a.silu()?)?, b.dims()))?,
                ])
            })
        }))
    }

    /// `e^self`.
    pub fn exp(&self) -> Result<Tensor> {
        self.saving_unary("exp", UnaryOp::Exp, 0.0, true, |g, y, _| g.mul(y))
    }

    /// Natural log: -inf at 0, NaN below 0.
    pub fn log(&self) -> Result<Tensor> {
        self.saving_unary("log", UnaryOp::Log, 0.0, false, |g, x, _| g.div(x))
    }

    /// Square root: NaN below 0.
    pub fn sqrt(&self) -> Result<Tensor> {
        self.saving_unary("sqrt", UnaryOp::Sqrt, 0.0, true, |g, y, _| {
            g.div(y)?.mul_scalar(0.5)
        })
    }

    /// `self^p` elementwise with torch's semantics: `x^0 = 1` (even for NaN), a negative base
    /// with an integer exponent keeps the sign of the exponent's parity, a negative base with a
    /// fractional exponent gives NaN, `0^p` is inf for p < 0. `p` must be finite
    /// ([`Error::InvalidArgument`] otherwise). p = 1 and p = 2 are exact.
    pub fn pow_scalar(&self, p: f32) -> Result<Tensor> {
        if !p.is_finite() {
            return Err(Error::InvalidArgument {
                op: "pow_scalar",
                reason: format!("the exponent must be finite, got {p}"),
            });
        }
        // d(x^p)/dx = p x^(p-1)
        self.saving_unary("pow_scalar", UnaryOp::PowScalar, p, false, |g, x, p| {
            g.mul(&x.pow_scalar(p - 1.0)?.mul_scalar(p)?)
        })
    }

    /// Every element limited to `[min, max]`; NaN stays NaN. As in torch, `min > max` sets every
    /// element to `max`. Infinite bounds are allowed, NaN bounds are an
    /// [`Error::InvalidArgument`].
    pub fn clamp(&self, min: f32, max: f32) -> Result<Tensor> {
        if min.is_nan() || max.is_nan() {
            return Err(Error::InvalidArgument {
                op: "clamp",
                reason: format!("bounds must not be NaN, got [{min}, {max}]"),
            });
        }
        let out = Tensor::uninit(self.device(), self.shape().clone(), self.dtype())?;
        elementwise::unary2(UnaryOp::Clamp, self, min, max, &out)?;
        Ok(autograd::record_nondiff("clamp", out, &[self]))
    }

    /// A copy in another dtype (f32 -> f16 rounds to nearest even); the same dtype copies.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let out = Tensor::uninit(self.device(), self.shape().clone(), dtype)?;
        elementwise::unary(UnaryOp::Identity, self, 0.0, &out)?;
        let from = self.dtype();
        Ok(record("to_dtype", out, &[self], || {
            Box::new(move |g, _| Ok(vec![Some(g.to_dtype(from)?)]))
        }))
    }

    /// `self` in `dtype`: itself (a clone) where it already is, else [`Tensor::to_dtype`]'s
    /// cast (recorded where recording is on and `self` requires grad).
    pub(crate) fn cast(&self, dtype: DType) -> Result<Tensor> {
        if self.dtype() == dtype {
            Ok(self.clone())
        } else {
            self.to_dtype(dtype)
        }
    }

    /// Sum of every element, as a rank-0 tensor of the same dtype (accumulated in f32).
    pub fn sum(&self) -> Result<Tensor> {
        self.reduce_all(false)
    }

    /// Mean of every element (NaN for an empty tensor, as in PyTorch).
    pub fn mean(&self) -> Result<Tensor> {
        self.reduce_all(true)
    }

    /// Sum along `axis`; `keepdim` keeps it as a dim of size 1.
    pub fn sum_axis(&self, axis: usize, keepdim: bool) -> Result<Tensor> {
        self.reduce_axis("sum_axis", axis, keepdim, false)
    }

    /// Mean along `axis` (NaN where the axis is empty).
    pub fn mean_axis(&self, axis: usize, keepdim: bool) -> Result<Tensor> {
        self.reduce_axis("mean_axis", axis, keepdim, true)
    }

    fn reduce_all(&self, mean: bool) -> Result<Tensor> {
        self.reshape(&[self.numel()])?.reduce_axis(
            if mean { "mean" } else { "sum" },
            0,
            false,
            mean,
        )
    }

    fn reduce_axis(
        &self,
        op: &'static str,
        axis: usize,
        keepdim: bool,
        mean: bool,
    ) -> Result<Tensor> {
        let dims = self.dims();
        if axis >= dims.len() {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("axis {axis} is out of range for shape {dims:?}"),
            });
        }
        let outer: usize = dims[..axis].iter().product();
        let len = dims[axis];
        let inner: usize = dims[axis + 1..].iter().product();
        let mut out_dims = dims.to_vec();
        if keepdim {
            out_dims[axis] = 1;
        } else {
            out_dims.remove(axis);
        }
        let dev = self.device();
        let out_shape = Shape::new(&out_dims)?;
        if mean && len == 0 {
            return Tensor::full(dev, &out_dims, f32::NAN, self.dtype());
        }
        // The kernel writes f32; an f16 result is cast from it.
        let acc = Tensor::uninit(dev, out_shape, DType::F32)?;
        let div = if mean { len as f32 } else { 1.0 };
        reduce::reduce(self, outer, len, inner, div, &acc)?;
        let out = if self.dtype() == DType::F32 {
            acc
        } else {
            let _g = autograd::no_grad();
            acc.to_dtype(self.dtype())?
        };
        let in_dims = dims.to_vec();
        let mut kept = in_dims.clone();
        kept[axis] = 1;
        Ok(record(op, out, &[self], || {
            // Each input element gets the gradient of its row's result (over `len` for a mean).
            Box::new(move |g, _| {
                let g = expand(&g.reshape(&kept)?, &in_dims)?;
                Ok(vec![Some(if mean { g.div_scalar(div)? } else { g })])
            })
        }))
    }

    /// The largest element, as a rank-0 tensor of the same dtype. NaN if any element is NaN (as
    /// in torch); an empty tensor is an [`Error::InvalidArgument`].
    pub fn max(&self) -> Result<Tensor> {
        self.reshape(&[self.numel()])?.max_axis(0, false)
    }

    /// The max along `axis` (`keepdim` keeps it as a dim of size 1), in the tensor's dtype.
    /// NaN wins over every number, as in torch. An empty axis is an [`Error::InvalidArgument`]
    /// (a max has no identity).
    pub fn max_axis(&self, axis: usize, keepdim: bool) -> Result<Tensor> {
        Ok(self.max_argmax("max_axis", axis, keepdim)?.0)
    }

    /// The index along `axis` of the max, as an **f32** tensor (fitgrad has no integer dtype;
    /// indices are exact because the axis may hold at most 2^24 elements). Ties go to the first
    /// index and the first NaN counts as the max, as in torch. Deterministic.
    pub fn argmax_axis(&self, axis: usize, keepdim: bool) -> Result<Tensor> {
        Ok(self.max_argmax("argmax_axis", axis, keepdim)?.1)
    }

    /// Both [`Tensor::max_axis`] and [`Tensor::argmax_axis`] from one kernel pass:
    /// (values in the tensor's dtype, f32 indices), like torch's `max(dim)`.
    pub fn max_axis_with_indices(&self, axis: usize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        self.max_argmax("max_axis_with_indices", axis, keepdim)
    }

    fn max_argmax(&self, op: &'static str, axis: usize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let dims = self.dims();
        if axis >= dims.len() {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("axis {axis} is out of range for shape {dims:?}"),
            });
        }
        let outer: usize = dims[..axis].iter().product();
        let len = dims[axis];
        let inner: usize = dims[axis + 1..].iter().product();
        if len == 0 {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "axis {axis} of shape {dims:?} is empty, and a max has no identity"
                ),
            });
        }
        if len > MAX_EXACT_INDEX {
            return Err(Error::InvalidArgument {
                op,
                reason: format!(
                    "axis {axis} has {len} elements; f32 indices are exact only up to 2^24"
                ),
            });
        }
        let mut out_dims = dims.to_vec();
        if keepdim {
            out_dims[axis] = 1;
        } else {
            out_dims.remove(axis);
        }
        let dev = self.device();
        let out_shape = Shape::new(&out_dims)?;
        // The kernel writes f32; f16 maxima are f16 values, so the cast back is exact.
        let max = Tensor::uninit(dev, out_shape.clone(), DType::F32)?;
        let idx = Tensor::uninit(dev, out_shape, DType::F32)?;
        reduce_max::max_axis(self, outer, len, inner, &max, &idx)?;
        let max = if self.dtype() == DType::F32 {
            max
        } else {
            let _g = autograd::no_grad();
            max.to_dtype(self.dtype())?
        };
        Ok((autograd::record_nondiff(op, max, &[self]), idx))
    }

    /// Swaps the last two dims: (.., R, C) -> (.., C, R), as a new contiguous tensor.
    pub fn transpose(&self) -> Result<Tensor> {
        let dims = self.dims();
        if dims.len() < 2 {
            return Err(Error::Shape {
                op: "transpose",
                lhs: dims.to_vec(),
                rhs: vec![],
                reason: "transpose swaps the last two dims and needs rank >= 2".into(),
            });
        }
        let (r, c) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        let mut out_dims = dims.to_vec();
        let k = out_dims.len();
        out_dims.swap(k - 2, k - 1);
        let out = Tensor::uninit(self.device(), Shape::new(&out_dims)?, self.dtype())?;
        transpose::transpose(self, r, c, &out)?;
        Ok(record("transpose", out, &[self], || {
            Box::new(|g, _| Ok(vec![Some(g.transpose()?)]))
        }))
    }
}

impl Device {
    /// Whether any of `tensors` holds a NaN or an infinity: one small dispatch per tensor into a
    /// shared flag and a single readback of 4 bytes (for mixed-precision loss scaling, which
    /// skips a step whose gradients overflowed). Empty tensors and an empty list give `false`.
    pub fn nonfinite(&self, tensors: &[&Tensor]) -> Result<bool> {
        if tensors.iter().all(|t| t.numel() == 0) {
            return Ok(false);
        }
        if tensors.iter().any(|t| t.device() != self) {
            return Err(Error::DeviceMismatch { op: "nonfinite" });
        }
        let flag = Tensor::zeros(self, &[1], DType::F32)?;
        for t in tensors {
            nonfinite::nonfinite(*t, &flag)?;
        }
        Ok(flag.item()? != 0.0)
    }
}
