//! Batch-invariant sums: a weight gradient that is the same bits however a batch is split into
//! micro-batches (`TrainerConfig::batch_invariant`).
//!
//! Every other gradient of a model that does not mix samples is already computed per sample:
//! each sample's forward and input gradient sum in an order fixed by the sample's own shape.
//! What a split changes are the sums over samples, of the weight gradients and of the loss's
//! mean. In this mode:
//! - each rule whose weight gradient sums over samples (conv2d's weight and bias, a matmul's
//!   shared right operand and bias, group norm's affine) adds the samples one after another, in
//!   order, in one sum per gradient element, continuing in place from the gradient the weight
//!   already holds ([`fold_target`]) instead of adding a separate sum to it, so micro-batches
//!   folded in turn give the bits of the whole batch;
//! - the trainer weighs each sample's loss by 1 / (the whole batch) inside the loss
//!   ([`weigh_samples`]), never by 1 / micro-batch times micro-batch / batch, which rounds.
//!
//! The price is parallelism: a gradient element's sum over the batch is one invocation's loop.

use super::autograd;
use super::Tensor;
use crate::device::Device;
use crate::kernels::matmul::{self, Epilogue, Problem, Variant};
use crate::kernels::reduce;
use crate::{DType, Error, Result, Shape};
use std::cell::RefCell;
use std::sync::Arc;

/// A device's mode, in its extension slot.
#[derive(Default)]
struct Mode(bool);

/// Turns batch-invariant sums on or off for the backward rules that run on `dev` (and its
/// clones). Off by default.
pub fn set_batch_invariant(dev: &Device, on: bool) {
    dev.with_ext(|m: &mut Mode| m.0 = on);
}

/// Whether [`set_batch_invariant`] turned the mode on for `dev`.
pub fn is_batch_invariant(dev: &Device) -> bool {
    dev.with_ext(|m: &mut Mode| m.0)
}

/// In batch-invariant mode, the f32 gradient that leaf input `i` of the running rule holds
/// (of the input's shape, as every leaf gradient): the rule adds its own onto it in place and
/// returns no gradient for that input. `None` when the mode is off, input `i` is no leaf (then
/// its gradient is summed from zero), or it holds nothing yet.
pub(crate) fn fold_target(dev: &Device, i: usize) -> Option<Tensor> {
    if !is_batch_invariant(dev) {
        return None;
    }
    autograd::leaf_grad(i, |g| g.dtype() == DType::F32)
}

/// The gradient of `dims` (f32) that sums x, viewed as (len, numel of dims), over its `len`
/// rows in order: added onto `onto` in place (then `None`), or a new tensor.
pub(crate) fn fold_rows(
    x: &Tensor,
    len: usize,
    dims: &[usize],
    onto: Option<Tensor>,
) -> Result<Option<Tensor>> {
    let inner = dims.iter().product();
    match onto {
        Some(t) => {
            reduce::fold(x, len, inner, true, &t)?;
            Ok(None)
        }
        None => {
            let out = Tensor::uninit(x.device(), Shape::new(dims)?, DType::F32)?;
            reduce::fold(x, len, inner, false, &out)?;
            Ok(Some(out))
        }
    }
}

/// The gradient (f32, (ni, nj)) = lᵀ · r over the rows of l (rows, ni) and r (rows, nj), rows
/// in order: added onto `onto` in place (then `None`), or a new tensor. Any matmul kernel does
/// it (each sums k in order), starting from the gradient held (`Problem::onto`).
pub(crate) fn fold_outer(
    l: &Tensor,
    r: &Tensor,
    dims: [usize; 2],
    onto: Option<Tensor>,
) -> Result<Option<Tensor>> {
    fold_outer_by(l, r, dims, onto, None)
}

/// [`fold_outer`] by `variant`, or (`None`) the autotuner's choice.
fn fold_outer_by(
    l: &Tensor,
    r: &Tensor,
    [ni, nj]: [usize; 2],
    onto: Option<Tensor>,
    variant: Option<Variant>,
) -> Result<Option<Tensor>> {
    let dev = l.device();
    let out = match &onto {
        Some(t) => t.reshape(&[ni, nj])?,
        None => Tensor::uninit(dev, Shape::new(&[ni, nj])?, DType::F32)?,
    };
    let pb = Problem {
        batch: 1,
        m: ni,
        n: nj,
        k: l.numel() / ni.max(1),
        trans_a: true,
        trans_b: false,
        k_blocks: false,
        onto: onto.is_some(),
        a_batch: 0,
        b_batch: 0,
        bias: false,
        epilogue: Epilogue::None,
    };
    let variant = match variant {
        Some(v) => v,
        None => matmul::select(dev, &pb, l.dtype(), |v| {
            matmul::run(dev, v, &pb, l, r, None, &out)
        })?,
    };
    matmul::run(dev, variant, &pb, l, r, None, &out)?;
    Ok(onto.is_none().then_some(out))
}

impl Tensor {
    /// `self`ᵀ · `other` over their rows ((K, M) and (K, N), f32) folded onto `onto` ((M, N),
    /// f32) in place, k in order, by one matmul kernel variant: the batch-invariant weight
    /// gradient's kernel (tests).
    #[doc(hidden)]
    pub fn fold_rows_onto(&self, other: &Tensor, onto: &Tensor, variant: Variant) -> Result<()> {
        let (Some(&m), Some(&n)) = (self.dims().last(), other.dims().last()) else {
            return Err(Error::InvalidArgument {
                op: "fold_rows_onto",
                reason: "need (K, M) and (K, N) operands".into(),
            });
        };
        if self.rank() != 2
            || other.rank() != 2
            || self.dims()[0] != other.dims()[0]
            || onto.dims() != [m, n]
            || [self, other, onto].iter().any(|t| t.dtype() != DType::F32)
        {
            return Err(Error::InvalidArgument {
                op: "fold_rows_onto",
                reason: format!(
                    "need f32 (K, M) and (K, N) operands and an (M, N) gradient, got {:?}, {:?} \
                     and {:?}",
                    self.dims(),
                    other.dims(),
                    onto.dims()
                ),
            });
        }
        fold_outer_by(self, other, [m, n], Some(onto.clone()), Some(variant)).map(drop)
    }
}

thread_local! {
    /// The open [`SampleScope`]: the whole batch's sample count and the losses that took it.
    static SAMPLES: RefCell<Option<(usize, Vec<usize>)>> = const { RefCell::new(None) };
}

/// While it lives, a loss that supports it ([`Tensor::cross_entropy_loss`]) weighs each of its
/// samples by 1 / `n`, the whole batch's count, instead of taking its own mean: the trainer's
/// share of a micro-batch without rounding. One scope per thread.
pub(crate) struct SampleScope(());

/// Opens a [`SampleScope`] for a batch of `n` samples.
pub(crate) fn weigh_samples(n: usize) -> SampleScope {
    SAMPLES.with(|s| *s.borrow_mut() = Some((n, Vec::new())));
    SampleScope(())
}

impl SampleScope {
    /// Checks that the open scope's weight reached `loss` and nothing else: `loss` must be the
    /// one loss that took it. Errors otherwise ([`Error::InvalidArgument`]), since the trainer
    /// does not weigh a loss that weighed itself.
    pub(crate) fn check(&self, op: &'static str, loss: &Tensor) -> Result<()> {
        let id = loss.node.as_ref().map(|n| Arc::as_ptr(n) as usize);
        let ok = SAMPLES.with(|s| match &*s.borrow() {
            Some((_, takers)) => id.is_some() && takers.as_slice() == [id.unwrap_or(0)],
            None => false,
        });
        if ok {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            op,
            reason: "batch-invariant training weighs each sample by 1 / batch inside the loss: \
                     the model's forward_loss must return the loss of one cross_entropy over \
                     the micro-batch, recorded for backward, as it is"
                .into(),
        })
    }
}

impl Drop for SampleScope {
    fn drop(&mut self) {
        SAMPLES.with(|s| *s.borrow_mut() = None);
    }
}

/// The open scope's batch count, for a loss over `b` samples that weighs them itself; `None`
/// without a scope. `b` past the count is an error.
pub(crate) fn sample_count(op: &'static str, b: usize) -> Result<Option<usize>> {
    SAMPLES.with(|s| match &*s.borrow() {
        Some((n, _)) if b > *n => Err(Error::InvalidArgument {
            op,
            reason: format!("a loss over {b} samples in a batch of {n}"),
        }),
        Some((n, _)) => Ok(Some(*n)),
        None => Ok(None),
    })
}

/// Records that `loss` took the open scope's weight.
pub(crate) fn took_weight(loss: &Tensor) {
    let id = loss.node.as_ref().map_or(0, |n| Arc::as_ptr(n) as usize);
    SAMPLES.with(|s| {
        if let Some((_, takers)) = &mut *s.borrow_mut() {
            takers.push(id);
        }
    });
}
