//! Where tensors meet the layers below them: tensors as kernel operands, f32 staging for the
//! outputs a kernel cannot write in place, and the device's memory API that takes tensors
//! (`Device::retag`, `PlanScope::forget`).

use super::{DType, Tensor};
use crate::device::{Device, PlanScope};
use crate::kernels::elementwise::{self, UnaryOp};
use crate::kernels::Operand;
use crate::memory::{Block, Category};
use crate::shape::Shape;
use crate::Result;

impl Operand for Tensor {
    fn device(&self) -> &Device {
        Tensor::device(self)
    }

    fn block(&self) -> &Block {
        Tensor::block(self)
    }

    fn shape(&self) -> &Shape {
        Tensor::shape(self)
    }

    fn dtype(&self) -> DType {
        Tensor::dtype(self)
    }
}

/// Runs `kernel` into `out`, or, where `staged` (packed f16 output whose words a kernel would
/// split between invocations) and `out` is not empty, into an f32 temporary of out's shape that
/// is then cast into `out`. The temporary lives only until the cast is recorded.
pub(crate) fn staged_f32(
    out: &Tensor,
    staged: bool,
    kernel: impl FnOnce(&Tensor) -> Result<()>,
) -> Result<()> {
    // An empty output has nothing to stage (the kernels write nothing).
    if !staged || out.numel() == 0 {
        return kernel(out);
    }
    let tmp = {
        let _s = out.device().staging_scope();
        Tensor::uninit(out.device(), out.shape().clone(), DType::F32)?
    };
    kernel(&tmp)?;
    elementwise::unary(UnaryOp::Identity, &tmp, 0.0, out)
}

impl Device {
    /// Counts `tensor`'s memory as `cat` from now on.
    pub fn retag(&self, tensor: &Tensor, cat: Category) {
        self.retag_block(tensor.block(), cat);
    }
}

impl PlanScope {
    /// Leaves `tensor` out of the plan: the planning arena frees its block (the real tensor
    /// lives on). The planner sets the optimizer's real state aside this way.
    pub fn forget(&self, tensor: &Tensor) {
        self.forget_block(tensor.block());
    }
}
