//! Dispatches of more than 65,535 workgroups, which the device splits into a 2-D grid that the
//! kernels turn back into a linear index. The only tests with large tensors (tens of millions of
//! elements, built on the GPU from small inputs so little crosses the bus).

use crate::common;

use common::*;
use fitgrad::{DType, Device};

device_tests!(
    elementwise_past_65535_workgroups,
    reduction_past_65535_workgroups
);

/// out[r, c] = a[r] + b[c] over 8193 x 4097 f16 elements: more than 2 * 256 * 65,535, so the
/// elementwise kernel runs on a 2-D grid. Every value is a small integer, exact in f16, and
/// different neighbours differ, so a wrong index shows.
fn elementwise_past_65535_workgroups(dev: &Device) {
    let (rows, cols) = (8193usize, 4097usize);
    assert!(rows * cols > 2 * 256 * 65_535);
    let a: Vec<f32> = (0..rows).map(|r| (r % 64) as f32).collect();
    let b: Vec<f32> = (0..cols).map(|c| ((c % 31) * 64) as f32).collect();
    let ta = upload(dev, &a, &[rows, 1], DType::F16);
    let tb = upload(dev, &b, &[1, cols], DType::F16);
    let out = ta.add(&tb).unwrap();
    assert_eq!(out.dims(), &[rows, cols]);
    let got = out.to_vec_f32().unwrap();
    let mut bad = 0usize;
    let mut first = None;
    for r in 0..rows {
        for c in 0..cols {
            let want = a[r] + b[c];
            if got[r * cols + c] != want {
                bad += 1;
                first.get_or_insert((r, c, got[r * cols + c], want));
            }
        }
    }
    assert_eq!(
        bad,
        0,
        "on {}: first wrong (row, col, got, want) {first:?}",
        label(dev)
    );
}

/// A row reduction with more than 65,535 rows of 64 or more elements runs one workgroup per
/// row on a 2-D grid; contiguous rows (axis 1) and strided ones (axis 0) both.
fn reduction_past_65535_workgroups(dev: &Device) {
    let (rows, cols) = (65_537usize, 64usize);
    let a: Vec<f32> = (0..rows).map(|r| (r % 100) as f32).collect();
    let b: Vec<f32> = (0..cols).map(|c| (c % 7) as f32).collect();
    let b_sum: f32 = b.iter().sum();
    let ta = upload(dev, &a, &[rows, 1], DType::F32);
    let tb = upload(dev, &b, &[1, cols], DType::F32);
    let x = ta.add(&tb).unwrap(); // (rows, 64)
    let s = x.sum_axis(1, false).unwrap().to_vec::<f32>().unwrap();
    let want: Vec<f32> = a.iter().map(|&v| 64.0 * v + b_sum).collect();
    assert_close(
        &format!("sum over 64-long rows of {rows} on {}", label(dev)),
        &s,
        &want,
        Tol::EXACT,
    );
    let xt = x.transpose().unwrap(); // (64, rows): reduce axis 0, inner = rows
    let s = xt.sum_axis(0, true).unwrap();
    assert_eq!(s.dims(), &[1, rows]);
    assert_close(
        &format!("strided sum over axis 0 of (64, {rows}) on {}", label(dev)),
        &s.to_vec::<f32>().unwrap(),
        &want,
        Tol::EXACT,
    );
}

// ---------------------------------------------------------------------------------------------
// Tensors larger than one storage binding
// ---------------------------------------------------------------------------------------------

/// The binding limit the split runs lower the device to: a tiny GPT's token embedding
/// (300 x 16) is 2 or 3 windows of it in f32, 2 in f16.
const SMALL_BINDING: u64 = 8192;

/// A tiny tied GPT whose embedding (and its gradient and optimizer state) passes
/// `SMALL_BINDING`: vocabulary 300, width 16, one block, context 4.
fn wide_vocab(dtype: DType) -> fitgrad::nn::GptConfig {
    let mut cfg = fitgrad::nn::GptConfig::new(300, 4, 1, 2, 16);
    cfg.dtype = dtype;
    cfg.seed = 7;
    cfg
}

/// Steps of SGD with momentum, AdamW and global-norm clipping on a tiny GPT; returns every
/// loss and every parameter's bits at the end.
fn train_wide(dev: &Device, dtype: DType) -> (Vec<u32>, Vec<Vec<u32>>) {
    use fitgrad::nn::{Gpt, Module};
    use fitgrad::optim::{clip_grad_norm, AdamW, Optimizer, Sgd};
    let gpt = Gpt::new(dev, wide_vocab(dtype)).unwrap();
    let ids: Vec<u32> = (0..4u32).map(|i| (i * 97 + 13) % 300).collect();
    let targets: Vec<u32> = (0..4u32).map(|i| (i * 61 + 5) % 300).collect();
    let mut losses = Vec::new();
    let mut sgd = Sgd::new(gpt.parameters(), 0.1)
        .unwrap()
        .momentum(0.9)
        .unwrap();
    let mut adamw = AdamW::new(gpt.parameters(), 1e-2).unwrap();
    for step in 0..4 {
        let loss = gpt.loss(&ids, &targets, 1, 4).unwrap();
        losses.push(loss.item().unwrap().to_bits());
        loss.backward().unwrap();
        clip_grad_norm(&gpt.parameters(), 0.5).unwrap();
        if step % 2 == 0 {
            sgd.step().unwrap();
        } else {
            adamw.step().unwrap();
        }
        gpt.zero_grad();
    }
    let params = gpt
        .named_parameters()
        .iter()
        .map(|(_, p)| {
            let v = p.to_vec_f32().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        })
        .collect();
    (losses, params)
}

/// A device of the default backend, with the binding limit lowered when `small`.
fn binding_device(small: bool, packed: bool) -> Option<Device> {
    let mut opts = fitgrad::DeviceOptions::default().force_packed_f16(packed);
    if small {
        opts = opts.max_binding_size(SMALL_BINDING);
    }
    fresh_device(opts)
}

/// With the binding limit lowered so the token embedding, its gradient and its optimizer state
/// are bound as several windows, the gather, the scatter-add of its gradient, the tied head's
/// three matmuls, the casts and fills, clipping and both optimizers give the bits the
/// unsplit run gives, in f32 and f16 (native and packed).
#[test]
fn tensors_past_one_binding_train_bit_for_bit() {
    for packed in [false, true] {
        let (Some(whole), Some(split)) =
            (binding_device(false, packed), binding_device(true, packed))
        else {
            return;
        };
        let limits = &split.info().limits;
        assert_eq!(limits.max_storage_buffer_binding_size, SMALL_BINDING);
        for dtype in [DType::F32, DType::F16] {
            let bytes = 300 * 16 * dtype.size() as u64;
            assert!(bytes > SMALL_BINDING, "the embedding must pass the binding");
            let want = train_wide(&whole, dtype);
            let got = train_wide(&split, dtype);
            assert_eq!(got.0, want.0, "losses, {dtype:?}, packed f16 {packed}");
            assert!(
                got.1 == want.1,
                "parameters differ, {dtype:?}, packed f16 {packed}"
            );
        }
    }
}

/// A kernel that binds tensors whole (softmax) refuses one past the binding limit with a typed
/// error naming the limit, before anything runs, and so does a plan of it; a tensor past the
/// largest buffer is refused when it is made.
#[test]
fn a_whole_binding_past_the_limit_is_a_typed_error() {
    let Some(dev) = binding_device(true, false) else {
        return;
    };
    let x = fitgrad::Tensor::zeros(&dev, &[4, 1024], DType::F32).unwrap();
    for planning in [false, true] {
        let plan = planning.then(|| dev.planning().unwrap());
        match x.softmax() {
            Err(fitgrad::Error::Limit { limit, .. }) => assert_eq!(limit, SMALL_BINDING),
            other => panic!("softmax past the binding (planning {planning}): {other:?}"),
        }
        drop(plan);
    }
    let past = dev.info().limits.max_buffer_size as usize / 4 + 64;
    assert!(matches!(
        fitgrad::Tensor::zeros(&dev, &[past], DType::F32),
        Err(fitgrad::Error::Limit { .. })
    ));
}

/// With bindings of 256 bytes (the smallest a device takes, under one 256-element run of f32),
/// AdamW on a 3001-element parameter runs over runs bound as windows and two steps give the
/// bits of the unsplit device; an elementwise product of it would need 141 storage bindings and
/// is a typed error before any pipeline is made.
#[test]
fn the_optimizer_over_the_smallest_binding() {
    use fitgrad::optim::{AdamW, Optimizer};
    let n = 3001;
    let x: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) / 16.0).collect();
    let g: Vec<f32> = (0..n).map(|i| ((i % 31) as f32 - 15.0) / 8.0).collect();
    let step = |dev: &Device| -> fitgrad::Result<Vec<u32>> {
        let mut p = upload(dev, &x, &[n], DType::F32);
        p.set_requires_grad(true);
        let mut opt = AdamW::new(vec![p.clone()], 1e-2).unwrap();
        for _ in 0..2 {
            p.set_grad(Some(upload(dev, &g, &[n], DType::F32))).unwrap();
            opt.step()?;
        }
        Ok(p.to_vec_f32()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect())
    };
    let (Some(whole), Some(split)) = (
        binding_device(false, false),
        fresh_device(fitgrad::DeviceOptions::default().max_binding_size(256)),
    ) else {
        return;
    };
    assert_eq!(split.info().limits.max_storage_buffer_binding_size, 256);
    match step(&split) {
        Ok(bits) => assert!(
            bits == step(&whole).unwrap(),
            "AdamW over 256-byte bindings"
        ),
        // The update's windows need 16 storage bindings; an adapter that allows fewer per stage
        // (SwiftShader: 10) refuses it with the typed error, before any pipeline is made.
        Err(fitgrad::Error::Limit { value, limit, .. })
            if limit == split.info().limits.max_storage_buffers_per_shader_stage as u64 =>
        {
            assert!(value > limit, "{value}")
        }
        Err(e) => panic!("AdamW over 256-byte bindings: {e}"),
    }
    let p = upload(&split, &x, &[n], DType::F32);
    match p.mul(&p) {
        Err(fitgrad::Error::Limit { value, limit, .. }) => assert!(value > limit, "{value}"),
        other => panic!("141 bindings: {other:?}"),
    }
}
