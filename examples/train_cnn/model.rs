//! The example's model: a small ResNet written with `module!` (stem, residual blocks of
//! conv-norm-relu, strided blocks doubling the channels, global average pool, Linear head),
//! with BatchNorm2d or GroupNorm as its norm.

use fitgrad::nn::{AvgPool2d, BatchNorm2d, Conv2d, GroupNorm, Linear, Module};
use fitgrad::train::{ClassBatch, EvalBatch, StepContext, TrainModel};
use fitgrad::{autograd, Activation, Conv2dOptions, DType, Device};
use fitgrad::{Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The shape of the ResNet: channels of the first stage, the stem's stride, blocks per stage
/// after its first, the norm, and the seed of its weights.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub width: usize,
    pub stem_stride: usize,
    pub blocks: usize,
    pub group_norm: bool,
    pub seed: u64,
}

/// BatchNorm2d or GroupNorm, chosen by --norm.
#[derive(Clone)]
enum Norm {
    Batch(BatchNorm2d),
    Group(GroupNorm),
}

impl Norm {
    fn new(dev: &Device, group: bool, channels: usize) -> Result<Norm> {
        Ok(if group {
            Norm::Group(GroupNorm::new(dev, (channels / 4).max(1), channels)?)
        } else {
            Norm::Batch(BatchNorm2d::new(dev, channels)?)
        })
    }

    fn inner(&self) -> &dyn Module {
        match self {
            Norm::Batch(b) => b,
            Norm::Group(g) => g,
        }
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.inner().forward(x)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.inner().named_parameters()
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.inner().named_buffers()
    }
    fn set_training(&self, training: bool) {
        self.inner().set_training(training)
    }
}

/// The skip path of a strided block: a 1x1 stride-2 conv and its norm.
#[derive(Clone)]
struct Downsample {
    conv: Conv2d,
    norm: Norm,
}

fitgrad::module! {
    impl Module for Downsample {
        params { conv, norm }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.norm.forward(&self.conv.forward(x)?)
        }
    }
}

/// relu(skip(x) + norm2(conv2(relu(norm1(conv1(x)))))): (B, C, S, S) -> (B, C', S', S').
#[derive(Clone)]
pub struct ResBlock {
    conv1: Conv2d,
    norm1: Norm,
    conv2: Conv2d,
    norm2: Norm,
    /// `Some` on a stage's first block (stride 2, channels doubled); the identity otherwise.
    down: Vec<Downsample>,
}

impl ResBlock {
    fn new(dev: &Device, group: bool, cin: usize, cout: usize, seed: u64) -> Result<ResBlock> {
        let stride = if cin == cout { 1 } else { 2 };
        let c3 = Conv2dOptions::new().padding(1);
        let down = if cin == cout {
            vec![]
        } else {
            vec![Downsample {
                conv: Conv2d::new(
                    dev,
                    cin,
                    cout,
                    1,
                    Conv2dOptions::new().stride(2),
                    false,
                    seed + 2,
                )?,
                norm: Norm::new(dev, group, cout)?,
            }]
        };
        Ok(ResBlock {
            conv1: Conv2d::new(dev, cin, cout, 3, c3.stride(stride), false, seed)?,
            norm1: Norm::new(dev, group, cout)?,
            conv2: Conv2d::new(dev, cout, cout, 3, c3, false, seed + 1)?,
            norm2: Norm::new(dev, group, cout)?,
            down,
        })
    }

    fn block(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.norm1.forward(&self.conv1.forward(x)?)?.relu()?;
        let h = self.norm2.forward(&self.conv2.forward(&h)?)?;
        let skip = match self.down.first() {
            Some(d) => d.forward(x)?,
            None => x.clone(),
        };
        h.add(&skip)?.relu()
    }
}

fitgrad::module! {
    impl Module for ResBlock {
        params { conv1, norm1, conv2, norm2, down }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.block(x)
        }
    }
}

/// stem -> stages -> global average pool -> head: (B, 1, S, S) -> logits (B, CLASSES).
pub struct ResNet {
    stem: Conv2d,
    stem_norm: Norm,
    pub blocks: Vec<ResBlock>,
    pool: AvgPool2d,
    pub head: Linear,
    side: usize,
    stem_stride: usize,
    pub checkpoint: AtomicBool,
}

impl ResNet {
    pub fn new(dev: &Device, side: usize, classes: usize, shape: Shape) -> Result<ResNet> {
        let (w, group) = (shape.width, shape.group_norm);
        let s = |k: u64| shape.seed.wrapping_mul(0x100_0000_01b3).wrapping_add(k);
        let mut blocks = Vec::new();
        let mut cin = w;
        for (stage, cout) in [w, 2 * w, 4 * w].into_iter().enumerate() {
            let first = stage > 0;
            let count = shape.blocks + usize::from(first);
            for b in 0..count {
                let c_in = if b == 0 { cin } else { cout };
                blocks.push(ResBlock::new(
                    dev,
                    group,
                    c_in,
                    cout,
                    s(100 * stage as u64 + 10 * b as u64),
                )?);
            }
            cin = cout;
        }
        Ok(ResNet {
            stem: Conv2d::new(
                dev,
                1,
                w,
                3,
                Conv2dOptions::new().padding(1).stride(shape.stem_stride),
                false,
                s(1),
            )?,
            stem_norm: Norm::new(dev, group, w)?,
            blocks,
            pool: AvgPool2d::global(),
            head: Linear::new(dev, 4 * w, classes, s(2))?,
            side,
            stem_stride: shape.stem_stride,
            checkpoint: AtomicBool::new(false),
        })
    }

    /// Logits (B, CLASSES), f32, from rows of pixels x (B, S S), computed in `dtype`.
    fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let b = x.dims()[0];
        let x = x.reshape(&[b, 1, self.side, self.side])?;
        let x = if x.dtype() == dtype {
            x
        } else {
            x.to_dtype(dtype)?
        };
        let mut h = self.stem_norm.forward(&self.stem.forward(&x)?)?.relu()?;
        let ckpt = self.checkpoint.load(Ordering::Relaxed) && autograd::is_grad_enabled();
        for block in &self.blocks {
            h = if ckpt {
                let params = block.parameters();
                let refs: Vec<&Tensor> = params.iter().collect();
                let blk = Arc::new(block.clone());
                autograd::checkpoint(&[&h], &refs, move |xs| blk.block(&xs[0]))?
            } else {
                block.block(&h)?
            };
        }
        let pooled = self.pool.forward(&h)?.flatten(1)?; // (B, 4W)
        let logits = self.head.forward_in(&pooled, Activation::None, dtype)?;
        if logits.dtype() == DType::F32 {
            Ok(logits)
        } else {
            logits.to_dtype(DType::F32)
        }
    }
}

fitgrad::module! {
    impl Module for ResNet {
        params { stem, stem_norm, blocks, head }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.forward_in(x, DType::F32)
        }
        fn config(&self) -> Vec<(String, String)> {
            vec![
                ("kind".into(), "resnet".into()),
                ("width".into(), self.stem.weight.dims()[0].to_string()),
                ("stem_stride".into(), self.stem_stride.to_string()),
                ("blocks".into(), self.blocks.len().to_string()),
                ("classes".into(), self.head.out_features.to_string()),
            ]
        }
    }
}

impl TrainModel<ClassBatch> for ResNet {
    fn forward_loss(&self, b: &ClassBatch, ctx: &StepContext) -> Result<Tensor> {
        b.loss(ctx, |x| self.forward_in(x, ctx.dtype))
    }

    fn evaluate_batch(&self, b: &ClassBatch, ctx: &StepContext) -> Result<EvalBatch> {
        b.evaluate(ctx, |x| self.forward_in(x, ctx.dtype))
    }

    fn set_checkpointing(&mut self, on: bool) -> bool {
        self.checkpoint.store(on, Ordering::Relaxed);
        true
    }
}
