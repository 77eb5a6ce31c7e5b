//! Optimizer state that takes less device memory.
//!
//! 8-bit AdamW (`AdamW::eight_bit`): the map against bitsandbytes' formula; the device's
//! block-wise quantize / dequantize against a plain-loop host reference bit for bit (sizes 1,
//! odd, a partial last block, just under and over 4096, a block of zeros, f16 input); one fused
//! update against a host reference of the whole 8-bit step (f32 and f16 gradients, scalar and
//! quad paths); small tensors keeping f32 state; a short digits run against f32 AdamW with the
//! planner's peak equal to the measured one; checkpoint resume exact; errors.
//!
//! Optimizer offload (`AdamW::offload`, `TrainerConfig::offload_optimizer`): the host update
//! against the device's over several chunks (f32 and f16 gradients); the trainer with micro-batches and
//! mixed precision against the on-device run, loss by loss; nothing on the device, the host
//! bytes in the plan and the summary; checkpoints both ways; combinations it cannot serve.

use crate::common;

use common::*;
use fitgrad::checkpoint::{self, TrainingState};
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::optim::offload::{CHUNK, HOST_BYTES_PER_ELEMENT};
use fitgrad::optim::quant8::{dynamic_map, f32_adamw_state_bytes, midpoints, BLOCK, MIN_NUMEL};
use fitgrad::optim::Sgd;
use fitgrad::optim::{AdamW, Optimizer, Quantized};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::Precision;
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{DType, Device, Error, Tensor};

device_tests!(
    round_trip_matches_host_reference,
    update_matches_host_reference
);

// ---------------------------------------------------------------------------------------------
// The host reference: plain loops over the same block-wise algorithm
// ---------------------------------------------------------------------------------------------

/// bitsandbytes' `create_dynamic_map(signed, 7, 8)` written out as in its Python: per decade
/// i, `linspace(0.1, 1, items + 1)` and the means of neighbours, times 10^(i - 6).
fn bnb_map(signed: bool) -> Vec<f32> {
    let mut data = Vec::new();
    for i in 0..7 {
        let items = if signed { 1 << i } else { 2 << i };
        let b: Vec<f64> = (0..=items)
            .map(|j| 0.1 + 0.9 * j as f64 / items as f64)
            .collect();
        for j in 0..items {
            let mean = (b[j] + b[j + 1]) / 2.0;
            data.push(10f64.powi(i - 6) * mean);
            if signed {
                data.push(-(10f64.powi(i - 6) * mean));
            }
        }
    }
    data.extend([0.0, 1.0]);
    let mut m: Vec<f32> = data.into_iter().map(|v| v as f32).collect();
    m.sort_by(f32::total_cmp);
    m
}

/// Codes and per-block absmax of `x`: absmax = max |x| of the block; a value's code is the
/// number of midpoints t with t * absmax < x (counted one by one here, a binary search there).
fn ref_quantize(x: &[f32], signed: bool) -> (Vec<u8>, Vec<f32>) {
    let mid = midpoints(&dynamic_map(signed));
    let mut codes = Vec::new();
    let mut absmax = Vec::new();
    for block in x.chunks(BLOCK) {
        let a = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        absmax.push(a);
        for &v in block {
            codes.push(ref_code(v, a, &mid));
        }
    }
    (codes, absmax)
}

fn ref_code(x: f32, absmax: f32, mid: &[f32; 256]) -> u8 {
    let mut c = 0;
    for &t in &mid[..255] {
        if t * absmax < x {
            c += 1;
        }
    }
    c as u8
}

fn ref_dequantize(codes: &[u8], absmax: &[f32], signed: bool) -> Vec<f32> {
    let map = dynamic_map(signed);
    codes
        .iter()
        .enumerate()
        .map(|(i, &c)| map[c as usize] * absmax[i / BLOCK])
        .collect()
}

/// The bits of f32 values (so -0.0 and 0.0 differ).
fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Values spread over six decades, of both signs, so every part of the map is used.
fn spread(seed: u64, n: usize) -> Vec<f32> {
    let mut r = HostRng::new(seed);
    (0..n)
        .map(|_| {
            let mag = 10f32.powf(r.uniform(-6.0, 0.0)) * r.uniform(0.5, 3.0);
            if r.next_u64().is_multiple_of(2) {
                mag
            } else {
                -mag
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The map and the round trip
// ---------------------------------------------------------------------------------------------

#[test]
fn the_map_is_the_papers_dynamic_tree() {
    for signed in [true, false] {
        let map = dynamic_map(signed);
        assert_eq!(bits(&map), bits(&bnb_map(signed)), "signed {signed}");
        assert!(map.windows(2).all(|w| w[0] < w[1]), "ascending, distinct");
        assert_eq!(*map.last().unwrap(), 1.0);
        assert!(map.contains(&0.0));
        let negative = map.iter().filter(|&&v| v < 0.0).count();
        assert_eq!(negative, if signed { 127 } else { 0 });
        // The smallest magnitude is 10^-6 times the first decade's mean.
        let smallest = map
            .iter()
            .filter(|&&v| v > 0.0)
            .fold(1f32, |a, &b| a.min(b));
        let want = if signed { 0.55e-6 } else { 0.325e-6 };
        assert!((smallest - want).abs() < 1e-12, "{smallest}");
    }
}

fn round_trip_matches_host_reference(dev: &Device) {
    let sizes = [1, 3, 255, 256, 257, 1023, 4095, 4096, 4097, 2 * BLOCK + 6];
    for (k, &n) in sizes.iter().enumerate() {
        for signed in [true, false] {
            let mut x = spread(k as u64 + 10 * signed as u64, n);
            if !signed {
                x.iter_mut().for_each(|v| *v = v.abs());
            }
            if n > 2 * BLOCK {
                // A block of zeros (absmax 0) and an exact absmax.
                x[BLOCK..2 * BLOCK].iter_mut().for_each(|v| *v = 0.0);
                x[2 * BLOCK] = 1.0;
            }
            // f16 input on every other size: the kernel reads any storage.
            let dtype = dtype_for(dev, k % 2 == 1);
            let x = as_dtype(&x, dtype);
            let what = format!("{} n {n} signed {signed} {dtype}", label(dev));
            let q = Quantized::new(&upload(dev, &x, &[n], dtype), signed).unwrap();
            let (codes, absmax) = ref_quantize(&x, signed);
            assert_eq!(q.absmax().unwrap().len(), n.div_ceil(BLOCK), "{what}");
            assert_eq!(bits(&q.absmax().unwrap()), bits(&absmax), "{what}: absmax");
            let got = q.code_bytes().unwrap();
            if let Some(i) = (0..n).find(|&i| got[i] != codes[i]) {
                panic!(
                    "{what}: code {i} of x = {} is {}, want {}",
                    x[i], got[i], codes[i]
                );
            }
            let back = q.dequantize().unwrap().to_vec::<f32>().unwrap();
            assert_eq!(
                bits(&back),
                bits(&ref_dequantize(&codes, &absmax, signed)),
                "{what}"
            );
            // Each value comes back as the map value nearest it.
            let map = dynamic_map(signed);
            for i in 0..n {
                let a = absmax[i / BLOCK];
                let best = map
                    .iter()
                    .fold(f32::MAX, |b, &c| b.min((c * a - x[i]).abs()));
                let err = (back[i] - x[i]).abs();
                assert!(
                    err <= best * (1.0 + 1e-5) + 1e-30,
                    "{what}: {i}: {err} > {best}"
                );
            }
        }
    }
    let empty = Quantized::new(&Tensor::zeros(dev, &[0], DType::F32).unwrap(), true).unwrap();
    assert!(empty.code_bytes().unwrap().is_empty());
    assert_eq!(empty.dequantize().unwrap().numel(), 0);
}

// ---------------------------------------------------------------------------------------------
// One fused update
// ---------------------------------------------------------------------------------------------

struct Hyper {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    wd: f32,
}

const HP: Hyper = Hyper {
    lr: 1e-2,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    wd: 0.01,
};

/// Host 8-bit state of one parameter: codes and absmax of m (signed) and v (unsigned).
#[derive(Clone)]
struct State8 {
    m: Vec<u8>,
    am: Vec<f32>,
    v: Vec<u8>,
    av: Vec<f32>,
}

/// The whole 8-bit step at update count t: dequantize, torch's AdamW in f32 (coefficients in
/// f64 as torch computes them), new block absmax, requantize. Returns the f32 moments before
/// requantization too, to judge codes that differ at a rounding boundary.
fn ref_step8(p: &mut [f32], g: &[f32], s: &mut State8, t: u64) -> (Vec<f32>, Vec<f32>) {
    let (lr, b1, b2) = (HP.lr as f64, HP.beta1 as f64, HP.beta2 as f64);
    let bc1 = 1.0 - b1.powf(t as f64);
    let bc2_sqrt = (1.0 - b2.powf(t as f64)).sqrt() as f32;
    let decay = (1.0 - lr * HP.wd as f64) as f32;
    let step_size = (lr / bc1) as f32;
    let (w1, w2) = ((1.0 - b1) as f32, (1.0 - b2) as f32);
    let m = ref_dequantize(&s.m, &s.am, true);
    let v = ref_dequantize(&s.v, &s.av, false);
    let mut m1 = vec![0f32; p.len()];
    let mut v1 = vec![0f32; p.len()];
    for j in 0..p.len() {
        m1[j] = HP.beta1 * m[j] + w1 * g[j];
        v1[j] = HP.beta2 * v[j] + w2 * g[j] * g[j];
        let denom = v1[j].sqrt() / bc2_sqrt + HP.eps;
        p[j] = p[j] * decay - step_size * (m1[j] / denom);
    }
    (s.m, s.am) = ref_quantize(&m1, true);
    (s.v, s.av) = ref_quantize(&v1, false);
    (m1, v1)
}

/// The device's 8-bit state of parameter 0, read back.
fn read_state(opt: &AdamW, n: usize) -> State8 {
    let st = opt.state();
    let code = |name: &str| {
        let c = st.codes.iter().find(|c| c.name == name).expect(name);
        assert_eq!(c.len, n);
        let w: Vec<f32> = c.words.to_vec().unwrap();
        let mut b: Vec<u8> = w.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
        b.truncate(n);
        b
    };
    let absmax = |name: &str| {
        let t = &st.tensors.iter().find(|(k, _)| k == name).expect(name).1;
        t.to_vec::<f32>().unwrap()
    };
    State8 {
        m: code("0.state1"),
        am: absmax("0.absmax1"),
        v: code("0.state2"),
        av: absmax("0.absmax2"),
    }
}

/// Codes may differ only where the reference value sits on the boundary between them (the
/// device may contract `b * m + w * g` into a fused multiply-add: one rounding less).
fn check_codes(what: &str, got: &[u8], want: &[u8], x: &[f32], absmax: &[f32], signed: bool) {
    let mid = midpoints(&dynamic_map(signed));
    let mut differ = 0;
    for i in 0..want.len() {
        if got[i] == want[i] {
            continue;
        }
        differ += 1;
        let lo = got[i].min(want[i]) as usize;
        let edge = mid[lo] * absmax[i / BLOCK];
        assert!(
            got[i].abs_diff(want[i]) == 1 && (x[i] - edge).abs() <= 1e-5 * absmax[i / BLOCK],
            "{what}: code {i} is {}, want {} (x {} boundary {edge})",
            got[i],
            want[i],
            x[i]
        );
    }
    assert!(differ * 1000 <= want.len(), "{what}: {differ} codes differ");
}

fn update_matches_host_reference(dev: &Device) {
    // Quads (n % 4 == 0) and the scalar path, each with a partial last block.
    for (n, f16_grad) in [(MIN_NUMEL + 260, false), (MIN_NUMEL + 3, true)] {
        let gdt = dtype_for(dev, f16_grad);
        let what = format!("{} n {n} grad {gdt}", label(dev));
        let p0 = host_data(1, n, -1.0, 1.0);
        let p = Tensor::from_slice(dev, &p0, &[n])
            .unwrap()
            .with_requires_grad();
        let mut opt = AdamW::new(vec![p.clone()], HP.lr)
            .unwrap()
            .betas(HP.beta1, HP.beta2)
            .unwrap()
            .eps(HP.eps)
            .unwrap()
            .weight_decay(HP.wd)
            .unwrap()
            .eight_bit();
        assert_eq!(opt.name(), "adamw8bit");
        // Two device steps reach a state with nonzero codes everywhere; the third is checked.
        for t in 1..=3u64 {
            let g = as_dtype(&spread(100 + t, n), gdt);
            let before = (
                p.to_vec::<f32>().unwrap(),
                (t > 1).then(|| read_state(&opt, n)),
            );
            p.set_grad(Some(upload(dev, &g, &[n], gdt))).unwrap();
            opt.step().unwrap();
            let Some(mut s) = before.1 else {
                continue;
            };
            let mut want_p = before.0;
            let (m1, v1) = ref_step8(&mut want_p, &g, &mut s, t);
            let got = read_state(&opt, n);
            for (name, a, b) in [("absmax1", &got.am, &s.am), ("absmax2", &got.av, &s.av)] {
                for (x, y) in a.iter().zip(b.iter()) {
                    assert!((x - y).abs() <= 1e-6 * y.abs(), "{what}: {name} {x} vs {y}");
                }
            }
            check_codes(&what, &got.m, &s.m, &m1, &s.am, true);
            check_codes(&what, &got.v, &s.v, &v1, &s.av, false);
            let got_p = p.to_vec::<f32>().unwrap();
            assert_close(
                &what,
                &got_p,
                &want_p,
                Tol {
                    abs: 1e-6,
                    rel: 1e-5,
                    f16_ulps: 0.0,
                },
            );
        }
        assert_eq!(opt.state().codes.len(), 2, "{what}: codes of m and v");
    }
    // Under MIN_NUMEL: f32 state, the f32 kernel.
    let small = Tensor::from_slice(
        dev,
        &host_data(2, MIN_NUMEL - 1, -1.0, 1.0),
        &[MIN_NUMEL - 1],
    )
    .unwrap()
    .with_requires_grad();
    let mut opt = AdamW::new(vec![small.clone()], 0.1).unwrap().eight_bit();
    small
        .set_grad(Some(
            Tensor::from_slice(
                dev,
                &host_data(3, MIN_NUMEL - 1, -1.0, 1.0),
                &[MIN_NUMEL - 1],
            )
            .unwrap(),
        ))
        .unwrap();
    opt.step().unwrap();
    let names: Vec<String> = opt.state_tensors().into_iter().map(|(k, _)| k).collect();
    assert_eq!(names, ["0.exp_avg", "0.exp_avg_sq"]);
    assert!(opt.state().codes.is_empty());
}

// ---------------------------------------------------------------------------------------------
// Training, the planner, checkpoints
// ---------------------------------------------------------------------------------------------

const SEED: u64 = 7;

fn digits() -> (Dataset, Dataset) {
    data::load("digits", SEED).expect("the embedded digits load")
}

/// An MLP whose first layer (64 x 96 = 6144 weights) gets 8-bit state, the rest f32.
fn digits_trainer(dev: &Device, train: &Dataset, eight_bit: bool) -> Trainer<Mlp> {
    let model = Mlp::new(dev, &[train.dim, 96, train.classes], Activation::Relu, SEED).unwrap();
    let opt = AdamW::new(model.parameters(), 3e-3).unwrap();
    let opt: Box<dyn Optimizer> = if eight_bit {
        Box::new(opt.eight_bit())
    } else {
        Box::new(opt)
    };
    let config = TrainerConfig::default().batch_size(32).lr(3e-3);
    Trainer::new(model, opt, config).unwrap()
}

/// One epoch of the digits with 8-bit and with f32 state: test loss and accuracy close, the
/// 8-bit state about a quarter where it applies, and the planned peak of a step equal to the
/// measured one.
#[test]
fn training_tracks_f32_adamw_and_the_plan_is_exact() {
    let Some(dev) = fresh_device(Default::default()) else {
        return;
    };
    let (train, test) = digits();
    let mut evals = Vec::new();
    for eight_bit in [false, true] {
        let mut t = digits_trainer(&dev, &train, eight_bit);
        t.train_epoch(&train, SEED, 0, |_, _, _| Ok(())).unwrap();
        let e = t.evaluate(&test, 256).unwrap();
        let params = t.model.parameters();
        let state = t.memory_summary().optimizer_state_bytes;
        let f32_state = f32_adamw_state_bytes(&params);
        if eight_bit {
            // fc1: 6144 weights at 2 bytes + 2 x 24 absmax; the rest f32; and the 4 KiB map.
            assert!(state < f32_state / 2, "{state} vs {f32_state}");
            dev.sync().unwrap();
            dev.reset_peak();
            let plan = t.plan(&train).unwrap();
            dev.reset_peak();
            let idx: Vec<usize> = (0..32).collect();
            t.step(&train, &idx).unwrap();
            dev.sync().unwrap();
            let measured = dev.memory_stats().peak_bytes_in_use;
            assert_eq!(plan.peak, measured, "planned = measured peak");
            assert_eq!(
                plan.optimizer_state,
                t.memory_summary().optimizer_state_bytes
            );
        } else {
            assert!(state >= f32_state - 8 * 1024, "{state} vs {f32_state}");
        }
        evals.push(e);
    }
    let (f, q) = (evals[0], evals[1]);
    let (fa, qa) = (f.accuracy.unwrap(), q.accuracy.unwrap());
    assert!(fa > 0.8, "f32 AdamW learns: {fa}");
    assert!((fa - qa).abs() <= 0.03, "accuracy f32 {fa} vs 8-bit {qa}");
    assert!(
        (f.loss - q.loss).abs() <= 0.1 * f.loss.max(0.05),
        "loss {} vs {}",
        f.loss,
        q.loss
    );
}

/// Steps `opt` on an MSE loss of `model` on fixed data.
fn steps(model: &Mlp, opt: &mut AdamW, dev: &Device, n: usize) {
    let x = Tensor::from_slice(dev, &host_data(5, 16 * 80, -1.0, 1.0), &[16, 80]).unwrap();
    let y = Tensor::from_slice(dev, &host_data(6, 16 * 3, -1.0, 1.0), &[16, 3]).unwrap();
    for _ in 0..n {
        opt.zero_grad();
        let loss = fitgrad::nn::mse_loss(&model.forward(&x).unwrap(), &y).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
    }
}

/// Saved after 3 steps and resumed in a fresh model and optimizer, 3 more steps give the same
/// bits as 6 steps in one go; the codes are U8 tensors in the file.
#[test]
fn checkpoint_resume_is_exact() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("fitgrad-8bit-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ckpt.safetensors");
    // fc1 is 80 x 64 = 5120 weights: 8-bit; fc2 64 x 3: f32.
    let build = |seed| {
        let m = Mlp::new(&dev, &[80, 64, 3], Activation::Tanh, seed).unwrap();
        let o = AdamW::new(m.parameters(), 1e-2).unwrap().eight_bit();
        (m, o)
    };
    let (a, mut oa) = build(1);
    steps(&a, &mut oa, &dev, 3);
    checkpoint::save(&path, &a, Some(&oa), &TrainingState::default().step(3)).unwrap();
    steps(&a, &mut oa, &dev, 3);

    let ckpt = checkpoint::load(&path).unwrap();
    assert_eq!(ckpt.metadata["optim.name"], "adamw8bit");
    assert_eq!(ckpt.codes["optim.0.state1"].len(), 80 * 64);
    assert_eq!(ckpt.codes["optim.0.state2"].len(), 80 * 64);
    assert_eq!(
        ckpt.tensors["optim.0.absmax1"].dims,
        [(80 * 64usize).div_ceil(BLOCK)]
    );
    assert!(
        ckpt.tensors.contains_key("optim.1.exp_avg"),
        "the bias keeps f32 state"
    );
    // The bytes read back as they were written.
    let again =
        fitgrad::checkpoint::Checkpoint::from_bytes(&ckpt.to_bytes().unwrap(), "x").unwrap();
    assert_eq!(again.codes, ckpt.codes);

    let (b, mut ob) = build(2);
    ckpt.apply_model(&b).unwrap();
    ckpt.apply_optimizer(&mut ob).unwrap();
    steps(&b, &mut ob, &dev, 3);
    assert_eq!(param_values(&a), param_values(&b), "weights after resume");
    let (sa, sb) = (oa.state(), ob.state());
    for (x, y) in sa.codes.iter().zip(&sb.codes) {
        assert_eq!(x.name, y.name);
        assert_eq!(
            x.words
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>(),
            y.words
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>(),
            "{}",
            x.name
        );
    }
    for ((k, x), (_, y)) in sa.tensors.iter().zip(&sb.tensors) {
        assert_eq!(
            bits(&x.to_vec::<f32>().unwrap()),
            bits(&y.to_vec::<f32>().unwrap()),
            "{k}"
        );
    }
    // The dequantized moments have the parameter's shape.
    let (m, v) = ob.moments_f32(0).unwrap().unwrap();
    assert_eq!(
        (m.dims(), v.dims()),
        (&[64usize, 80][..], &[64usize, 80][..])
    );

    // Errors: 8-bit state into f32 AdamW, f32 state into 8-bit, a missing absmax.
    let (c, _) = build(3);
    let mut f32_opt = AdamW::new(c.parameters(), 1e-2).unwrap();
    let e = ckpt.apply_optimizer(&mut f32_opt).unwrap_err();
    assert!(
        matches!(&e, Error::Data { reason, .. } if reason.contains("adamw8bit")),
        "{e}"
    );
    let mut broken = ckpt.clone();
    broken.tensors.remove("optim.0.absmax2");
    let e = broken.apply_optimizer(&mut build(4).1).unwrap_err();
    assert!(
        matches!(&e, Error::Data { reason, .. } if reason.contains("part of its 8-bit state")),
        "{e}"
    );
    let mut short = ckpt.clone();
    short.codes.get_mut("optim.0.state1").unwrap().pop();
    let e = short.apply_optimizer(&mut build(5).1).unwrap_err();
    assert!(
        matches!(&e, Error::Data { reason, .. } if reason.contains("codes")),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

// ---------------------------------------------------------------------------------------------
// Optimizer offload
// ---------------------------------------------------------------------------------------------

/// max |a - b| / max |b|.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs() as f64)).max(1e-30);
    let diff = a
        .iter()
        .zip(b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
    diff / scale
}

/// Two parameters (one over two chunks, one small) stepped by on-device and offloaded AdamW on
/// the same gradients, f32 and f16: the host loop computes the shader's formula.
#[test]
fn host_update_matches_the_device_kernel() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let sizes = [CHUNK + 1001, 7];
    let mut runs = Vec::new();
    for offload in [false, true] {
        let params: Vec<Tensor> = sizes
            .iter()
            .enumerate()
            .map(|(k, &n)| {
                Tensor::from_slice(&dev, &host_data(20 + k as u64, n, -1.0, 1.0), &[n])
                    .unwrap()
                    .with_requires_grad()
            })
            .collect();
        let opt = AdamW::new(params.clone(), 1e-2)
            .unwrap()
            .weight_decay(0.1)
            .unwrap();
        let mut opt = if offload { opt.offload().unwrap() } else { opt };
        assert_eq!(opt.is_offloaded(), offload);
        for t in 0..3u64 {
            for (k, (p, &n)) in params.iter().zip(&sizes).enumerate() {
                let g = host_data(40 + 10 * t + k as u64, n, -1.0, 1.0);
                // Mixed precision's f16 gradients on the last step.
                let gdt = if t == 2 { DType::F16 } else { DType::F32 };
                p.set_grad(Some(upload(&dev, &as_dtype(&g, gdt), &[n], gdt)))
                    .unwrap();
            }
            opt.step().unwrap();
        }
        if offload {
            assert_eq!(opt.state_bytes(), 0, "no optimizer state on the device");
            assert!(opt.state_tensors().is_empty());
            let n: usize = sizes.iter().sum();
            assert_eq!(opt.host_bytes(), n as u64 * HOST_BYTES_PER_ELEMENT);
        }
        let values: Vec<Vec<f32>> = params.iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
        let state = opt.state();
        let moments: Vec<Vec<f32>> = if offload {
            state.host.iter().map(|h| h.values.clone()).collect()
        } else {
            state
                .tensors
                .iter()
                .map(|(_, t)| t.to_vec::<f32>().unwrap())
                .collect()
        };
        runs.push((values, moments));
    }
    for k in 0..sizes.len() {
        let r = rel(&runs[1].0[k], &runs[0].0[k]);
        assert!(r <= 1e-6, "parameter {k}: host vs device {r:e}");
    }
    assert_eq!(runs[1].1.len(), runs[0].1.len());
    for (k, (a, b)) in runs[1].1.iter().zip(&runs[0].1).enumerate() {
        assert!(rel(a, b) <= 1e-6, "moment {k}: {:e}", rel(a, b));
    }
}

fn offload_trainer(dev: &Device, train: &Dataset, offload: bool, mixed: bool) -> Trainer<Mlp> {
    let model = Mlp::new(dev, &[train.dim, 48, train.classes], Activation::Relu, SEED).unwrap();
    let opt = Box::new(AdamW::new(model.parameters(), 3e-3).unwrap());
    let precision = if mixed {
        Precision::Mixed
    } else {
        Precision::F32
    };
    let config = TrainerConfig::default()
        .batch_size(32)
        .micro_batch(8)
        .lr(3e-3)
        .precision(precision)
        .offload_optimizer(offload);
    Trainer::new(model, opt, config).unwrap()
}

/// Four steps of four micro-batches each, f32 and mixed precision: the offloaded trainer's
/// losses and weights equal the on-device ones within 1e-5 relative; the device holds no
/// optimizer state and the plan and summary show the host bytes.
#[test]
fn offloaded_training_matches_the_device() {
    let Some(dev) = fresh_device(Default::default()) else {
        return;
    };
    let (train, _) = digits();
    for mixed in [false, true] {
        let mut runs = Vec::new();
        for offload in [false, true] {
            let mut t = offload_trainer(&dev, &train, offload, mixed);
            let mut losses = Vec::new();
            for s in 0..4usize {
                let idx: Vec<usize> = (32 * s..32 * (s + 1)).collect();
                t.step(&train, &idx).unwrap();
                losses.push(t.take_loss().unwrap());
            }
            if offload {
                let n = t.model.num_parameters() as u64;
                let plan = t.plan(&train).unwrap();
                assert_eq!(plan.optimizer_state, 0, "mixed {mixed}");
                assert_eq!(plan.host_bytes, n * HOST_BYTES_PER_ELEMENT);
                let summary = t.memory_summary();
                assert_eq!(summary.optimizer_state_bytes, 0);
                assert_eq!(summary.host_bytes, n * HOST_BYTES_PER_ELEMENT);
                assert!(summary.to_string().contains("host memory"));
            }
            runs.push((losses, param_values(&t.model)));
        }
        for (s, (a, b)) in runs[1].0.iter().zip(&runs[0].0).enumerate() {
            assert!(
                ((a - b) / b).abs() <= 1e-5,
                "mixed {mixed} step {s}: loss {a} vs {b}"
            );
        }
        for (k, (a, b)) in runs[1].1.iter().zip(&runs[0].1).enumerate() {
            assert!(
                rel(a, b) <= 1e-5,
                "mixed {mixed} param {k}: {:e}",
                rel(a, b)
            );
        }
    }
}

/// An offloaded run saved and resumed offloaded gives the same bits as going on; the file is
/// the on-device AdamW's (same names), and loads into it too.
#[test]
fn offloaded_checkpoints_resume_exactly() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("fitgrad-offload-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ckpt.safetensors");
    let build = |seed, offload: bool| {
        let m = Mlp::new(&dev, &[80, 64, 3], Activation::Tanh, seed).unwrap();
        let o = AdamW::new(m.parameters(), 1e-2).unwrap();
        (m, if offload { o.offload().unwrap() } else { o })
    };
    let (a, mut oa) = build(1, true);
    steps(&a, &mut oa, &dev, 2);
    checkpoint::save(&path, &a, Some(&oa), &TrainingState::default().step(2)).unwrap();
    steps(&a, &mut oa, &dev, 2);
    let ckpt = checkpoint::load(&path).unwrap();
    assert_eq!(ckpt.metadata["optim.name"], "adamw");
    assert_eq!(ckpt.tensors["optim.0.exp_avg"].dims, [64, 80]);

    let (b, mut ob) = build(2, true);
    ckpt.apply_model(&b).unwrap();
    ckpt.apply_optimizer(&mut ob).unwrap();
    steps(&b, &mut ob, &dev, 2);
    assert_eq!(
        param_values(&a),
        param_values(&b),
        "weights after an offloaded resume"
    );

    let (c, mut oc) = build(3, false);
    ckpt.apply_model(&c).unwrap();
    ckpt.apply_optimizer(&mut oc).unwrap();
    steps(&c, &mut oc, &dev, 2);
    let r = worst_rel_diff(&param_values(&c), &param_values(&a));
    assert!(r <= 1e-5, "resumed on the device: {r:e}");
    std::fs::remove_dir_all(&dir).ok();
}

/// What offload cannot serve is refused before training: SGD, 8-bit state, f16 parameters.
#[test]
fn offload_refuses_what_it_cannot_serve() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let model = || Mlp::new(&dev, &[80, 64, 3], Activation::Relu, 1).unwrap();
    let invalid = |e: &Error, word: &str| matches!(e, Error::InvalidArgument { reason, .. } if reason.contains(word));
    let config = TrainerConfig::default().offload_optimizer(true);
    let m = model();
    let sgd = Box::new(Sgd::new(m.parameters(), 0.1).unwrap());
    let e = Trainer::new(m, sgd, config.clone()).err().unwrap();
    assert!(invalid(&e, "sgd"), "{e}");
    let m = model();
    let q8 = Box::new(AdamW::new(m.parameters(), 0.1).unwrap().eight_bit());
    let e = Trainer::new(m, q8, config).err().unwrap();
    assert!(invalid(&e, "8-bit"), "{e}");
    let half = Mlp::with_dtype(&dev, &[8, 4], Activation::Relu, DType::F16, 1).unwrap();
    let e = AdamW::new(half.parameters(), 0.1)
        .unwrap()
        .offload()
        .err()
        .unwrap();
    assert!(invalid(&e, "f16"), "{e}");
}
