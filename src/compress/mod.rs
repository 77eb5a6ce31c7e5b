//! Smaller models: magnitude pruning ([`Pruner`]), with int8 quantization and knowledge
//! distillation to follow in their own files.
//!
//! Each works on any [`Module`](crate::nn::Module) whose weights are
//! [`Linear`](crate::nn::Linear) layers: the weights are found by name and rank in
//! `named_parameters`.

mod prune;

pub use prune::{
    prunable, LayerSparsity, PruneConfig, PruneSchedule, PruneScope, Pruner, SparsityReport,
};
