//! Training: the generic [`Trainer`] (micro-batches, gradient accumulation, mixed precision,
//! budgets, out-of-memory retry, checkpoints), the traits a model and its data implement
//! ([`TrainModel`], [`BatchSource`]), the planner ([`Plan`]), datasets and shards.

#[doc(hidden)]
pub mod bench;
mod born;
mod budget;
mod config;
mod csv_file;
pub mod data;
mod epoch;
mod events;
mod fit;
mod fit_choice;
mod model;
mod order;
mod plan;
pub mod plays;
mod resume;
mod rows;
mod run_plan;
pub mod shard;
mod stream;
mod summary;
mod sync;
mod temp_shard;
pub mod text;
mod trainer;
mod window_loss;

pub use config::TrainerConfig;
pub use events::TrainEvent;
pub use fit_choice::{Candidate, FitChoice, Residence, VariantsChoice};
pub use model::{
    Batch, BatchSource, ClassBatch, EvalBatch, Features, StepContext, TensorBatch, TensorDataset,
    TrainModel,
};
pub use order::epoch_permutation;
pub use plan::Plan;
pub use rows::{HostRows, ShardedView};
pub use run_plan::{plan_json, print_plan, Phase, PhasePlan, RunPlan};
pub use summary::{Evaluation, MemorySummary};
pub use sync::{GradientSync, UnitTraffic};
pub use trainer::Trainer;
pub use window_loss::{window_loss, WindowLoss};

use crate::DType;

/// Numeric precision of training ("f32", "f16", "mixed" in JSON).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// Parameters, gradients and activations in f16; optimizer state in f32.
    F16,
    /// f32 parameters and optimizer state; f16 activations and matmuls; loss scaling.
    Mixed,
}

impl Precision {
    /// The dtype the matmuls and activations use.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 | Precision::Mixed => DType::F16,
        }
    }

    /// The name [`FromStr`](std::str::FromStr) reads: "f32", "f16" or "mixed".
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Mixed => "mixed",
        }
    }

    /// The dtype of parameters and gradients.
    pub fn param_dtype(self) -> DType {
        match self {
            Precision::F16 => DType::F16,
            Precision::F32 | Precision::Mixed => DType::F32,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Precision> {
        match s {
            "f32" => Ok(Precision::F32),
            "f16" => Ok(Precision::F16),
            "mixed" => Ok(Precision::Mixed),
            _ => Err(crate::Error::InvalidArgument {
                op: "precision",
                reason: format!("unknown precision '{s}' (f32, f16, mixed)"),
            }),
        }
    }
}
