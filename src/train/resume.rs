//! A trainer's checkpoints: what a save stores besides the tensors (position, loss scaler, the
//! settings that change a step's math, the data identity), the checks that keep a diverged
//! model from replacing a good file, and a resume that refuses a checkpoint of another run.

use super::summary::REMEDY;
use super::Trainer;
use crate::nn::Module;
use crate::{Error, Result};

/// The prefix of the data identity's keys among a checkpoint's extra entries.
const DATA_PREFIX: &str = "data.";

impl<M: Module> Trainer<M> {
    /// The trainer's settings that change the math of a step (checkpoints store them and
    /// resume checks them): precision, base learning rate, its schedule and the effective
    /// batch. The optimizer's own hyperparameters are checked by the checkpoint.
    fn run_settings(&self) -> Vec<(String, String)> {
        vec![
            ("precision".into(), self.config.precision.name().into()),
            ("lr".into(), self.config.lr.to_string()),
            ("schedule".into(), self.config.schedule.to_string()),
            ("effective_batch".into(), self.effective_batch().to_string()),
        ]
    }

    /// Records what this run trains on, as (key, value) pairs (a text's hash, a dataset's):
    /// every checkpoint stores them as `extra.data.KEY`, and [`Trainer::resume_from`] refuses
    /// a checkpoint that stored another value for a key (an older file without the key
    /// passes).
    pub fn set_data_identity(&mut self, identity: Vec<(String, String)>) {
        self.data_identity = identity;
    }

    /// The stored keys of the run settings and the data identity, with this run's values.
    fn stored_settings(&self) -> Vec<(String, String)> {
        let data = self
            .data_identity
            .iter()
            .map(|(k, v)| (format!("{DATA_PREFIX}{k}"), v.clone()));
        self.run_settings().into_iter().chain(data).collect()
    }

    /// Saves the model (and its configuration, where it has one), the optimizer state, the
    /// loss scaler and the position in training (`epochs_done` full epochs) to a safetensors
    /// file, atomically: a crash mid-save leaves the previous file intact.
    pub fn save_checkpoint(&self, path: &std::path::Path, epochs_done: u64) -> Result<()> {
        let state = self.checkpoint_training_state(path, epochs_done)?;
        crate::checkpoint::save(path, &self.model, Some(self.optimizer.as_ref()), &state)
    }

    /// What a checkpoint of this trainer stores besides the tensors (position, scaler, run
    /// settings, data identity), after the checks that keep a diverged model from replacing
    /// the good checkpoint at `path` (named in the error). Sharded checkpoints
    /// ([`crate::distributed::zero`]) write it into their index.
    pub fn checkpoint_training_state(
        &self,
        path: &std::path::Path,
        epochs_done: u64,
    ) -> Result<crate::checkpoint::TrainingState> {
        // A diverged model must not replace a good file: one whose weights are not finite,
        // or whose loss scaling stopped training (finite weights that overflow every step).
        if let Some(sc) = self.scaler.as_ref().filter(|_| self.scaling_blew_up()) {
            return Err(Error::NonFinite {
                step: self.step,
                what: format!(
                    "the last {} tries overflowed, so the checkpoint was not written ({} \
                     keeps what it held)",
                    sc.skipped_in_a_row(),
                    path.display()
                ),
                remedy: REMEDY.into(),
            });
        }
        let params = self.device_params();
        if self.device.nonfinite(&params.iter().collect::<Vec<_>>())?
            || self.host_params_nonfinite()
        {
            return Err(Error::NonFinite {
                step: self.step,
                what: format!(
                    "a parameter is not finite (NaN or infinity), so the checkpoint was not \
                     written ({} keeps what it held)",
                    path.display()
                ),
                remedy: REMEDY.into(),
            });
        }
        Ok(crate::checkpoint::TrainingState {
            step: self.step,
            epoch: epochs_done,
            rng_state: 0,
            scaler: self
                .scaler
                .as_ref()
                .map(|s| crate::checkpoint::ScalerState {
                    scale: s.scale(),
                    growth_tracker: s.growth_tracker(),
                }),
            extra: self.stored_settings().into_iter().collect(),
        })
    }

    /// Restores what [`Trainer::save_checkpoint`] wrote into this trainer (same model shape
    /// and optimizer kind) and returns the epochs already done; training on from there gives
    /// the weights of an uninterrupted run (the data order depends only on seed and epoch).
    pub fn resume_from(&mut self, path: &std::path::Path) -> Result<u64> {
        self.resume_from_checkpoint(&crate::checkpoint::load(path)?)
    }

    /// [`Trainer::resume_from`] with a checkpoint already read (a sharded one put together by
    /// [`crate::distributed::zero::load_checkpoint`]); errors name its source.
    pub fn resume_from_checkpoint(&mut self, ckpt: &crate::checkpoint::Checkpoint) -> Result<u64> {
        let state = ckpt.training_state()?;
        // What the model is comes first (a file of another model says so, not that its
        // learning rate differs), then the settings, then values that could not train on.
        ckpt.check_config(&self.model)?;
        let expected: Vec<crate::checkpoint::Expect> = self
            .stored_settings()
            .into_iter()
            .map(|(key, value)| crate::checkpoint::Expect {
                key,
                value,
                change: "resume with the same setting, or start a new run".into(),
            })
            .collect();
        ckpt.check_extra(&expected)?;
        ckpt.check_finite()?;
        ckpt.apply_model(&self.model)?;
        if let Some(s) = self.sync.as_mut() {
            s.parameters_written()?;
        }
        ckpt.apply_optimizer(self.optimizer.as_mut())?;
        self.step = state.step;
        if let (Some(sc), Some(saved)) = (self.scaler.as_mut(), state.scaler) {
            sc.set_state(saved.scale, saved.growth_tracker);
        }
        Ok(state.epoch)
    }
}
