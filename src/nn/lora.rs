//! LoRA (Hu et al. 2021) as PEFT implements it: a frozen layer's output plus
//! `lora_B(lora_A(dropout(x))) * alpha / r`, with A (r, in) Kaiming-uniform (a = sqrt(5), so
//! uniform in ±1/sqrt(in)) and B (out, r) zero, so a fresh adapter changes nothing. The factors
//! have PEFT's layouts (nn.Linear weights), which is what lets adapters move between fitgrad and
//! PEFT unchanged. Merging adds `scaling · B A` to the dense weight in place; unmerging
//! subtracts it again.

use super::{Dropout, Module};
use crate::tensor::autograd::no_grad;
use crate::{Activation, DType, Error, MatmulOptions, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// An adapter's hyperparameters, PEFT's `LoraConfig` fields of the same names.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The rank r of the update, at least 1 and at most the layer's smaller width.
    pub r: usize,
    /// `lora_alpha`: the update is scaled by `alpha / r`.
    pub alpha: f32,
    /// `lora_dropout`: dropout on the adapter's input, in [0, 1).
    pub dropout: f32,
}

impl Default for LoraConfig {
    /// PEFT's defaults: r = 8, lora_alpha = 8, no dropout.
    fn default() -> LoraConfig {
        LoraConfig {
            r: 8,
            alpha: 8.0,
            dropout: 0.0,
        }
    }
}

impl LoraConfig {
    /// `alpha / r`.
    pub fn scaling(&self) -> f32 {
        self.alpha / self.r as f32
    }

    /// Checks the values for a layer of `in_features` -> `out_features` (named `layer` in the
    /// message), before any device work: an [`Error::InvalidArgument`] for a rank of 0 or
    /// above the smaller width, an alpha that is not a finite number > 0, or a dropout outside
    /// [0, 1).
    pub fn check(&self, layer: &str, in_features: usize, out_features: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { op: "LoRA", reason });
        let width = in_features.min(out_features);
        if self.r == 0 || self.r > width {
            return bad(format!(
                "rank {} for {layer} ({in_features} -> {out_features}): the rank must be \
                 between 1 and the layer's smaller width {width}",
                self.r
            ));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad(format!(
                "lora_alpha must be a number > 0, got {}",
                self.alpha
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!(
                "lora_dropout must be in [0, 1), got {}",
                self.dropout
            ));
        }
        Ok(())
    }
}

/// A LoRA adapter of one layer.
pub struct Lora {
    /// `lora_A.weight`, (r, in).
    pub a: Tensor,
    /// `lora_B.weight`, (out, r).
    pub b: Tensor,
    /// `alpha / r`.
    pub scaling: f32,
    /// Dropout of the adapter's input (PEFT's `lora_dropout`).
    pub dropout: Dropout,
    merged: AtomicBool,
}

impl Lora {
    /// An adapter with these factors (trainable leaves, as given).
    pub fn from_factors(a: Tensor, b: Tensor, cfg: &LoraConfig, seed: u64) -> Result<Lora> {
        Ok(Lora {
            a,
            b,
            scaling: cfg.scaling(),
            dropout: Dropout::new(cfg.dropout, seed)?,
            merged: AtomicBool::new(false),
        })
    }

    /// Whether the update is in the layer's weight (and so skipped by the forward).
    pub fn is_merged(&self) -> bool {
        self.merged.load(Ordering::Relaxed)
    }

    /// `scaling · (dropout(x) · Aᵀ) · Bᵀ` for x (M, in), in `dtype`: (M, out).
    pub(crate) fn delta(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let t = MatmulOptions::new().trans_b(true);
        // (M, in) -> (M, r) -> (M, out)
        let h = self
            .dropout
            .forward(x)?
            .matmul_with(&self.a.cast(dtype)?, &t)?;
        h.matmul_with(&self.b.cast(dtype)?, &t)?
            .mul_scalar(self.scaling)
    }

    /// `scaling · B A`, (out, in), outside the graph.
    fn update(&self) -> Result<Tensor> {
        let _g = no_grad();
        self.b.matmul(&self.a)?.mul_scalar(self.scaling)
    }

    /// Adds the update to `weight` in place (`merge`), or subtracts it again; nothing when it
    /// is there already, or not.
    pub(crate) fn move_update(&self, weight: &Tensor, merge: bool) -> Result<()> {
        if self.is_merged() == merge {
            return Ok(());
        }
        let d = self.update()?.cast(weight.dtype())?;
        let d = if merge { d } else { d.neg()? };
        weight.add_(&d)?;
        self.merged.store(merge, Ordering::Relaxed);
        Ok(())
    }
}

/// `act(y)` as the fused epilogue would apply it.
pub(crate) fn activate(y: &Tensor, act: Activation) -> Result<Tensor> {
    match act {
        Activation::None => Ok(y.clone()),
        Activation::Relu => y.relu(),
        Activation::Gelu => y.gelu(),
        Activation::Tanh => y.tanh(),
        Activation::Sigmoid => y.sigmoid(),
        Activation::Silu => y.silu(),
    }
}

/// The parameters of `model` that train (those that require grad), with their names: an
/// adapter's factors once the base is frozen.
pub fn trainable_parameters(model: &dyn Module) -> Vec<(String, Tensor)> {
    model
        .named_parameters()
        .into_iter()
        .filter(|(_, t)| t.requires_grad())
        .collect()
}
