//! The run every training command shares, for the examples and for an application: the flags
//! checked before any device work, the trainer built under a budget or by `--fit auto`, the
//! whole run planned (`--plan`), a resume checked and applied, the epochs, the report, the
//! peaks planned beside the measured, and the `--json` fields.
//!
//! A command keeps what is its own (its model, its data, its flags) and describes the rest:
//! - `args` (feature `cli`): the flags themselves, in groups a command flattens into its own;
//! - [`flags`]: the budget and fit auto ([`parse_budget`], [`parse_fit`]), the batch
//!   ([`effective_batch`]), a learning rate, the files read and written ([`Files`]);
//! - [`checks`]: the one bound per kind of count ([`check_counts`] with [`MAX_STEPS`], ...),
//!   paths, offload, the environment, errors that name the flag ([`name_flags`]);
//! - [`resume`]: a checkpoint checked on the host ([`check_checkpoint`]);
//! - [`build`]: the trainer built and joined to the job ([`build_trainer`]);
//! - [`describe`]: the lines that describe a run (its data, batch and budget);
//! - `epochs` (feature `cli`): a classifier's epochs with a progress bar ([`EpochRun`]);
//! - [`steps`]: the samples of each step of a run counted in steps ([`StepOrder`]);
//! - [`finish`]: the peaks, the report's files, the shared JSON fields.
//!
//! It sits above `train`, `distributed`, `compress` and `report`; nothing below uses it.

#[cfg(feature = "cli")]
pub mod args;
pub mod build;
pub mod checks;
pub mod describe;
#[cfg(feature = "cli")]
pub mod epochs;
pub mod finish;
pub mod flags;
pub mod resume;
pub mod steps;

#[cfg(feature = "cli")]
pub use args::{
    agree_flags, flag_settings, parse, try_parse_from, CheckpointArgs, FitArgs, JobArgs,
    ReportArgs, RunArgs, TrainArgs,
};
pub use build::{build_trainer, lr_schedule, pruner, Built, Joined, Strategy};
pub use checks::{
    check_counts, check_environment, check_offload, check_paths, check_resume_progress, name_flags,
    own_remedy, MAX_BATCH, MAX_EPOCHS, MAX_LAYERS, MAX_SAMPLE_LEN, MAX_STEPS, MAX_WIDTH,
};
pub use describe::{batch_setting, budget_line, dataset_line, dataset_setting};
#[cfg(feature = "cli")]
pub use epochs::{temp_shards, Ended, EpochRun, Trained};
pub use flags::{
    check_number, effective_batch, invalid, parse_budget, parse_fit, total_steps, Files,
};
pub use resume::{check_checkpoint, Until};
pub use steps::StepOrder;

use crate::{Device, DeviceOptions, Result};

/// Opens the device a command's flags ask for: the adapter whose name holds `adapter` (else
/// the one with the most memory) under `budget`.
pub fn open_device(adapter: Option<&str>, budget: Option<u64>) -> Result<Device> {
    Device::with_options(DeviceOptions {
        adapter: adapter.map(str::to_string),
        memory_budget: budget,
        ..DeviceOptions::default()
    })
}
