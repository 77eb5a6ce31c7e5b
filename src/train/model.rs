//! What the [`Trainer`](super::Trainer) needs of a model and of its data: a model computes the
//! loss of a batch ([`TrainModel`]); a data source makes a batch from sample indices
//! ([`BatchSource`]). Any pair that fits gets micro-batching under a budget, accumulation,
//! out-of-memory retry, mixed precision, the planner and checkpoints.
//!
//! Batches are host-side values (labels, token ids, targets of any rank); the model uploads
//! what it needs inside `forward_loss`, so a micro-batch's device memory lives only while it
//! runs. Two batch kinds come with the crate: [`ClassBatch`] (features and class labels, made
//! by [`Dataset`]) and [`TensorBatch`] (inputs and f32 targets of any rank, made by
//! [`TensorDataset`]).

use super::data::Dataset;
use super::order::epoch_permutation;
use crate::nn::{self, Mlp, Module};
use crate::{DType, Device, Error, Result, Tensor};

/// What a model's forward knows about the step it runs in.
#[derive(Clone, Debug)]
pub struct StepContext {
    /// The device the trainer runs on.
    pub device: Device,
    /// The dtype matmuls and activations use: f16 under mixed precision, even with f32
    /// parameters (cast them with `to_dtype`, as [`nn::Linear::forward_in`] does).
    pub dtype: DType,
    /// False during evaluation (no graph is recorded then).
    pub training: bool,
}

/// A batch: it knows how many samples it holds (the weight of its loss in a split batch).
pub trait Batch {
    /// Samples in the batch.
    fn len(&self) -> usize;
    /// Whether the batch holds no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A data source the trainer draws batches from.
pub trait BatchSource {
    /// The batch type the model consumes.
    type Batch: Batch;
    /// Samples in the source.
    fn len(&self) -> usize;
    /// Whether the source holds no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The samples `indices` (each `< len()`) as one batch.
    fn batch(&self, indices: &[usize]) -> Result<Self::Batch>;
    /// The sample order of one epoch; by default a seeded shuffle that depends only on
    /// (seed, epoch), so a resumed run sees the same order.
    fn epoch_order(&self, seed: u64, epoch: u64) -> Vec<usize> {
        epoch_permutation(self.len(), seed, epoch)
    }
    /// Device memory the source keeps while steps run on it, beyond the batches it makes (a
    /// sharded epoch's shards, train/rows.rs `ShardedView`). The planner allocates these on
    /// its planning arena before the step it plans, so plans, budgets and preallocation count
    /// them. None by default.
    fn resident(&self, _device: &Device) -> Result<Vec<Tensor>> {
        Ok(Vec::new())
    }
}

/// What evaluation gets from one batch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EvalBatch {
    /// The batch's mean loss.
    pub loss: f32,
    /// Samples predicted right, for models that classify.
    pub correct: Option<usize>,
}

/// A model the trainer can train on batches of type `B`.
///
/// ```no_run
/// use fitgrad::nn::{Linear, Module};
/// use fitgrad::train::{StepContext, TensorBatch, TrainModel};
/// use fitgrad::{Result, Tensor};
///
/// struct Regressor { lin: Linear }
/// impl Module for Regressor {
///     fn forward(&self, x: &Tensor) -> Result<Tensor> { self.lin.forward(x) }
///     fn named_parameters(&self) -> Vec<(String, Tensor)> { self.lin.named_parameters() }
/// }
/// impl TrainModel<TensorBatch> for Regressor {
///     fn forward_loss(&self, b: &TensorBatch, ctx: &StepContext) -> Result<Tensor> {
///         let (x, y) = b.to_device(&ctx.device)?;
///         fitgrad::nn::mse_loss(&self.forward(&x)?, &y)
///     }
/// }
/// ```
pub trait TrainModel<B>: Module {
    /// The mean loss over `batch`, recorded for backward (a one-element f32 tensor).
    fn forward_loss(&self, batch: &B, ctx: &StepContext) -> Result<Tensor>;

    /// The loss (and, for classifiers, the right predictions) of `batch`, run without a
    /// graph. The default reads the loss back.
    fn evaluate_batch(&self, batch: &B, ctx: &StepContext) -> Result<EvalBatch> {
        Ok(EvalBatch {
            loss: self.forward_loss(batch, ctx)?.item()?,
            correct: None,
        })
    }

    /// Turns activation checkpointing on or off (recompute forward pieces in backward instead
    /// of keeping their activations) and says whether the model has any to checkpoint: `false`
    /// (the default) means the call did nothing and [`Trainer::fit_auto`](super::Trainer::fit_auto)
    /// will not try it.
    fn set_checkpointing(&mut self, _on: bool) -> bool {
        false
    }
}

/// Features of a batch: on the host, or rows already on the device (a dataset shard).
#[derive(Clone, Debug)]
pub enum Features {
    /// Row-major host values of shape `dims` (samples first).
    Host {
        /// The values.
        data: Vec<f32>,
        /// Their shape, samples first.
        dims: Vec<usize>,
    },
    /// An f32 device tensor, samples first.
    Device(Tensor),
}

impl Features {
    /// The features as a device tensor (an upload for host features).
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        match self {
            Features::Host { data, dims } => Tensor::from_slice(device, data, dims),
            Features::Device(t) => Ok(t.clone()),
        }
    }
}

/// Features and class labels: what [`Dataset`] makes and [`Mlp`] trains on.
#[derive(Clone, Debug)]
pub struct ClassBatch {
    /// (n, ...) features.
    pub x: Features,
    /// One class index per sample.
    pub y: Vec<u32>,
}

impl ClassBatch {
    /// The mean cross-entropy of the logits `logits_of` computes from the batch's features
    /// (uploaded to the step's device; (B, ...) -> (B, classes)): a classifier's
    /// [`TrainModel::forward_loss`] in one line.
    pub fn loss(
        &self,
        ctx: &StepContext,
        logits_of: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let x = self.x.to_device(&ctx.device)?;
        let logits = logits_of(&x)?;
        drop(x); // the graph keeps what backward needs
        nn::cross_entropy(&logits, &self.y)
    }

    /// The loss and the correct predictions of the logits `logits_of` computes: a
    /// classifier's [`TrainModel::evaluate_batch`] in one line.
    pub fn evaluate(
        &self,
        ctx: &StepContext,
        logits_of: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<EvalBatch> {
        let x = self.x.to_device(&ctx.device)?;
        let logits = logits_of(&x)?;
        Ok(EvalBatch {
            loss: nn::cross_entropy(&logits, &self.y)?.item()?,
            correct: Some(nn::correct(&logits, &self.y)?),
        })
    }
}

impl Batch for ClassBatch {
    fn len(&self) -> usize {
        self.y.len()
    }
}

impl BatchSource for Dataset {
    type Batch = ClassBatch;
    fn len(&self) -> usize {
        Dataset::len(self)
    }
    fn batch(&self, indices: &[usize]) -> Result<ClassBatch> {
        check_indices("Dataset::batch", indices, Dataset::len(self))?;
        let (mut data, mut y) = (Vec::new(), Vec::new());
        self.gather(indices, &mut data, &mut y);
        Ok(ClassBatch {
            x: Features::Host {
                data,
                dims: vec![indices.len(), self.dim],
            },
            y,
        })
    }
    fn epoch_order(&self, seed: u64, epoch: u64) -> Vec<usize> {
        self.shuffled_order(seed, epoch)
    }
}

/// An index out of range is a typed error, not a panic.
pub(super) fn check_indices(op: &'static str, indices: &[usize], len: usize) -> Result<()> {
    match indices.iter().find(|&&i| i >= len) {
        Some(i) => Err(Error::InvalidArgument {
            op,
            reason: format!("sample {i} is out of range for {len} samples"),
        }),
        None => Ok(()),
    }
}

impl TrainModel<ClassBatch> for Mlp {
    fn forward_loss(&self, b: &ClassBatch, ctx: &StepContext) -> Result<Tensor> {
        b.loss(ctx, |x| self.forward_in(x, ctx.dtype))
    }

    fn evaluate_batch(&self, b: &ClassBatch, ctx: &StepContext) -> Result<EvalBatch> {
        b.evaluate(ctx, |x| self.forward_in(x, ctx.dtype))
    }

    /// Sets [`Mlp::checkpoint_activations`]; only gelu layers have activations to drop.
    fn set_checkpointing(&mut self, on: bool) -> bool {
        self.checkpoint_activations = on;
        self.act == crate::Activation::Gelu
    }
}

/// Inputs and f32 targets of any rank (regression, autoencoders).
#[derive(Clone, Debug)]
pub struct TensorBatch {
    /// Row-major inputs of shape `x_dims` (samples first).
    pub x: Vec<f32>,
    /// Shape of `x`.
    pub x_dims: Vec<usize>,
    /// Row-major targets of shape `y_dims` (samples first).
    pub y: Vec<f32>,
    /// Shape of `y`.
    pub y_dims: Vec<usize>,
}

impl TensorBatch {
    /// Uploads (inputs, targets).
    pub fn to_device(&self, device: &Device) -> Result<(Tensor, Tensor)> {
        Ok((
            Tensor::from_slice(device, &self.x, &self.x_dims)?,
            Tensor::from_slice(device, &self.y, &self.y_dims)?,
        ))
    }
}

impl Batch for TensorBatch {
    fn len(&self) -> usize {
        self.x_dims.first().copied().unwrap_or(0)
    }
}

/// Samples of any shape with f32 targets of any shape, held on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorDataset {
    x: Vec<f32>,
    sample_dims: Vec<usize>,
    y: Vec<f32>,
    target_dims: Vec<usize>,
    len: usize,
}

impl TensorDataset {
    /// `x` holds `len` samples of shape `sample_dims`, `y` one target of shape `target_dims`
    /// each, row-major. Sample and target ranks plus one are at most 4 (a tensor's rank).
    pub fn new(
        x: Vec<f32>,
        sample_dims: &[usize],
        y: Vec<f32>,
        target_dims: &[usize],
    ) -> Result<TensorDataset> {
        let per_x: usize = sample_dims.iter().product();
        let per_y: usize = target_dims.iter().product();
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "TensorDataset::new",
                reason,
            })
        };
        if sample_dims.len() >= crate::tensor::MAX_RANK
            || target_dims.len() >= crate::tensor::MAX_RANK
        {
            return bad(format!(
                "sample shape {sample_dims:?} or target shape {target_dims:?} has too many dims (at most {})",
                crate::tensor::MAX_RANK - 1
            ));
        }
        if per_x == 0 || per_y == 0 {
            return bad("samples and targets must hold at least one value each".into());
        }
        let len = x.len() / per_x;
        if x.len() != len * per_x || y.len() != len * per_y {
            return bad(format!(
                "{} input values are not a whole number of samples of {sample_dims:?}, or {} targets do not match {len} samples of {target_dims:?}",
                x.len(),
                y.len()
            ));
        }
        Ok(TensorDataset {
            x,
            sample_dims: sample_dims.to_vec(),
            y,
            target_dims: target_dims.to_vec(),
            len,
        })
    }
}

impl BatchSource for TensorDataset {
    type Batch = TensorBatch;
    fn len(&self) -> usize {
        self.len
    }
    fn batch(&self, indices: &[usize]) -> Result<TensorBatch> {
        check_indices("TensorDataset::batch", indices, self.len)?;
        let per_x: usize = self.sample_dims.iter().product();
        let per_y: usize = self.target_dims.iter().product();
        let mut b = TensorBatch {
            x: Vec::with_capacity(indices.len() * per_x),
            x_dims: [&[indices.len()][..], &self.sample_dims].concat(),
            y: Vec::with_capacity(indices.len() * per_y),
            y_dims: [&[indices.len()][..], &self.target_dims].concat(),
        };
        for &i in indices {
            b.x.extend_from_slice(&self.x[i * per_x..(i + 1) * per_x]);
            b.y.extend_from_slice(&self.y[i * per_y..(i + 1) * per_y]);
        }
        Ok(b)
    }
}
