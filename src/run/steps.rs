//! A run counted in optimizer steps rather than epochs: which samples each step trains on.

use crate::train::BatchSource;

/// The samples of step `step` in a run of effective batch `eff`: positions `step * eff ..` of
/// the concatenated epoch orders (each epoch a seeded shuffle of every sample), so a resumed
/// run continues with the samples the uninterrupted run would have seen.
pub struct StepOrder {
    seed: u64,
    epoch: u64,
    order: Vec<usize>,
}

impl StepOrder {
    /// The order of a run seeded with `seed`.
    pub fn new(seed: u64) -> StepOrder {
        StepOrder {
            seed,
            epoch: u64::MAX,
            order: Vec::new(),
        }
    }

    /// The sample indices of step `step` (from 0) of `eff` samples each.
    pub fn indices<D: BatchSource>(&mut self, data: &D, step: u64, eff: usize) -> Vec<usize> {
        let n = data.len() as u64;
        (0..eff as u64)
            .map(|i| {
                let pos = step * eff as u64 + i;
                let epoch = pos / n;
                if epoch != self.epoch {
                    self.order = data.epoch_order(self.seed, epoch);
                    self.epoch = epoch;
                }
                self.order[(pos % n) as usize]
            })
            .collect()
    }
}
