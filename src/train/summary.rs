//! What training reports: where the device memory went ([`MemorySummary`]) and the result of
//! an evaluation ([`Evaluation`]).

use crate::{Error, MemoryStats, Result};

/// What a diverged run can change (the examples' flags in parentheses): the remedy of every
/// [`Error::NonFinite`] training returns.
pub(super) const REMEDY: &str = "lower the learning rate (--lr), clip the gradients \
     (--clip-grad-norm), or resume from a checkpoint saved before it diverged";

/// Where the device memory of training went, from the arena's statistics.
#[derive(Clone, Debug)]
pub struct MemorySummary {
    /// The model's parameters.
    pub parameter_bytes: u64,
    /// Gradients on the device at the in-use peak (the arena's count).
    pub gradient_bytes: u64,
    /// Optimizer state.
    pub optimizer_state_bytes: u64,
    /// Host memory the optimizer keeps (master weights and state under optimizer offload;
    /// not device memory, and not counted in the peak).
    pub host_bytes: u64,
    /// Peak live bytes minus parameters, gradients and optimizer state: activations, saved
    /// tensors and temporaries alive at the worst point of a step.
    pub activation_bytes: u64,
    /// The arena's statistics.
    pub stats: MemoryStats,
}

impl MemorySummary {
    /// What a step really needs at its worst point (= peak bytes in use).
    pub fn needed_bytes(&self) -> u64 {
        self.stats.peak_bytes_in_use
    }

    /// Peak bytes the arena held from the driver over what the step needed (1.0 = no waste).
    pub fn overhead(&self) -> f64 {
        self.stats.peak_bytes_reserved as f64 / self.needed_bytes().max(1) as f64
    }
}

impl std::fmt::Display for MemorySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::error::Bytes;
        writeln!(f, "training memory (peak of a step):")?;
        writeln!(f, "  parameters        {:>12}", Bytes(self.parameter_bytes))?;
        writeln!(f, "  gradients         {:>12}", Bytes(self.gradient_bytes))?;
        writeln!(
            f,
            "  optimizer state   {:>12}",
            Bytes(self.optimizer_state_bytes)
        )?;
        writeln!(
            f,
            "  activations etc.  {:>12}",
            Bytes(self.activation_bytes)
        )?;
        writeln!(f, "  = needed          {:>12}", Bytes(self.needed_bytes()))?;
        writeln!(
            f,
            "  reserved (peak)   {:>12}  ({:.2}x of needed)",
            Bytes(self.stats.peak_bytes_reserved),
            self.overhead()
        )?;
        if self.host_bytes > 0 {
            writeln!(
                f,
                "  host memory       {:>12}  (optimizer offload: master weights and state)",
                Bytes(self.host_bytes)
            )?;
        }
        Ok(())
    }
}

/// Mean loss and, for classifiers, accuracy over a data set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// Mean loss per sample.
    pub loss: f32,
    /// Fraction predicted right, where the model reports it.
    pub accuracy: Option<f32>,
}

impl Evaluation {
    /// This evaluation, or [`Error::NonFinite`] naming `step` and `on` (the data evaluated)
    /// when its loss is NaN or infinite: the weights have blown up, and nothing trained on
    /// them (or saved) is worth keeping.
    pub fn finite(self, step: u64, on: &str) -> Result<Evaluation> {
        if self.loss.is_finite() {
            return Ok(self);
        }
        Err(Error::NonFinite {
            step,
            what: format!("the {on} loss is {}", self.loss),
            remedy: REMEDY.into(),
        })
    }
}
