//! What to prune, how far and when: [`PruneConfig`] (target sparsity, [`PruneScope`],
//! [`PruneSchedule`], the [`ParamFilter`] choosing the weights, by default [`prunable`]) and its
//! checks.

use crate::{Error, Result};
use std::fmt;
use std::sync::Arc;

/// Which weights share a threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PruneScope {
    /// Each layer is pruned to the target sparsity on its own.
    PerLayer,
    /// One threshold over every selected weight: the total sparsity is the target, and layers
    /// with many small weights lose more of them. The default: on the digits ([64, 256, 256,
    /// 10], 80% along [`PruneSchedule::gradual`], five seeds) it lost at most 0.84 points of
    /// accuracy against the dense run where per-layer pruning lost up to 2.5.
    #[default]
    Global,
}

/// When the masks grow.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum PruneSchedule {
    /// Straight to the target at the first [`Pruner::step`](super::Pruner::step) (or by
    /// [`Pruner::prune`](super::Pruner::prune)).
    #[default]
    OneShot,
    /// Zhu & Gupta's gradual pruning: at steps `start_step + j · every` up to `end_step`, the
    /// sparsity becomes `s_t = s_f + (s_i - s_f) (1 - (t - start_step) / (end_step -
    /// start_step))^3`, where `s_i` is `initial_sparsity` and `s_f` the target; from
    /// `end_step` on it is `s_f`. Fast early, when the network has many redundant weights,
    /// and slow late.
    Cubic {
        /// `s_i`, the sparsity at `start_step` (at most the target).
        initial_sparsity: f32,
        /// The first pruning step (counted in optimizer steps taken).
        start_step: u64,
        /// The step at which the target is reached; after `start_step`.
        end_step: u64,
        /// Steps between pruning events (Δt); at least 1.
        every: u64,
    },
}

impl PruneSchedule {
    /// The cubic schedule for a run of `total_steps` optimizer steps: from sparsity 0 at 5% of
    /// the run to the target at 60%, pruning about 50 times, which leaves the last 40% to
    /// recover (the examples' `--prune`).
    pub fn gradual(total_steps: u64) -> PruneSchedule {
        let start = total_steps / 20;
        let end = (total_steps * 6 / 10).max(start + 1);
        PruneSchedule::cubic(start, end, (total_steps / 50).max(1))
    }

    /// The cubic schedule from sparsity 0 at `start_step` to the target at `end_step`, pruning
    /// every `every` steps.
    pub fn cubic(start_step: u64, end_step: u64, every: u64) -> PruneSchedule {
        PruneSchedule::Cubic {
            initial_sparsity: 0.0,
            start_step,
            end_step,
            every,
        }
    }
}

/// Chooses the parameters to prune from their name and dims.
pub type ParamFilter = Arc<dyn Fn(&str, &[usize]) -> bool + Send + Sync>;

/// The default filter: 2-D weights, except embeddings and norms. Biases and norm scales are
/// rank 1, so rank 2 leaves them out; a name with a part containing `emb` or `norm`
/// (`tok_emb.weight`, `embedding.weight`) or a part `wte` / `wpe` (GPT-2's token and position
/// tables, as in [`Gpt`](crate::nn::Gpt), whose head is `wte`) is an embedding table or a
/// norm, left out too. On a Gpt that leaves the blocks' Linear weights (`attn.qkv`,
/// `attn.proj`, `mlp.fc`, `mlp.proj`).
pub fn prunable(name: &str, dims: &[usize]) -> bool {
    dims.len() == 2
        && !name.split('.').any(|part| {
            let p = part.to_ascii_lowercase();
            p.contains("emb") || p.contains("norm") || p == "wte" || p == "wpe"
        })
}

/// What to prune, how far and when.
#[non_exhaustive]
#[derive(Clone)]
pub struct PruneConfig {
    /// The target sparsity: the fraction of each selected weight (or of all of them, with
    /// [`PruneScope::Global`]) set to zero, in [0, 1).
    pub sparsity: f32,
    /// Per layer or one global threshold.
    pub scope: PruneScope,
    /// One-shot or gradual.
    pub schedule: PruneSchedule,
    /// Which parameters are pruned (default [`prunable`]).
    pub filter: ParamFilter,
}

impl PruneConfig {
    /// Prune the 2-D weights (see [`prunable`]) to `sparsity` with one global threshold,
    /// one-shot.
    pub fn new(sparsity: f32) -> PruneConfig {
        PruneConfig {
            sparsity,
            scope: PruneScope::Global,
            schedule: PruneSchedule::OneShot,
            filter: Arc::new(prunable),
        }
    }

    /// Checks the numbers without a model: a sparsity outside [0, 1), an initial sparsity
    /// above the target, or an empty schedule (`end_step <= start_step`, `every == 0`) is an
    /// [`Error::InvalidArgument`]. [`Pruner::new`](super::Pruner::new) calls it; a program can
    /// call it before it opens a device.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "PruneConfig";
        check_sparsity(OP, "the sparsity", self.sparsity)?;
        if let PruneSchedule::Cubic {
            initial_sparsity,
            start_step,
            end_step,
            every,
        } = self.schedule
        {
            check_sparsity(OP, "the initial sparsity", initial_sparsity)?;
            let bad = |reason: String| Err(Error::InvalidArgument { op: OP, reason });
            if initial_sparsity > self.sparsity {
                return bad(format!(
                    "the initial sparsity {initial_sparsity} is above the target {}",
                    self.sparsity
                ));
            }
            if end_step <= start_step || every == 0 {
                return bad(format!(
                    "the cubic schedule needs start_step < end_step and every >= 1, got {start_step}, {end_step}, {every}"
                ));
            }
        }
        Ok(())
    }

    /// This configuration with another parameter filter (`name`, `dims` -> prune it?).
    pub fn with_filter(
        mut self,
        filter: impl Fn(&str, &[usize]) -> bool + Send + Sync + 'static,
    ) -> PruneConfig {
        self.filter = Arc::new(filter);
        self
    }
}

impl fmt::Debug for PruneConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PruneConfig")
            .field("sparsity", &self.sparsity)
            .field("scope", &self.scope)
            .field("schedule", &self.schedule)
            .finish_non_exhaustive()
    }
}

/// A sparsity outside [0, 1) (NaN included) is an [`Error::InvalidArgument`].
pub(super) fn check_sparsity(op: &'static str, what: &str, s: f32) -> Result<()> {
    if (0.0..1.0).contains(&s) {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op,
            reason: format!("{what} must be in [0, 1), got {s}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_filter_keeps_2d_weights_only() {
        assert!(prunable("layers.0.weight", &[10, 4]));
        assert!(!prunable("layers.0.bias", &[10]));
        assert!(!prunable("tok_emb.weight", &[100, 16]));
        assert!(!prunable("wte.weight", &[100, 16]));
        assert!(!prunable("wpe.weight", &[8, 16]));
        assert!(prunable("blocks.0.attn.qkv.weight", &[48, 16]));
        assert!(!prunable("blocks.0.norm.weight", &[16]));
        assert!(!prunable("conv", &[2, 3, 4]));
    }
}
