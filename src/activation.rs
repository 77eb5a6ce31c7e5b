//! [`Activation`]: the one list of activation functions, used by `nn` layers and by the matmul
//! epilogue (which fuses relu and gelu into its store).

use crate::{Error, Result};
use std::fmt;
use std::str::FromStr;

/// An elementwise activation: between the layers of an [`Mlp`](crate::nn::Mlp), or applied by
/// [`Tensor::matmul_with`](crate::Tensor::matmul_with) to its result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activation {
    /// The identity (the default: a plain matmul).
    #[default]
    None,
    /// `max(x, 0)` (NaN stays NaN). Fused into the matmul's store.
    Relu,
    /// gelu, tanh form. Fused into the matmul's store when nothing records a gradient.
    Gelu,
    /// tanh.
    Tanh,
    /// The logistic sigmoid.
    Sigmoid,
    /// `x * sigmoid(x)` (SiLU, swish): Llama's MLP activation.
    Silu,
}

impl Activation {
    /// The name [`FromStr`] reads and checkpoints store.
    pub fn name(self) -> &'static str {
        match self {
            Activation::None => "none",
            Activation::Relu => "relu",
            Activation::Gelu => "gelu",
            Activation::Tanh => "tanh",
            Activation::Sigmoid => "sigmoid",
            Activation::Silu => "silu",
        }
    }
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Activation {
    type Err = Error;
    fn from_str(s: &str) -> Result<Activation> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "identity" => Ok(Activation::None),
            "relu" => Ok(Activation::Relu),
            "gelu" => Ok(Activation::Gelu),
            "tanh" => Ok(Activation::Tanh),
            "sigmoid" => Ok(Activation::Sigmoid),
            "silu" | "swish" => Ok(Activation::Silu),
            _ => Err(Error::InvalidArgument {
                op: "Activation",
                reason: format!("unknown activation '{s}' (none, relu, gelu, tanh, sigmoid, silu)"),
            }),
        }
    }
}
