//! The ops a user calls on tensors: validation here, kernels in src/kernels/.

use super::{DType, Shape, Tensor};
use crate::kernels::elementwise::{self, BinaryOp, UnaryOp};
use crate::kernels::{reduce, transpose};
use crate::{Error, Result};

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

    fn binary(&self, op: BinaryOp, name: &'static str, other: &Tensor) -> Result<Tensor> {
        self.same_device_and_dtype(name, other)?;
        let shape = Shape::broadcast(name, self.shape(), other.shape())?;
        let out = Tensor::uninit(self.device(), shape, self.dtype())?;
        elementwise::binary(op, self, other, &out)?;
        Ok(out)
    }

    /// Elementwise `self + other`, broadcasting like numpy.
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Add, "add", other)
    }

    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Sub, "sub", other)
    }

    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Mul, "mul", other)
    }

    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Div, "div", other)
    }

    fn unary(&self, op: UnaryOp, s: f32) -> Result<Tensor> {
        let out = Tensor::uninit(self.device(), self.shape().clone(), self.dtype())?;
        elementwise::unary(op, self, s, &out)?;
        Ok(out)
    }

    pub fn add_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::AddScalar, s)
    }

    pub fn sub_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::SubScalar, s)
    }

    pub fn mul_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::MulScalar, s)
    }

    pub fn div_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::DivScalar, s)
    }

    /// `s - self`.
    pub fn rsub_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::RSubScalar, s)
    }

    /// `s / self`.
    pub fn rdiv_scalar(&self, s: f32) -> Result<Tensor> {
        self.unary(UnaryOp::RDivScalar, s)
    }

    pub fn neg(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg, 0.0)
    }

    pub fn relu(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Relu, 0.0)
    }

    /// A copy in another dtype (f32 -> f16 rounds to nearest even); the same dtype copies.
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let out = Tensor::uninit(self.device(), self.shape().clone(), dtype)?;
        elementwise::unary(UnaryOp::Identity, self, 0.0, &out)?;
        Ok(out)
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
        if self.dtype() == DType::F32 {
            Ok(acc)
        } else {
            acc.to_dtype(self.dtype())
        }
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
        Ok(out)
    }
}
