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

#![warn(missing_docs)]

mod activation;
pub mod checkpoint;
pub mod compress;
pub mod device;
pub mod distributed;
mod dtype;
pub mod error;
mod fsutil;
mod hash;
pub mod hf;
mod kernels;
pub mod memory;
pub mod nn;
pub mod optim;
pub mod report;
pub mod residency;
pub mod run;
mod shape;
pub mod tensor;
pub mod train;

pub use activation::Activation;
pub use device::{AdapterSummary, Device, DeviceInfo, DeviceLimits, DeviceOptions};
pub use error::{AtLeast, Bytes, Error, Result};
pub use fsutil::write_atomic;
pub use memory::MemoryStats;
pub use tensor::autograd;
pub use tensor::autograd::{is_grad_enabled, no_grad, NoGradGuard};
pub use tensor::{AttentionKind, AttentionOptions};
pub use tensor::{BatchNormOptions, Conv2dOptions};
pub use tensor::{DType, Element, MatmulOptions, MatmulVariant, Shape, SoftmaxOptions, Tensor};
/// The wgpu version fitgrad is built on, for the types in its signatures
/// ([`Device::from_wgpu`], [`Device::wgpu_device`]).
pub use wgpu;

/// Validates every variant of every shader file with naga, without a GPU: one line per variant,
/// with the error where one fails (`cargo xtask shaders`).
pub fn validate_shaders() -> Vec<(String, std::result::Result<(), String>)> {
    kernels::validate_all()
}
