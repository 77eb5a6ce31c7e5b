//! Magnitude pruning against a plain-loop reference on every device: the pruned set is exactly
//! the k = round(s n) smallest magnitudes (ties to the lower index) per layer or globally, for
//! f32 and f16 weights of random shapes (1, odd, empty); masks nest along the cubic schedule
//! and hold through optimizer steps (every pruned weight exactly 0 after training); 80%
//! sparsity on the digits costs at most 2 points of accuracy; bad settings are typed errors.

use crate::common;

use common::*;
use fitgrad::compress::{PruneConfig, PruneSchedule, PruneScope, Pruner};
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{DType, Device, Error, Result, Tensor};
use proptest::prelude::*;
use std::sync::OnceLock;

/// A model that is only a list of named tensors (pruning needs nothing else).
struct Params(Vec<(String, Tensor)>);

impl Module for Params {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.0.clone()
    }
}

/// The reference: which of `mags` (one list per layer) a pruning to `s` removes.
fn ref_pruned(mags: &[Vec<f32>], s: f32, global: bool) -> Vec<Vec<bool>> {
    let pick = |m: &[f32]| -> Vec<bool> {
        let k = (s as f64 * m.len() as f64).round() as usize;
        let mut order: Vec<usize> = (0..m.len()).collect();
        // Insertion sort by (magnitude, index): plain and obviously right.
        for i in 1..order.len() {
            let mut j = i;
            while j > 0 {
                let (a, b) = (order[j - 1], order[j]);
                if m[a] > m[b] || (m[a] == m[b] && a > b) {
                    order.swap(j - 1, j);
                    j -= 1;
                } else {
                    break;
                }
            }
        }
        let mut out = vec![false; m.len()];
        for &i in &order[..k] {
            out[i] = true;
        }
        out
    };
    if !global {
        return mags.iter().map(|m| pick(m)).collect();
    }
    let all = pick(&mags.concat());
    let mut at = 0;
    mags.iter()
        .map(|m| {
            at += m.len();
            all[at - m.len()..at].to_vec()
        })
        .collect()
}

/// Weights of the given dims (values from a small set, so ties happen) and a bias, pruned to
/// `s`: the weights must equal the reference's (0 where pruned, unchanged elsewhere), the bias
/// untouched, and the report must count the pruned elements.
fn check_one_shot(
    dev: &Device,
    dims: &[[usize; 2]],
    s: f32,
    global: bool,
    dtype: DType,
    seed: u64,
) {
    let what = format!("{dims:?} s {s} global {global} {dtype} on {}", label(dev));
    let mut params = Vec::new();
    let mut host = Vec::new();
    for (i, d) in dims.iter().enumerate() {
        // Multiples of 1/8 in [-1, 1]: exact in f16, many equal magnitudes.
        let v: Vec<f32> = host_data(seed + i as u64, d[0] * d[1], -8.0, 8.0)
            .iter()
            .map(|x| x.round() / 8.0)
            .collect();
        params.push((format!("layers.{i}.weight"), upload(dev, &v, d, dtype)));
        host.push(v);
    }
    let bias = host_data(seed ^ 7, 5, -1.0, 1.0);
    params.push(("layers.0.bias".into(), upload(dev, &bias, &[5], dtype)));
    let model = Params(params);
    let mut cfg = PruneConfig::new(s);
    cfg.scope = if global {
        PruneScope::Global
    } else {
        PruneScope::PerLayer
    };
    let mut pruner = Pruner::new(&model, cfg).unwrap();
    assert_eq!(
        pruner.names().len(),
        dims.len(),
        "{what}: the bias is not pruned"
    );
    pruner.prune(s).unwrap();
    let mags: Vec<Vec<f32>> = host
        .iter()
        .map(|v| v.iter().map(|x| x.abs()).collect())
        .collect();
    let want = ref_pruned(&mags, s, global);
    let report = pruner.report().unwrap();
    for (i, (v, p)) in host.iter().zip(&want).enumerate() {
        let got = model.0[i].1.to_vec_f32().unwrap();
        let expect: Vec<f32> = v
            .iter()
            .zip(p)
            .map(|(&x, &pr)| if pr { 0.0 } else { x })
            .collect();
        assert_eq!(got, expect, "{what}: layer {i}");
        let l = &report.layers[i];
        assert_eq!(
            l.pruned,
            p.iter().filter(|&&x| x).count(),
            "{what}: layer {i}"
        );
        assert_eq!(l.zeros, got.iter().filter(|&&x| x == 0.0).count());
        assert_eq!(l.pruned_nonzero, 0);
    }
    let b = model.0.last().unwrap().1.to_vec_f32().unwrap();
    assert_eq!(b, as_dtype(&bias, dtype), "{what}: bias changed");
    // Per layer, every layer reaches round(s n); globally, the total does.
    let n: usize = host.iter().map(Vec::len).sum();
    if global {
        assert_eq!(
            report.pruned(),
            (s as f64 * n as f64).round() as usize,
            "{what}"
        );
    }
}

/// Random shapes (1, odd, empty), sparsities and both scopes, in f32 and f16.
fn one_shot_matches_reference(dev: &Device) {
    let dim = prop_oneof![Just(1usize), Just(0usize), 2usize..9, 9usize..40];
    proptest!(ProptestConfig::with_cases(16), |(
        a in dim.clone(), b in dim.clone(), c in dim.clone(), d in dim,
        s in 0.0f32..0.99, global in any::<bool>(), f16 in any::<bool>(), seed in any::<u64>(),
    )| {
        let dtype = dtype_for(dev, f16);
        check_one_shot(dev, &[[a, b], [c, d]], s, global, dtype, seed);
    });
    // Fixed edges: nothing pruned, one element, the nearest count above a half.
    check_one_shot(dev, &[[3, 5], [1, 1]], 0.0, false, DType::F32, 1);
    check_one_shot(dev, &[[1, 1], [7, 3]], 0.5, true, DType::F16, 2);
}

/// The cubic schedule's values, and a gradual run: the masks only grow, every masked weight is
/// exactly 0 after every step (the optimizer moves them and the mask zeroes them again), and
/// the final sparsity is the target.
fn gradual_pruning_holds_through_training(dev: &Device) {
    let (train, _) = digits();
    let model = Mlp::new(dev, &[train.dim, 24, train.classes], Activation::Relu, 3).unwrap();
    let opt = Opt::AdamW { lr: 3e-3 }.build(model.parameters());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(64, 1, 3e-3)).unwrap();
    let mut cfg = PruneConfig::new(0.75);
    cfg.scope = PruneScope::PerLayer;
    cfg.schedule = PruneSchedule::cubic(2, 12, 2);
    let mut pruner = Pruner::new(&t.model, cfg).unwrap();
    assert_eq!(pruner.names(), ["layers.0.weight", "layers.1.weight"]);
    assert_eq!(pruner.sparsity_at(0), 0.0);
    assert_eq!(pruner.sparsity_at(2), 0.0);
    assert!((pruner.sparsity_at(7) - 0.75 * (1.0 - 0.125)).abs() < 1e-6);
    assert_eq!(pruner.sparsity_at(12), 0.75);
    assert_eq!(pruner.sparsity_at(1000), 0.75);
    let idx: Vec<usize> = (0..64).collect();
    let mut last = 0;
    for _ in 0..16 {
        t.step(train, &idx).unwrap();
        pruner.step(t.steps()).unwrap();
        let r = pruner.report().unwrap();
        assert!(r.pruned() >= last, "masks shrank: {last} -> {}", r.pruned());
        last = r.pruned();
        for l in &r.layers {
            assert_eq!(
                l.pruned_nonzero,
                0,
                "step {}: a pruned weight is not 0\n{r}",
                t.steps()
            );
        }
    }
    let r = pruner.report().unwrap();
    for l in &r.layers {
        assert_eq!(l.pruned, (0.75 * l.numel as f64).round() as usize, "{r}");
    }
    // The biases are not pruned.
    let b = t.model.layers[0]
        .bias
        .as_ref()
        .unwrap()
        .to_vec_f32()
        .unwrap();
    assert!(b.iter().any(|&v| v != 0.0));
}

/// Digits, [64, 128, 128, 10], 12 epochs: pruned gradually to 80% (one global threshold), the
/// test accuracy is within 2 points of the same run dense, and 80% of the weights are exactly
/// 0 at the end.
fn eighty_percent_costs_at_most_two_points(dev: &Device) {
    let (train, test) = digits();
    let epochs = 12;
    let run = |prune: bool| -> (f32, Option<f64>) {
        let model = Mlp::new(
            dev,
            &[train.dim, 128, 128, train.classes],
            Activation::Relu,
            5,
        )
        .unwrap();
        let opt = Opt::AdamW { lr: 3e-3 }.build(model.parameters());
        let mut t = Trainer::new(model, opt, TrainerConfig::new(64, 1, 3e-3)).unwrap();
        let steps = epochs * train.len().div_ceil(64) as u64;
        let mut cfg = PruneConfig::new(0.8);
        // Pruning from 5% to 60% of the run, then 40% of it to recover.
        cfg.schedule = PruneSchedule::gradual(steps);
        let mut pruner = Pruner::new(&t.model, cfg).unwrap();
        for epoch in 0..epochs {
            t.train_epoch(train, 0, epoch, |t, _, _| {
                if prune {
                    pruner.step(t.steps())?;
                }
                Ok(())
            })
            .unwrap();
        }
        let acc = t.evaluate(test, 512).unwrap().accuracy.unwrap();
        let sparsity = prune.then(|| {
            let r = pruner.report().unwrap();
            assert_eq!(r.pruned(), (0.8 * r.numel() as f64).round() as usize, "{r}");
            for l in &r.layers {
                assert_eq!(l.pruned_nonzero, 0, "a pruned weight is not 0\n{r}");
            }
            r.sparsity()
        });
        (acc, sparsity)
    };
    let (dense, _) = run(false);
    let (pruned, sparsity) = run(true);
    eprintln!(
        "digits on {}: dense {dense:.4}, 80% pruned {pruned:.4} (sparsity {sparsity:?})",
        label(dev)
    );
    assert!(
        pruned >= dense - 0.02,
        "pruned accuracy {pruned} vs dense {dense}"
    );
}

/// The masks exist from `Pruner::new`, so a trainer's plan made after it counts them: the
/// planned peak equals the measured peak of steps that prune (the grown masks reuse the old
/// masks' bytes).
fn plan_counts_the_masks(shared: &Device) {
    let mut opts = fitgrad::DeviceOptions::default();
    opts.backend = Some(shared.info().adapter.backend.clone());
    let Some(dev) = fresh_device(opts) else {
        return;
    };
    let (train, _) = digits();
    let model = Mlp::new(&dev, &[train.dim, 96, train.classes], Activation::Relu, 2).unwrap();
    let weight_bytes: u64 = model
        .layers
        .iter()
        .map(|l| l.weight.allocated_bytes())
        .sum();
    let opt = Opt::AdamW { lr: 3e-3 }.build(model.parameters());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(64, 1, 3e-3)).unwrap();
    let idx: Vec<usize> = (0..64).collect();
    // One step first: the plan is of a step whose optimizer state exists.
    t.step(train, &idx).unwrap();
    dev.sync().unwrap();
    let before = dev.memory_stats().bytes_in_use;
    let mut cfg = PruneConfig::new(0.7);
    cfg.schedule = PruneSchedule::cubic(1, 4, 1);
    let mut pruner = Pruner::new(&t.model, cfg).unwrap();
    dev.sync().unwrap();
    assert_eq!(
        dev.memory_stats().bytes_in_use - before,
        weight_bytes,
        "one mask per weight, the weight's size"
    );
    let planned = t.plan(train).unwrap();
    dev.reset_peak();
    let mut grew = 0;
    for _ in 0..4 {
        t.step(train, &idx).unwrap();
        grew += pruner.step(t.steps()).unwrap() as usize;
    }
    dev.sync().unwrap();
    assert!(grew >= 3, "the masks grew {grew} times");
    let measured = dev.memory_stats().peak_bytes_in_use;
    assert_eq!(
        planned.peak,
        measured,
        "planned {} measured {}",
        fitgrad::Bytes(planned.peak),
        fitgrad::Bytes(measured)
    );
}

/// A weight loaded with zeros in it gets them masked by `mask_zeros`.
fn mask_zeros_adopts_loaded_zeros(dev: &Device) {
    let w = Tensor::from_slice(dev, &[0.0f32, 1.0, 0.0, 2.0], &[2, 2]).unwrap();
    let model = Params(vec![("w".into(), w.clone())]);
    let mut pruner = Pruner::new(&model, PruneConfig::new(0.5)).unwrap();
    pruner.mask_zeros().unwrap();
    assert_eq!(pruner.report().unwrap().pruned(), 2);
    // A later pruning to 50% keeps those two and prunes nothing else.
    pruner.prune(0.5).unwrap();
    assert_eq!(w.to_vec_f32().unwrap(), [0.0, 1.0, 0.0, 2.0]);
}

/// Sparsity outside [0, 1), a bad schedule or a filter that selects nothing: typed errors,
/// before any device work.
fn bad_settings_are_typed_errors(dev: &Device) {
    let w = Tensor::zeros(dev, &[3, 4], DType::F32).unwrap();
    let model = Params(vec![("w".into(), w)]);
    let invalid = |r: fitgrad::Result<Pruner>| {
        assert!(
            matches!(r, Err(Error::InvalidArgument { .. })),
            "{:?}",
            r.err()
        )
    };
    for s in [1.0, 1.5, -0.1, f32::NAN] {
        invalid(Pruner::new(&model, PruneConfig::new(s)));
    }
    let mut cfg = PruneConfig::new(0.5);
    cfg.schedule = PruneSchedule::cubic(10, 10, 1);
    invalid(Pruner::new(&model, cfg.clone()));
    cfg.schedule = PruneSchedule::cubic(0, 10, 0);
    invalid(Pruner::new(&model, cfg.clone()));
    cfg.schedule = PruneSchedule::Cubic {
        initial_sparsity: 0.6,
        start_step: 0,
        end_step: 10,
        every: 1,
    };
    invalid(Pruner::new(&model, cfg));
    invalid(Pruner::new(
        &model,
        PruneConfig::new(0.5).with_filter(|_, d| d.len() == 1),
    ));
    let mut p = Pruner::new(&model, PruneConfig::new(0.5)).unwrap();
    assert!(matches!(p.prune(1.0), Err(Error::InvalidArgument { .. })));
}

/// The embedded digits, split once per test binary.
fn digits() -> &'static (Dataset, Dataset) {
    static DIGITS: OnceLock<(Dataset, Dataset)> = OnceLock::new();
    DIGITS.get_or_init(|| data::load("digits", 0).expect("the embedded digits load"))
}

common::device_tests!(
    one_shot_matches_reference,
    gradual_pruning_holds_through_training,
    eighty_percent_costs_at_most_two_points,
    plan_counts_the_masks,
    mask_zeros_adopts_loaded_zeros,
    bad_settings_are_typed_errors,
);
