//! Selection ops: `abs`, `maximum` / `minimum` (broadcast), `where_` (three-input select) and
//! `masked_fill`, with their validation and backward rules.

use super::{Shape, Tensor};
use crate::kernels::elementwise::{self, BinaryOp, UnaryOp};
use crate::tensor::autograd::{grad_if, record, sum_to};
use crate::{Error, Result};

/// `c ? a : b` with all three broadcast (no validation, no recording): out is the broadcast shape.
fn select(op: &'static str, c: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let shape = Shape::broadcast(op, &Shape::broadcast(op, c.shape(), a.shape())?, b.shape())?;
    let out = Tensor::uninit(a.device(), shape, a.dtype())?;
    elementwise::select(c, a, b, &out)?;
    Ok(out)
}

/// The share of an extremum's gradient that goes to `x` against `y` (broadcast): 1 where `x`
/// wins, 0.5 at ties, 0 where it loses.
fn share(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    x.binary(BinaryOp::Share, "share", y)
}

impl Tensor {
    /// |x| elementwise (NaN stays NaN). The gradient is sign(x): 0 at 0, as in torch.
    pub fn abs(&self) -> Result<Tensor> {
        self.saving_unary("abs", UnaryOp::Abs, 0.0, false, |g, x, _| {
            Tensor::activation_backward(BinaryOp::AbsBackward, g, x)
        })
    }

    /// The larger of `self` and `other` elementwise, broadcasting like numpy; NaN if either is
    /// NaN (torch's `maximum`). The gradient goes to the larger; ties split it 0.5 / 0.5, as in
    /// torch.
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        self.extremum("maximum", BinaryOp::Maximum, other)
    }

    /// The smaller of `self` and `other` elementwise, broadcasting; NaN if either is NaN. The
    /// gradient goes to the smaller; ties split it 0.5 / 0.5.
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        self.extremum("minimum", BinaryOp::Minimum, other)
    }

    fn extremum(&self, name: &'static str, op: BinaryOp, other: &Tensor) -> Result<Tensor> {
        let out = self.binary(op, name, other)?;
        Ok(record(name, out, &[self, other], || {
            let (a, b) = (self.detach(), other.detach());
            // The winner of a minimum is the winner of the maximum with the operands swapped.
            let min = op == BinaryOp::Minimum;
            Box::new(move |g, need| {
                let (win_a, win_b) = if min { (&b, &a) } else { (&a, &b) };
                Ok(vec![
                    grad_if(need[0], || sum_to(&g.mul(&share(win_a, win_b)?)?, a.dims()))?,
                    grad_if(need[1], || sum_to(&g.mul(&share(win_b, win_a)?)?, b.dims()))?,
                ])
            })
        }))
    }

    /// `on_true` where `cond` is nonzero, else `on_false`, all three broadcast together like
    /// numpy (torch's `where`). `cond` is an f32 or f16 tensor (NaN counts as nonzero, -0 as
    /// zero), of any dtype whatever the values' dtype; `on_true` and `on_false` share a dtype.
    /// Gradients flow to `on_true` and `on_false` where each was selected, never to `cond`.
    ///
    /// Errors: [`Error::Shape`] when the shapes do not broadcast, [`Error::DType`] when the
    /// values' dtypes differ, [`Error::DeviceMismatch`].
    pub fn where_(cond: &Tensor, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        const OP: &str = "where_";
        on_true.same_device_and_dtype(OP, on_false)?;
        if cond.device() != on_true.device() {
            return Err(Error::DeviceMismatch { op: OP });
        }
        let out = select(OP, cond, on_true, on_false)?;
        Ok(record(OP, out, &[on_true, on_false], || {
            let c = cond.detach();
            let (da, db) = (on_true.dims().to_vec(), on_false.dims().to_vec());
            Box::new(move |g, need| {
                // g has the broadcast shape of all three, so c ? g : 0 has g's shape.
                let zero = Tensor::zeros(g.device(), &[], g.dtype())?;
                Ok(vec![
                    grad_if(need[0], || sum_to(&select(OP, &c, g, &zero)?, &da))?,
                    grad_if(need[1], || sum_to(&select(OP, &c, &zero, g)?, &db))?,
                ])
            })
        }))
    }

    /// `value` where `mask` is nonzero, else this tensor's element (torch's `masked_fill`);
    /// `mask` (f32 or f16, any dtype) broadcasts to this tensor's shape. `value` is rounded to
    /// f16 for f16 tensors. The gradient is zero where filled.
    ///
    /// Errors: [`Error::Shape`] when `mask` does not broadcast to this tensor's shape,
    /// [`Error::DeviceMismatch`].
    pub fn masked_fill(&self, mask: &Tensor, value: f32) -> Result<Tensor> {
        const OP: &str = "masked_fill";
        if mask.device() != self.device() {
            return Err(Error::DeviceMismatch { op: OP });
        }
        if Shape::broadcast(OP, self.shape(), mask.shape())? != *self.shape() {
            return Err(Error::Shape {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: mask.dims().to_vec(),
                reason: "the mask must broadcast to the tensor's shape".into(),
            });
        }
        let fill = Tensor::full(self.device(), &[], value, self.dtype())?;
        let out = select(OP, mask, &fill, self)?;
        Ok(record(OP, out, &[self], || {
            let m = mask.detach();
            Box::new(move |g, _| {
                let zero = Tensor::zeros(g.device(), &[], g.dtype())?;
                Ok(vec![Some(select(OP, &m, &zero, g)?)])
            })
        }))
    }
}
