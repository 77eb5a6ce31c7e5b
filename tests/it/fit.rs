//! Fitting training into memory: the planner predicts the measured peak of a step within 2%
//! (f32 and mixed precision, activation checkpointing on and off, SGD and AdamW, accumulated
//! micro-batches), checkpointing lowers the peak without changing the gradients, mixed precision
//! trains as well as f32 in less memory on every device, the loss scaler skips overflowing steps
//! and grows again, a budget of half the f32 peak is met by smaller micro-batches with the same
//! weights, an out-of-memory in the middle of a step halves the micro-batch and redoes the step,
//! a budget too small for one sample is a typed error before any step, and a reservation made
//! from the plan covers every later step without a new buffer.
//!
//! Memory is measured on devices of their own (`fresh_device`): the arena's statistics are per
//! device, and the tests of this binary run in parallel.
//!
//! Every matmul here stays below the autotuner's threshold (M * N * K < 2^21), and the widths are
//! multiples of 4 but for the 10 classes, so the file compiles only the default kernels the other
//! training tests use too: on lavapipe with a cold Mesa shader cache one f32 32 x 16 register
//! block takes about two minutes to compile, and timing the candidates of a shape class more.
//! Where activations must dominate, that means narrow layers and large batches.

use crate::common;

use common::*;
use fitgrad::nn::{self, Activation, Mlp, Module};
use fitgrad::optim::GradScaler;
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::{HostRows, Precision, Trainer, TrainerConfig};
use fitgrad::{Bytes, DType, Device, Error, Tensor};
use std::io::Write;
use std::sync::OnceLock;
use std::time::Instant;

device_tests!(mixed_precision_lowers_the_loss);

/// Seed of the digits split and of the models.
const SEED: u64 = 11;

/// Writes to stderr directly so the measured numbers reach the log (the harness captures
/// `eprintln!` of passing tests).
fn note(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

fn digits() -> &'static (Dataset, Dataset) {
    static DIGITS: OnceLock<(Dataset, Dataset)> = OnceLock::new();
    DIGITS.get_or_init(|| data::load("digits", 0).expect("the embedded digits load"))
}

/// What a test trainer is made of.
#[derive(Clone, Debug)]
struct Setup {
    widths: Vec<usize>,
    act: Activation,
    checkpoint: bool,
    precision: Precision,
    opt: Opt,
    batch: usize,
    micro: Option<usize>,
    seed: u64,
}

impl Setup {
    fn new(widths: &[usize], batch: usize) -> Setup {
        Setup {
            widths: widths.to_vec(),
            act: Activation::Relu,
            checkpoint: false,
            precision: Precision::F32,
            opt: Opt::Sgd {
                lr: 0.05,
                momentum: 0.0,
            },
            batch,
            micro: None,
            seed: SEED,
        }
    }

    fn act(mut self, act: Activation) -> Setup {
        self.act = act;
        self
    }

    fn checkpoint(mut self, on: bool) -> Setup {
        self.checkpoint = on;
        self
    }

    fn precision(mut self, p: Precision) -> Setup {
        self.precision = p;
        self
    }

    fn opt(mut self, opt: Opt) -> Setup {
        self.opt = opt;
        self
    }

    fn micro(mut self, micro: usize) -> Setup {
        self.micro = Some(micro);
        self
    }

    fn build(&self, dev: &Device) -> Trainer<Mlp> {
        let mut model = Mlp::with_dtype(
            dev,
            &self.widths,
            self.act,
            self.precision.param_dtype(),
            self.seed,
        )
        .expect("model");
        model.checkpoint_activations = self.checkpoint;
        let opt = self.opt.build(model.parameters());
        let mut config = TrainerConfig::new(self.batch, 1, self.opt.lr()).precision(self.precision);
        config.micro_batch = self.micro;
        Trainer::new(model, opt, config).expect("valid trainer")
    }

    fn label(&self) -> String {
        format!(
            "{:?} {:?}{} {:?} {:?} batch {}{}",
            self.widths,
            self.act,
            if self.checkpoint { " ckpt" } else { "" },
            self.precision,
            self.opt,
            self.batch,
            self.micro
                .map(|m| format!(" micro {m}"))
                .unwrap_or_default()
        )
    }
}

/// `count` fixed batches of `n` random rows of `dim` features (uniform in [-1, 1)) with labels
/// below `classes`.
fn host_batches(seed: u64, count: usize, n: usize, dim: usize, classes: usize) -> Batches {
    let mut r = HostRng::new(seed ^ 0xba7c);
    Batches(
        (0..count)
            .map(|i| {
                let x = host_data(seed.wrapping_add(i as u64 * 7919), n * dim, -1.0, 1.0);
                let y = (0..n)
                    .map(|_| (r.next_u64() % classes as u64) as u32)
                    .collect();
                (x, y)
            })
            .collect(),
    )
}

struct Batches(Vec<(Vec<f32>, Vec<u32>)>);

impl Batches {
    fn get(&self, i: usize) -> (&[f32], &[u32]) {
        let (x, y) = &self.0[i % self.0.len()];
        (x, y)
    }
}

/// The trainer's parameters, read back.
fn weights(t: &Trainer<Mlp>) -> Vec<(String, Vec<f32>)> {
    t.model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.to_vec_f32().expect("readback")))
        .collect()
}

/// max |a - b| / max |b| (0 when both are zero).
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
    let diff = a
        .iter()
        .zip(b)
        .fold(0.0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
    if diff == 0.0 {
        0.0
    } else if !diff.is_finite() {
        f64::INFINITY
    } else {
        diff / scale.max(1e-30)
    }
}

/// The largest relative difference over all parameters; panics past `rel`.
fn assert_weights_close(
    what: &str,
    a: &[(String, Vec<f32>)],
    b: &[(String, Vec<f32>)],
    rel: f64,
) -> f64 {
    let mut worst = 0.0f64;
    for ((name, wa), (_, wb)) in a.iter().zip(b) {
        let d = rel_diff(wa, wb);
        assert!(
            d <= rel,
            "{what}: {name} differs by {d:.3e} relative (max {rel:.0e})"
        );
        worst = worst.max(d);
    }
    worst
}

/// Steps `t` over `steps` batches, panicking with the step on error.
fn run(t: &mut Trainer<Mlp>, b: &Batches, steps: usize, what: &str) {
    for i in 0..steps {
        let (x, y) = b.get(i);
        t.step_rows(x, y)
            .unwrap_or_else(|e| panic!("{what}: step {i} failed: {e}"));
    }
}

/// Planned peak and measured peak bytes in use of one step, after `warm` steps.
fn planned_and_measured(dev: &Device, s: &Setup, warm: usize) -> (u64, u64) {
    let dim = s.widths[0];
    let classes = *s.widths.last().unwrap();
    let b = host_batches(s.seed, warm + 1, s.batch, dim, classes);
    let mut t = s.build(dev);
    run(&mut t, &b, warm, &s.label());
    dev.sync().unwrap();
    dev.reset_peak();
    let (x, y) = b.get(warm);
    let planned = t.plan(&HostRows::new(x, y).unwrap()).unwrap().peak;
    dev.reset_peak();
    t.step_rows(x, y).unwrap();
    dev.sync().unwrap();
    let measured = dev.memory_stats().peak_bytes_in_use;
    assert!(
        t.take_events().is_empty(),
        "{}: the trainer changed something on its own",
        s.label()
    );
    (planned, measured)
}

// ---------------------------------------------------------------------------------------------
// 1. The planner
// ---------------------------------------------------------------------------------------------

/// Planned vs measured peak bytes in use of a warm step, within 2%, on configurations that
/// cover f32 / f16 / mixed, checkpointing off / on (gelu, where it changes something; tanh, where it
/// does not), relu / gelu / tanh, SGD without and with momentum / AdamW, one and several
/// micro-batches.
/// Then checkpointing a gelu model whose activations dominate lowers both peaks, and leaves the
/// gradients as they were.
#[test]
fn planner_within_2_percent() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let started = Instant::now();
    let mom = Opt::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    let adamw = Opt::AdamW { lr: 1e-3 };
    let small = [64, 96, 80, 10];
    // Batches of at most 20 rows here: 20 x 784 x 128 is just under the autotuner's threshold.
    let wide = [784, 128, 64, 10];
    let configs = [
        Setup::new(&small, 96).micro(32).opt(mom),
        Setup::new(&small, 64).act(Activation::Gelu).opt(adamw),
        Setup::new(&small, 96)
            .act(Activation::Gelu)
            .checkpoint(true)
            .micro(32)
            .opt(mom),
        Setup::new(&small, 48)
            .act(Activation::Gelu)
            .checkpoint(true)
            .precision(Precision::Mixed)
            .opt(adamw),
        Setup::new(&small, 96)
            .act(Activation::Gelu)
            .precision(Precision::Mixed)
            .micro(32)
            .opt(mom),
        Setup::new(&wide, 20).act(Activation::Tanh).opt(adamw),
        Setup::new(&wide, 40)
            .precision(Precision::Mixed)
            .micro(20)
            .opt(mom),
        Setup::new(&wide, 20)
            .act(Activation::Tanh)
            .checkpoint(true)
            .precision(Precision::Mixed)
            .opt(mom),
        Setup::new(&wide, 20)
            .act(Activation::Gelu)
            .checkpoint(true)
            .opt(adamw),
        Setup::new(&small, 96)
            .precision(Precision::F16)
            .micro(32)
            .opt(mom),
        Setup::new(&small, 64)
            .act(Activation::Gelu)
            .precision(Precision::F16)
            .opt(adamw),
        Setup::new(&small, 64).opt(Opt::Sgd {
            lr: 0.05,
            momentum: 0.0,
        }),
    ];
    let mut failures = Vec::new();
    for s in &configs {
        let (planned, measured) = planned_and_measured(&dev, s, 2);
        let ratio = planned as f64 / measured as f64;
        note(&format!(
            "planner: {:<70} planned {:>10} measured {:>10} ratio {ratio:.3}",
            s.label(),
            planned,
            measured
        ));
        if (ratio - 1.0).abs() > 0.02 {
            failures.push(format!(
                "{}: planned {} vs measured {} (ratio {ratio:.3})",
                s.label(),
                Bytes(planned),
                Bytes(measured)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "planner off by more than 2%:\n{}",
        failures.join("\n")
    );

    // Checkpointing where activations dominate: gelu keeps its pre-activation per layer. (In
    // [64, 512, 512, 512, 10] at batch 256 the peak is in the backward, where the 512 x 512
    // weight gradients outweigh the activations, and checkpointing does not move it.)
    let base = Setup::new(&[32, 64, 64, 64, 64, 64, 10], 480).act(Activation::Gelu);
    let (plan_off, meas_off) = planned_and_measured(&dev, &base, 1);
    let (plan_on, meas_on) = planned_and_measured(&dev, &base.clone().checkpoint(true), 1);
    note(&format!(
        "checkpointing {:?} gelu batch 480: planned {} -> {}, measured {} -> {} ({:.2}x)",
        base.widths,
        Bytes(plan_off),
        Bytes(plan_on),
        Bytes(meas_off),
        Bytes(meas_on),
        meas_on as f64 / meas_off as f64
    ));
    assert!(
        plan_on < plan_off,
        "checkpointing did not lower the planned peak"
    );
    assert!(
        meas_on < meas_off,
        "checkpointing did not lower the measured peak: {meas_on} vs {meas_off}"
    );
    for (p, m) in [(plan_off, meas_off), (plan_on, meas_on)] {
        let ratio = p as f64 / m as f64;
        assert!(
            (ratio - 1.0).abs() <= 0.10,
            "planner off on the checkpointing model: ratio {ratio:.3}"
        );
    }

    // Same seed, same batch: the gradients with and without checkpointing agree.
    let x = host_data(5, 480 * 32, -1.0, 1.0);
    let y: Vec<u32> = (0..480).map(|i| (i * 7 % 10) as u32).collect();
    let grads = |ckpt: bool| {
        let mut m = Mlp::new(&dev, &base.widths, Activation::Gelu, SEED).unwrap();
        m.checkpoint_activations = ckpt;
        let xt = Tensor::from_slice(&dev, &x, &[480, 32]).unwrap();
        let loss = nn::cross_entropy(&m.forward_in(&xt, DType::F32).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        m.named_parameters()
            .into_iter()
            .map(|(n, p)| {
                let g = p.grad().unwrap_or_else(|| panic!("{n} has no gradient"));
                (n, g.to_vec_f32().unwrap())
            })
            .collect::<Vec<_>>()
    };
    let (g_off, g_on) = (grads(false), grads(true));
    let worst = assert_weights_close("checkpointed gradients", &g_on, &g_off, 1e-5);
    note(&format!(
        "checkpointed gradients differ by {worst:.2e} relative at most; planner test took {:.1?}",
        started.elapsed()
    ));
}

// ---------------------------------------------------------------------------------------------
// 2. Mixed precision
// ---------------------------------------------------------------------------------------------

/// Epochs of digits with `precision`; test accuracy. Batches of 30: 30 x 256 x 256 stays under
/// the autotuner's threshold.
fn digits_accuracy(dev: &Device, precision: Precision, epochs: u64) -> f32 {
    let (train, test) = digits();
    let mut t = Setup::new(&[64, 256, 256, 10], 30)
        .precision(precision)
        .opt(Opt::AdamW { lr: 2e-3 })
        .build(dev);
    for e in 0..epochs {
        t.train_epoch(train, SEED, e, |_, _, _| Ok(())).unwrap();
    }
    let loss = t.take_loss().unwrap();
    let e = t.evaluate(test, 30).unwrap();
    let (test_loss, acc) = (e.loss, e.accuracy.unwrap());
    note(&format!(
        "digits {precision:?}: last-epoch train loss {loss:.4}, test loss {test_loss:.4}, \
         accuracy {acc:.4}; events {:?}",
        t.take_events()
    ));
    acc
}

/// Mixed precision learns digits as well as f32 (within 2 points, at least 90%; pure f16 at least
/// 90% too) and takes at most 0.7x the f32 peak where activations dominate;
/// `mixed_precision_lowers_the_loss` runs it on every device.
#[test]
fn mixed_precision_trains_and_saves_memory() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let started = Instant::now();
    let acc32 = digits_accuracy(&dev, Precision::F32, 4);
    let acc16 = digits_accuracy(&dev, Precision::Mixed, 4);
    // Pure f16 (parameters and gradients in f16, AdamW state in f32) trains too.
    let pure16 = digits_accuracy(&dev, Precision::F16, 4);
    note(&format!(
        "digits in three precisions took {:.1?}",
        started.elapsed()
    ));
    assert!(acc16 >= 0.9, "mixed precision reached only {acc16:.3}");
    assert!(pure16 >= 0.9, "f16 with AdamW reached only {pure16:.3}");
    assert!(
        (acc16 - acc32).abs() <= 0.02,
        "mixed {acc16:.4} vs f32 {acc32:.4}: more than 2 points apart"
    );
    drop(dev);

    // Peak of a warm step at a large batch (activations dominate), each precision on a device of
    // its own.
    let big = Setup::new(&[32, 64, 64, 10], 480);
    let mut peaks = Vec::new();
    for p in [Precision::F32, Precision::Mixed] {
        let Some(dev) = fresh_with_budget(None) else {
            return;
        };
        let (planned, measured) = planned_and_measured(&dev, &big.clone().precision(p), 1);
        note(&format!(
            "peak of a step, {:?} batch 480 {p:?}: planned {} measured {}",
            big.widths,
            Bytes(planned),
            Bytes(measured)
        ));
        peaks.push(measured);
    }
    let ratio = peaks[1] as f64 / peaks[0] as f64;
    note(&format!("mixed / f32 measured peak: {ratio:.3}"));
    assert!(
        ratio <= 0.7,
        "mixed precision peak is {ratio:.3}x the f32 one (want <= 0.7)"
    );

    note(&format!(
        "mixed precision test took {:.1?}",
        started.elapsed()
    ));
}

/// A few mixed-precision steps on every device (native and packed f16): finite losses, the loss
/// going down, no step skipped.
fn mixed_precision_lowers_the_loss(dev: &Device) {
    let b = host_batches(3, 1, 32, 16, 4);
    let mut t = Setup::new(&[16, 32, 4], 32)
        .precision(Precision::Mixed)
        .opt(Opt::Sgd {
            lr: 0.5,
            momentum: 0.0,
        })
        .build(dev);
    let (x, y) = b.get(0);
    t.step_rows(x, y).unwrap();
    let first = t.take_loss().unwrap();
    for _ in 0..10 {
        t.step_rows(x, y).unwrap();
    }
    let later = t.take_loss().unwrap();
    note(&format!(
        "mixed on {}: loss {first:.4} then {later:.4} (mean of 10 steps)",
        label(dev)
    ));
    assert!(
        first.is_finite() && later.is_finite(),
        "{}: non-finite loss",
        label(dev)
    );
    assert!(
        later < first,
        "{}: mixed precision did not lower the loss ({first} -> {later})",
        label(dev)
    );
    assert_eq!(t.steps(), 11, "{}: steps were skipped", label(dev));
}

// ---------------------------------------------------------------------------------------------
// 3. The loss scaler
// ---------------------------------------------------------------------------------------------

/// GradScaler on GPU gradients: an inf is reported, the scale halves and the skip counts;
/// clean gradients are divided by the scale; the scale doubles after `growth_interval` clean
/// updates. Through the trainer: a huge initial scale skips steps (weights untouched, events
/// say so) until the scale comes down, then training goes on.
#[test]
fn grad_scaler_skips_overflow_and_grows() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let p = Tensor::zeros(&dev, &[3, 5], DType::F32)
        .unwrap()
        .with_requires_grad();
    let params = vec![p.clone()];
    let mut sc = GradScaler::with(1024.0, 3).unwrap();

    // Clean gradients: divided by the scale, nothing reported.
    let g: Vec<f32> = (0..15).map(|i| i as f32 * 256.0 - 1024.0).collect();
    p.set_grad(Some(Tensor::from_slice(&dev, &g, &[3, 5]).unwrap()))
        .unwrap();
    assert!(!sc.unscale(&dev, &params).unwrap());
    let got = p.grad().unwrap().to_vec_f32().unwrap();
    let want: Vec<f32> = g.iter().map(|v| v / 1024.0).collect();
    assert_eq!(got, want, "unscale divides by the scale");

    // One inf among them: reported; the update halves the scale and counts a skip.
    let mut bad = g.clone();
    bad[7] = f32::INFINITY;
    p.set_grad(Some(Tensor::from_slice(&dev, &bad, &[3, 5]).unwrap()))
        .unwrap();
    assert!(sc.unscale(&dev, &params).unwrap(), "inf not reported");
    let mut nan = g.clone();
    nan[14] = f32::NAN;
    p.set_grad(Some(Tensor::from_slice(&dev, &nan, &[3, 5]).unwrap()))
        .unwrap();
    assert!(sc.unscale(&dev, &params).unwrap(), "NaN not reported");
    sc.update(true);
    assert_eq!(sc.scale(), 512.0);
    assert_eq!(sc.skipped_steps(), 1);
    assert_eq!(sc.growth_tracker(), 0);

    // Growth: x2 after 3 clean updates, not before; the tracker starts over.
    sc.update(false);
    sc.update(false);
    assert_eq!(sc.scale(), 512.0, "grew before the interval");
    assert_eq!(sc.growth_tracker(), 2);
    sc.update(false);
    assert_eq!(sc.scale(), 1024.0, "did not grow after 3 clean updates");
    assert_eq!(sc.growth_tracker(), 0);
    // An overflow resets the run of clean updates.
    sc.update(false);
    sc.update(true);
    sc.update(false);
    sc.update(false);
    assert_eq!(sc.scale(), 512.0);
    sc.update(false);
    assert_eq!(sc.scale(), 1024.0);
    assert_eq!(sc.skipped_steps(), 2);
    assert!(GradScaler::with(f32::INFINITY, 3).is_err());
    assert!(GradScaler::with(1.0, 0).is_err());

    // Through the trainer: a scale of 1e30 overflows the f16 backward.
    let setup = Setup::new(&[16, 32, 4], 32)
        .precision(Precision::Mixed)
        .opt(Opt::Sgd {
            lr: 0.5,
            momentum: 0.9,
        });
    let b = host_batches(9, 1, 32, 16, 4);
    let (x, y) = b.get(0);
    let mut t = setup.build(&dev);
    assert_eq!(t.scaler().expect("mixed has a scaler").scale(), 65536.0);
    t.scaler_mut().unwrap().set_state(1e30, 0);
    let before = weights(&t);
    t.step_rows(x, y).unwrap();
    assert_eq!(t.steps(), 0, "an overflowing step counted");
    assert_eq!(weights(&t), before, "a skipped step changed the weights");
    assert_eq!(t.scaler().unwrap().skipped_steps(), 1);
    assert_eq!(t.scaler().unwrap().scale(), 5e29);
    assert!(
        t.take_loss().unwrap().is_nan(),
        "a skipped step's loss counted"
    );
    let events = t.take_events();
    assert!(
        events.len() == 1 && events[0].to_string().contains("skipped"),
        "events of a skipped step: {events:?}"
    );
    let mut calls = 1;
    while t.steps() == 0 {
        assert!(calls < 200, "still skipping after {calls} steps");
        t.step_rows(x, y).unwrap();
        calls += 1;
    }
    let skipped = t.scaler().unwrap().skipped_steps();
    assert_eq!(skipped, calls - 1);
    assert_eq!(t.take_events().len() as u64, skipped - 1);
    assert_ne!(weights(&t), before, "the first clean step changed nothing");
    let first = t.take_loss().unwrap();
    for _ in 0..10 {
        t.step_rows(x, y).unwrap();
    }
    let later = t.take_loss().unwrap();
    note(&format!(
        "scaler from 1e30: {skipped} steps skipped, scale now {}, loss {first:.4} -> {later:.4}",
        t.scaler().unwrap().scale()
    ));
    assert!(later.is_finite() && later < first, "{first} -> {later}");
    assert_eq!(t.steps(), 11);
    // The same model from the scale it settled at trains like one that never overflowed: the
    // skipped steps left neither gradients nor momentum behind.
    let mut clean = setup.build(&dev);
    clean
        .scaler_mut()
        .unwrap()
        .set_state(1e30 * 0.5f32.powi(skipped as i32), 0);
    for _ in 0..11 {
        clean.step_rows(x, y).unwrap();
    }
    assert_weights_close("after skipped steps", &weights(&t), &weights(&clean), 0.0);
}

// ---------------------------------------------------------------------------------------------
// 4. A budget of half the f32 peak
// ---------------------------------------------------------------------------------------------

/// The unconstrained f32 run's peak reserved bytes, halved, as a hard budget: `fit_to_budget`
/// picks a smaller micro-batch, the run completes under the budget and reaches the same weights.
///
/// The model is narrow and the batch large: activations of 500 KB each (larger than the arena's
/// shared 2 MiB segments hold) dominate, and every matmul stays under the autotuner's threshold.
#[test]
fn budget_half_of_f32_peak() {
    const BATCH: usize = 8000;
    let setup = Setup::new(&[16, 16, 16, 16, 16, 16, 10], BATCH).opt(Opt::Sgd {
        lr: 0.05,
        momentum: 0.9,
    });
    let b = host_batches(21, 3, BATCH, 16, 10);
    let started = Instant::now();
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let mut free = setup.build(&dev);
    run(&mut free, &b, 3, "unconstrained");
    dev.sync().unwrap();
    let free_stats = dev.memory_stats();
    let w_free = weights(&free);
    note(&format!(
        "budget: unconstrained run took {:.1?}",
        started.elapsed()
    ));
    drop(free);
    drop(dev);
    let budget = free_stats.peak_bytes_reserved / 2;

    let Some(dev) = fresh_with_budget(Some(budget)) else {
        return;
    };
    let mut fit = setup.build(&dev);
    let (x0, y0) = b.get(0);
    let rows = HostRows::new(x0, y0).unwrap();
    let micro = fit
        .fit_to_budget(&rows, budget)
        .expect("half the peak fits");
    assert!(
        micro < BATCH,
        "fit_to_budget kept the whole batch ({micro})"
    );
    assert_eq!(fit.micro_batch(), micro);
    assert_eq!(fit.effective_batch(), BATCH);
    let planned = fit.plan(&rows).unwrap();
    assert!(planned.peak_reserved <= budget);
    run(&mut fit, &b, 3, "under the budget");
    dev.sync().unwrap();
    let stats = dev.memory_stats();
    let events = fit.take_events();
    let worst = assert_weights_close("budgeted vs unconstrained", &weights(&fit), &w_free, 1e-4);
    note(&format!(
        "budget: unconstrained peak reserved {} (in use {}); budget {}; micro-batch {micro} \
         (then {}), planned peak {} (reserved {}); measured peak in use {} reserved {}; \
         weights within {worst:.2e}; events {events:?}; {:.1?}",
        Bytes(free_stats.peak_bytes_reserved),
        Bytes(free_stats.peak_bytes_in_use),
        Bytes(budget),
        fit.micro_batch(),
        Bytes(planned.peak),
        Bytes(planned.peak_reserved),
        Bytes(stats.peak_bytes_in_use),
        Bytes(stats.peak_bytes_reserved),
        started.elapsed()
    ));
    assert!(
        stats.peak_bytes_reserved <= budget,
        "reserved {} over the budget {}",
        stats.peak_bytes_reserved,
        budget
    );
    assert!(
        stats.peak_bytes_reserved as f64 >= 0.85 * budget as f64,
        "the budgeted run used only {} of the {} budget",
        Bytes(stats.peak_bytes_reserved),
        Bytes(budget)
    );
    assert_eq!(fit.steps(), 3);
}

// ---------------------------------------------------------------------------------------------
// 5. Out of memory in the middle of a step
// ---------------------------------------------------------------------------------------------

/// An allocation failing halfway through a step's backward: the step still succeeds, at half
/// the micro-batch, says so in the events, and the run reaches the weights of a run without the
/// fault. With a micro-batch of one there is nothing to halve: the error comes back and the
/// trainer keeps working.
#[test]
fn oom_mid_step_is_retried() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let setup = Setup::new(&[64, 96, 80, 10], 64)
        .act(Activation::Gelu)
        .opt(Opt::AdamW { lr: 1e-2 });
    let b = host_batches(33, 5, 64, 64, 10);
    let mut clean = setup.build(&dev);
    run(&mut clean, &b, 1, "clean");
    // Allocations of a warm step and of its forward alone.
    let (x, y) = b.get(1);
    let a0 = dev.memory_stats().allocations;
    clean.step_rows(x, y).unwrap();
    let per_step = dev.memory_stats().allocations - a0;
    let a0 = dev.memory_stats().allocations;
    {
        let xt = Tensor::from_slice(&dev, x, &[64, 64]).unwrap();
        let logits = clean.model.forward_in(&xt, DType::F32).unwrap();
        let _loss = nn::cross_entropy(&logits, y).unwrap();
    }
    let forward = dev.memory_stats().allocations - a0 + 1; // + the step's loss accumulator
    run_from(&mut clean, &b, 2, 5);
    let w_clean = weights(&clean);
    drop(clean);

    let mut t = setup.build(&dev);
    run(&mut t, &b, 1, "faulty");
    let k = forward + (per_step - forward) / 2;
    let ooms = dev.memory_stats().oom_errors;
    dev.inject_oom_after(k);
    let (x, y) = b.get(1);
    t.step_rows(x, y)
        .expect("the step is redone at half the micro-batch");
    assert_eq!(dev.memory_stats().oom_errors, ooms + 1, "no fault was hit");
    assert_eq!(t.micro_batch(), 32);
    assert_eq!(t.steps(), 2);
    let events = t.take_events();
    assert!(
        events.len() == 1
            && events[0].to_string().contains("out of memory")
            && events[0].to_string().contains("64 -> 32"),
        "events: {events:?}"
    );
    run_from(&mut t, &b, 2, 5);
    let worst = assert_weights_close("after a mid-step OOM", &weights(&t), &w_clean, 1e-5);
    note(&format!(
        "oom: {per_step} allocations per step, {forward} in the forward, fault at {k}; \
         event {:?}; weights within {worst:.2e}",
        events[0]
    ));
    drop(t);

    // A micro-batch of one: nothing left to halve.
    let one = Setup::new(&[16, 32, 4], 4).micro(1).opt(Opt::Sgd {
        lr: 0.1,
        momentum: 0.9,
    });
    let b = host_batches(44, 3, 4, 16, 4);
    let mut reference = one.build(&dev);
    run(&mut reference, &b, 2, "micro 1 reference");
    let w_ref = weights(&reference);
    drop(reference);
    let mut t = one.build(&dev);
    let w0 = weights(&t);
    dev.sync().unwrap();
    let in_use = dev.memory_stats().bytes_in_use;
    dev.inject_oom_after(12);
    let (x, y) = b.get(0);
    match t.step_rows(x, y) {
        Err(Error::OutOfMemory { .. }) => {}
        other => panic!("a micro-batch of one out of memory gave {other:?}"),
    }
    assert_eq!(t.steps(), 0);
    assert_eq!(t.micro_batch(), 1);
    assert_eq!(weights(&t), w0, "a failed step changed the weights");
    assert!(t.model.parameters().iter().all(|p| p.grad().is_none()));
    dev.sync().unwrap();
    assert_eq!(
        dev.memory_stats().bytes_in_use,
        in_use,
        "a failed step left memory behind"
    );
    run(&mut t, &b, 2, "micro 1 after the error");
    assert_eq!(t.steps(), 2);
    assert_weights_close("micro 1 after the error", &weights(&t), &w_ref, 0.0);
}

/// Steps `t` over batches `from..to`.
fn run_from(t: &mut Trainer<Mlp>, b: &Batches, from: usize, to: usize) {
    for i in from..to {
        let (x, y) = b.get(i);
        t.step_rows(x, y)
            .unwrap_or_else(|e| panic!("step on batch {i} failed: {e}"));
    }
}

// ---------------------------------------------------------------------------------------------
// 6. A budget too small
// ---------------------------------------------------------------------------------------------

/// 1 KiB cannot hold one sample: a typed error naming the minimum, before any step; the
/// minimum itself is accepted.
#[test]
fn budget_too_small_is_a_clear_error() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let mut t = Setup::new(&[64, 128, 10], 64).build(&dev);
    let b = host_batches(5, 1, 64, 64, 10);
    let (x, y) = b.get(0);
    let rows = HostRows::new(x, y).unwrap();
    let err = t
        .fit_to_budget(&rows, 1024)
        .expect_err("1 KiB is too small");
    let msg = err.to_string();
    let Error::BudgetTooSmall {
        budget, minimum, ..
    } = err
    else {
        panic!("expected BudgetTooSmall, got {err:?}");
    };
    note(&format!("budget too small: {msg}"));
    assert_eq!(budget, 1024);
    assert!(minimum > budget);
    let all: Vec<usize> = (0..64).collect();
    let one = t.plan_at(&rows, &all, 1, None, 0).unwrap();
    assert!(
        one.peak <= minimum && minimum <= one.peak_reserved,
        "the minimum {minimum} lies between the one-sample step's peak in use {} and reserved {}",
        one.peak,
        one.peak_reserved
    );
    assert!(
        msg.contains(&Bytes(minimum).to_string()),
        "the message does not name the minimum: {msg}"
    );
    assert!(msg.contains(&Bytes(1024).to_string()), "{msg}");
    assert_eq!(t.steps(), 0);
    assert_eq!(t.micro_batch(), 64, "a failed fit changed the micro-batch");
    assert!(matches!(
        t.fit_to_budget(&rows, minimum - 1),
        Err(Error::BudgetTooSmall { .. })
    ));
    let m = t.fit_to_budget(&rows, minimum).expect("the minimum fits");
    assert!((1..=64).contains(&m), "micro-batch {m} at the minimum");
    assert_eq!(t.steps(), 0);
    // A run under exactly that budget succeeds and stays within it.
    dev.set_memory_budget(Some(minimum)).unwrap();
    t.step_rows(x, y).expect("a step under the minimum budget");
    t.step_rows(x, y)
        .expect("a second step under the minimum budget");
    assert!(dev.memory_stats().peak_bytes_reserved <= minimum);
    assert!(t.take_events().is_empty(), "{:?}", t.take_events());
}

// ---------------------------------------------------------------------------------------------
// 7. Preallocation from the plan
// ---------------------------------------------------------------------------------------------

/// Reserving what the planner finds before training: no step creates a buffer afterwards.
#[test]
fn prealloc_creates_no_buffers_after_start() {
    let setups = [
        Setup::new(&[64, 128, 128, 10], 120).opt(Opt::AdamW { lr: 1e-3 }),
        Setup::new(&[64, 96, 80, 10], 96)
            .act(Activation::Gelu)
            .checkpoint(true)
            .precision(Precision::Mixed)
            .micro(32)
            .opt(Opt::Sgd {
                lr: 0.05,
                momentum: 0.9,
            }),
    ];
    for s in &setups {
        let Some(dev) = fresh_with_budget(None) else {
            return;
        };
        let mut t = s.build(&dev);
        let b = host_batches(55, 4, s.batch, s.widths[0], *s.widths.last().unwrap());
        let (x, y) = b.get(0);
        let est = t.prealloc(&HostRows::new(x, y).unwrap()).unwrap();
        let before = dev.memory_stats();
        run(&mut t, &b, 6, &s.label());
        let _ = t.take_loss().unwrap();
        dev.sync().unwrap();
        let after = dev.memory_stats();
        note(&format!(
            "prealloc {}: reserved {} up front, peak in use {}; buffers {} -> {}",
            s.label(),
            Bytes(est),
            Bytes(after.peak_bytes_in_use),
            before.buffers_created,
            after.buffers_created
        ));
        assert_eq!(
            after.buffers_created,
            before.buffers_created,
            "{}: steps created buffers after the reservation\n{}",
            s.label(),
            dev.memory_report()
        );
    }
}
