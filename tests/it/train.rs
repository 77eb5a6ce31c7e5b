//! The training loop end to end: gradient accumulation and micro-batching give the weights of one
//! big batch, steady-state steps create no buffer, the same seeds give bitwise the same run, one
//! to three steps match a plain-loop f64 CPU implementation of the MLP and of torch's SGD and
//! AdamW, a short run on the embedded digits learns, evaluation records nothing, and bad
//! configurations or batches are typed errors that leave the trainer usable.

use crate::common;

use common::*;
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{Device, DeviceOptions, Error, MemoryStats, Tensor};
use std::sync::OnceLock;

device_tests!(one_step_matches_cpu_reference);

/// Seed of the digits split, the models and the epoch orders.
const SEED: u64 = 7;

/// The embedded digits, split once per test binary: (train, test).
fn digits() -> &'static (Dataset, Dataset) {
    static DIGITS: OnceLock<(Dataset, Dataset)> = OnceLock::new();
    DIGITS.get_or_init(|| data::load("digits", SEED).expect("the embedded digits load"))
}

/// The first device of `common::devices()`, or `None` after its loud SKIPPED.
fn first_device() -> Option<Device> {
    devices().into_iter().next()
}

/// Batching of a trainer; `trainer()` sets the learning rate from the optimizer.
fn config(batch_size: usize, accum_steps: usize, micro_batch: Option<usize>) -> TrainerConfig {
    let mut config = TrainerConfig::default()
        .batch_size(batch_size)
        .accum_steps(accum_steps);
    config.micro_batch = micro_batch;
    config
}

/// A relu MLP of `widths` seeded with `SEED`, its optimizer, and a trainer with `cfg` (whose
/// learning rate is the optimizer's).
fn trainer(dev: &Device, widths: &[usize], opt: Opt, cfg: TrainerConfig) -> Trainer<Mlp> {
    let model = Mlp::new(dev, widths, Activation::Relu, SEED).expect("model");
    let optimizer = opt.build(model.parameters());
    Trainer::new(model, optimizer, cfg.lr(opt.lr())).expect("trainer")
}

/// Every parameter by name, read back.
fn weights(t: &Trainer<Mlp>) -> Vec<(String, Vec<f32>)> {
    t.model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            let v = p
                .to_vec::<f32>()
                .unwrap_or_else(|e| panic!("readback of {n}: {e}"));
            (n, v)
        })
        .collect()
}

/// max |a - b| / max |a| (the size of a difference relative to the tensor's scale).
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs())
        .fold(0.0, f64::max);
    let scale = a.iter().map(|x| (*x as f64).abs()).fold(0.0, f64::max);
    diff / scale.max(1e-30)
}

/// Asserts every parameter of `b` is within `rel` of `a`'s (relative to each tensor's largest
/// magnitude); returns the worst relative difference.
fn assert_weights_close(what: &str, a: &Trainer<Mlp>, b: &Trainer<Mlp>, rel: f64) -> f64 {
    let (wa, wb) = (weights(a), weights(b));
    let mut worst = 0.0f64;
    for ((na, va), (nb, vb)) in wa.iter().zip(&wb) {
        assert_eq!(na, nb);
        assert!(
            va.iter().all(|x| x.is_finite()),
            "{what}: {na} is not finite"
        );
        let d = rel_diff(va, vb);
        assert!(
            d <= rel,
            "{what}: {na} differs by {d:e} relative (max |a-b| / max |a|), allowed {rel:e}"
        );
        worst = worst.max(d);
    }
    worst
}

/// The f32 bits of every parameter.
fn weight_bits(t: &Trainer<Mlp>) -> Vec<(String, Vec<u32>)> {
    weights(t)
        .into_iter()
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

/// The memory statistics once the queue is idle.
fn settled_stats(dev: &Device) -> MemoryStats {
    dev.sync().expect("sync");
    dev.memory_stats()
}

// ---------------------------------------------------------------------------------------------
// 1. Gradient accumulation and micro-batching
// ---------------------------------------------------------------------------------------------

/// `--batch-size 64 --accum-steps 1` and `--batch-size 16 --accum-steps 4` (same seed, SGD with
/// momentum) give the same weights after one epoch of digits within 1e-5 relative; so does
/// batch 64 run as micro-batches of 8. Only the order of float additions differs: four
/// backward passes add their (exactly scaled) gradients in place instead of one matmul summing
/// all 64 rows.
#[test]
fn accumulation_matches_one_big_batch() {
    let Some(dev) = first_device() else {
        return;
    };
    let (train, _) = digits();
    let widths = [train.dim, 32, train.classes];
    let opt = Opt::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    let run = |cfg: TrainerConfig| {
        let mut t = trainer(&dev, &widths, opt, cfg);
        t.train_epoch(train, SEED, 0, |_, _, _| Ok(()))
            .expect("one epoch");
        t
    };
    let big = run(config(64, 1, None));
    let steps = train.len().div_ceil(64) as u64;
    assert_eq!(big.steps(), steps);
    for (what, cfg) in [
        ("batch 16 x accum 4", config(16, 4, None)),
        ("batch 64, micro-batch 8", config(64, 1, Some(8))),
        ("batch 32 x accum 2, micro-batch 8", config(32, 2, Some(8))),
    ] {
        let t = run(cfg);
        assert_eq!(t.steps(), steps, "{what}");
        assert_eq!(t.effective_batch(), 64, "{what}");
        let what = format!("{what} vs batch 64 on {}", label(&dev));
        let worst = assert_weights_close(&what, &big, &t, 1e-5);
        eprintln!("{what}: worst relative difference {worst:e}");
    }
    // The epoch did train: the weights moved well beyond the tolerance.
    let fresh = trainer(&dev, &widths, opt, config(64, 1, None));
    let moved = weights(&fresh)
        .iter()
        .zip(weights(&big))
        .map(|((_, a), (_, b))| rel_diff(a, &b))
        .fold(0.0, f64::max);
    assert!(
        moved > 1e-2,
        "one epoch barely moved the weights ({moved:e})"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Steady state: no buffer created after the first step
// ---------------------------------------------------------------------------------------------

/// A source of fixed-size batches: `batches` distinct (x, y) pairs, cycled.
struct Batches {
    xs: Vec<Vec<f32>>,
    ys: Vec<Vec<u32>>,
}

impl Batches {
    /// Uniform random inputs in [0, 1) and random labels.
    fn random(n: usize, dim: usize, classes: usize, batches: usize) -> Batches {
        let mut rng = HostRng::new(SEED);
        let xs = (0..batches)
            .map(|i| host_data(1000 + i as u64, n * dim, 0.0, 1.0))
            .collect();
        let ys = (0..batches)
            .map(|_| {
                (0..n)
                    .map(|_| (rng.next_u64() % classes as u64) as u32)
                    .collect()
            })
            .collect();
        Batches { xs, ys }
    }

    /// Consecutive rows of `d`.
    fn from_dataset(d: &Dataset, n: usize, batches: usize) -> Batches {
        assert!(n * batches <= d.len());
        let (mut xs, mut ys) = (Vec::new(), Vec::new());
        for i in 0..batches {
            let idx: Vec<usize> = (i * n..(i + 1) * n).collect();
            let (mut x, mut y) = (Vec::new(), Vec::new());
            d.gather(&idx, &mut x, &mut y);
            xs.push(x);
            ys.push(y);
        }
        Batches { xs, ys }
    }

    fn get(&self, step: usize) -> (&[f32], &[u32]) {
        let i = step % self.xs.len();
        (&self.xs[i], &self.ys[i])
    }
}

/// After the first `Trainer::step` (which creates the optimizer state), 21 more steps create no
/// wgpu buffer and leave the bytes reserved and in use unchanged: the arena reuses the blocks of
/// the previous step. Runs a model whose tensors take the large-segment path ([784, 256, 10],
/// batch 128: 784 KiB weight, 392 KiB input) and the digits model with accumulation, each with
/// AdamW and with SGD + momentum, each on a device of its own so no other test shows in the
/// statistics.
#[test]
fn steady_state_creates_no_buffers() {
    let (train, _) = digits();
    let cases: Vec<(&str, Vec<usize>, TrainerConfig, Batches)> = vec![
        (
            "[784, 256, 10] batch 128",
            vec![784, 256, 10],
            config(128, 1, None),
            Batches::random(128, 784, 10, 3),
        ),
        (
            "digits [64, 32, 10] batch 32 x accum 2",
            vec![train.dim, 32, train.classes],
            config(32, 2, None),
            Batches::from_dataset(train, 64, 3),
        ),
    ];
    let opts = [
        Opt::AdamW { lr: 1e-3 },
        Opt::Sgd {
            lr: 0.01,
            momentum: 0.9,
        },
    ];
    for (name, widths, cfg, batches) in &cases {
        for opt in opts {
            let Some(dev) = fresh_device(DeviceOptions::default()) else {
                return;
            };
            let what = format!("{name}, {opt:?} on {}", label(&dev));
            let mut t = trainer(&dev, widths, opt, cfg.clone());
            let step = |t: &mut Trainer<Mlp>, i: usize| {
                let (x, y) = batches.get(i);
                t.step_rows(x, y)
                    .unwrap_or_else(|e| panic!("{what}: step {i}: {e}"));
            };
            step(&mut t, 0);
            let first = settled_stats(&dev);
            assert!(
                t.optimizer.state_bytes() > 0,
                "{what}: the first step creates the optimizer state"
            );
            step(&mut t, 1);
            let second = settled_stats(&dev);
            for i in 2..22 {
                step(&mut t, i);
            }
            let last = settled_stats(&dev);
            assert!(
                t.take_loss().unwrap().is_finite(),
                "{what}: the loss is finite"
            );
            eprintln!(
                "{what}: buffers created after step 1: {}, after step 2: {}, after step 22: {}; \
                 reserved {} / {} / {}",
                first.buffers_created,
                second.buffers_created,
                last.buffers_created,
                first.bytes_reserved,
                second.bytes_reserved,
                last.bytes_reserved
            );
            assert_eq!(
                (second.buffers_created, second.bytes_reserved),
                (first.buffers_created, first.bytes_reserved),
                "{what}: the second step created buffers (the first step should reach the \
                 steady state)\nafter step 1: {first:?}\nafter step 2: {second:?}"
            );
            assert_eq!(
                last.buffers_created, first.buffers_created,
                "{what}: steps 2..=22 created buffers\nafter step 1: {first:?}\nafter: {last:?}"
            );
            assert_eq!(
                last.bytes_reserved, first.bytes_reserved,
                "{what}: bytes reserved changed\nafter step 1: {first:?}\nafter: {last:?}"
            );
            assert_eq!(
                last.bytes_in_use, first.bytes_in_use,
                "{what}: bytes in use changed between steps (a leak)"
            );
            assert_eq!(last.buffers_released, 0, "{what}: {last:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Reproducibility
// ---------------------------------------------------------------------------------------------

/// Per-epoch losses and final weights of 2 epochs of digits with AdamW.
fn two_epochs(dev: &Device) -> (Vec<u32>, Vec<(String, Vec<u32>)>) {
    let (train, _) = digits();
    let mut t = trainer(
        dev,
        &[train.dim, 32, train.classes],
        Opt::AdamW { lr: 3e-3 },
        config(64, 1, None),
    );
    let mut losses = Vec::new();
    for epoch in 0..2 {
        t.train_epoch(train, SEED, epoch, |_, _, _| Ok(()))
            .expect("epoch");
        let loss = t.take_loss().expect("loss");
        assert!(loss.is_finite(), "epoch {epoch} loss {loss}");
        losses.push(loss.to_bits());
    }
    (losses, weight_bits(&t))
}

/// Two trainers with the same seeds on one device, and a third on a fresh device of the same
/// adapter, give bitwise the same epoch losses and final weights.
#[test]
fn same_seed_same_loss_bitwise() {
    let Some(dev) = first_device() else {
        return;
    };
    let (l1, w1) = two_epochs(&dev);
    let (l2, w2) = two_epochs(&dev);
    let what = label(&dev);
    assert!(
        f32::from_bits(l1[1]) < f32::from_bits(l1[0]),
        "{what}: the loss falls from epoch 1 to 2: {:?}",
        l1.iter().map(|b| f32::from_bits(*b)).collect::<Vec<_>>()
    );
    assert_eq!(
        l1, l2,
        "{what}: epoch losses (f32 bits) of two runs on one device"
    );
    assert!(
        w1 == w2,
        "{what}: final weights of two runs on one device differ"
    );
    let info = dev.info();
    if let Some(fresh) = fresh_device(
        DeviceOptions::default()
            .backend(info.adapter.backend.clone())
            .adapter(info.adapter.name.clone()),
    ) {
        let (l3, w3) = two_epochs(&fresh);
        assert_eq!(l1, l3, "{what}: epoch losses on a fresh device");
        assert!(w1 == w3, "{what}: final weights on a fresh device differ");
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Against a plain-loop f64 CPU implementation
// ---------------------------------------------------------------------------------------------

/// One layer of the reference MLP: W (out, in) row-major as torch, b (out).
#[derive(Clone)]
struct RefLayer {
    w: Vec<f64>,
    b: Vec<f64>,
    inp: usize,
    out: usize,
}

/// Gradients of one layer and, for each element, the sum of the magnitudes of the terms that
/// made it (the scale of its f32 rounding error: a gradient much smaller than its scale is a
/// cancellation whose sign f32 arithmetic may not get right).
struct RefGrad {
    w: Vec<f64>,
    b: Vec<f64>,
    w_scale: Vec<f64>,
    b_scale: Vec<f64>,
}

/// Mean softmax cross-entropy of the relu MLP `layers` (no activation after the last) on
/// `x` (n, in) and labels `y`, and the gradients of every layer, with plain loops in f64.
fn ref_loss_and_grads(layers: &[RefLayer], x: &[f32], y: &[u32]) -> (f64, Vec<RefGrad>) {
    let n = y.len();
    // Forward: the input of every layer, and every pre-activation.
    let mut inputs: Vec<Vec<f64>> = vec![x.iter().map(|&v| v as f64).collect()];
    let mut pre: Vec<Vec<f64>> = Vec::new();
    for (l, layer) in layers.iter().enumerate() {
        let h = &inputs[l];
        let mut z = vec![0.0f64; n * layer.out];
        for r in 0..n {
            for o in 0..layer.out {
                let mut acc = layer.b[o];
                for i in 0..layer.inp {
                    acc += h[r * layer.inp + i] * layer.w[o * layer.inp + i];
                }
                z[r * layer.out + o] = acc;
            }
        }
        if l + 1 < layers.len() {
            inputs.push(z.iter().map(|&v| v.max(0.0)).collect());
        }
        pre.push(z);
    }
    // Loss and d loss / d logits = (softmax - onehot) / n.
    let c = layers.last().unwrap().out;
    let logits = pre.last().unwrap();
    let mut loss = 0.0f64;
    let mut dz = vec![0.0f64; n * c];
    for r in 0..n {
        let row = &logits[r * c..(r + 1) * c];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        loss += m + s.ln() - row[y[r] as usize];
        for j in 0..c {
            let hot = if j == y[r] as usize { 1.0 } else { 0.0 };
            dz[r * c + j] = ((row[j] - m).exp() / s - hot) / n as f64;
        }
    }
    let mut dz_scale: Vec<f64> = dz.iter().map(|v| v.abs()).collect();
    // Backward, last layer first.
    let mut grads: Vec<RefGrad> = Vec::new();
    for l in (0..layers.len()).rev() {
        let layer = &layers[l];
        let h = &inputs[l];
        let (inp, out) = (layer.inp, layer.out);
        let mut g = RefGrad {
            w: vec![0.0; out * inp],
            b: vec![0.0; out],
            w_scale: vec![0.0; out * inp],
            b_scale: vec![0.0; out],
        };
        for o in 0..out {
            for i in 0..inp {
                for r in 0..n {
                    g.w[o * inp + i] += dz[r * out + o] * h[r * inp + i];
                    g.w_scale[o * inp + i] += dz_scale[r * out + o] * h[r * inp + i].abs();
                }
            }
            for r in 0..n {
                g.b[o] += dz[r * out + o];
                g.b_scale[o] += dz_scale[r * out + o];
            }
        }
        grads.push(g);
        if l > 0 {
            // d loss / d input, through the previous layer's relu.
            let z_prev = &pre[l - 1];
            let mut dh = vec![0.0f64; n * inp];
            let mut dh_scale = vec![0.0f64; n * inp];
            for r in 0..n {
                for i in 0..inp {
                    if z_prev[r * inp + i] <= 0.0 {
                        continue;
                    }
                    for o in 0..out {
                        dh[r * inp + i] += dz[r * out + o] * layer.w[o * inp + i];
                        dh_scale[r * inp + i] += dz_scale[r * out + o] * layer.w[o * inp + i].abs();
                    }
                }
            }
            dz = dh;
            dz_scale = dh_scale;
        }
    }
    grads.reverse();
    (loss / n as f64, grads)
}

/// torch's SGD without momentum (p -= lr g) or AdamW, per element, in f64; keeps the moments.
struct RefOptimizer {
    opt: Opt,
    t: i32,
    /// Per layer: (m, v) of the weights and of the biases.
    m: Vec<[Vec<f64>; 2]>,
    v: Vec<[Vec<f64>; 2]>,
}

const BETA1: f64 = 0.9;
const BETA2: f64 = 0.999;
const EPS: f64 = 1e-8;
const WEIGHT_DECAY: f64 = 0.01;

impl RefOptimizer {
    fn new(opt: Opt, layers: &[RefLayer]) -> RefOptimizer {
        let zeros = |l: &RefLayer| [vec![0.0; l.w.len()], vec![0.0; l.b.len()]];
        RefOptimizer {
            opt,
            t: 0,
            m: layers.iter().map(zeros).collect(),
            v: layers.iter().map(zeros).collect(),
        }
    }

    /// One update with the gradients `grads`, each element moved by `shift` times its rounding
    /// scale (0 for the reference itself; +-c to see how far f32 noise of relative size c in
    /// the gradients can move the result).
    fn step(&mut self, layers: &mut [RefLayer], grads: &[RefGrad], shift: f64) {
        self.t += 1;
        for (l, (layer, g)) in layers.iter_mut().zip(grads).enumerate() {
            let parts = [
                (&mut layer.w, &g.w, &g.w_scale),
                (&mut layer.b, &g.b, &g.b_scale),
            ];
            for (k, (p, g, scale)) in parts.into_iter().enumerate() {
                for e in 0..p.len() {
                    let g = g[e] + shift * scale[e];
                    match self.opt {
                        Opt::Sgd { lr, momentum } => {
                            assert_eq!(momentum, 0.0, "the reference SGD has no momentum");
                            p[e] -= lr as f64 * g;
                        }
                        Opt::AdamW { lr } => {
                            let lr = lr as f64;
                            let m = &mut self.m[l][k][e];
                            let v = &mut self.v[l][k][e];
                            *m = BETA1 * *m + (1.0 - BETA1) * g;
                            *v = BETA2 * *v + (1.0 - BETA2) * g * g;
                            let m_hat = *m / (1.0 - BETA1.powi(self.t));
                            let v_hat = *v / (1.0 - BETA2.powi(self.t));
                            p[e] *= 1.0 - lr * WEIGHT_DECAY;
                            p[e] -= lr * m_hat / (v_hat.sqrt() + EPS);
                        }
                    }
                }
            }
        }
    }
}

/// The relative size of f32 rounding noise in a gradient, against the sum of the magnitudes of
/// its terms (a few tens of terms of unit roundoff 6e-8, with room).
const GRAD_NOISE: f64 = 1e-5;

/// From the GPU model's initial weights, 3 trainer steps on 3 different batches of digits give
/// the weights of the f64 reference (forward, cross-entropy, backward, then SGD or torch's
/// AdamW) within 1e-4 relative to each tensor's largest weight, and the mean loss within 1e-5.
/// Accumulated and micro-batched configurations (2 x 24 rows) must match the one-batch
/// reference too. On every device.
///
/// AdamW normalizes each gradient element, so an element whose gradient is a cancellation
/// (|g| near its f32 noise) moves by about lr in a direction f32 cannot settle. Each element
/// is therefore also allowed the spread of the reference's result when every gradient element
/// is shifted by +-GRAD_NOISE of its rounding scale; fewer than 5% of the elements may need more
/// than the plain tolerance.
fn one_step_matches_cpu_reference(dev: &Device) {
    const STEPS: usize = 3;
    const N: usize = 48;
    let (train, _) = digits();
    let widths = [train.dim, 24, train.classes];
    let batches = Batches::from_dataset(train, N, STEPS);
    let sgd = Opt::Sgd {
        lr: 0.1,
        momentum: 0.0,
    };
    let adamw = Opt::AdamW { lr: 1e-2 };
    let cases = [
        (sgd, config(N, 1, None)),
        (sgd, config(24, 2, None)),
        (adamw, config(N, 1, None)),
        (adamw, config(N, 1, Some(24))),
    ];
    for (opt, cfg) in &cases {
        let what = format!(
            "{opt:?}, batch {} x accum {}, micro {:?} on {}",
            cfg.batch_size,
            cfg.accum_steps,
            cfg.micro_batch,
            label(dev)
        );
        let mut t = trainer(dev, &widths, *opt, cfg.clone());
        let init = weights(&t);
        let layers: Vec<RefLayer> = init
            .chunks(2)
            .zip(widths.windows(2))
            .map(|(wb, io)| {
                assert_eq!(wb[0].1.len(), io[0] * io[1], "{}", wb[0].0);
                RefLayer {
                    w: wb[0].1.iter().map(|&v| v as f64).collect(),
                    b: wb[1].1.iter().map(|&v| v as f64).collect(),
                    inp: io[0],
                    out: io[1],
                }
            })
            .collect();
        // The reference, and two copies updated with gradients shifted by -+GRAD_NOISE.
        let mut runs: Vec<(Vec<RefLayer>, RefOptimizer)> = (0..3)
            .map(|_| (layers.clone(), RefOptimizer::new(*opt, &layers)))
            .collect();
        let mut ref_loss = 0.0f64;
        for s in 0..STEPS {
            let (x, y) = batches.get(s);
            t.step_rows(x, y)
                .unwrap_or_else(|e| panic!("{what}: step {s}: {e}"));
            let (loss, grads) = ref_loss_and_grads(&runs[0].0, x, y);
            ref_loss += loss / STEPS as f64;
            for (i, (l, o)) in runs.iter_mut().enumerate() {
                o.step(l, &grads, [0.0, -GRAD_NOISE, GRAD_NOISE][i]);
            }
        }
        let loss = t.take_loss().expect("loss");
        assert!(
            ((loss as f64 - ref_loss) / ref_loss).abs() < 1e-5,
            "{what}: mean loss {loss}, reference {ref_loss}"
        );
        let got = weights(&t);
        let mut widened = 0usize;
        let mut total = 0usize;
        let mut worst = 0.0f64;
        for l in 0..layers.len() {
            for k in 0..2 {
                let part = |r: &RefLayer| -> Vec<f64> {
                    if k == 0 {
                        r.w.clone()
                    } else {
                        r.b.clone()
                    }
                };
                let want = part(&runs[0].0[l]);
                let (lo, hi) = (part(&runs[1].0[l]), part(&runs[2].0[l]));
                let (name, g) = &got[2 * l + k];
                let (_, start) = &init[2 * l + k];
                let scale = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
                let tol = 1e-4 * scale;
                let moved = want
                    .iter()
                    .zip(start)
                    .map(|(w, s)| (w - *s as f64).abs())
                    .fold(0.0, f64::max);
                assert!(
                    moved > 20.0 * tol,
                    "{what}: {name} barely moved ({moved:e})"
                );
                for e in 0..want.len() {
                    total += 1;
                    let spread = (lo[e] - want[e]).abs().max((hi[e] - want[e]).abs());
                    let allowed = tol + 2.0 * spread;
                    let d = (g[e] as f64 - want[e]).abs();
                    widened += (d > tol) as usize;
                    worst = worst.max(d / scale);
                    assert!(
                        d <= allowed,
                        "{what}: {name}[{e}] = {}, reference {} (|diff| {d:e}, allowed \
                         {allowed:e}: 1e-4 of the tensor's largest weight {scale:e} plus \
                         twice the noise spread {spread:e})",
                        g[e],
                        want[e]
                    );
                }
            }
        }
        assert!(
            widened * 20 < total,
            "{what}: {widened} of {total} elements needed more than 1e-4 relative"
        );
        eprintln!(
            "{what}: worst |diff| / max |w| {worst:e}; {widened} of {total} elements beyond \
             1e-4 relative, within noise"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Learning and evaluation
// ---------------------------------------------------------------------------------------------

/// Five epochs of digits ([64, 64, 10], AdamW 3e-3, batch 64) reach test accuracy >= 0.9.
/// Evaluation records no graph: the bytes in use return to their level before it, its forward
/// gives no tensor that requires grad, and grad mode is on again afterwards.
#[test]
fn train_mlp_digits_learns() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let (train, test) = digits();
    let mut t = trainer(
        &dev,
        &[train.dim, 64, train.classes],
        Opt::AdamW { lr: 3e-3 },
        config(64, 1, None),
    );
    let e0 = t.evaluate(test, 256).expect("evaluate");
    let (loss0, acc0) = (e0.loss, e0.accuracy.expect("accuracy"));
    let mut losses = Vec::new();
    for epoch in 0..5 {
        t.train_epoch(train, SEED, epoch, |_, _, _| Ok(()))
            .expect("epoch");
        losses.push(t.take_loss().expect("loss"));
    }
    let before = settled_stats(&dev);
    let e = t.evaluate(test, 100).expect("evaluate");
    let (loss, acc) = (e.loss, e.accuracy.expect("accuracy"));
    let after = settled_stats(&dev);
    eprintln!(
        "digits on {}: test loss {loss0:.4} -> {loss:.4}, accuracy {acc0:.3} -> {acc:.3}, \
         train losses {losses:?}",
        label(&dev)
    );
    assert!(fitgrad::is_grad_enabled(), "evaluate restores grad mode");
    assert_eq!(
        after.bytes_in_use, before.bytes_in_use,
        "evaluate left tensors alive\nbefore: {before:?}\nafter: {after:?}"
    );
    assert!(
        acc >= 0.9,
        "test accuracy {acc} after 5 epochs (loss {loss})"
    );
    assert!(loss < loss0, "test loss {loss0} -> {loss}");
    assert!(
        losses.windows(2).all(|w| w[1] < w[0] * 1.05) && losses[4] < losses[0],
        "train losses {losses:?}"
    );
    // The same forward under no_grad records nothing; with grad on it would.
    let x = Tensor::from_slice(&dev, &test.features[..32 * test.dim], &[32, test.dim]).unwrap();
    {
        let _g = fitgrad::no_grad();
        let logits = t.model.forward(&x).unwrap();
        assert!(
            !logits.requires_grad(),
            "logits under no_grad record a graph"
        );
    }
    assert!(t.model.forward(&x).unwrap().requires_grad());
    // Evaluating again gives the same numbers.
    assert_eq!(t.evaluate(test, 100).unwrap(), e);
}

// ---------------------------------------------------------------------------------------------
// 6. Errors
// ---------------------------------------------------------------------------------------------

/// Zero batch size, accumulation steps or micro-batch are `InvalidArgument`; a step whose x
/// and y do not fit (or that is empty) is `Shape`, counts no step, changes no weight, and the
/// trainer then trains normally.
#[test]
fn trainer_rejects_bad_config() {
    let Some(dev) = first_device() else {
        return;
    };
    let (train, _) = digits();
    let widths = [train.dim, 32, train.classes];
    let opt = Opt::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    for (what, cfg) in [
        ("batch_size 0", config(0, 1, None)),
        ("accum_steps 0", config(16, 0, None)),
        ("micro_batch Some(0)", config(16, 1, Some(0))),
    ] {
        let model = Mlp::new(&dev, &widths, Activation::Relu, SEED).unwrap();
        let optimizer = opt.build(model.parameters());
        match Trainer::new(model, optimizer, cfg).err() {
            Some(Error::InvalidArgument { op, .. }) => assert_eq!(op, "Trainer::new", "{what}"),
            Some(e) => panic!("{what}: expected InvalidArgument, got {e}"),
            None => panic!("{what}: accepted"),
        }
    }

    let mut t = trainer(&dev, &widths, opt, config(32, 2, None));
    let before = weight_bits(&t);
    let batch = Batches::from_dataset(train, 64, 1);
    let (x, y) = batch.get(0);
    let dim = train.dim;
    let bad: [(&str, &[f32], &[u32]); 5] = [
        ("x one row short", &x[..63 * dim], y),
        ("y one label short", x, &y[..63]),
        ("x not whole rows", &x[..64 * dim - 1], y),
        ("no sample", &[], &[]),
        ("x without labels", x, &[]),
    ];
    for (what, bx, by) in bad {
        match t.step_rows(bx, by) {
            Err(Error::Shape { .. }) => {}
            Err(e) => panic!("{what}: expected Error::Shape, got {e}"),
            Ok(()) => panic!("{what}: accepted"),
        }
    }
    assert_eq!(t.steps(), 0, "failed steps were counted");
    assert!(
        t.take_loss().unwrap().is_nan(),
        "failed steps reported a loss"
    );
    assert!(
        weight_bits(&t) == before,
        "a failed step changed the weights"
    );
    // The trainer still works.
    t.step_rows(x, y).expect("a good step after the errors");
    assert_eq!(t.steps(), 1);
    let loss = t.take_loss().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "loss {loss}");
    assert!(weight_bits(&t) != before, "the good step changed nothing");
}

/// A step that fails part way (a label out of range in its second micro-batch, found after the
/// first micro-batch's backward) must not leave that micro-batch's gradient or loss behind: the
/// next good step gives bitwise the weights and loss of a trainer that never saw the bad batch.
#[test]
fn failed_step_leaves_no_partial_gradient() {
    let Some(dev) = first_device() else {
        return;
    };
    let (train, _) = digits();
    let widths = [train.dim, 32, train.classes];
    let opt = Opt::Sgd {
        lr: 0.05,
        momentum: 0.9,
    };
    let batch = Batches::from_dataset(train, 64, 2);
    let (x, y) = batch.get(0);
    let (x2, y2) = batch.get(1);
    let mut bad_y = y2.to_vec();
    bad_y[40] = train.classes as u32;

    let mut a = trainer(&dev, &widths, opt, config(32, 2, None));
    match a.step_rows(x2, &bad_y) {
        Err(Error::InvalidArgument { .. }) => {}
        Err(e) => panic!("label out of range: expected InvalidArgument, got {e}"),
        Ok(()) => panic!("label out of range accepted"),
    }
    assert_eq!(a.steps(), 0);
    let mut problems = Vec::new();
    let left = a
        .model
        .parameters()
        .iter()
        .filter(|p| p.grad().is_some())
        .count();
    if left > 0 {
        problems.push(format!(
            "{left} parameters still hold a gradient after the failed step"
        ));
    }
    a.step_rows(x, y).unwrap();
    let mut b = trainer(&dev, &widths, opt, config(32, 2, None));
    b.step_rows(x, y).unwrap();
    let (la, lb) = (a.take_loss().unwrap(), b.take_loss().unwrap());
    if la.to_bits() != lb.to_bits() {
        problems.push(format!(
            "the next step's loss is {la}, without the failed step {lb}"
        ));
    }
    let (wa, wb) = (weights(&a), weights(&b));
    for ((name, va), (_, vb)) in wa.iter().zip(&wb) {
        if va != vb {
            problems.push(format!(
                "{name} after the next step differs from a trainer that never saw the failed \
                 step by {:e} relative",
                rel_diff(vb, va)
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "on {}:\n{}",
        label(&dev),
        problems.join("\n")
    );
}
