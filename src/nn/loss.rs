//! Losses and metrics.

use crate::{Error, Result, Tensor};

/// Mean softmax cross-entropy of logits (B, C) against class indices: one fused kernel for the
/// loss and its gradient (see [`Tensor::cross_entropy_loss`]).
pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    logits.cross_entropy_loss(targets)
}

/// Mean squared error `mean((pred - target)^2)`; shapes must be equal.
pub fn mse_loss(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    if pred.dims() != target.dims() {
        return Err(Error::Shape {
            op: "mse_loss",
            lhs: pred.dims().to_vec(),
            rhs: target.dims().to_vec(),
            reason: "prediction and target must have the same shape".into(),
        });
    }
    let d = pred.sub(target)?;
    d.mul(&d)?.mean()
}

/// How many rows of logits (B, C) have their argmax at the target.
pub fn correct(logits: &Tensor, targets: &[u32]) -> Result<usize> {
    if logits.rank() != 2 || logits.dims()[0] != targets.len() {
        return Err(Error::Shape {
            op: "accuracy",
            lhs: logits.dims().to_vec(),
            rhs: vec![targets.len()],
            reason: "logits must be (batch, classes) with one target per row".into(),
        });
    }
    let _g = crate::no_grad();
    let pred = logits.argmax_axis(1, false)?.to_vec::<f32>()?;
    Ok(pred
        .iter()
        .zip(targets)
        .filter(|(p, &t)| **p as u32 == t)
        .count())
}

/// The fraction of rows whose argmax is the target (0 for an empty batch).
pub fn accuracy(logits: &Tensor, targets: &[u32]) -> Result<f32> {
    let n = correct(logits, targets)?;
    Ok(if targets.is_empty() {
        0.0
    } else {
        n as f32 / targets.len() as f32
    })
}
