//! A residual MLP with LayerNorm and dropout, defined here (a small copy of
//! examples/custom_model/model.rs's model), trained on a `Dataset` through `Trainer`:
//! a budget of half the unbudgeted peak gives the same weights and is never passed; the
//! planned peak equals the measured peak of a steady-state step (f32 and mixed precision,
//! dropout on); planning leaves the dropout masks alone.
//!
//! Dropout and micro-batches: a mask is hashed from (call seed, element index) and each
//! micro-batch's forward is a call of its own, so splitting a batch changes the masks (rows of
//! the second micro-batch get the second call's seed and restart the element index). A budgeted
//! run therefore reaches the unbudgeted weights only with dropout 0; with dropout on, the test
//! checks that it still fits its budget and that the weights do differ (so the p = 0
//! comparison is the one that tests the split).

use crate::common;

use common::*;
use fitgrad::nn::{self, Dropout, LayerNorm, Linear, Module};
use fitgrad::optim::AdamW;
use fitgrad::train::data::Dataset;
use fitgrad::train::{
    ClassBatch, EvalBatch, Precision, StepContext, TrainModel, Trainer, TrainerConfig,
};
use fitgrad::{Activation, Bytes, DType, Device, Result, Tensor};
use std::io::Write;

fn note(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// x + fc2(dropout(gelu(fc1(layer_norm(x))))): (B, W) -> (B, W).
struct Block {
    norm: LayerNorm,
    fc1: Linear,
    drop: Dropout,
    fc2: Linear,
}

impl Block {
    fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let h = self.norm.forward(x)?;
        let h = self.fc1.forward_in(&h, Activation::Gelu, dtype)?;
        let h = self.drop.forward(&h)?;
        x.add(&self.fc2.forward_in(&h, Activation::None, dtype)?)
    }
}

fitgrad::module! {
    impl Module for Block {
        params { norm, fc1, drop, fc2 }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.forward_in(x, x.dtype())
        }
    }
}

/// stem -> blocks -> layer norm -> head: (B, IN) -> (B, CLASSES).
struct ResMlp {
    stem: Linear,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Linear,
}

/// `t` in `dtype` (a recorded cast, or `t` itself).
fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t.clone())
    } else {
        t.to_dtype(dtype)
    }
}

impl ResMlp {
    /// Logits in f32, every matmul in `dtype`.
    fn forward_in(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let x = cast(x, dtype)?;
        let mut h = self.stem.forward_in(&x, Activation::None, dtype)?;
        for b in &self.blocks {
            h = b.forward_in(&h, dtype)?;
        }
        let logits = self
            .head
            .forward_in(&self.norm.forward(&h)?, Activation::None, dtype)?;
        cast(&logits, DType::F32)
    }

    fn dropout_calls(&self) -> Vec<u64> {
        self.blocks.iter().map(|b| b.drop.calls()).collect()
    }
}

fitgrad::module! {
    impl Module for ResMlp {
        params { stem, blocks, norm, head }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.forward_in(x, DType::F32)
        }
    }
}

impl TrainModel<ClassBatch> for ResMlp {
    fn forward_loss(&self, b: &ClassBatch, ctx: &StepContext) -> Result<Tensor> {
        let logits = self.forward_in(&b.x.to_device(&ctx.device)?, ctx.dtype)?;
        nn::cross_entropy(&logits, &b.y)
    }

    fn evaluate_batch(&self, b: &ClassBatch, ctx: &StepContext) -> Result<EvalBatch> {
        let logits = self.forward_in(&b.x.to_device(&ctx.device)?, ctx.dtype)?;
        Ok(EvalBatch {
            loss: nn::cross_entropy(&logits, &b.y)?.item()?,
            correct: Some(nn::correct(&logits, &b.y)?),
        })
    }
}

const IN: usize = 12;
const WIDTH: usize = 24;
const CLASSES: usize = 4;
/// Big enough that activations, not the parameters and their AdamW state, are most of a
/// step's peak, so half the peak leaves room for a micro-batch.
const BATCH: usize = 256;

fn model(dev: &Device, dropout: f32) -> ResMlp {
    let lin = |i, o, s| Linear::new(dev, i, o, s).unwrap();
    ResMlp {
        stem: lin(IN, WIDTH, 1),
        blocks: (0..2)
            .map(|k| Block {
                norm: LayerNorm::new(dev, WIDTH).unwrap(),
                fc1: lin(WIDTH, WIDTH, 10 + k),
                drop: Dropout::new(dropout, 100 + k).unwrap(),
                fc2: lin(WIDTH, WIDTH, 20 + k),
            })
            .collect(),
        norm: LayerNorm::new(dev, WIDTH).unwrap(),
        head: lin(WIDTH, CLASSES, 2),
    }
}

/// `n` samples whose class is the sign pattern of two features, so the loss can fall.
fn dataset(n: usize, seed: u64) -> Dataset {
    let features = host_data(seed, n * IN, -1.0, 1.0);
    let labels = (0..n)
        .map(|i| {
            let r = &features[i * IN..(i + 1) * IN];
            u32::from(r[0] > 0.0) + 2 * u32::from(r[1] > r[2])
        })
        .collect();
    Dataset {
        name: "signs".into(),
        features,
        labels,
        dim: IN,
        classes: CLASSES,
    }
}

fn trainer(dev: &Device, dropout: f32, precision: Precision) -> Trainer<ResMlp> {
    let m = model(dev, dropout);
    let opt = Box::new(AdamW::new(m.parameters(), 3e-3).unwrap());
    let config = TrainerConfig::new(BATCH, 1, 3e-3).precision(precision);
    Trainer::new(m, opt, config).unwrap()
}

/// What one training run left behind.
struct Run {
    weights: Vec<Vec<f32>>,
    peak_in_use: u64,
    peak_reserved: u64,
    micro: usize,
}

/// Two epochs of 512 samples (4 steps of 256) on a fresh device, fitted to `budget` first.
fn run(budget: Option<u64>, dropout: f32) -> Option<Run> {
    let dev = fresh_with_budget(budget)?;
    let data = dataset(2 * BATCH, 8);
    let mut t = trainer(&dev, dropout, Precision::F32);
    let micro = match budget {
        Some(b) => t.fit_to_budget(&data, b).unwrap(),
        None => BATCH,
    };
    for epoch in 0..2 {
        t.train_epoch(&data, 1, epoch, |_, _, _| Ok(())).unwrap();
    }
    dev.sync().unwrap();
    assert!(
        t.take_events().is_empty(),
        "the trainer had to change something on its own"
    );
    let s = dev.memory_stats();
    Some(Run {
        weights: param_values(&t.model),
        peak_in_use: s.peak_bytes_in_use,
        peak_reserved: s.peak_bytes_reserved,
        micro,
    })
}

/// (a) Half the unbudgeted peak in use: smaller micro-batches, the budget never passed, the
/// same weights with dropout 0; with dropout on, still within its budget (the masks differ).
#[test]
fn half_peak_budget_same_weights() {
    let Some(free) = run(None, 0.0) else { return };
    let budget = free.peak_in_use / 2;
    let held = run(Some(budget), 0.0).unwrap();
    let diff = worst_rel_diff(&held.weights, &free.weights);
    note(&format!(
        "dropout 0: unbudgeted peak in use {}, budget {}, micro-batch {} of {BATCH}, peak reserved {} in use {}, weights within {diff:.2e}",
        Bytes(free.peak_in_use),
        Bytes(budget),
        held.micro,
        Bytes(held.peak_reserved),
        Bytes(held.peak_in_use)
    ));
    assert!(held.micro < BATCH, "half the peak must split the batch");
    assert!(held.peak_reserved <= budget, "over the budget");
    assert!(diff <= 1e-5, "weights differ by {diff:.2e}");

    let free = run(None, 0.25).unwrap();
    let budget = free.peak_in_use / 2;
    let held = run(Some(budget), 0.25).unwrap();
    let diff = worst_rel_diff(&held.weights, &free.weights);
    note(&format!(
        "dropout 0.25: unbudgeted peak in use {}, budget {}, micro-batch {} of {BATCH}, peak reserved {} in use {}, weights differ by {diff:.2e} (other masks)",
        Bytes(free.peak_in_use),
        Bytes(budget),
        held.micro,
        Bytes(held.peak_reserved),
        Bytes(held.peak_in_use)
    ));
    assert!(held.micro < BATCH, "half the peak must split the batch");
    assert!(held.peak_reserved <= budget, "over the budget");
    assert!(
        diff > 1e-5,
        "micro-batches drew the same dropout masks as whole batches: compare the weights with dropout on too"
    );
}

/// (b) The planned peak in use of the next step equals that step's measured peak within 2%
/// (the first step, which creates the optimizer state, peaks at most as high), f32 and mixed
/// precision, dropout on, whole and split batches.
#[test]
fn planned_peak_is_measured_peak() {
    let mut lines = Vec::new();
    for (precision, micro) in [
        (Precision::F32, None),
        (Precision::F32, Some(100)),
        (Precision::Mixed, None),
        (Precision::Mixed, Some(100)),
    ] {
        let Some(dev) = fresh_with_budget(None) else {
            return;
        };
        let data = dataset(4 * BATCH, 3);
        let mut t = trainer(&dev, 0.25, precision);
        if let Some(m) = micro {
            t.set_micro_batch(m).unwrap();
        }
        let idx: Vec<usize> = (0..data.len()).collect();
        for (i, step) in idx.chunks(BATCH).enumerate() {
            let planned = t.plan(&data).unwrap();
            dev.sync().unwrap();
            dev.reset_peak();
            t.step(&data, step).unwrap();
            dev.sync().unwrap();
            let measured = dev.memory_stats().peak_bytes_in_use;
            let ratio = planned.peak as f64 / measured as f64;
            lines.push(format!(
                "{precision:?} micro {micro:?} step {i}: planned {} measured {} ({ratio:.4}), peak at {:?}",
                Bytes(planned.peak),
                Bytes(measured),
                planned.peak_op
            ));
            let line = lines.last().unwrap();
            if i == 0 {
                assert!(ratio >= 1.0, "{line}");
            } else {
                assert!((ratio - 1.0).abs() <= 0.02, "{line}");
            }
        }
        let events = t.take_events();
        assert!(events.is_empty(), "{precision:?}: {events:?}");
    }
    note(&lines.join("\n"));
}

/// (c) Planning leaves dropout's call counter where it was: a plan between two steps gives
/// bitwise the weights of two steps without it.
#[test]
fn planning_leaves_dropout_masks_alone() {
    let data = dataset(2 * BATCH, 5);
    let two_steps = |plan_between: bool| -> Option<(Vec<Vec<f32>>, Vec<u64>)> {
        let dev = fresh_with_budget(None)?;
        let mut t = trainer(&dev, 0.25, Precision::F32);
        t.set_micro_batch(BATCH / 2).unwrap();
        let idx: Vec<usize> = (0..data.len()).collect();
        t.step(&data, &idx[..BATCH]).unwrap();
        if plan_between {
            let calls = t.model.dropout_calls();
            let plan = t.plan(&data).unwrap();
            assert!(plan.peak > 0);
            assert_eq!(t.model.dropout_calls(), calls, "planning moved the counter");
        }
        t.step(&data, &idx[BATCH..]).unwrap();
        Some((param_values(&t.model), t.model.dropout_calls()))
    };
    let Some((plain, calls)) = two_steps(false) else {
        return;
    };
    let (planned, calls_planned) = two_steps(true).unwrap();
    // Two steps of two micro-batches: four training calls per layer.
    assert_eq!(calls, vec![4, 4]);
    assert_eq!(calls_planned, calls);
    assert_eq!(
        planned, plain,
        "a plan between the steps changed the weights"
    );
}
