//! In-place updates of tensors outside the graph: running sums and counters that live on the
//! device across steps (the trainer's loss sums) without a readback or a new block per step.

use super::Tensor;
use crate::kernels::elementwise::{self, BinaryOp};
use crate::{Error, Result};

impl Tensor {
    /// Sets every element to `value`, in place. Not recorded by autograd: a tensor that
    /// requires grad is refused, as torch refuses an in-place op on a leaf that requires grad.
    pub fn fill_(&self, value: f32) -> Result<()> {
        self.check_inplace("fill_")?;
        elementwise::fill(self, value)
    }

    /// `self += other`, in place, with `other` of the same shape and dtype (no broadcasting:
    /// the sum is written over `self`'s own block). Not recorded by autograd; `other` is read
    /// as a value, so a tensor in the graph may be added (its gradient does not flow here).
    pub fn add_(&self, other: &Tensor) -> Result<()> {
        self.check_inplace("add_")?;
        self.same_device_and_dtype("add_", other)?;
        if self.dims() != other.dims() {
            return Err(Error::Shape {
                op: "add_",
                lhs: self.dims().to_vec(),
                rhs: other.dims().to_vec(),
                reason: "an in-place add needs equal shapes".into(),
            });
        }
        elementwise::binary(BinaryOp::Add, self, other, self)
    }

    fn check_inplace(&self, op: &'static str) -> Result<()> {
        if self.requires_grad() {
            return Err(Error::InvalidArgument {
                op,
                reason: "an in-place op on a tensor that requires grad would hide the change \
                         from autograd; detach() it first"
                    .into(),
            });
        }
        Ok(())
    }
}
