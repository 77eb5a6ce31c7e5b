//! Batch-invariant sums (`TrainerConfig::batch_invariant`, src/tensor/invariant.rs): the weight
//! gradients of conv2d (weight and bias, through the kernel even for a 1x1), a matmul's shared
//! right operand and bias, and group norm's affine are the same bits whether a batch runs whole
//! or as consecutive runs of samples whose gradients accumulate, on random shapes with every
//! edge (batch 1, odd sizes, stride, dilation, depthwise, 7x7); each agrees with the default
//! path within f32 rounding (the default path is checked against f64 loops and finite
//! differences in tests/conv2d.rs, tests/matmul.rs and tests/cnn.rs). Through the trainer, a
//! group-norm ResNet's weights after two steps are the same bits for every micro-batch size,
//! with a batch (10) whose 1 / batch is inexact; a loss the trainer cannot weigh, and a
//! precision other than f32, are typed errors. Each test has its own device: the mode is a device's.

use crate::common;

use common::{fresh_device, host_data, HostRng};
use fitgrad::nn::{self, AvgPool2d, Conv2d, GroupNorm, Linear, Module};
use fitgrad::optim::Sgd;
use fitgrad::tensor::invariant::set_batch_invariant;
use fitgrad::train::data::Dataset;
use fitgrad::train::{ClassBatch, Precision, StepContext, TrainModel, Trainer, TrainerConfig};
use fitgrad::{Conv2dOptions, Device, DeviceOptions, Error, MatmulOptions, Result, Tensor};

fn device() -> Option<Device> {
    fresh_device(DeviceOptions::default())
}

fn leaf(dev: &Device, seed: u64, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    let mut t = Tensor::from_slice(dev, &host_data(seed, n, -1.0, 1.0), dims).unwrap();
    t.set_requires_grad(true);
    t
}

fn data(dev: &Device, seed: u64, dims: &[usize]) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_slice(dev, &host_data(seed, n, -1.0, 1.0), dims).unwrap()
}

fn grads(params: &[&Tensor]) -> Vec<Vec<f32>> {
    params
        .iter()
        .map(|p| p.grad().expect("a gradient").to_vec_f32().unwrap())
        .collect()
}

/// The parameters' gradients of sum(f(x) * r) over the samples of x and r, the batch run as
/// `runs` (consecutive sample counts adding up to the batch), accumulated.
fn split_grads(
    params: &[&Tensor],
    x: &Tensor,
    r: &Tensor,
    runs: &[usize],
    f: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Vec<Vec<f32>> {
    params.iter().for_each(|p| p.zero_grad());
    let mut start = 0;
    for &len in runs {
        let y = f(&x.narrow(0, start, len).unwrap()).unwrap();
        let loss = y
            .mul(&r.narrow(0, start, len).unwrap())
            .unwrap()
            .sum()
            .unwrap();
        loss.backward().unwrap();
        start += len;
    }
    assert_eq!(start, x.dims()[0]);
    grads(params)
}

/// Gradients the same bits for the whole batch, two runs and one sample at a time, and within
/// f32 rounding of the default path's.
fn check_splits(
    dev: &Device,
    what: &str,
    params: &[&Tensor],
    x: &Tensor,
    r: &Tensor,
    f: &dyn Fn(&Tensor) -> Result<Tensor>,
) {
    let n = x.dims()[0];
    set_batch_invariant(dev, false);
    let default = split_grads(params, x, r, &[n], f);
    set_batch_invariant(dev, true);
    let whole = split_grads(params, x, r, &[n], f);
    let cut = 1 + n / 3;
    let mut splits = vec![vec![1; n]];
    if n > 1 {
        splits.push(vec![cut.min(n - 1), n - cut.min(n - 1)]);
    }
    for runs in splits {
        let got = split_grads(params, x, r, &runs, f);
        for (k, (a, b)) in whole.iter().zip(&got).enumerate() {
            let same = a.iter().zip(b).all(|(u, v)| u.to_bits() == v.to_bits());
            assert!(same, "{what}: parameter {k} differs in runs {runs:?}");
        }
    }
    for (k, (a, b)) in whole.iter().zip(&default).enumerate() {
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let worst = a.iter().zip(b).fold(0f32, |m, (u, v)| m.max((u - v).abs()));
        assert!(
            worst <= 1e-5 * scale,
            "{what}: parameter {k} {worst} from the default path"
        );
    }
    set_batch_invariant(dev, false);
}

#[test]
fn conv2d_weight_and_bias_gradients_fold_across_splits() {
    let Some(dev) = device() else { return };
    let mut rng = HostRng::new(11);
    // (n, c, side, oc, kernel, stride, padding, dilation, groups)
    let mut cases = vec![
        (1, 3, 5, 4, 3, 1, 1, 1, 1),
        (5, 4, 7, 6, 3, 2, 1, 1, 2),
        (4, 6, 6, 6, 3, 1, 2, 2, 6),
        (3, 2, 9, 5, 7, 1, 3, 1, 1),
        (6, 8, 4, 5, 1, 1, 0, 1, 1),
        (7, 5, 5, 3, 1, 2, 0, 1, 1),
    ];
    for _ in 0..3 {
        let mut below = |k: u64| (rng.next_u64() % k) as usize;
        let g = [1, 2][below(2)];
        cases.push((
            1 + below(6),
            g * (1 + below(4)),
            3 + below(6),
            g * (1 + below(5)),
            [1, 3, 5][below(3)],
            1 + below(2),
            below(3),
            1,
            g,
        ));
    }
    for (i, &(n, c, side, oc, k, s, p, d, g)) in cases.iter().enumerate() {
        let opts = Conv2dOptions::new()
            .stride(s)
            .padding(p)
            .dilation(d)
            .groups(g);
        let out = (side + 2 * p - d * (k - 1) - 1) / s + 1;
        let x = data(&dev, 100 + i as u64, &[n, c, side, side]);
        let r = data(&dev, 200 + i as u64, &[n, oc, out, out]);
        let w = leaf(&dev, 300 + i as u64, &[oc, c / g, k, k]);
        let b = leaf(&dev, 400 + i as u64, &[oc]);
        let f = |x: &Tensor| x.conv2d(&w, Some(&b), &opts);
        check_splits(&dev, &format!("conv case {i}"), &[&w, &b], &x, &r, &f);
    }
}

#[test]
fn matmul_and_group_norm_gradients_fold_across_splits() {
    let Some(dev) = device() else { return };
    // A Linear: x (n, in) · Wᵀ + b, and W stored (in, out); rows of a rank-3 x are samples' rows.
    for (i, &(n, t, fin, fout)) in [(1, 1, 5, 3), (9, 1, 17, 10), (4, 3, 8, 33)]
        .iter()
        .enumerate()
    {
        let dims: Vec<usize> = if t == 1 {
            vec![n, fin]
        } else {
            vec![n, t, fin]
        };
        let ydims: Vec<usize> = if t == 1 {
            vec![n, fout]
        } else {
            vec![n, t, fout]
        };
        let x = data(&dev, 10 + i as u64, &dims);
        let r = data(&dev, 20 + i as u64, &ydims);
        let w = leaf(&dev, 30 + i as u64, &[fout, fin]);
        let b = leaf(&dev, 40 + i as u64, &[fout]);
        let f = |x: &Tensor| x.matmul_with(&w, &MatmulOptions::new().trans_b(true).bias(&b));
        check_splits(&dev, &format!("linear case {i}"), &[&w, &b], &x, &r, &f);
        let wt = leaf(&dev, 50 + i as u64, &[fin, fout]);
        let f = |x: &Tensor| x.matmul(&wt);
        check_splits(&dev, &format!("matmul case {i}"), &[&wt], &x, &r, &f);
    }
    for (i, &(n, c, groups, side)) in [(1, 4, 2, 3), (6, 6, 3, 5), (5, 8, 1, 1)]
        .iter()
        .enumerate()
    {
        let x = data(&dev, 60 + i as u64, &[n, c, side, side]);
        let r = data(&dev, 70 + i as u64, &[n, c, side, side]);
        let gamma = leaf(&dev, 80 + i as u64, &[c]);
        let beta = leaf(&dev, 90 + i as u64, &[c]);
        let f = |x: &Tensor| x.group_norm(groups, Some(&gamma), Some(&beta), 1e-5);
        check_splits(
            &dev,
            &format!("group norm case {i}"),
            &[&gamma, &beta],
            &x,
            &r,
            &f,
        );
    }
}

/// A small ResNet-like model: conv (bias) -> group norm -> relu -> strided conv + 1x1 skip ->
/// group norm -> relu -> global average pool -> Linear; the loss one cross-entropy (or, to be
/// refused, twice it).
struct Net {
    stem: Conv2d,
    norm1: GroupNorm,
    conv: Conv2d,
    skip: Conv2d,
    norm2: GroupNorm,
    head: Linear,
    doubled: bool,
}

fitgrad::module! {
    impl Module for Net {
        params { stem, norm1, conv, skip, norm2, head }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let b = x.dims()[0];
            let x = x.reshape(&[b, 1, 6, 6])?;
            let h = self.norm1.forward(&self.stem.forward(&x)?)?.relu()?;
            let h = self.conv.forward(&h)?.add(&self.skip.forward(&h)?)?;
            let h = self.norm2.forward(&h)?.relu()?;
            let pooled = AvgPool2d::global().forward(&h)?.flatten(1)?;
            self.head.forward(&pooled)
        }
    }
}

impl TrainModel<ClassBatch> for Net {
    fn forward_loss(&self, b: &ClassBatch, ctx: &StepContext) -> Result<Tensor> {
        let logits = self.forward(&b.x.to_device(&ctx.device)?)?;
        let loss = nn::cross_entropy(&logits, &b.y)?;
        if self.doubled {
            loss.mul_scalar(2.0)
        } else {
            Ok(loss)
        }
    }
}

fn net(dev: &Device, doubled: bool) -> Net {
    let c3 = Conv2dOptions::new().padding(1);
    Net {
        stem: Conv2d::new(dev, 1, 4, 3, c3, true, 1).unwrap(),
        norm1: GroupNorm::new(dev, 2, 4).unwrap(),
        conv: Conv2d::new(dev, 4, 6, 3, c3.stride(2), false, 2).unwrap(),
        skip: Conv2d::new(dev, 4, 6, 1, Conv2dOptions::new().stride(2), false, 3).unwrap(),
        norm2: GroupNorm::new(dev, 3, 6).unwrap(),
        head: Linear::new(dev, 6, 3, 4).unwrap(),
        doubled,
    }
}

fn images(rows: usize) -> Dataset {
    Dataset {
        name: "noise".into(),
        features: host_data(5, rows * 36, 0.0, 1.0),
        labels: (0..rows).map(|i| (i % 3) as u32).collect(),
        dim: 36,
        classes: 3,
    }
}

/// The weights after two SGD steps on batches of 10, micro-batches of `micro`.
fn trained(micro: Option<usize>, invariant: bool) -> Vec<Vec<f32>> {
    let dev = device().expect("checked by the caller");
    let model = net(&dev, false);
    let opt = Box::new(
        Sgd::new(model.parameters(), 0.1)
            .unwrap()
            .momentum(0.9)
            .unwrap(),
    );
    let mut cfg = TrainerConfig::new(10, 1, 0.1).batch_invariant(invariant);
    cfg.micro_batch = micro;
    let mut trainer = Trainer::new(model, opt, cfg).unwrap();
    let data = images(20);
    let order: Vec<usize> = (0..20).rev().collect();
    for batch in order.chunks(10) {
        trainer.step(&data, batch).unwrap();
    }
    assert_eq!(trainer.micro_batch(), micro.unwrap_or(10));
    common::param_values(&trainer.model)
}

#[test]
fn a_group_norm_resnet_trains_to_the_same_bits_for_any_micro_batch() {
    if device().is_none() {
        return;
    }
    let whole = trained(None, true);
    for micro in [1, 3, 4, 7] {
        assert!(
            whole == trained(Some(micro), true),
            "micro-batches of {micro}"
        );
    }
    // The same training as the default sums, up to their rounding.
    let default = trained(None, false);
    let worst = common::worst_rel_diff(&whole, &default);
    assert!(worst < 1e-5, "{worst}");
}

#[test]
fn a_loss_the_trainer_cannot_weigh_is_a_typed_error() {
    let Some(dev) = device() else { return };
    let model = net(&dev, true);
    let opt = Box::new(Sgd::new(model.parameters(), 0.1).unwrap());
    let cfg = TrainerConfig::new(4, 1, 0.1).batch_invariant(true);
    let mut trainer = Trainer::new(model, opt, cfg).unwrap();
    let data = images(4);
    match trainer.step(&data, &[0, 1, 2, 3]) {
        Err(Error::InvalidArgument { op, reason }) => {
            assert_eq!(op, "Trainer::step (batch_invariant)");
            assert!(reason.contains("cross_entropy"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // The process goes on: the same model, its loss as it is, steps.
    trainer.model.doubled = false;
    trainer.step(&data, &[0, 1, 2, 3]).unwrap();
    // f16 weights would round each micro-batch's sums apart: refused before any step.
    let model = net(&dev, false);
    let opt = Box::new(Sgd::new(model.parameters(), 0.1).unwrap());
    let cfg = TrainerConfig::new(4, 1, 0.1)
        .precision(Precision::Mixed)
        .batch_invariant(true);
    match Trainer::new(model, opt, cfg).err() {
        Some(Error::InvalidArgument { op, reason }) => {
            assert_eq!(op, "Trainer::new");
            assert!(reason.contains("f32"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}
