//! `Mlp`: Linear layers with an activation between them (none after the last).

use super::{Linear, Module};
use crate::kernels::matmul::Activation;
use crate::{DType, Device, Error, Result, Tensor};
use std::str::FromStr;

/// The activation between layers. Relu and gelu are fused into the matmul's epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Act {
    #[default]
    Relu,
    Gelu,
    Tanh,
    Sigmoid,
}

impl FromStr for Act {
    type Err = Error;
    fn from_str(s: &str) -> Result<Act> {
        match s.to_ascii_lowercase().as_str() {
            "relu" => Ok(Act::Relu),
            "gelu" => Ok(Act::Gelu),
            "tanh" => Ok(Act::Tanh),
            "sigmoid" => Ok(Act::Sigmoid),
            _ => Err(Error::InvalidArgument {
                op: "Act",
                reason: format!("unknown activation '{s}' (relu, gelu, tanh, sigmoid)"),
            }),
        }
    }
}

pub struct Mlp {
    pub layers: Vec<Linear>,
    pub act: Act,
}

impl Mlp {
    /// Layers `widths[0] -> widths[1] -> ... -> widths[last]`, e.g. `[784, 512, 512, 10]`, f32,
    /// layer i seeded from `seed` and i.
    pub fn new(device: &Device, widths: &[usize], act: Act, seed: u64) -> Result<Mlp> {
        Mlp::with_dtype(device, widths, act, DType::F32, seed)
    }

    pub fn with_dtype(
        device: &Device,
        widths: &[usize],
        act: Act,
        dtype: DType,
        seed: u64,
    ) -> Result<Mlp> {
        if widths.len() < 2 {
            return Err(Error::InvalidArgument {
                op: "Mlp::new",
                reason: format!("need at least an input and an output width, got {widths:?}"),
            });
        }
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let s = seed
                    .wrapping_mul(0x100_0000_01b3)
                    .wrapping_add(i as u64 + 1);
                Linear::with_options(device, w[0], w[1], true, dtype, s)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Mlp { layers, act })
    }

    /// The widths the model was built from.
    pub fn widths(&self) -> Vec<usize> {
        let mut w = vec![self.layers[0].in_features];
        w.extend(self.layers.iter().map(|l| l.out_features));
        w
    }
}

impl Module for Mlp {
    /// x (B, in) -> logits (B, out).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let last = self.layers.len() - 1;
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = if i == last {
                layer.forward(&h)?
            } else {
                match self.act {
                    Act::Relu => layer.forward_act(&h, Activation::Relu)?,
                    Act::Gelu => layer.forward_act(&h, Activation::Gelu)?,
                    Act::Tanh => layer.forward(&h)?.tanh()?,
                    Act::Sigmoid => layer.forward(&h)?.sigmoid()?,
                }
            };
        }
        Ok(h)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .enumerate()
            .flat_map(|(i, l)| {
                l.named_parameters()
                    .into_iter()
                    .map(move |(n, t)| (format!("layers.{i}.{n}"), t))
            })
            .collect()
    }
}
