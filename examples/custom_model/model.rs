//! The model: a residual MLP written with `fitgrad::module!` and `TrainModel<ClassBatch>`, all
//! a model needs to train with every memory feature (the module docs of main.rs describe it).

use fitgrad::nn::{Dropout, LayerNorm, Linear, Module, Unit};
use fitgrad::train::{ClassBatch, EvalBatch, StepContext, TrainModel};
use fitgrad::{Activation, DType, Device, Result, Tensor};

/// x + fc2(dropout(gelu(fc1(layer_norm(x))))): (B, W) -> (B, W).
struct Block {
    norm: LayerNorm,
    fc1: Linear,
    drop: Dropout,
    fc2: Linear,
}

impl Block {
    /// The block computed in `dtype` (x has it): the Linear layers cast their f32 parameters
    /// inside the graph, LayerNorm casts its own to x's dtype.
    fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let h = self.norm.forward(x)?; // (B, W)
        let h = self.fc1.forward_in(&h, Activation::Gelu, dtype)?; // (B, W), gelu fused
        let h = self.drop.forward(&h)?; // identity in eval mode
        x.add(&self.fc2.forward_in(&h, Activation::None, dtype)?)
    }
}

fitgrad::module! {
    impl Module for Block {
        // `drop` has no parameters, but listing it lets `set_training` reach it.
        params { norm, fc1, drop, fc2 }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.forward_in(x, x.dtype())
        }
    }
}

/// stem -> blocks -> layer norm -> head: (B, IN) -> logits (B, CLASSES). Each block is a
/// `Unit`: with `--offload parameters` its parameters live in host memory and come to the
/// device around its forward and backward; otherwise the wrapper changes nothing.
pub struct ResMlp {
    stem: Linear,
    blocks: Vec<Unit<Block>>,
    norm: LayerNorm,
    head: Linear,
    /// The blocks' dropout probability (stored in checkpoints).
    dropout: f32,
}

impl ResMlp {
    pub fn new(
        dev: &Device,
        inputs: usize,
        width: usize,
        blocks: usize,
        classes: usize,
        dropout: f32,
        seed: u64,
    ) -> Result<ResMlp> {
        // Each layer gets its own stream of the seed.
        let s = |k: u64| seed.wrapping_mul(0x100_0000_01b3).wrapping_add(k);
        Ok(ResMlp {
            stem: Linear::new(dev, inputs, width, s(1))?,
            blocks: (0..blocks as u64)
                .map(|b| {
                    Ok(Unit::new(Block {
                        norm: LayerNorm::new(dev, width)?,
                        fc1: Linear::new(dev, width, width, s(100 + 2 * b))?,
                        drop: Dropout::new(dropout, s(10_000 + b))?,
                        fc2: Linear::new(dev, width, width, s(101 + 2 * b))?,
                    }))
                })
                .collect::<Result<_>>()?,
            norm: LayerNorm::new(dev, width)?,
            head: Linear::new(dev, width, classes, s(2))?,
            dropout,
        })
    }

    /// Logits (B, CLASSES) in f32 from x (B, IN), with every matmul and activation in
    /// `dtype` (f16 under mixed precision).
    fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let x = if x.dtype() == dtype {
            x.clone()
        } else {
            x.to_dtype(dtype)?
        };
        let mut h = self.stem.forward_in(&x, Activation::None, dtype)?; // (B, W)
        drop(x);
        for b in &self.blocks {
            h = b.forward(&h)?; // in h's dtype
        }
        let logits = self
            .head
            .forward_in(&self.norm.forward(&h)?, Activation::None, dtype)?;
        // The loss in f32: a scaled f16 loss could overflow.
        if logits.dtype() == DType::F32 {
            Ok(logits)
        } else {
            logits.to_dtype(DType::F32)
        }
    }

    /// Moves every dropout layer's mask counter past `calls` training calls, so a resumed run
    /// draws the masks the uninterrupted run would have drawn next (checkpoints hold weights,
    /// not counters).
    pub fn skip_dropout_masks(&self, calls: u64) {
        for b in &self.blocks {
            for _ in 0..calls {
                b.inner().drop.next_seed();
            }
        }
    }
}

fitgrad::module! {
    impl Module for ResMlp {
        params { stem, blocks, norm, head }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.forward_in(x, self.stem.weight.dtype())
        }
        // Stored in checkpoints: resuming into a model of another shape is a clear error.
        fn config(&self) -> Vec<(String, String)> {
            vec![
                ("kind".into(), "res-mlp".into()),
                ("inputs".into(), self.stem.in_features.to_string()),
                ("width".into(), self.stem.out_features.to_string()),
                ("blocks".into(), self.blocks.len().to_string()),
                ("classes".into(), self.head.out_features.to_string()),
                // Another dropout trains another run: a resume with it is refused.
                ("dropout".into(), self.dropout.to_string()),
            ]
        }
    }
}

impl TrainModel<ClassBatch> for ResMlp {
    fn forward_loss(&self, b: &ClassBatch, ctx: &StepContext) -> Result<Tensor> {
        b.loss(ctx, |x| self.forward_in(x, ctx.dtype))
    }

    fn evaluate_batch(&self, b: &ClassBatch, ctx: &StepContext) -> Result<EvalBatch> {
        b.evaluate(ctx, |x| self.forward_in(x, ctx.dtype))
    }
}
