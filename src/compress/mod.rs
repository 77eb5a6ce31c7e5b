//! Smaller models: magnitude pruning ([`Pruner`]), post-training int8 quantization
//! ([`QuantizedLinear`], [`quantize_model`], [`QuantizedMlp`]) and knowledge distillation
//! ([`distillation_loss`], [`Distill`]).
//!
//! Each works on any [`Module`](crate::nn::Module) whose weights are
//! [`Linear`](crate::nn::Linear) layers (the Mlp, a user's model, the Gpt): pruning and
//! quantization find the weights by name and rank in `named_parameters` (see [`prunable`]);
//! distillation needs only each model's logits ([`Logits`]).

mod distill;
mod nf4;
mod prune;
mod quantize;
mod quantized_model;

pub use distill::{distillation_loss, Distill, DistillConfig, Labeled, Logits};
pub use nf4::{
    dequantize_nf4, double_dequantize, double_quantize, quantize_gpt_base, quantize_linear,
    quantize_llama_base, quantize_nf4, quantize_weight, BaseQuant, NF4,
};
pub use prune::{
    prunable, LayerSparsity, ParamFilter, PruneConfig, PruneSchedule, PruneScope, Pruner,
    SparsityReport,
};
pub use quantize::{quantize_rows, QuantizedLinear};
pub use quantized_model::{
    quantize_model, QuantizedMlp, QuantizedModel, QUANTIZED_FORMAT, QUANTIZED_VERSION,
};
