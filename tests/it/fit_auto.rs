//! `Trainer::fit_auto`: a budget picks the strategy. On a model whose samples are big (rows of
//! a gelu MLP per sample, so activations dominate even at one sample per micro-batch) budgets
//! taken from the planner's own figures walk the order: a generous one keeps the whole batch,
//! tighter ones choose accumulation, then activation checkpointing, then mixed precision, and
//! one below everything is `Error::BudgetTooSmall` leaving the trainer as configured. The
//! minimum that error names is exact: `fit_auto` succeeds with it and real steps run under it
//! (a small model, so the steps are quick). The same budgets give the same choice, candidate
//! by candidate, on every adapter.
//!
//! The big model is only planned (the planner compiles and runs nothing); each trainer gets a
//! device of its own, since plans start from the arena as it is.

use crate::common;

use common::*;
use fitgrad::nn::{Mlp, Module};
use fitgrad::optim::Sgd;
use fitgrad::train::{
    BatchSource, FitChoice, Precision, StepContext, TensorBatch, TensorDataset, TrainModel,
    Trainer, TrainerConfig,
};
use fitgrad::{Activation, Bytes, Device, DeviceOptions, Error, Result, Tensor};
use std::io::Write;

fn note(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// An MLP applied to each of a sample's rows: samples are (rows, in), targets (rows, out).
struct RowMlp {
    mlp: Mlp,
}

fitgrad::module! {
    impl Module for RowMlp {
        params { mlp }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.mlp.forward(x)
        }
    }
}

impl TrainModel<TensorBatch> for RowMlp {
    fn forward_loss(&self, b: &TensorBatch, ctx: &StepContext) -> Result<Tensor> {
        let (x, y) = b.to_device(&ctx.device)?;
        // x is (n, rows, in): every row through the MLP at once, (n * rows, in).
        let (n, rows, width) = (b.x_dims[0], b.x_dims[1], b.x_dims[2]);
        let out = self
            .mlp
            .forward_in(&x.reshape(&[n * rows, width])?, ctx.dtype)?;
        fitgrad::nn::mse_loss(&out, &y.reshape(&[n * rows, b.y_dims[2]])?)
    }

    fn set_checkpointing(&mut self, on: bool) -> bool {
        self.mlp.set_checkpointing(on)
    }
}

/// A model and its data: `batch` samples of `rows` rows through gelu layers `widths`.
struct Case {
    widths: Vec<usize>,
    rows: usize,
    batch: usize,
}

impl Case {
    fn data(&self) -> TensorDataset {
        let (i, o) = (self.widths[0], *self.widths.last().unwrap());
        let n = self.batch;
        TensorDataset::new(
            host_data(3, n * self.rows * i, -1.0, 1.0),
            &[self.rows, i],
            host_data(4, n * self.rows * o, -1.0, 1.0),
            &[self.rows, o],
        )
        .unwrap()
    }

    /// A trainer on a device of its own, like `dev` (same backend and f16 storage).
    fn trainer(&self, dev: &Device, precision: Precision) -> Trainer<RowMlp> {
        let own = device_like(dev);
        let mlp = Mlp::new(&own, &self.widths, Activation::Gelu, 7).unwrap();
        let opt = Sgd::new(mlp.parameters(), 0.01).unwrap();
        let mut config = TrainerConfig::new(self.batch, 1, 0.01);
        config.precision = precision;
        Trainer::new(RowMlp { mlp }, Box::new(opt), config).unwrap()
    }
}

/// A fresh device of `dev`'s backend, f16 stored as `dev` stores it.
fn device_like(dev: &Device) -> Device {
    let info = dev.info();
    let mut o = DeviceOptions::default();
    o.backend = Some(info.adapter.backend.clone());
    o.force_packed_f16 = !info.f16_native
        && dev
            .wgpu_device()
            .features()
            .contains(wgpu::Features::SHADER_F16);
    Device::with_options(o).expect("a second device on this adapter")
}

/// Four samples of 1,024 rows through 256-wide gelu layers: each activation of a sample is
/// 1 MiB, so every strategy moves the peak by whole segments.
fn big() -> Case {
    Case {
        widths: vec![64, 256, 256, 256, 256, 64],
        rows: 1024,
        batch: 4,
    }
}

/// Peak reserved of a step at `micro` with checkpointing `ckpt`, planned without a budget.
fn reserved(t: &mut Trainer<RowMlp>, data: &TensorDataset, ckpt: bool, micro: usize) -> u64 {
    t.model.mlp.checkpoint_activations = ckpt;
    let all: Vec<usize> = (0..data.len()).collect();
    let p = t.plan_at(data, &all, micro, None, 0).unwrap();
    t.model.mlp.checkpoint_activations = false;
    p.peak_reserved
}

/// `fit_auto` with `budget` on a fresh f32 trainer of `case`.
fn fit(dev: &Device, case: &Case, budget: u64) -> (Trainer<RowMlp>, Result<FitChoice>) {
    let mut t = case.trainer(dev, Precision::F32);
    let choice = t.fit_auto(&case.data(), budget);
    (t, choice)
}

/// (micro-batch, checkpointing, precision) of a choice that must exist.
fn chosen(c: &Result<FitChoice>) -> (usize, bool, Precision) {
    let c = c.as_ref().expect("a choice");
    note(&c.to_string());
    (c.micro_batch, c.checkpointing, c.precision)
}

/// The order: whole batch, accumulation, checkpointing, mixed precision, then the error.
fn budget_walks_the_strategies(dev: &Device) {
    let case = big();
    let data = case.data();
    let b = case.batch;
    let mut f32_ref = case.trainer(dev, Precision::F32);
    let mut mixed_ref = case.trainer(dev, Precision::Mixed);
    let plain = reserved(&mut f32_ref, &data, false, b);
    let half = reserved(&mut f32_ref, &data, false, b / 2);
    let one = reserved(&mut f32_ref, &data, false, 1);
    let ckpt_one = reserved(&mut f32_ref, &data, true, 1);
    let mixed_ckpt_one = reserved(&mut mixed_ref, &data, true, 1);
    note(&format!(
        "{}: whole batch {}, half {}, one {}, one checkpointed {}, one mixed checkpointed {}",
        label(dev),
        Bytes(plain),
        Bytes(half),
        Bytes(one),
        Bytes(ckpt_one),
        Bytes(mixed_ckpt_one)
    ));
    assert!(
        plain > half && half > one && one > ckpt_one && ckpt_one > mixed_ckpt_one,
        "each strategy must save memory on this model"
    );

    let (t, c) = fit(dev, &case, plain);
    assert_eq!(chosen(&c), (b, false, Precision::F32), "a generous budget");
    let c = c.unwrap();
    assert_eq!(c.candidates.len(), 1);
    assert!(c.candidates[0].fits && c.candidates[0].planned_reserved <= plain);
    assert_eq!(t.micro_batch(), b);

    let (t, c) = fit(dev, &case, half);
    let (micro, ckpt, precision) = chosen(&c);
    assert!((b / 2..b).contains(&micro) && !ckpt && precision == Precision::F32);
    assert_eq!(t.micro_batch(), micro);
    let c = c.unwrap();
    assert_eq!(
        c.candidates.iter().map(|c| c.fits).collect::<Vec<_>>(),
        [false, true],
        "the whole batch, then the largest micro-batch that fits"
    );
    assert!(c.candidates[0].planned_reserved > half);
    let shown = c.to_string();
    assert!(
        shown.contains(&c.candidates[1].description)
            && shown.contains("does not fit")
            && shown.contains(&Bytes(c.candidates[0].planned_reserved).to_string()),
        "the report names each candidate, its planned figure and whether it fits: {shown}"
    );

    let (t, c) = fit(dev, &case, ckpt_one);
    let (_, ckpt, precision) = chosen(&c);
    assert!(ckpt && precision == Precision::F32, "checkpointing");
    assert!(t.model.mlp.checkpoint_activations);
    assert_eq!(c.unwrap().candidates.len(), 4);

    let (t, c) = fit(dev, &case, mixed_ckpt_one);
    let (_, _, precision) = chosen(&c);
    assert_eq!(precision, Precision::Mixed, "mixed precision last");
    assert_eq!(t.config().precision, Precision::Mixed);
    assert!(t.scaler().is_some(), "mixed precision scales the loss");

    let tight = mixed_ckpt_one / 2;
    let (t, c) = fit(dev, &case, tight);
    let err = c.expect_err("half the most frugal plan");
    let msg = err.to_string();
    let Error::BudgetTooSmall {
        budget, minimum, ..
    } = err
    else {
        panic!("expected BudgetTooSmall, got {err:?}");
    };
    assert_eq!(budget, tight);
    assert!(
        tight < minimum && minimum <= mixed_ckpt_one,
        "minimum {minimum}"
    );
    assert!(msg.contains(&Bytes(minimum).to_string()), "{msg}");
    assert_eq!(t.micro_batch(), b, "a failed fit leaves the micro-batch");
    assert_eq!(t.config().precision, Precision::F32, "and the precision");
    assert!(!t.model.mlp.checkpoint_activations, "and checkpointing off");
}

/// The minimum of the error is exact: it fits, one block less does not, and real steps run
/// under it without an out-of-memory. Long narrow samples (6,144 rows of 16): each activation
/// of a sample is 384 KiB, a block of its own, while every matmul stays too small to be
/// autotuned, so the steps are quick.
fn budget_error_minimum_runs(dev: &Device) {
    let case = Case {
        widths: vec![16, 16, 16, 16, 16],
        rows: 6144,
        batch: 3,
    };
    let data = case.data();
    let (_, c) = fit(dev, &case, 1024);
    let Err(Error::BudgetTooSmall { minimum, .. }) = c else {
        panic!("1 KiB is too small: {c:?}");
    };
    let (_, c) = fit(dev, &case, minimum - 256);
    assert!(
        matches!(c, Err(Error::BudgetTooSmall { .. })),
        "a block below the minimum: {c:?}"
    );
    let (mut t, c) = fit(dev, &case, minimum);
    let (_, ckpt, precision) = chosen(&c);
    assert!(
        ckpt || precision == Precision::Mixed,
        "one sample per micro-batch alone needs more on this model"
    );
    let all: Vec<usize> = (0..data.len()).collect();
    t.device().set_memory_budget(Some(minimum)).unwrap();
    for i in 0..2 {
        t.step(&data, &all)
            .unwrap_or_else(|e| panic!("step {i} under the minimum {minimum}: {e}"));
    }
    t.device().sync().unwrap();
    let stats = t.device().memory_stats();
    assert!(stats.peak_bytes_reserved <= minimum);
    assert!(t.take_events().is_empty(), "{:?}", t.take_events());
    assert!(t.take_loss().unwrap().is_finite());
}

device_tests!(budget_walks_the_strategies, budget_error_minimum_runs);

/// One choice for every adapter: the same budgets on the big model give equal choices and
/// equal candidates (descriptions, planned figures, fits) on each device. This compares
/// devices with each other, so it runs once over all of them rather than per backend.
#[test]
fn same_choice_on_every_adapter() {
    let devs = devices();
    if devs.is_empty() {
        return; // reported by devices()
    }
    let case = big();
    let data = case.data();
    let mut f32_ref = case.trainer(&devs[0], Precision::F32);
    let budgets = [
        reserved(&mut f32_ref, &data, false, case.batch),
        reserved(&mut f32_ref, &data, false, 2),
        reserved(&mut f32_ref, &data, true, 1),
        reserved(&mut f32_ref, &data, true, 1) - (2 << 20),
    ];
    let choices = |d: &Device| -> Vec<String> {
        budgets
            .iter()
            .map(|&b| match fit(d, &case, b).1 {
                Ok(c) => format!("{c:?}"),
                Err(e) => e.to_string(),
            })
            .collect()
    };
    let first = choices(&devs[0]);
    for d in &devs[1..] {
        assert_eq!(
            choices(d),
            first,
            "{} chose differently from {}",
            label(d),
            label(&devs[0])
        );
    }
}
