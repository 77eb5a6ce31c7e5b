//! `Linear`: y = x · Wᵀ + b with W stored (out, in) as in torch, so weights load into and out of
//! PyTorch state dicts unchanged. The forward is one fused matmul dispatch (bias and activation
//! in its epilogue) that reads W transposed in place. A layer may carry a LoRA adapter
//! (src/nn/lora.rs) and hold its frozen weight quantized ([`QuantWeight`]).

use super::lora::{Lora, LoraConfig};
use super::Module;
use crate::tensor::QuantWeight;
use crate::{Activation, DType, Device, Error, MatmulOptions, Result, Tensor};
use std::sync::Arc;

/// A fully connected layer, `y = x · Wᵀ + b`.
#[derive(Clone)]
pub struct Linear {
    /// (out_features, in_features)
    pub weight: Tensor,
    /// (out_features)
    pub bias: Option<Tensor>,
    /// Width of the input.
    pub in_features: usize,
    /// Width of the output.
    pub out_features: usize,
    /// A LoRA adapter added to the output (see [`Linear::add_lora`]); none by default.
    pub lora: Option<Arc<Lora>>,
    /// The frozen weight held quantized (int8 or NF4); `weight` is then an empty (0) tensor
    /// and is not listed as a parameter.
    pub quantized: Option<Arc<QuantWeight>>,
}

impl Linear {
    /// A Linear layer with bias, f32, initialized like torch's `nn.Linear` from `seed`.
    pub fn new(
        device: &Device,
        in_features: usize,
        out_features: usize,
        seed: u64,
    ) -> Result<Linear> {
        Linear::with_options(device, in_features, out_features, true, DType::F32, seed)
    }

    /// Kaiming-uniform init as torch does it (`kaiming_uniform_(a=sqrt(5))`): weight and bias
    /// uniform in ±1/sqrt(in_features). The weight draws from `seed`, the bias from a stream
    /// derived from it.
    pub fn with_options(
        device: &Device,
        in_features: usize,
        out_features: usize,
        bias: bool,
        dtype: DType,
        seed: u64,
    ) -> Result<Linear> {
        if in_features == 0 || out_features == 0 {
            return Err(Error::InvalidArgument {
                op: "Linear::new",
                reason: format!(
                    "features must be positive, got in {in_features}, out {out_features}"
                ),
            });
        }
        let bound = 1.0 / (in_features as f32).sqrt();
        let weight = Tensor::rand_uniform(
            device,
            &[out_features, in_features],
            -bound,
            bound,
            seed,
            dtype,
        )?
        .with_requires_grad();
        let bias = if bias {
            let s = seed ^ 0x9e37_79b9_7f4a_7c15;
            Some(
                Tensor::rand_uniform(device, &[out_features], -bound, bound, s, dtype)?
                    .with_requires_grad(),
            )
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            in_features,
            out_features,
            lora: None,
            quantized: None,
        })
    }

    /// `act(x · Wᵀ + b)` in one dispatch; x is (.., in_features).
    pub fn forward_act(&self, x: &Tensor, activation: Activation) -> Result<Tensor> {
        self.forward_in(x, activation, self.weight.dtype())
    }

    /// `forward_act` computed in `dtype`: x must have it, and the parameters are cast to it on
    /// the fly (recorded, so their gradients flow back to the stored dtype). Mixed precision keeps
    /// f32 parameters and runs the matmuls in f16 this way.
    pub fn forward_in(&self, x: &Tensor, activation: Activation, dtype: DType) -> Result<Tensor> {
        if x.dims().last() != Some(&self.in_features) {
            return Err(Error::Shape {
                op: "Linear::forward",
                lhs: x.dims().to_vec(),
                rhs: vec![self.out_features, self.in_features],
                reason: format!(
                    "input's last dim must be in_features = {}",
                    self.in_features
                ),
            });
        }
        // A rank-1 input is one row.
        let x2 = if x.rank() == 1 {
            x.reshape(&[1, self.in_features])?
        } else {
            x.clone()
        };
        // With an active adapter the activation comes after the adapter's sum.
        let base_act = if self.lora_active() {
            Activation::None
        } else {
            activation
        };
        let y = match &self.quantized {
            Some(q) => {
                // The dequantizing matmul takes rows: (.., in) -> (rows, in) -> (.., out).
                let rows = x2.numel() / self.in_features;
                let flat = x2.reshape(&[rows, self.in_features])?;
                let y = q.linear(&flat, self.bias.as_ref(), base_act)?;
                let mut dims = x2.dims().to_vec();
                *dims.last_mut().expect("rank >= 2") = self.out_features;
                y.reshape(&dims)?
            }
            None => {
                let weight = self.weight.cast(dtype)?;
                let bias = self.bias.as_ref().map(|b| b.cast(dtype)).transpose()?;
                x2.matmul_with(
                    &weight,
                    &MatmulOptions {
                        trans_b: true,
                        bias: bias.as_ref(),
                        activation: base_act,
                        ..Default::default()
                    },
                )?
            }
        };
        let y = match &self.lora {
            Some(l) if self.lora_active() => {
                let y = y.add(&l.delta(&x2, dtype)?)?;
                super::lora::activate(&y, activation)?
            }
            _ => y,
        };
        if x.rank() == 1 {
            y.reshape(&[self.out_features])
        } else {
            Ok(y)
        }
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, Activation::None)
    }

    /// `weight` (unless quantized), `bias`, then an adapter's `lora_A.weight` (r, in) and
    /// `lora_B.weight` (out, r), PEFT's names.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = Vec::new();
        if self.quantized.is_none() {
            v.push(("weight".to_string(), self.weight.clone()));
        }
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        if let Some(l) = &self.lora {
            v.push(("lora_A.weight".to_string(), l.a.clone()));
            v.push(("lora_B.weight".to_string(), l.b.clone()));
        }
        v
    }

    fn set_training(&self, training: bool) {
        if let Some(l) = &self.lora {
            l.dropout.set_training(training);
        }
    }
}

/// The layer's LoRA adapter: adding, merging, unmerging (the adapter itself is src/nn/lora.rs).
impl Linear {
    /// Adds a fresh adapter of `cfg` (A from `seed`, B zero, in the weight's dtype) and freezes
    /// the layer's own weight and bias. Errors, before any device work: those of
    /// [`LoraConfig::check`], and an [`Error::InvalidArgument`] when the layer has an adapter.
    pub fn add_lora(&mut self, cfg: &LoraConfig, seed: u64) -> Result<()> {
        let (i, o) = (self.in_features, self.out_features);
        cfg.check("the layer", i, o)?;
        if self.lora.is_some() {
            return Err(Error::InvalidArgument {
                op: "Linear::add_lora",
                reason: "the layer already has a LoRA adapter".into(),
            });
        }
        let (dev, dtype) = (self.weight.device().clone(), self.weight.dtype());
        let bound = 1.0 / (i as f32).sqrt();
        let a = Tensor::rand_uniform(&dev, &[cfg.r, i], -bound, bound, seed, dtype)?
            .with_requires_grad();
        let b = Tensor::zeros(&dev, &[o, cfg.r], dtype)?.with_requires_grad();
        let drop_seed = seed ^ 0x5851_f42d_4c95_7f2d;
        self.lora = Some(Arc::new(Lora::from_factors(a, b, cfg, drop_seed)?));
        self.freeze();
        Ok(())
    }

    /// Detaches the layer's own weight and bias from autograd: they get no gradient and no
    /// optimizer state. An adapter stays trainable.
    pub fn freeze(&mut self) {
        self.weight = self.weight.detach();
        self.bias = self.bias.as_ref().map(Tensor::detach);
    }

    /// Whether an adapter runs beside the weight (there is one and it is not merged).
    pub fn lora_active(&self) -> bool {
        self.lora.as_ref().is_some_and(|l| !l.is_merged())
    }

    /// Adds the adapter's `scaling · B A` to the weight in place; the forward then skips the
    /// adapter. Nothing happens without an adapter or when it is merged already. A quantized
    /// weight is an [`Error::InvalidArgument`] (merge into the dense folder instead).
    pub fn merge_lora(&self) -> Result<()> {
        self.move_update(true)
    }

    /// Subtracts what [`Linear::merge_lora`] added (equal up to rounding), so the adapter runs
    /// beside the weight again.
    pub fn unmerge_lora(&self) -> Result<()> {
        self.move_update(false)
    }

    fn move_update(&self, merge: bool) -> Result<()> {
        let Some(l) = &self.lora else { return Ok(()) };
        if l.is_merged() == merge {
            return Ok(());
        }
        if self.quantized.is_some() {
            return Err(Error::InvalidArgument {
                op: "Linear::merge_lora",
                reason: "the weight is quantized: merge the adapter into the dense weights \
                         (hf::merge_adapter) instead"
                    .into(),
            });
        }
        l.move_update(&self.weight, merge)
    }
}
