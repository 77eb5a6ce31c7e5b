//! Magnitude pruning: masks that zero a model's smallest weights, one-shot or gradually along
//! Zhu & Gupta's cubic schedule, applied after every optimizer step so pruned weights stay
//! exactly zero.
//!
//! The threshold is exact: the selected weights are read back to the host and the
//! `k = round(s · n)` smallest magnitudes are found by a sort (one readback per pruning event,
//! none per step; fine for the layer sizes fitgrad trains). Ties are broken by position (layer
//! order, then row-major index), so exactly `k` weights are pruned whatever the values: the
//! achieved sparsity is `k / n`, the fraction nearest the target. Masks only grow: a weight
//! pruned once stays pruned (an already-zero weight that was never pruned is not preferred
//! over it), so a gradual schedule's masks nest.
//!
//! A mask is a device tensor of the weight's shape and dtype holding 0 and 1; applying it is
//! the elementwise `weight = weight * mask`, in place, so the optimizer keeps updating the same
//! tensor. The optimizer's state for a pruned weight keeps moving, and the next application
//! zeroes the weight again. The masks are made (all ones) by [`Pruner::new`], so memory made
//! afterwards, a trainer's plan included, counts them from the start; a pruning event frees a
//! mask before it uploads the grown one into the same bytes.
//!
//! The configuration and its checks are config.rs, the report of what was pruned report.rs.

mod config;
mod report;

pub use config::{prunable, ParamFilter, PruneConfig, PruneSchedule, PruneScope};
pub use report::{LayerSparsity, SparsityReport};

use crate::kernels::elementwise::{self, BinaryOp};
use crate::nn::Module;
use crate::{DType, Error, Result, Tensor};
use config::check_sparsity;

/// One pruned weight: the model's tensor (shared), which elements are pruned, and the mask.
struct Layer {
    name: String,
    weight: Tensor,
    /// Host copy of the mask: true where the weight is pruned.
    pruned: Vec<bool>,
    /// How many of `pruned` are true.
    count: usize,
    /// 0 where pruned, 1 elsewhere, in the weight's dims and dtype (None only while a new one
    /// is uploaded, or after that upload failed).
    mask: Option<Tensor>,
}

impl Layer {
    /// A layer with nothing pruned and a mask of ones.
    fn new(name: String, weight: Tensor) -> Result<Layer> {
        let mask = Tensor::ones(weight.device(), weight.dims(), weight.dtype())?;
        Ok(Layer {
            name,
            pruned: vec![false; weight.numel()],
            count: 0,
            weight,
            mask: Some(mask),
        })
    }

    /// Makes `pruned` the mask, on the host and the device (0 where pruned), if it changed.
    /// The old device mask is freed first, so the new one reuses its bytes.
    fn set_mask(&mut self, pruned: Vec<bool>) -> Result<()> {
        if pruned == self.pruned && self.mask.is_some() {
            return Ok(());
        }
        self.mask = None;
        let dev = self.weight.device();
        let dims = self.weight.dims();
        let ones = pruned.iter().map(|&p| if p { 0.0 } else { 1.0 });
        self.mask = Some(match self.weight.dtype() {
            DType::F32 => Tensor::from_slice(dev, &ones.collect::<Vec<f32>>(), dims)?,
            DType::F16 => Tensor::from_slice(
                dev,
                &ones.map(half::f16::from_f32).collect::<Vec<_>>(),
                dims,
            )?,
        });
        self.count = pruned.iter().filter(|&&p| p).count();
        self.pruned = pruned;
        Ok(())
    }
}

/// Prunes a model's weights by magnitude and keeps them pruned: call [`Pruner::step`] after
/// every optimizer step (the trainer's `on_step` callback is the place).
///
/// ```no_run
/// use fitgrad::compress::{PruneConfig, PruneSchedule, Pruner};
/// # fn f(trainer: &mut fitgrad::train::Trainer<fitgrad::nn::Mlp>, data: &fitgrad::train::data::Dataset) -> fitgrad::Result<()> {
/// let mut cfg = PruneConfig::new(0.8);
/// cfg.schedule = PruneSchedule::cubic(50, 300, 10);
/// let mut pruner = Pruner::new(&trainer.model, cfg)?;
/// for epoch in 0..20 {
///     trainer.train_epoch(data, 0, epoch, |t, _, _| pruner.step(t.steps()).map(|_| ()))?;
/// }
/// println!("{}", pruner.report()?);
/// # Ok(()) }
/// ```
pub struct Pruner {
    config: PruneConfig,
    layers: Vec<Layer>,
    /// The largest sparsity pruned to so far (0 before the first pruning).
    target: f32,
    /// Whether a one-shot schedule has pruned.
    pruned_once: bool,
}

impl Pruner {
    /// A pruner for the parameters of `model` that `config.filter` selects (they are shared,
    /// not copied), with a mask of ones for each (as many bytes as the weights): nothing is
    /// pruned yet. A sparsity outside [0, 1), an initial sparsity above the target, an empty
    /// schedule (`end_step <= start_step`, `every == 0`) or a filter that selects nothing is an
    /// [`Error::InvalidArgument`], before any device work.
    pub fn new(model: &dyn Module, config: PruneConfig) -> Result<Pruner> {
        const OP: &str = "Pruner::new";
        config.validate()?;
        let selected: Vec<(String, Tensor)> = model
            .named_parameters()
            .into_iter()
            .filter(|(name, t)| (config.filter)(name, t.dims()))
            .collect();
        if selected.is_empty() {
            let names: Vec<String> = model.named_parameters().into_iter().map(|p| p.0).collect();
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "the filter selects none of the model's parameters ({})",
                    names.join(", ")
                ),
            });
        }
        let layers = selected
            .into_iter()
            .map(|(name, weight)| Layer::new(name, weight))
            .collect::<Result<_>>()?;
        Ok(Pruner {
            config,
            layers,
            target: 0.0,
            pruned_once: false,
        })
    }

    /// The names of the pruned parameters, in model order.
    pub fn names(&self) -> Vec<&str> {
        self.layers.iter().map(|l| l.name.as_str()).collect()
    }

    /// The schedule's sparsity after `step` optimizer steps: the target for one-shot; for the
    /// cubic schedule 0 before `start_step`, then `s_t` (see [`PruneSchedule::Cubic`]).
    pub fn sparsity_at(&self, step: u64) -> f32 {
        let s_f = self.config.sparsity;
        match self.config.schedule {
            PruneSchedule::OneShot => s_f,
            PruneSchedule::Cubic {
                initial_sparsity: s_i,
                start_step,
                end_step,
                ..
            } => {
                if step < start_step {
                    0.0
                } else if step >= end_step {
                    s_f
                } else {
                    let frac = (step - start_step) as f64 / (end_step - start_step) as f64;
                    let s = s_f as f64 + (s_i as f64 - s_f as f64) * (1.0 - frac).powi(3);
                    s as f32
                }
            }
        }
    }

    /// What to call after each optimizer step, with the steps taken so far: at a pruning step
    /// of the schedule the masks grow (one readback of the weights), and the masks are applied
    /// every time. Returns whether the masks grew.
    pub fn step(&mut self, step: u64) -> Result<bool> {
        let due = match self.config.schedule {
            PruneSchedule::OneShot => (!self.pruned_once).then_some(self.config.sparsity),
            PruneSchedule::Cubic {
                start_step,
                end_step,
                every,
                ..
            } => {
                let on_grid = step >= start_step && (step - start_step).is_multiple_of(every);
                (on_grid || step >= end_step).then(|| self.sparsity_at(step))
            }
        };
        self.pruned_once = true;
        match due {
            Some(s) if s > self.target => {
                self.prune(s)?;
                Ok(true)
            }
            _ => {
                self.apply()?;
                Ok(false)
            }
        }
    }

    /// Prunes to `sparsity` now (one-shot pruning, or a step of one's own schedule) and
    /// applies the masks. Masks only grow, so a sparsity below the current one changes
    /// nothing. Outside [0, 1): [`Error::InvalidArgument`].
    pub fn prune(&mut self, sparsity: f32) -> Result<()> {
        check_sparsity("Pruner::prune", "the sparsity", sparsity)?;
        let mags: Vec<Vec<f32>> = self
            .layers
            .iter()
            .map(|l| Ok(l.weight.to_vec_f32()?.iter().map(|v| v.abs()).collect()))
            .collect::<Result<_>>()?;
        let chosen: Vec<Vec<bool>> = match self.config.scope {
            PruneScope::PerLayer => self
                .layers
                .iter()
                .zip(&mags)
                .map(|(l, m)| smallest(m, &l.pruned, count_for(sparsity, m.len())))
                .collect(),
            PruneScope::Global => {
                let all: Vec<f32> = mags.concat();
                let before: Vec<bool> = self
                    .layers
                    .iter()
                    .flat_map(|l| l.pruned.iter().copied())
                    .collect();
                let picked = smallest(&all, &before, count_for(sparsity, all.len()));
                let mut rest = picked.as_slice();
                mags.iter()
                    .map(|m| {
                        let (head, tail) = rest.split_at(m.len());
                        rest = tail;
                        head.to_vec()
                    })
                    .collect()
            }
        };
        for (layer, pruned) in self.layers.iter_mut().zip(chosen) {
            layer.set_mask(pruned)?;
        }
        self.target = self.target.max(sparsity);
        self.apply()
    }

    /// Masks every selected weight that is exactly zero now (for a model loaded from a pruned
    /// checkpoint, whose masks were not saved) and applies the masks.
    pub fn mask_zeros(&mut self) -> Result<()> {
        for layer in &mut self.layers {
            let w = layer.weight.to_vec_f32()?;
            let pruned: Vec<bool> = w
                .iter()
                .zip(&layer.pruned)
                .map(|(&v, &p)| p || v == 0.0)
                .collect();
            layer.set_mask(pruned)?;
        }
        self.apply()
    }

    /// `weight = weight * mask` in place for every weight with a pruned element (no
    /// readback). Pruned weights become 0 (or -0, which compares equal).
    pub fn apply(&self) -> Result<()> {
        for layer in self.layers.iter().filter(|l| l.count > 0) {
            if let Some(mask) = &layer.mask {
                elementwise::binary(BinaryOp::Mul, &layer.weight, mask, &layer.weight)?;
            }
        }
        Ok(())
    }

    /// Per-layer sparsity, read back from the weights: how many are masked and how many are
    /// exactly zero.
    pub fn report(&self) -> Result<SparsityReport> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let w = l.weight.to_vec_f32()?;
                Ok(LayerSparsity {
                    name: l.name.clone(),
                    dims: l.weight.dims().to_vec(),
                    pruned: l.count,
                    zeros: w.iter().filter(|&&v| v == 0.0).count(),
                    pruned_nonzero: w
                        .iter()
                        .zip(&l.pruned)
                        .filter(|&(&v, &p)| p && v != 0.0)
                        .count(),
                    numel: w.len(),
                })
            })
            .collect::<Result<_>>()?;
        Ok(SparsityReport { layers })
    }
}

/// Weights to prune for sparsity `s` of `n`: the nearest whole number.
fn count_for(s: f32, n: usize) -> usize {
    ((s as f64 * n as f64).round() as usize).min(n)
}

/// The `k` entries to prune: every one already pruned, then the smallest magnitudes among the
/// rest, ties to the lower index. With `k` below the pruned count, the pruned ones stay.
fn smallest(mags: &[f32], already: &[bool], k: usize) -> Vec<bool> {
    let mut out = already.to_vec();
    let have = already.iter().filter(|&&p| p).count();
    if k <= have {
        return out;
    }
    let mut free: Vec<usize> = (0..mags.len()).filter(|&i| !already[i]).collect();
    free.sort_unstable_by(|&a, &b| mags[a].total_cmp(&mags[b]).then(a.cmp(&b)));
    for &i in &free[..k - have] {
        out[i] = true;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_go_to_the_lower_index_and_the_count_is_exact() {
        let m = [0.5, 0.1, 0.1, 0.1, 0.9];
        let none = [false; 5];
        assert_eq!(smallest(&m, &none, 2), [false, true, true, false, false]);
        assert_eq!(smallest(&m, &none, 0), [false; 5]);
        assert_eq!(smallest(&m, &none, 5), [true; 5]);
    }

    #[test]
    fn pruned_entries_stay_pruned_and_come_first() {
        // Entry 4 is pruned although it is the largest; a target below the count keeps it.
        let m = [0.5, 0.0, 0.1, 0.2, 0.9];
        let before = [false, false, false, false, true];
        assert_eq!(smallest(&m, &before, 2), [false, true, false, false, true]);
        assert_eq!(smallest(&m, &before, 0), before);
    }

    #[test]
    fn counts_round_to_nearest() {
        assert_eq!(count_for(0.7, 10), 7);
        assert_eq!(count_for(0.8, 10), 8);
        assert_eq!(count_for(0.25, 3), 1);
        assert_eq!(count_for(0.0, 0), 0);
    }
}
