//! Gradient clipping by the global L2 norm (torch.nn.utils.clip_grad_norm_), computed and
//! applied on the GPU: the clipping itself never waits for the host.

use super::grad_of;
use crate::kernels::grad_norm;
use crate::{DType, Error, Result, Tensor};

const OP: &str = "clip_grad_norm";

/// Scales every gradient of `params` in place so that their global L2 norm is at most
/// `max_norm`, and returns that norm (before clipping), as torch's `clip_grad_norm_`:
/// ```text
/// norm = sqrt(sum over parameters p, elements i of grad(p)_i^2)
/// grad(p) *= min(1, max_norm / (norm + 1e-6))
/// ```
/// Parameters without a gradient are skipped; with no gradient at all the norm is 0. Squares
/// and sums are f32 whatever the gradients' dtype, in an order fixed by the shapes, so the result
/// is bitwise reproducible.
///
/// One dispatch per gradient writes its partial sums of squares into slots of one shared
/// buffer, one dispatch adds the slots into the norm, and one in-place dispatch per gradient
/// scales it by the factor computed on the GPU: the only readback is the returned norm (see
/// [`clip_grad_norm_tensor`] to avoid even that). A NaN or infinite norm is returned as it is and
/// leaves the gradients unchanged (a [`GradScaler`](super::GradScaler) skips such a step anyway).
///
/// Errors, before any device work: [`Error::InvalidArgument`] when `max_norm` is not a finite
/// positive number or a gradient is listed twice, [`Error::DeviceMismatch`] for gradients on
/// several devices, [`Error::Shape`] for a gradient whose shape differs from its parameter's.
///
/// ```no_run
/// # fn f(model: &impl fitgrad::nn::Module, opt: &mut impl fitgrad::optim::Optimizer) -> fitgrad::Result<()> {
/// let norm = fitgrad::optim::clip_grad_norm(&model.parameters(), 1.0)?;
/// opt.step()?;
/// # Ok(()) }
/// ```
pub fn clip_grad_norm(params: &[Tensor], max_norm: f32) -> Result<f32> {
    match clip(params, max_norm)? {
        Some(norm) => norm.item(),
        None => Ok(0.0),
    }
}

/// [`clip_grad_norm`] returning the norm as a rank-0 f32 tensor on the parameters' device,
/// without reading it back: a trainer that must not stall logs it later. An empty parameter
/// list is an [`Error::InvalidArgument`] (there is no device to put the norm on).
pub fn clip_grad_norm_tensor(params: &[Tensor], max_norm: f32) -> Result<Tensor> {
    let Some(first) = params.first() else {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: "the parameter list is empty".into(),
        });
    };
    match clip(params, max_norm)? {
        Some(norm) => Ok(norm),
        None => Tensor::zeros(first.device(), &[], DType::F32),
    }
}

/// The clipping; the norm tensor, or `None` when no parameter has a gradient.
/// [`clip_grad_norm_tensor`] over gradients sharded across replicas: this replica's norm of
/// `params`' gradients goes through `global` (the norm over every replica, the same on each;
/// called even when this replica holds no gradient) and the gradients are scaled by it.
pub(crate) fn clip_grad_norm_sharded(
    device: &crate::Device,
    params: &[Tensor],
    max_norm: f32,
    global: &mut dyn FnMut(f32) -> Result<f32>,
) -> Result<()> {
    clip_with(params, max_norm, Some((device, global))).map(drop)
}

fn clip(params: &[Tensor], max_norm: f32) -> Result<Option<Tensor>> {
    clip_with(params, max_norm, None)
}

type Global<'a> = (&'a crate::Device, &'a mut dyn FnMut(f32) -> Result<f32>);

fn clip_with(
    params: &[Tensor],
    max_norm: f32,
    global: Option<Global<'_>>,
) -> Result<Option<Tensor>> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("max_norm = {max_norm} must be finite and > 0"),
        });
    }
    let mut grads: Vec<Tensor> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, p) in params.iter().enumerate() {
        let Some(g) = grad_of(OP, p)? else { continue };
        if let Some(first) = grads.first() {
            if g.device() != first.device() {
                return Err(Error::DeviceMismatch { op: OP });
            }
        }
        let b = g.block();
        if g.numel() > 0 && !seen.insert((b.plan_id, b.segment, b.offset)) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "parameter {i}'s gradient is listed twice (it would be clipped twice)"
                ),
            });
        }
        grads.push(g);
    }
    let dev = match (grads.first(), &global) {
        (Some(first), _) => first.device().clone(),
        (None, Some((d, _))) => (*d).clone(),
        (None, None) => return Ok(None),
    };
    let numels: Vec<usize> = grads.iter().map(Tensor::numel).collect();
    let norm = global_norm_of(&dev, &numels, |i| Ok(grads[i].clone()))?;
    if let Some((_, global)) = global {
        if !dev.is_planning() {
            let n = global(norm.item()?)?;
            norm.fill_(n)?;
        }
    }
    scale_by_norm(&grads, &norm, max_norm)?;
    Ok(Some(norm))
}

/// The L2 norm of all of `numels.len()` gradients together as a rank-0 f32 tensor, computed on
/// the device in the fixed order of [`clip_grad_norm`], over gradients made one at a time: `grad(i)` gives the i-th
/// (of `numels[i]` elements), which may be dropped once its squares are summed, so
/// gradients that live elsewhere (host sums of streamed parameters) are uploaded one by one.
/// The same kernels in the same order: the same bits as over the gradients all on the device.
pub(crate) fn global_norm_of(
    dev: &crate::Device,
    numels: &[usize],
    mut grad: impl FnMut(usize) -> Result<Tensor>,
) -> Result<Tensor> {
    let norm = Tensor::zeros(dev, &[], DType::F32)?;
    let slots: usize = numels.iter().map(|&n| grad_norm::parts(n)).sum();
    if slots == 0 {
        // Only empty gradients: the norm is 0.
        return Ok(norm);
    }
    // acc is (slots,): every slot is written by exactly one workgroup.
    let acc = Tensor::uninit(dev, crate::Shape::new(&[slots])?, DType::F32)?;
    let mut slot = 0;
    for (i, &n) in numels.iter().enumerate() {
        let g = grad(i)?;
        grad_norm::sum_squares(&g, &acc, slot)?;
        slot += grad_norm::parts(n);
    }
    grad_norm::norm(&acc, slots, &norm)?;
    Ok(norm)
}

/// Scales each of `grads` in place by `max_norm / (norm + 1e-6)` where that is below 1 and
/// `norm` (a rank-0 f32 tensor) is finite.
pub(crate) fn scale_by_norm(grads: &[Tensor], norm: &Tensor, max_norm: f32) -> Result<()> {
    for g in grads {
        grad_norm::scale(g, norm, max_norm)?;
    }
    Ok(())
}

/// The factor [`scale_by_norm`] applies for `norm`, on the host: `None` where it leaves the
/// gradients as they are.
pub(crate) fn clip_factor(norm: f32, max_norm: f32) -> Option<f32> {
    let factor = max_norm / (norm + 1e-6);
    (norm.is_finite() && factor < 1.0).then_some(factor)
}
