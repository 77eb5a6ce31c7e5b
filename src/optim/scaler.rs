//! Dynamic loss scaling for mixed precision (torch's `GradScaler`): the loss is multiplied by
//! `scale` before backward so small f16 gradients do not flush to zero; the f32 gradients are
//! divided by it before the update. A step whose gradients hold inf or NaN (the fused non-finite
//! check, one 4-byte readback) is skipped and the scale halves; after `growth_interval` clean
//! steps in a row it doubles.

use crate::kernels::elementwise::{self, UnaryOp};
use crate::{Device, Error, Result, Tensor};

/// Dynamic loss scaling for f16 gradients, as torch's `GradScaler`: the loss is multiplied by the
/// scale before backward, gradients are unscaled before the step, and a step with non-finite
/// gradients is skipped and the scale halved.
#[derive(Clone, Debug)]
pub struct GradScaler {
    scale: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u64,
    /// Clean steps since the scale last changed.
    growth_tracker: u64,
    /// Steps skipped for non-finite gradients.
    skipped: u64,
    /// Steps skipped since the last one taken.
    in_a_row: u64,
}

impl Default for GradScaler {
    /// torch's defaults: scale 65536, x2 after 2,000 clean steps, x0.5 on overflow.
    fn default() -> Self {
        GradScaler {
            scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            growth_tracker: 0,
            skipped: 0,
            in_a_row: 0,
        }
    }
}

impl GradScaler {
    /// A scaler with torch's defaults (see [`Default`]).
    pub fn new() -> GradScaler {
        GradScaler::default()
    }

    /// A scaler with another initial scale and growth interval.
    pub fn with(init_scale: f32, growth_interval: u64) -> Result<GradScaler> {
        if !(init_scale.is_finite() && init_scale > 0.0) || growth_interval == 0 {
            return Err(Error::InvalidArgument {
                op: "GradScaler",
                reason: format!(
                    "need a finite positive scale and interval > 0, got {init_scale}, {growth_interval}"
                ),
            });
        }
        Ok(GradScaler {
            scale: init_scale,
            growth_interval,
            ..Default::default()
        })
    }

    /// The current scale.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Clean steps since the scale last changed.
    pub fn growth_tracker(&self) -> u64 {
        self.growth_tracker
    }

    /// Steps skipped so far because gradients overflowed.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    /// Steps skipped since the last step taken (0 after a clean step).
    pub fn skipped_in_a_row(&self) -> u64 {
        self.in_a_row
    }

    /// Restores a saved state (checkpoints).
    pub fn set_state(&mut self, scale: f32, growth_tracker: u64) {
        self.scale = scale;
        self.growth_tracker = growth_tracker;
    }

    /// `loss * scale`, recorded, so backward produces scaled gradients.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        loss.mul_scalar(self.scale)
    }

    /// Divides every gradient of `params` by the scale, in place, and reports whether any is
    /// non-finite (then the caller skips the step).
    pub fn unscale(&self, device: &Device, params: &[Tensor]) -> Result<bool> {
        let grads: Vec<Tensor> = params.iter().filter_map(|p| p.grad()).collect();
        let inv = 1.0 / self.scale;
        for g in &grads {
            elementwise::unary(UnaryOp::MulScalar, g, inv, g)?;
        }
        let refs: Vec<&Tensor> = grads.iter().collect();
        device.nonfinite(&refs)
    }

    /// Moves the scale after a step: halve on overflow (the step was skipped), double after
    /// `growth_interval` clean steps.
    pub fn update(&mut self, found_nonfinite: bool) {
        if found_nonfinite {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
            self.skipped += 1;
            self.in_a_row += 1;
        } else {
            self.in_a_row = 0;
            self.growth_tracker += 1;
            if self.growth_tracker >= self.growth_interval {
                self.scale *= self.growth_factor;
                self.growth_tracker = 0;
            }
        }
    }
}
