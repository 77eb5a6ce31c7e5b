//! The generic trainer and the dry-run planner on models the crate does not know: a residual
//! regressor written with `module!`, `Vec<Block>` and `Sequential`, trained on a
//! `TensorDataset` through `Trainer`. The planner's peak equals the measured peak of the same
//! step (SGD with and without momentum, AdamW, with and without accumulation); a budget of half
//! the peak gives the same weights; planning leaves weights, gradients, optimizer state and the
//! arena as they were and runs nothing; the trainer trains on a worker thread; an Mlp is rebuilt
//! from its checkpoint alone.

use crate::common;

use common::*;
use fitgrad::nn::{Activation, Linear, Mlp, Module, Sequential};
use fitgrad::optim::{AdamW, Optimizer, Sgd};
use fitgrad::train::{
    BatchSource, StepContext, TensorBatch, TensorDataset, TrainModel, Trainer, TrainerConfig,
};
use fitgrad::{Bytes, DType, Device, Error, Result, Tensor};
use std::io::Write;

fn note(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

/// x + fc2(tanh(fc1(x))): (B, C) -> (B, C).
struct Block {
    fc1: Linear,
    fc2: Linear,
}

fitgrad::module! {
    impl Module for Block {
        params { fc1, fc2 }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            x.add(&self.fc2.forward(&self.fc1.forward(x)?.tanh()?)?)
        }
    }
}

/// input projection, residual blocks, a head: (B, IN) -> (B, OUT).
struct Regressor {
    stem: Sequential,
    blocks: Vec<Block>,
    head: Linear,
}

fitgrad::module! {
    impl Module for Regressor {
        params { stem, blocks, head }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.head.forward(&self.blocks.forward(&self.stem.forward(x)?)?)
        }
    }
}

impl TrainModel<TensorBatch> for Regressor {
    fn forward_loss(&self, b: &TensorBatch, ctx: &StepContext) -> Result<Tensor> {
        let (x, y) = b.to_device(&ctx.device)?;
        fitgrad::nn::mse_loss(&self.forward(&x)?, &y)
    }
}

const IN: usize = 12;
const WIDTH: usize = 24;
const OUT: usize = 3;

fn regressor(dev: &Device, seed: u64) -> Regressor {
    let lin = |i, o, s| Linear::with_options(dev, i, o, true, DType::F32, seed * 100 + s).unwrap();
    Regressor {
        stem: Sequential::new().push(lin(IN, WIDTH, 1)),
        blocks: (0..2)
            .map(|k| Block {
                fc1: lin(WIDTH, WIDTH, 10 + k),
                fc2: lin(WIDTH, WIDTH, 20 + k),
            })
            .collect(),
        head: lin(WIDTH, OUT, 3),
    }
}

/// y = a smooth function of x, so the loss can fall.
fn dataset(n: usize, seed: u64) -> TensorDataset {
    let x = host_data(seed, n * IN, -1.0, 1.0);
    let y: Vec<f32> = (0..n)
        .flat_map(|i| {
            let r = &x[i * IN..(i + 1) * IN];
            [r[0] * r[1], r[2].sin(), r[3] - 0.5 * r[4]]
        })
        .collect();
    TensorDataset::new(x, &[IN], y, &[OUT]).unwrap()
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Sgd,
    Momentum,
    AdamW,
}

fn optimizer(kind: Kind, params: Vec<Tensor>) -> Box<dyn Optimizer> {
    match kind {
        Kind::Sgd => Box::new(Sgd::new(params, 0.05).unwrap()),
        Kind::Momentum => Box::new(Sgd::new(params, 0.05).unwrap().momentum(0.9).unwrap()),
        Kind::AdamW => Box::new(AdamW::new(params, 3e-3).unwrap()),
    }
}

fn trainer(dev: &Device, kind: Kind, batch: usize, accum: usize) -> Trainer<Regressor> {
    let model = regressor(dev, 1);
    let opt = optimizer(kind, model.parameters());
    let lr = opt.lr();
    Trainer::new(model, opt, TrainerConfig::new(batch, accum, lr)).unwrap()
}

/// Planned peak in use of the next step, then that step's measured peak, for several
/// optimizers and splits of the batch.
#[test]
fn planner_matches_measured_peak_of_custom_model() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let data = dataset(96, 3);
    let mut lines = Vec::new();
    for (kind, batch, accum, micro) in [
        (Kind::Sgd, 32, 1, None),
        (Kind::Momentum, 16, 2, Some(7)),
        (Kind::AdamW, 30, 1, Some(20)),
        (Kind::AdamW, 8, 3, None),
    ] {
        let mut t = trainer(&dev, kind, batch, accum);
        if let Some(m) = micro {
            t.set_micro_batch(m).unwrap();
        }
        let order: Vec<usize> = (0..data.len()).collect();
        let eff = t.effective_batch();
        let mut checked = 0;
        for (i, idx) in order.chunks(eff).enumerate() {
            if idx.len() < eff {
                break;
            }
            let planned = t.plan(&data).unwrap();
            dev.sync().unwrap();
            dev.reset_peak();
            t.step(&data, idx).unwrap();
            dev.sync().unwrap();
            let measured = dev.memory_stats().peak_bytes_in_use;
            let ratio = planned.peak as f64 / measured as f64;
            lines.push(format!(
                "{kind:?} batch {batch} x {accum} micro {micro:?} step {i}: planned {} measured {} ({ratio:.4}); peak at {:?}",
                Bytes(planned.peak),
                Bytes(measured),
                planned.peak_op
            ));
            if i == 0 {
                // The plan is of a step with the optimizer state already made (it runs two);
                // the very first step makes it, so it peaks at most as high.
                assert!(ratio >= 1.0, "{}", lines.last().unwrap());
            } else {
                assert!((ratio - 1.0).abs() <= 0.02, "{}", lines.last().unwrap());
            }
            assert_eq!(
                planned.parameters,
                t.model.parameter_bytes(),
                "the parameters at the peak are the model's"
            );
            checked += 1;
        }
        assert!(checked >= 2);
    }
    note(&lines.join("\n"));
}

/// Planning changes nothing real: weights, optimizer state, gradients, step count, the
/// arena's reserved bytes and buffers; and it records no dispatch (a plan of a large step
/// takes no GPU time and creates no buffer).
#[test]
fn planning_leaves_everything_as_it_was() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let data = dataset(64, 5);
    let mut t = trainer(&dev, Kind::AdamW, 32, 1);
    t.step(&data, &(0..32).collect::<Vec<_>>()).unwrap();
    dev.sync().unwrap();
    let w = param_values(&t.model);
    let state: Vec<Vec<f32>> = t
        .optimizer
        .state_tensors()
        .iter()
        .map(|(_, s)| s.to_vec_f32().unwrap())
        .collect();
    // 64x more samples than any step so far: a real step would need new buffers.
    let big = dataset(4096, 6);
    let mut wide = trainer(&dev, Kind::AdamW, 4096, 1);
    dev.sync().unwrap();
    let before = dev.memory_stats();
    let plan = wide.plan(&big).unwrap();
    t.plan(&data).unwrap();
    let after = dev.memory_stats();
    assert!(
        plan.new_buffers > 0,
        "a big step needs new segments: {plan:?}"
    );
    assert_eq!(after.buffers_created, before.buffers_created);
    assert_eq!(after.bytes_reserved, before.bytes_reserved);
    assert_eq!(after.bytes_in_use, before.bytes_in_use);
    assert_eq!(after.allocations, before.allocations);
    assert_eq!(param_values(&t.model), w, "planning changed the weights");
    let state_after: Vec<Vec<f32>> = t
        .optimizer
        .state_tensors()
        .iter()
        .map(|(_, s)| s.to_vec_f32().unwrap())
        .collect();
    assert_eq!(state_after, state, "planning changed the optimizer state");
    assert_eq!(t.steps(), 1);
    assert!(t.model.parameters().iter().all(|p| p.grad().is_none()));
    assert!(!dev.is_planning());
    note(&format!(
        "planning: big step planned peak {} reserved {} ({} new buffers), nothing created",
        Bytes(plan.peak),
        Bytes(plan.peak_reserved),
        plan.new_buffers
    ));
}

/// Inside a plan, readbacks are zeros and ops write nothing; another thread's work on the
/// same device runs for real meanwhile.
#[test]
fn planning_is_a_mode_of_the_calling_thread() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let a = Tensor::from_slice(&dev, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let before = dev.memory_stats();
    {
        let scope = dev.planning().unwrap();
        assert!(dev.is_planning());
        assert!(matches!(dev.planning(), Err(Error::InvalidArgument { .. })));
        let b = a.matmul(&a).unwrap().exp().unwrap();
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![0.0; 4]);
        assert!(scope.stats().allocations > before.allocations);
        let other = {
            let (dev, a) = (dev.clone(), a.clone());
            std::thread::spawn(move || {
                assert!(!dev.is_planning());
                a.add(&a).unwrap().to_vec::<f32>().unwrap()
            })
            .join()
            .unwrap()
        };
        assert_eq!(other, vec![2.0, 4.0, 6.0, 8.0]);
    }
    assert!(!dev.is_planning());
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    assert_eq!(dev.memory_stats().buffers_created, before.buffers_created);
}

/// Half the unbudgeted peak: the trainer picks smaller micro-batches, never passes the budget,
/// uses most of it, and reaches the same weights.
#[test]
fn custom_model_under_half_its_peak() {
    let data = dataset(512, 8);
    let run = |budget: Option<u64>| -> Option<(Vec<Vec<f32>>, u64, u64, usize)> {
        let dev = fresh_with_budget(budget)?;
        let mut t = trainer(&dev, Kind::AdamW, 256, 1);
        let micro = match budget {
            Some(b) => t.fit_to_budget(&data, b).unwrap(),
            None => 256,
        };
        for epoch in 0..2 {
            t.train_epoch(&data, 1, epoch, |_, _, _| Ok(())).unwrap();
        }
        dev.sync().unwrap();
        let s = dev.memory_stats();
        assert!(t.take_events().is_empty());
        Some((
            param_values(&t.model),
            s.peak_bytes_reserved,
            s.peak_bytes_in_use,
            micro,
        ))
    };
    let Some((w_free, _, peak, _)) = run(None) else {
        return;
    };
    // Half the peak in use: a small model's whole step fits one shared segment, so half the
    // reserved peak would not constrain it.
    let budget = peak / 2;
    let (w, reserved, in_use, micro) = run(Some(budget)).unwrap();
    let worst = worst_rel_diff(&w, &w_free);
    note(&format!(
        "custom model: unbudgeted peak in use {}, budget {}, micro-batch {micro} of 256, peak reserved {} in use {}, weights within {worst:.2e}",
        Bytes(peak),
        Bytes(budget),
        Bytes(reserved),
        Bytes(in_use)
    ));
    assert!(micro < 256);
    assert!(reserved <= budget, "over the budget");
    assert!(worst <= 1e-5, "weights differ by {worst:.2e}");
}

/// Trainer and optimizers are Send: train on a worker thread, read the result on this one.
#[test]
fn trains_on_a_worker_thread() {
    fn send<T: Send>(_: &T) {}
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let data = dataset(64, 9);
    let mut t = trainer(&dev, Kind::AdamW, 16, 1);
    send(&t);
    let t = std::thread::spawn(move || {
        let mut first = f32::NAN;
        for epoch in 0..6 {
            t.train_epoch(&data, 0, epoch, |_, _, _| Ok(())).unwrap();
            let l = t.take_loss().unwrap();
            if epoch == 0 {
                first = l;
            }
        }
        (t, first)
    })
    .join()
    .unwrap();
    let (t, first) = t;
    let eval = t.evaluate(&dataset(64, 9), 32).unwrap();
    note(&format!(
        "worker thread: first epoch loss {first:.4}, eval loss {:.4}",
        eval.loss
    ));
    assert!(eval.accuracy.is_none());
    assert!(
        eval.loss < first,
        "the loss did not fall: {first} -> {}",
        eval.loss
    );
}

/// A saved Mlp comes back from the file alone; a model of another configuration is refused.
#[test]
fn mlp_rebuilt_from_its_checkpoint() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let mut m = Mlp::new(&dev, &[6, 10, 4], Activation::Gelu, 3).unwrap();
    m.checkpoint_activations = true;
    let opt = Box::new(AdamW::new(m.parameters(), 1e-3).unwrap());
    let mut t = Trainer::new(m, opt, TrainerConfig::new(8, 1, 1e-3)).unwrap();
    let x = host_data(1, 8 * 6, -1.0, 1.0);
    let y: Vec<u32> = (0..8).map(|i| i % 4).collect();
    t.step_rows(&x, &y).unwrap();
    let dir = tempdir();
    let path = dir.join("mlp.safetensors");
    t.save_checkpoint(&path, 1).unwrap();
    let ckpt = fitgrad::checkpoint::load(&path).unwrap();
    let back = ckpt.rebuild(|cfg| Mlp::from_config(&dev, cfg)).unwrap();
    assert_eq!(back.widths(), vec![6, 10, 4]);
    assert_eq!(back.act, Activation::Gelu);
    assert!(back.checkpoint_activations);
    assert_eq!(param_values(&back), param_values(&t.model));
    let other = Mlp::new(&dev, &[6, 10, 4], Activation::Relu, 3).unwrap();
    let err = ckpt.apply_model(&other).unwrap_err();
    assert!(err.to_string().contains("activation"), "{err}");
    // A configuration the builder refuses is an error naming the file.
    let err = ckpt
        .rebuild(|cfg| {
            let mut cfg = cfg.clone();
            cfg.insert("kind".into(), "gpt".into());
            Mlp::from_config(&dev, &cfg)
        })
        .err()
        .expect("a gpt configuration is refused");
    assert!(
        matches!(&err, fitgrad::Error::Data { path, .. } if path.contains("mlp.safetensors")),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "fitgrad-generic-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `clip_grad_norm` in the trainer is torch's recipe: backward, clip the total norm, step. The
/// planner counts the clipping's buffers too.
#[test]
fn trainer_clips_like_the_manual_loop() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let data = dataset(32, 12);
    let idx: Vec<usize> = (0..32).collect();
    // By hand.
    let model = regressor(&dev, 1);
    let mut opt = optimizer(Kind::Sgd, model.parameters());
    let batch = data.batch(&idx).unwrap();
    let ctx = StepContext {
        device: dev.clone(),
        dtype: DType::F32,
        training: true,
    };
    model
        .forward_loss(&batch, &ctx)
        .unwrap()
        .backward()
        .unwrap();
    let norm = fitgrad::optim::clip_grad_norm(&model.parameters(), 0.05).unwrap();
    assert!(
        norm > 0.05,
        "the test needs a norm above the limit, got {norm}"
    );
    opt.step().unwrap();
    // Through the trainer, in micro-batches.
    let m2 = regressor(&dev, 1);
    let o2 = optimizer(Kind::Sgd, m2.parameters());
    let cfg = TrainerConfig::new(32, 1, 0.05)
        .clip_grad_norm(0.05)
        .micro_batch(10);
    let mut t = Trainer::new(m2, o2, cfg).unwrap();
    let plan = t.plan(&data).unwrap();
    dev.reset_peak();
    t.step(&data, &idx).unwrap();
    let measured = dev.memory_stats().peak_bytes_in_use;
    assert!(
        plan.peak >= measured,
        "planned {} < measured {measured}",
        plan.peak
    );
    for (a, b) in param_values(&t.model).iter().zip(param_values(&model)) {
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }
    assert!(matches!(
        Trainer::new(
            regressor(&dev, 2),
            optimizer(Kind::Sgd, regressor(&dev, 2).parameters()),
            TrainerConfig::new(8, 1, 0.1).clip_grad_norm(0.0)
        ),
        Err(Error::InvalidArgument { .. })
    ));
}
