//! Tensors: a shape, a dtype, and a block of arena memory on one device. Always contiguous and
//! row-major; `reshape` shares the block, every op writes a new one.

mod dtype;
mod matmul;
mod ops;
mod random;
mod shape;
mod softmax;

pub use dtype::{DType, Element};
pub use matmul::MatmulOptions;
pub use random::Rng;
pub use shape::{Shape, MAX_RANK};

use crate::device::Device;
use crate::kernels::elementwise;
use crate::memory::Block;
use crate::{Error, Result};
use std::fmt;
use std::sync::Arc;

/// A block owned by tensors; returned to the arena when the last tensor using it is dropped.
struct Storage {
    block: Block,
    device: Device,
}

impl Drop for Storage {
    fn drop(&mut self) {
        self.device.free(&self.block);
    }
}

#[derive(Clone)]
pub struct Tensor {
    storage: Arc<Storage>,
    shape: Shape,
    dtype: DType,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({:?}, {})", self.shape, self.dtype)
    }
}

fn bytes_for(shape: &Shape, dtype: DType) -> u64 {
    (shape.numel() * dtype.size()) as u64
}

impl Tensor {
    /// A tensor whose contents are whatever the block held (every op overwrites it).
    pub(crate) fn uninit(device: &Device, shape: Shape, dtype: DType) -> Result<Tensor> {
        let block = device.alloc(bytes_for(&shape, dtype))?;
        Ok(Tensor {
            storage: Arc::new(Storage {
                block,
                device: device.clone(),
            }),
            shape,
            dtype,
        })
    }

    /// Copies host data to a new tensor of shape `dims`.
    pub fn from_slice<T: Element>(device: &Device, data: &[T], dims: &[usize]) -> Result<Tensor> {
        let shape = Shape::new(dims)?;
        if shape.numel() != data.len() {
            return Err(Error::Shape {
                op: "from_slice",
                lhs: vec![data.len()],
                rhs: dims.to_vec(),
                reason: format!("{} values cannot fill shape {dims:?}", data.len()),
            });
        }
        let t = Tensor::uninit(device, shape, T::DTYPE)?;
        device.upload(t.block(), bytemuck::cast_slice(data))?;
        Ok(t)
    }

    /// A rank-0 tensor.
    pub fn scalar<T: Element>(device: &Device, value: T) -> Result<Tensor> {
        Tensor::from_slice(device, &[value], &[])
    }

    pub fn zeros(device: &Device, dims: &[usize], dtype: DType) -> Result<Tensor> {
        let t = Tensor::uninit(device, Shape::new(dims)?, dtype)?;
        device.clear(t.block());
        Ok(t)
    }

    pub fn ones(device: &Device, dims: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(device, dims, 1.0, dtype)
    }

    /// Every element `value` (rounded to f16 for f16 tensors).
    pub fn full(device: &Device, dims: &[usize], value: f32, dtype: DType) -> Result<Tensor> {
        let t = Tensor::uninit(device, Shape::new(dims)?, dtype)?;
        elementwise::fill(&t, value)?;
        Ok(t)
    }

    /// A copy made by the copy engine (`copy_buffer_to_buffer`), the memory-bandwidth yardstick
    /// benchmarks compare kernels against. wgpu cannot copy within one buffer, so when the new
    /// block lands in the same arena segment the copy kernel runs instead.
    pub fn copy(&self) -> Result<Tensor> {
        let out = Tensor::uninit(self.device(), self.shape.clone(), self.dtype)?;
        let bytes = bytes_for(&self.shape, self.dtype).div_ceil(4) * 4;
        if Arc::ptr_eq(&self.block().buffer, &out.block().buffer) {
            elementwise::unary(elementwise::UnaryOp::Identity, self, 0.0, &out)?;
        } else if bytes > 0 {
            self.device().copy(self.block(), out.block(), bytes);
        }
        Ok(out)
    }

    /// Reads the tensor back. `T` must match the dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::DType {
                op: "to_vec",
                expected: self.dtype,
                got: T::DTYPE,
            });
        }
        let bytes = self
            .device()
            .download(self.block(), bytes_for(&self.shape, self.dtype))?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Reads the tensor back as f32 whatever its dtype.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        match self.dtype {
            DType::F32 => self.to_vec::<f32>(),
            DType::F16 => Ok(self
                .to_vec::<half::f16>()?
                .into_iter()
                .map(f32::from)
                .collect()),
        }
    }

    /// The value of a one-element tensor.
    pub fn item(&self) -> Result<f32> {
        if self.numel() != 1 {
            return Err(Error::Shape {
                op: "item",
                lhs: self.dims().to_vec(),
                rhs: vec![],
                reason: "item() needs exactly one element".into(),
            });
        }
        Ok(self.to_vec_f32()?[0])
    }

    /// The same data seen with another shape of the same element count; no copy.
    pub fn reshape(&self, dims: &[usize]) -> Result<Tensor> {
        let shape = Shape::new(dims)?;
        if shape.numel() != self.numel() {
            return Err(Error::Shape {
                op: "reshape",
                lhs: self.dims().to_vec(),
                rhs: dims.to_vec(),
                reason: "element counts differ".into(),
            });
        }
        Ok(Tensor {
            storage: self.storage.clone(),
            shape,
            dtype: self.dtype,
        })
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn device(&self) -> &Device {
        &self.storage.device
    }

    /// Bytes of arena memory this tensor's block takes (aligned).
    pub fn allocated_bytes(&self) -> u64 {
        self.storage.block.size
    }

    pub(crate) fn block(&self) -> &Block {
        &self.storage.block
    }
}
