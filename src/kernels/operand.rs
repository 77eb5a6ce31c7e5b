//! What a kernel sees of a tensor: the device it lives on, its block of arena memory, its
//! shape (contiguous, row-major) and its dtype. Kernels take operands through this trait, so
//! they know nothing of tensors, autograd or ops; `Tensor` implements it (src/tensor/).

use crate::device::Device;
use crate::dtype::DType;
use crate::memory::Block;
use crate::shape::Shape;

/// A kernel's view of one tensor.
pub(crate) trait Operand {
    /// The device whose arena holds the block.
    fn device(&self) -> &Device;
    /// The elements, contiguous from the block's start.
    fn block(&self) -> &Block;
    /// The shape the elements are laid out in (row-major).
    fn shape(&self) -> &Shape;
    /// How each element is stored.
    fn dtype(&self) -> DType;

    /// The shape's dims.
    fn dims(&self) -> &[usize] {
        self.shape().dims()
    }

    /// The element count.
    fn numel(&self) -> usize {
        self.shape().numel()
    }
}
