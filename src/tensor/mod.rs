//! Tensors: a shape, a dtype, and a block of arena memory on one device. Always contiguous and
//! row-major; `reshape` shares the block, every op writes a new one.

mod attention;
pub mod autograd;
mod batch_norm;
mod conv;
mod dropout;
mod index_select;
mod inplace;
pub mod invariant;
mod layer_norm;
mod layout;
mod matmul;
mod operand;
mod ops;
mod pool;
mod qlinear;
mod random;
mod rope;
mod select;
mod softmax;
pub(crate) mod streamed;

pub use crate::dtype::{DType, Element};
pub use crate::kernels::matmul::Variant as MatmulVariant;
pub use crate::shape::{Shape, MAX_RANK};
pub use attention::{repeat_kv, AttentionKind, AttentionOptions};
pub use batch_norm::BatchNormOptions;
pub use conv::Conv2dOptions;
pub use matmul::MatmulOptions;
pub use qlinear::{DoubleQuant, QuantFormat, QuantWeight, NF4_BLOCK, NF4_DQ_BLOCK};
pub use random::Rng;
pub use rope::{rope_table, Rope};
pub use softmax::SoftmaxOptions;

use crate::device::Device;
use crate::kernels::elementwise;
use crate::memory::Block;
use crate::{Error, Result};
use autograd::Node;
use std::fmt;
use std::sync::Arc;

/// A block owned by tensors; returned to the arena when the last tensor using it is dropped.
/// A range view ([`Tensor::range_view`]) holds part of another allocation's block and keeps
/// that allocation alive instead of owning memory.
struct Allocation {
    block: Block,
    device: Device,
    /// Set when the tensor's home moves to host memory (src/tensor/streamed.rs); `block` has
    /// been freed then.
    streamed: std::sync::OnceLock<streamed::Streamed>,
    /// The allocation a range view shares (it frees nothing itself).
    parent: Option<Arc<Allocation>>,
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if self.parent.is_none() {
            self.release();
        }
    }
}

/// An n-dimensional array on a [`Device`]: contiguous, row-major, f32 or f16. Clones share the
/// memory; the block goes back to the arena when the last clone drops.
#[derive(Clone)]
pub struct Tensor {
    alloc: Arc<Allocation>,
    shape: Shape,
    dtype: DType,
    /// Autograd: set on leaves that require grad and on outputs of ops recorded from them.
    node: Option<Arc<Node>>,
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
            alloc: Arc::new(Allocation {
                block,
                device: device.clone(),
                streamed: std::sync::OnceLock::new(),
                parent: None,
            }),
            shape,
            dtype,
            node: None,
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

    /// A tensor of zeros.
    pub fn zeros(device: &Device, dims: &[usize], dtype: DType) -> Result<Tensor> {
        let t = Tensor::uninit(device, Shape::new(dims)?, dtype)?;
        device.clear(t.block())?;
        Ok(t)
    }

    /// A tensor of ones.
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
        if self.block().same_segment(out.block()) {
            elementwise::unary(elementwise::UnaryOp::Identity, self, 0.0, &out)?;
        } else if bytes > 0 {
            self.device().copy(self.block(), out.block(), bytes)?;
        }
        Ok(autograd::record("copy", out, &[self], || {
            Box::new(|g, _| Ok(vec![Some(g.clone())]))
        }))
    }

    /// Rows `start..end` along the first dim, as a new tensor copied by the copy engine (a
    /// batch out of a dataset shard). Not differentiable.
    pub fn rows(&self, start: usize, end: usize) -> Result<Tensor> {
        let dims = self.dims();
        if dims.is_empty() || start > end || end > dims[0] {
            return Err(Error::Shape {
                op: "rows",
                lhs: dims.to_vec(),
                rhs: vec![start, end],
                reason: "need rank >= 1 and start <= end <= the first dim".into(),
            });
        }
        let per_row = dims[1..].iter().product::<usize>() * self.dtype.size();
        let mut out_dims = dims.to_vec();
        out_dims[0] = end - start;
        let out = Tensor::uninit(self.device(), Shape::new(&out_dims)?, self.dtype)?;
        let (offset, bytes) = ((start * per_row) as u64, ((end - start) * per_row) as u64);
        if bytes == 0 {
            return Ok(out);
        }
        let same_buffer = self.block().same_segment(out.block());
        if offset % 4 == 0 && bytes % 4 == 0 && !same_buffer {
            let src = Block {
                offset: self.block().offset + offset,
                size: bytes,
                ..self.block().clone()
            };
            self.device().copy(&src, out.block(), bytes)?;
        } else {
            // Unaligned f16 rows, or both in one segment (wgpu cannot copy a buffer onto
            // itself): through the host, reading only the 4-byte aligned span of the rows.
            let lo = offset & !3;
            let span = Block {
                offset: self.block().offset + lo,
                size: offset + bytes - lo,
                ..self.block().clone()
            };
            let read = self.device().download(&span, span.size)?;
            let skip = (offset - lo) as usize;
            self.device()
                .upload(out.block(), &read[skip..skip + bytes as usize])?;
        }
        Ok(autograd::record_nondiff("rows", out, &[self]))
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
        Ok(bytemuck::pod_collect_to_vec(&self.read_bytes()?))
    }

    /// Elements `start..end` read back as f32 whatever the dtype (one readback of that range
    /// only; `start` a multiple of 2, so the range starts on a 4-byte boundary).
    pub(crate) fn read_range_f32(&self, start: usize, end: usize) -> Result<Vec<f32>> {
        if let Some(v) = self.host_range(start, end) {
            return Ok(v);
        }
        let size = self.dtype.size();
        let bytes = self.device().download_at(
            self.block(),
            (start * size) as u64,
            ((end - start) * size) as u64,
        )?;
        Ok(match self.dtype {
            DType::F32 => bytemuck::pod_collect_to_vec(&bytes),
            DType::F16 => bytemuck::pod_collect_to_vec::<u8, half::f16>(&bytes)
                .into_iter()
                .map(f32::from)
                .collect(),
        })
    }

    /// Writes `values` (rounded to the tensor's dtype) into elements `start..` (`start` a
    /// multiple of 2).
    pub(crate) fn write_range_f32(&self, start: usize, values: &[f32]) -> Result<()> {
        if self.write_host_range(start, values)? {
            return Ok(());
        }
        let at = (start * self.dtype.size()) as u64;
        match self.dtype {
            DType::F32 => self
                .device()
                .upload_at(self.block(), at, bytemuck::cast_slice(values)),
            DType::F16 => {
                let h: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
                self.device()
                    .upload_at(self.block(), at, bytemuck::cast_slice(&h))
            }
        }
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
        let out = Tensor {
            alloc: self.alloc.clone(),
            shape,
            dtype: self.dtype,
            node: None,
        };
        let from = self.dims().to_vec();
        Ok(autograd::record("reshape", out, &[self], || {
            Box::new(move |g, _| Ok(vec![Some(g.reshape(&from)?)]))
        }))
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dims, outermost first.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the tensor lives on.
    pub fn device(&self) -> &Device {
        &self.alloc.device
    }

    /// Bytes of arena memory this tensor's block takes (aligned).
    pub fn allocated_bytes(&self) -> u64 {
        self.alloc.block.size
    }

    pub(crate) fn block(&self) -> &Block {
        match self.alloc.streamed.get() {
            Some(s) => &s.block,
            None => &self.alloc.block,
        }
    }

    /// Whether `other` is this tensor's memory with this shape (the same parameter, however
    /// many handles hold it).
    pub(crate) fn is_same(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.alloc, &other.alloc) && self.shape == other.shape
    }

    /// Elements `start..start + len` of this tensor's memory as a 1-D tensor that shares it
    /// (writes through either change both; the view keeps the memory alive), without graph:
    /// the update of a shard of the parameters that starts or ends inside a tensor. The range
    /// must start on a block boundary ([`BLOCK_ALIGN`](crate::memory::BLOCK_ALIGN) bytes).
    pub(crate) fn range_view(&self, start: usize, len: usize) -> Result<Tensor> {
        let es = self.dtype.size() as u64;
        let align = crate::memory::BLOCK_ALIGN;
        let at = start as u64 * es;
        if start + len > self.numel() || !at.is_multiple_of(align) || len == 0 {
            return Err(Error::InvalidArgument {
                op: "range_view",
                reason: format!(
                    "elements {start}..{} of a tensor of {} are not a view starting on a \
                     {align}-byte boundary",
                    start + len,
                    self.numel()
                ),
            });
        }
        let b = &self.alloc.block;
        // Whole aligned blocks up to the end of the parent's: kernels bound by the count.
        let size = (len as u64 * es).div_ceil(align) * align;
        let block = Block {
            offset: b.offset + at,
            size: size.min(b.size - at),
            ..b.clone()
        };
        Ok(Tensor {
            alloc: Arc::new(Allocation {
                block,
                device: self.alloc.device.clone(),
                streamed: std::sync::OnceLock::new(),
                parent: Some(self.alloc.clone()),
            }),
            shape: Shape::new(&[len])?,
            dtype: self.dtype,
            node: None,
        })
    }

    /// Whether no other tensor (clone or reshape) shares this tensor's memory.
    pub(crate) fn storage_is_unique(&self) -> bool {
        Arc::strong_count(&self.alloc) == 1
    }

    pub(crate) fn node(&self) -> Option<&Arc<Node>> {
        self.node.as_ref()
    }

    pub(crate) fn set_node(&mut self, node: Option<Arc<Node>>) {
        self.node = node;
    }

    // ---- autograd ----

    /// Whether ops on this tensor are recorded for `backward()`.
    pub fn requires_grad(&self) -> bool {
        self.node.is_some()
    }

    /// Marks this tensor as a leaf whose gradient `backward()` accumulates (a parameter), or
    /// stops that. Clones made afterwards share the gradient; clones made before do not.
    pub fn set_requires_grad(&mut self, on: bool) {
        self.node = on.then(|| Node::leaf(self.dims()));
    }

    /// The builder form of [`Tensor::set_requires_grad`]`(true)`.
    pub fn with_requires_grad(mut self) -> Tensor {
        self.set_requires_grad(true);
        self
    }

    /// Whether this is a tensor the user created (not an op's recorded output).
    pub fn is_leaf(&self) -> bool {
        self.node.as_ref().is_none_or(|n| n.is_leaf())
    }

    /// The same memory without the graph: ops on it are not recorded and backward stops there.
    pub fn detach(&self) -> Tensor {
        Tensor {
            alloc: self.alloc.clone(),
            shape: self.shape.clone(),
            dtype: self.dtype,
            node: None,
        }
    }

    /// The gradient accumulated by `backward()` calls since the last `zero_grad()` (leaves
    /// only; `None` before any backward reached this tensor).
    pub fn grad(&self) -> Option<Tensor> {
        self.node.as_ref().and_then(|n| n.grad())
    }

    /// Replaces the accumulated gradient (gradient clipping, loss scaling, tests). The shape
    /// must match.
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        match &self.node {
            Some(n) if n.is_leaf() => n.set_grad(grad),
            _ => Err(Error::Autograd(
                "set_grad needs a leaf tensor that requires grad".into(),
            )),
        }
    }

    /// Drops the accumulated gradient (torch's `zero_grad(set_to_none=True)`): its memory goes
    /// back to the arena and the next backward starts from zero.
    pub fn zero_grad(&self) {
        if let Some(n) = &self.node {
            if n.is_leaf() {
                let _ = n.set_grad(None);
            }
        }
        self.take_host_grad();
    }

    /// Backpropagates from this one-element tensor (a loss): every leaf it depends on gets
    /// d(self)/d(leaf) added to its gradient. The graph is freed as it goes, so a second
    /// `backward()` through the same graph is an [`Error::Autograd`].
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(Error::Autograd(format!(
                "backward() needs a one-element tensor (a loss), got shape {:?}; use backward_with(grad) for others",
                self.dims()
            )));
        }
        let seed = Tensor::full(self.device(), self.dims(), 1.0, self.dtype)?;
        self.backward_with(seed)
    }

    /// Backpropagates with `grad` as the gradient of this tensor (same shape).
    pub fn backward_with(&self, grad: Tensor) -> Result<()> {
        let node = self.node.as_ref().ok_or_else(|| {
            Error::Autograd(
                "this tensor does not require grad: nothing it was computed from has set_requires_grad(true), or it was computed under no_grad()"
                    .into(),
            )
        })?;
        if grad.dims() != self.dims() {
            return Err(Error::Autograd(format!(
                "backward_with: gradient shape {:?} differs from the tensor's {:?}",
                grad.dims(),
                self.dims()
            )));
        }
        autograd::backward(node, grad.detach())
    }
}
