//! Training: datasets and the [`Trainer`] loop (micro-batches, gradient accumulation, learning
//! rate schedule, evaluation, the memory summary).

#[doc(hidden)]
pub mod bench;
pub mod data;
pub mod shard;
mod trainer;

pub use trainer::{reserved_estimate, MemorySummary, Trainer, TrainerConfig};
