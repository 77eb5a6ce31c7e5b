//! `Dropout`: [`Tensor::dropout`] with a fresh mask per call while training and the identity in
//! evaluation, as torch's `nn.Dropout`. Each call's mask seed is a pure function of the layer's
//! seed and a call counter, so a run is reproducible and a mask can be replayed.

use super::Module;
use crate::tensor::Rng;
use crate::{Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Dropout layer: a seeded mask per training call, the identity in evaluation.
pub struct Dropout {
    /// Probability of dropping an element, in [0, 1).
    pub p: f32,
    seed: u64,
    training: AtomicBool,
    /// Calls made in training mode so far: the next call's mask is `seed_for_call(calls)`.
    calls: AtomicU64,
}

impl Dropout {
    /// Drops with probability `p` (in [0, 1), else an [`Error::InvalidArgument`]); masks are
    /// derived from `seed`. Starts in training mode.
    pub fn new(p: f32, seed: u64) -> Result<Dropout> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "Dropout::new",
                reason: format!("p must be in [0, 1), got {p}"),
            });
        }
        Ok(Dropout {
            p,
            seed,
            training: AtomicBool::new(true),
            calls: AtomicU64::new(0),
        })
    }

    /// Whether `forward` drops (training) or passes its input through (evaluation).
    pub fn is_training(&self) -> bool {
        self.training.load(Ordering::Relaxed)
    }

    /// The mask seed of training call number `call` (0 for the first): a pure function of the
    /// layer's seed and `call`.
    pub fn seed_for_call(&self, call: u64) -> u64 {
        Rng::new(self.seed ^ call.wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64()
    }

    /// The mask seed the next training `forward` will use, without using it up.
    pub fn peek_seed(&self) -> u64 {
        self.seed_for_call(self.calls.load(Ordering::Relaxed))
    }

    /// Takes the next call's mask seed and advances the counter (what `forward` does). Code that
    /// must recompute the same mask later (gradient checkpointing) takes the seed once with this
    /// and passes it to [`Dropout::forward_with_seed`] in the forward and in the recomputation.
    pub fn next_seed(&self) -> u64 {
        self.seed_for_call(self.calls.fetch_add(1, Ordering::Relaxed))
    }

    /// Training calls made so far (the counter `forward` advances).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// The dropout of `x` with the mask of `seed`, in training mode; `x` itself in evaluation.
    /// The counter does not move.
    pub fn forward_with_seed(&self, x: &Tensor, seed: u64) -> Result<Tensor> {
        if !self.is_training() {
            return Ok(x.clone());
        }
        x.dropout(self.p, seed)
    }
}

impl Module for Dropout {
    /// Training: a new mask per call (the counter advances, except on a planning device, whose
    /// dry run must leave the real step's masks alone). Evaluation: `x` unchanged.
    ///
    /// The seed goes through [`crate::tensor::autograd::replayable_seed`]: when a checkpointed segment
    /// recomputes this call in the backward pass it gets the first forward's seed back, and the
    /// counter does not move a second time.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !self.is_training() {
            return Ok(x.clone());
        }
        let seed = crate::tensor::autograd::replayable_seed(|| {
            if x.device().is_planning() {
                self.peek_seed()
            } else {
                self.next_seed()
            }
        })?;
        x.dropout(self.p, seed)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }
}
