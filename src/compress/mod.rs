//! Smaller models: magnitude pruning ([`Pruner`]) and post-training int8 quantization
//! ([`QuantizedLinear`], [`quantize_model`], [`QuantizedMlp`]).
//!
//! Each works on any [`Module`](crate::nn::Module) whose weights are
//! [`Linear`](crate::nn::Linear) layers: the weights are found by name and rank in
//! `named_parameters` (see [`prunable`]).

mod prune;
mod quantize;
mod quantized_model;

pub use prune::{
    prunable, LayerSparsity, ParamFilter, PruneConfig, PruneSchedule, PruneScope, Pruner,
    SparsityReport,
};
pub use quantize::{quantize_rows, QuantizedLinear};
pub use quantized_model::{
    quantize_model, QuantizedMlp, QuantizedModel, QUANTIZED_FORMAT, QUANTIZED_VERSION,
};
