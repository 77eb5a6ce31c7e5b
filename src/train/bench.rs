//! The training-step benchmark's fixture, shared by `benches/train_step.rs` and
//! `cargo xtask bench`: an MLP step (forward, backward, AdamW) and the same step's matmuls
//! alone, so the report can say what the non-matmul work costs.

use super::{Trainer, TrainerConfig};
use crate::nn::{Mlp, Module};
use crate::optim::AdamW;
use crate::tensor::Rng;
use crate::{Activation, DType, Device, MatmulOptions, Result, Tensor};

/// A trainer for `widths` at `batch` with AdamW, and one fixed batch of random inputs.
pub fn step_fixture(
    dev: &Device,
    widths: &[usize],
    batch: usize,
) -> Result<(Trainer<Mlp>, Vec<f32>, Vec<u32>)> {
    let model = Mlp::new(dev, widths, Activation::Relu, 0)?;
    let opt = AdamW::new(model.parameters(), 1e-3)?;
    let config = TrainerConfig {
        batch_size: batch,
        ..Default::default()
    };
    let trainer = Trainer::new(model, Box::new(opt), config)?;
    let mut rng = Rng::new(9);
    let classes = *widths.last().expect("widths checked by Mlp::new") as u64;
    let x = (0..batch * widths[0])
        .map(|_| rng.next_f64() as f32)
        .collect();
    let y = (0..batch)
        .map(|_| (rng.next_u64() % classes) as u32)
        .collect();
    Ok((trainer, x, y))
}

/// The matmuls of one training step of an MLP with `widths` at `batch`, on tensors of the same
/// shapes: forward `X·Wᵀ + b` with relu fused, weight gradients `dYᵀ·X`, and input gradients
/// `dY·W` for every layer but the first.
pub struct StepMatmuls {
    /// (x (B, in), w (out, in), b (out), dy (B, out), layer index)
    layers: Vec<(Tensor, Tensor, Tensor, Tensor, usize)>,
}

impl StepMatmuls {
    pub fn new(dev: &Device, widths: &[usize], batch: usize) -> Result<StepMatmuls> {
        let t = |d: &[usize], s| Tensor::randn(dev, d, 0.0, 0.1, s, DType::F32);
        let mut layers = Vec::new();
        for (i, w) in widths.windows(2).enumerate() {
            let (k, n) = (w[0], w[1]);
            layers.push((
                t(&[batch, k], 1)?,
                t(&[n, k], 2)?,
                t(&[n], 3)?,
                t(&[batch, n], 4)?,
                i,
            ));
        }
        Ok(StepMatmuls { layers })
    }

    /// Records every matmul (the caller syncs).
    pub fn run(&self) -> Result<()> {
        for (x, w, b, dy, i) in &self.layers {
            let fwd = MatmulOptions {
                trans_b: true,
                bias: Some(b),
                activation: Activation::Relu,
                ..Default::default()
            };
            x.matmul_with(w, &fwd)?;
            let dw = MatmulOptions {
                trans_a: true,
                k_blocks: true,
                ..Default::default()
            };
            dy.matmul_with(x, &dw)?;
            if *i > 0 {
                dy.matmul(w)?;
            }
        }
        Ok(())
    }
}
