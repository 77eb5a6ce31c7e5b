//! Convolutional layers, as torch's: [`Conv2d`], [`BatchNorm2d`] (running statistics as
//! buffers: in checkpoints, never in the optimizer), [`GroupNorm`], [`MaxPool2d`],
//! [`AvgPool2d`]. Parameters of another dtype than the input are cast to it inside the graph
//! (mixed precision keeps f32 parameters), as `LayerNorm` does.

use super::Module;
use crate::tensor::autograd;
use crate::{BatchNormOptions, Conv2dOptions, DType, Device, Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A 2-D convolution layer (NCHW), as torch's `nn.Conv2d`: weight (out, in / groups, k, k)
/// and an optional bias (out), both initialized uniform in ±1 / sqrt(in / groups k k) (torch's
/// kaiming_uniform with a = sqrt(5)).
#[derive(Clone)]
pub struct Conv2d {
    /// (out_channels, in_channels / groups, kh, kw)
    pub weight: Tensor,
    /// (out_channels)
    pub bias: Option<Tensor>,
    /// Stride, padding, dilation and groups.
    pub options: Conv2dOptions,
}

impl Conv2d {
    /// A square `kernel` convolution from `in_channels` to `out_channels` with `options`, f32,
    /// weights drawn from `seed`.
    pub fn new(
        device: &Device,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        options: Conv2dOptions,
        bias: bool,
        seed: u64,
    ) -> Result<Conv2d> {
        let g = options.groups;
        if in_channels == 0
            || out_channels == 0
            || kernel == 0
            || g == 0
            || !in_channels.is_multiple_of(g)
            || !out_channels.is_multiple_of(g)
        {
            return Err(Error::InvalidArgument {
                op: "Conv2d::new",
                reason: format!(
                    "need channels, kernel and groups > 0 with groups dividing the channels, got \
                     in {in_channels}, out {out_channels}, kernel {kernel}, groups {g}"
                ),
            });
        }
        let fan_in = in_channels / g * kernel * kernel;
        let bound = 1.0 / (fan_in as f32).sqrt();
        let dims = [out_channels, in_channels / g, kernel, kernel];
        let weight = Tensor::rand_uniform(device, &dims, -bound, bound, seed, DType::F32)?
            .with_requires_grad();
        let bias = if bias {
            let s = seed ^ 0x9e37_79b9_7f4a_7c15;
            Some(
                Tensor::rand_uniform(device, &[out_channels], -bound, bound, s, DType::F32)?
                    .with_requires_grad(),
            )
        } else {
            None
        };
        Ok(Conv2d {
            weight,
            bias,
            options,
        })
    }
}

impl Module for Conv2d {
    /// x (N, in, H, W) -> (N, out, OH, OW) in x's dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.cast(x.dtype())?;
        let b = self.bias.as_ref().map(|b| b.cast(x.dtype())).transpose()?;
        x.conv2d(&w, b.as_ref(), &self.options)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("weight".to_string(), self.weight.clone())];
        out.extend(self.bias.iter().map(|b| ("bias".to_string(), b.clone())));
        out
    }
}

/// Batch normalization over (N, C, H, W) per channel, as torch's `nn.BatchNorm2d(C)`: weight
/// ones, bias zeros, eps 1e-5, momentum 0.1; in training the batch's statistics normalize and
/// the running mean and (unbiased) variance move, in eval the running ones normalize. The
/// running statistics are f32 buffers (`running_mean`, `running_var`; zeros and ones at the
/// start): saved in checkpoints, given no gradient. Statistics mix the samples of a batch, so
/// micro-batches change them, as they do in torch. Clones share the tensors and the mode.
#[derive(Clone)]
pub struct BatchNorm2d {
    /// (C), ones.
    pub weight: Tensor,
    /// (C), zeros.
    pub bias: Tensor,
    /// (C) f32, zeros: updated in place by each training forward.
    pub running_mean: Tensor,
    /// (C) f32, ones.
    pub running_var: Tensor,
    /// The running statistics' step.
    pub momentum: f32,
    /// Added to the variance before the square root.
    pub eps: f32,
    training: Arc<AtomicBool>,
}

impl BatchNorm2d {
    /// Normalizes `channels` channels, f32 parameters, in training mode.
    pub fn new(device: &Device, channels: usize) -> Result<BatchNorm2d> {
        if channels == 0 {
            return Err(Error::InvalidArgument {
                op: "BatchNorm2d::new",
                reason: "need at least one channel".into(),
            });
        }
        let f = DType::F32;
        Ok(BatchNorm2d {
            weight: Tensor::ones(device, &[channels], f)?.with_requires_grad(),
            bias: Tensor::zeros(device, &[channels], f)?.with_requires_grad(),
            running_mean: Tensor::zeros(device, &[channels], f)?,
            running_var: Tensor::ones(device, &[channels], f)?,
            momentum: 0.1,
            eps: 1e-5,
            training: Arc::new(AtomicBool::new(true)),
        })
    }

    /// Whether the layer is in training mode.
    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }
}

impl Module for BatchNorm2d {
    /// x (N, C, H, W) -> the same shape and dtype. A forward recomputed by activation
    /// checkpointing's backward leaves the running statistics alone: they move once per step,
    /// with or without checkpointing.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.cast(x.dtype())?;
        let b = self.bias.cast(x.dtype())?;
        let training = self.is_training();
        let update = training && !autograd::recomputing();
        x.batch_norm(&BatchNormOptions {
            running: Some((&self.running_mean, &self.running_var)),
            weight: Some(&w),
            bias: Some(&b),
            training,
            momentum: if update { self.momentum } else { 0.0 },
            eps: self.eps,
        })
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        vec![
            ("running_mean".to_string(), self.running_mean.clone()),
            ("running_var".to_string(), self.running_var.clone()),
        ]
    }

    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }
}

/// Group normalization, as torch's `nn.GroupNorm(groups, C)`: weight ones, bias zeros, eps
/// 1e-5. Each sample is normalized alone, so micro-batches give the whole batch's result.
#[derive(Clone)]
pub struct GroupNorm {
    /// (C), ones.
    pub weight: Tensor,
    /// (C), zeros.
    pub bias: Tensor,
    /// Channel groups normalized together.
    pub groups: usize,
    /// Added to the variance before the square root.
    pub eps: f32,
}

impl GroupNorm {
    /// `groups` groups of `channels` (groups dividing channels), f32 parameters.
    pub fn new(device: &Device, groups: usize, channels: usize) -> Result<GroupNorm> {
        if groups == 0 || channels == 0 || !channels.is_multiple_of(groups) {
            return Err(Error::InvalidArgument {
                op: "GroupNorm::new",
                reason: format!("groups {groups} must be > 0 and divide the channels {channels}"),
            });
        }
        let f = DType::F32;
        Ok(GroupNorm {
            weight: Tensor::ones(device, &[channels], f)?.with_requires_grad(),
            bias: Tensor::zeros(device, &[channels], f)?.with_requires_grad(),
            groups,
            eps: 1e-5,
        })
    }
}

impl Module for GroupNorm {
    /// x (N, C, ..) -> the same shape and dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.cast(x.dtype())?;
        let b = self.bias.cast(x.dtype())?;
        x.group_norm(self.groups, Some(&w), Some(&b), self.eps)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }
}

/// Max pooling, as torch's `nn.MaxPool2d(kernel, stride, padding)`.
#[derive(Clone, Copy, Debug)]
pub struct MaxPool2d {
    /// Window size.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
    /// Implicit -inf on each side, at most half the kernel.
    pub padding: usize,
}

impl Module for MaxPool2d {
    /// x (N, C, H, W) -> (N, C, OH, OW).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (k, s, p) = (self.kernel, self.stride, self.padding);
        x.max_pool2d([k, k], [s, s], [p, p])
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
}

/// Average pooling, as torch's `nn.AvgPool2d(kernel, stride, padding)` (count_include_pad).
/// `kernel` 0 is the global average pool, (N, C, 1, 1), whatever the input's size.
#[derive(Clone, Copy, Debug)]
pub struct AvgPool2d {
    /// Window size; 0 for the whole plane.
    pub kernel: usize,
    /// Step between windows.
    pub stride: usize,
    /// Zeros on each side, at most half the kernel.
    pub padding: usize,
}

impl AvgPool2d {
    /// The global average pool: each plane's mean.
    pub fn global() -> AvgPool2d {
        AvgPool2d {
            kernel: 0,
            stride: 1,
            padding: 0,
        }
    }
}

impl Module for AvgPool2d {
    /// x (N, C, H, W) -> (N, C, OH, OW).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.kernel == 0 {
            return x.global_avg_pool2d();
        }
        let (k, s, p) = (self.kernel, self.stride, self.padding);
        x.avg_pool2d([k, k], [s, s], [p, p], true)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }
}
