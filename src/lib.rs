//! fitgrad: train neural networks on any GPU through wgpu, built around GPU memory.
//!
//! ```no_run
//! use fitgrad::{Device, DType, Tensor};
//! # fn main() -> fitgrad::Result<()> {
//! let dev = Device::new()?;
//! let a = Tensor::randn(&dev, &[2, 3], 0.0, 1.0, 42, DType::F32)?;
//! let b = Tensor::ones(&dev, &[3], DType::F32)?;
//! let c = a.add(&b)?.relu()?.sum_axis(1, false)?; // (2,)
//! println!("{:?}\n{}", c.to_vec::<f32>()?, dev.memory_report());
//! # Ok(()) }
//! ```

pub mod autograd;
pub mod checkpoint;
pub mod device;
mod dtype;
pub mod error;
pub mod fsutil;
pub mod kernels;
pub mod memory;
pub mod nn;
pub mod optim;
mod shape;
pub mod tensor;
pub mod train;

pub use autograd::{is_grad_enabled, no_grad, NoGradGuard};
pub use device::{AdapterSummary, Device, DeviceInfo, DeviceLimits, DeviceOptions};
pub use error::{Bytes, Error, Result};
pub use kernels::matmul::Activation;
pub use memory::MemoryStats;
pub use tensor::{AttentionKind, AttentionOptions};
pub use tensor::{DType, Element, MatmulOptions, Shape, SoftmaxOptions, Tensor};
