//! `LayerNorm`: layer norm over the last dim with a learned weight and bias, as torch's
//! `nn.LayerNorm(dim)` (see [`Tensor::layer_norm`]).

use super::Module;
use crate::{DType, Device, Error, Result, Tensor};

/// torch's default eps.
pub const LAYER_NORM_EPS: f32 = 1e-5;

/// Layer normalization over the last dim with a learned scale and shift, like torch's
/// `nn.LayerNorm`.
#[derive(Clone)]
pub struct LayerNorm {
    /// (dim), initialized to ones.
    pub weight: Tensor,
    /// (dim), initialized to zeros.
    pub bias: Tensor,
    /// The normalized (last) dim's size.
    pub dim: usize,
    /// Added to the variance before the square root.
    pub eps: f32,
}

impl LayerNorm {
    /// Normalizes the last dim, of size `dim`, f32, eps 1e-5.
    pub fn new(device: &Device, dim: usize) -> Result<LayerNorm> {
        LayerNorm::with_options(device, dim, LAYER_NORM_EPS, DType::F32)
    }

    /// [`LayerNorm::new`] with another eps (finite, >= 0) and parameter dtype.
    pub fn with_options(device: &Device, dim: usize, eps: f32, dtype: DType) -> Result<LayerNorm> {
        if dim == 0 || !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::InvalidArgument {
                op: "LayerNorm::new",
                reason: format!("need dim > 0 and a finite eps >= 0, got dim {dim}, eps {eps}"),
            });
        }
        Ok(LayerNorm {
            weight: Tensor::ones(device, &[dim], dtype)?.with_requires_grad(),
            bias: Tensor::zeros(device, &[dim], dtype)?.with_requires_grad(),
            dim,
            eps,
        })
    }
}

impl Module for LayerNorm {
    /// x (.., dim) -> (.., dim) in x's dtype. Parameters of another dtype are cast to it inside
    /// the graph (mixed precision keeps f32 parameters), so gradients reach them in theirs.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.layer_norm(
            Some(&self.weight.cast(x.dtype())?),
            Some(&self.bias.cast(x.dtype())?),
            self.eps,
        )
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![
            ("weight".to_string(), self.weight.clone()),
            ("bias".to_string(), self.bias.clone()),
        ]
    }
}
