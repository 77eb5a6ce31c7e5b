//! A resumed checkpoint checked on the host before any device work: the model the flags
//! describe, the data it was trained on, finite values, and something left to train.

use super::checks::check_resume_progress;
use crate::checkpoint::Expect;
use crate::Result;
use std::path::Path;

/// How far a run goes: the count a checkpoint's progress is checked against.
#[derive(Clone, Copy, Debug)]
pub enum Until {
    /// `--epochs` epochs.
    Epochs(u64),
    /// `--steps` optimizer steps.
    Steps(u64),
}

/// What a run stores of the data it trains on (the identity a resume compares): the
/// dataset's hash under `dataset`.
pub fn dataset_identity(hash: u64) -> Vec<(String, String)> {
    vec![("dataset".to_string(), format!("{hash:016x}"))]
}

/// The expectation that a checkpoint was trained on the dataset of `identity`
/// ([`dataset_identity`]), saying which flags choose it.
pub fn same_dataset(identity: &[(String, String)]) -> Expect {
    Expect::new(
        "data.dataset",
        &identity[0].1,
        "another dataset: resume with the --dataset (and --seed) it was trained on, or start \
         a new run without --resume",
    )
}

/// Checks the checkpoint at `path` (one file or a sharded folder) for a command `op`: its
/// model as `config` expects (each naming the flag to set), the data as `data` expects, every
/// value finite, and no more done than `until` asks. `Ok(true)`: exactly as much is done, so
/// the run trains nothing and says so.
pub fn check_checkpoint(
    op: &str,
    path: &Path,
    config: &[Expect],
    data: &[Expect],
    until: Until,
) -> Result<bool> {
    let ckpt = crate::distributed::load_checkpoint(path)?;
    ckpt.expect_config(config, op)?;
    ckpt.check_extra(data)?;
    ckpt.check_finite()?;
    let state = ckpt.training_state()?;
    match until {
        Until::Epochs(n) => check_resume_progress(path, state.epoch, n, "--epochs"),
        Until::Steps(n) => check_resume_progress(path, state.step, n, "--steps"),
    }
}

/// "set FLAG as it was saved": what a checkpoint's mismatch with a model flag says.
pub fn as_saved(flag: &str) -> String {
    format!("set {flag} as it was saved")
}
