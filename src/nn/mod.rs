//! Layers and losses: [`Linear`], [`Mlp`], [`Embedding`], [`LayerNorm`], [`Dropout`],
//! [`Sequential`] (and the [`module!`](crate::module) macro for custom models), the [`Gpt`]
//! transformer, cross-entropy, mse, accuracy. Parameters are leaf
//! tensors that require grad; a [`Module`] lists them for optimizers and checkpoints.

mod attention;
mod block;
mod conv;
mod dropout;
mod embedding;
mod generate;
mod gpt;
mod linear;
mod llama;
mod loss;
mod mlp;
mod norm;
mod sequential;

pub use crate::Activation;
pub use crate::AttentionKind;
pub use attention::CausalSelfAttention;
pub use block::{FeedForward, GptBlock};
pub use conv::{AvgPool2d, BatchNorm2d, Conv2d, GroupNorm, MaxPool2d};
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use generate::{KvCache, LanguageModel, Sampling};
pub use gpt::{Gpt, GptConfig};
pub use linear::Linear;
pub use llama::{Llama, LlamaAttention, LlamaBlock, LlamaConfig, LlamaMlp, RmsNorm};
pub use loss::{accuracy, correct, cross_entropy, mse_loss};
pub use mlp::Mlp;
pub use norm::{LayerNorm, LAYER_NORM_EPS};
pub use sequential::Sequential;

use crate::{Result, Tensor};

/// What optimizers, checkpoints and the trainer need from a model.
pub trait Module {
    /// The model's output for a batch `x` (recorded for autograd where grad is enabled).
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// Parameters with stable names (`layers.0.weight`, ...), in a fixed order.
    fn named_parameters(&self) -> Vec<(String, Tensor)>;

    /// State that is not trained but belongs to the model (batch norm's running statistics),
    /// with stable names as parameters have: checkpoints save and load it, optimizers never see
    /// it. Empty by default.
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    /// The parameters (clones share memory and gradients with the model's).
    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    /// The model's configuration as key-value pairs, where it has one: checkpoints store it
    /// (`model.config.KEY` in the file's metadata) so the model can be rebuilt from the file
    /// alone (see [`Mlp::from_config`] and
    /// [`Checkpoint::rebuild`](crate::checkpoint::Checkpoint::rebuild)). Empty by default.
    fn config(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// Switches training behaviour (dropout) on or off, like torch's `train()` / `eval()`.
    /// Containers pass it to every child; layers without such behaviour ignore it.
    fn set_training(&self, _training: bool) {}

    /// Drops every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }

    /// Number of scalar parameters.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(|p| p.numel()).sum()
    }

    /// Device bytes the parameters take (without gradients or optimizer state).
    fn parameter_bytes(&self) -> u64 {
        self.parameters().iter().map(|p| p.allocated_bytes()).sum()
    }
}
