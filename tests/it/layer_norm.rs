//! layer_norm and its backward (input, weight and bias gradients) against an f64 plain-loop
//! reference on every device in f32 and f16: random shapes (rank 1-4, rows of 1, odd rows,
//! rows shared by several invocations, tall inputs whose column sums run in chunks, empty),
//! with and without weight and bias; constant rows; finite differences; bitwise repeatability;
//! the errors (before any device work); and `nn::LayerNorm`.

use crate::common;

use common::gradcheck::{check_grads, input};
use common::strategies::{cap, shape_rank};
use common::*;
use fitgrad::nn::{LayerNorm, Module};
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};
use proptest::prelude::*;

device_tests!(
    layer_norm_matches_reference,
    layer_norm_fixed_shapes,
    constant_rows_give_the_bias,
    layer_norm_is_bitwise_repeatable,
    layer_norm_layer
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];
const EPS: f32 = 1e-5;

/// Each row's mean and 1 / sqrt(biased variance + eps), in f64.
fn ref_stats(x: &[f64], c: usize, eps: f64) -> Vec<(f64, f64)> {
    x.chunks(c)
        .map(|row| {
            let mean = row.iter().sum::<f64>() / c as f64;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
            (mean, 1.0 / (var + eps).sqrt())
        })
        .collect()
}

/// y = (x - mean) * rstd * w + b per row of length c (w = 1, b = 0 where absent).
fn ref_layer_norm(x: &[f64], c: usize, w: Option<&[f64]>, b: Option<&[f64]>, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    if c == 0 {
        return out;
    }
    for (row, (mean, rstd)) in x.chunks(c).zip(ref_stats(x, c, eps)) {
        for (j, &v) in row.iter().enumerate() {
            let wj = w.map_or(1.0, |w| w[j]);
            let bj = b.map_or(0.0, |b| b[j]);
            out.push((v - mean) * rstd * wj + bj);
        }
    }
    out
}

/// The gradients of layer norm for upstream `g`: dx (each element with the scale of its
/// terms, for the tolerance), dw and db (with the sums of their terms' magnitudes).
struct RefGrads {
    dx: Vec<f64>,
    dx_scale: Vec<f64>,
    dw: Vec<f64>,
    dw_abs: Vec<f64>,
    db: Vec<f64>,
    db_abs: Vec<f64>,
}

fn ref_backward(x: &[f64], g: &[f64], c: usize, w: &[f64], eps: f64) -> RefGrads {
    let mut r = RefGrads {
        dx: Vec::with_capacity(x.len()),
        dx_scale: Vec::with_capacity(x.len()),
        dw: vec![0.0; c],
        dw_abs: vec![0.0; c],
        db: vec![0.0; c],
        db_abs: vec![0.0; c],
    };
    if c == 0 {
        return r;
    }
    for (k, (mean, rstd)) in ref_stats(x, c, eps).into_iter().enumerate() {
        let row = &x[k * c..(k + 1) * c];
        let gr = &g[k * c..(k + 1) * c];
        let xh: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
        let gw: Vec<f64> = gr.iter().zip(w).map(|(g, w)| g * w).collect();
        let m1 = gw.iter().sum::<f64>() / c as f64;
        let m2 = gw.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / c as f64;
        let big_gw = gw.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let big_xh = xh.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for j in 0..c {
            r.dx.push(rstd * (gw[j] - m1 - xh[j] * m2));
            r.dx_scale.push(rstd * big_gw * (1.0 + big_xh));
            r.dw[j] += gr[j] * xh[j];
            r.dw_abs[j] += (gr[j] * xh[j]).abs();
            r.db[j] += gr[j];
            r.db_abs[j] += gr[j].abs();
        }
    }
    r
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Tolerance of a result `want` in `dtype` whose f32 computation has error about `f32_err`.
fn tol(dtype: DType, want: f32, f32_err: f64) -> f32 {
    let e = f32_err as f32;
    match dtype {
        DType::F32 => 1e-6 + e + 1e-6 * want.abs(),
        DType::F16 => 1e-6 + e + 2.0 * f16_ulp(want),
    }
}

/// Forward and backward of one case. `affine`: bit 0 a weight, bit 1 a bias.
fn check(
    dev: &Device,
    dtype: DType,
    dims: &[usize],
    affine: u8,
    offset: f32,
    seed: u64,
) -> Result<(), String> {
    let what = format!(
        "layer_norm {dims:?} affine {affine} offset {offset} {dtype} on {}",
        label(dev)
    );
    let c = *dims.last().unwrap();
    let x_host = as_dtype(
        &host_data(seed, numel(dims), offset - 3.0, offset + 3.0),
        dtype,
    );
    let w_host = as_dtype(&host_data(seed ^ 2, c, -2.0, 2.0), dtype);
    let b_host = as_dtype(&host_data(seed ^ 3, c, -1.0, 1.0), dtype);
    let g_host = as_dtype(&host_data(seed ^ 4, numel(dims), -1.0, 1.0), dtype);
    let x = upload(dev, &x_host, dims, dtype).with_requires_grad();
    let w = (affine & 1 != 0).then(|| upload(dev, &w_host, &[c], dtype).with_requires_grad());
    let b = (affine & 2 != 0).then(|| upload(dev, &b_host, &[c], dtype).with_requires_grad());
    let y = x
        .layer_norm(w.as_ref(), b.as_ref(), EPS)
        .map_err(|e| format!("{what}: {e}"))?;

    let x64 = f64s(&x_host);
    let (w64, b64) = (f64s(&w_host), f64s(&b_host));
    let want = f32s(&ref_layer_norm(
        &x64,
        c,
        w.as_ref().map(|_| &w64[..]),
        b.as_ref().map(|_| &b64[..]),
        EPS as f64,
    ));
    let want = expect_in(want, dtype);
    let got = download(&y, dims, dtype).map_err(|e| format!("{what}: {e}"))?;
    // (x - mean) * rstd is within a few f32 ulps of |xhat| <= sqrt(c); times |w| <= 2. The
    // mean itself is only as exact as an f32 near max |x| (an ulp there), and with an offset
    // and a row of close values that error is large against x - mean: rstd scales it.
    let cancel: Vec<f64> = x64
        .chunks(c.max(1))
        .map(|row| {
            let n = row.len().max(1) as f64;
            let mean = row.iter().sum::<f64>() / n;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            let max = row.iter().fold(0f64, |m, v| m.max(v.abs()));
            4.0 * f64::from(f32::EPSILON) * max / (var + EPS as f64).sqrt()
        })
        .collect();
    let w_abs = |i: usize| if w.is_some() { w64[i % c].abs() } else { 1.0 };
    check_close_by(&what, &got, &want, |i| {
        let f32_err = 4e-6 * (1.0 + want[i].abs() as f64) + cancel[i / c] * w_abs(i);
        tol(dtype, want[i], f32_err)
    })?;

    y.backward_with(upload(dev, &g_host, dims, dtype))
        .map_err(|e| format!("{what}: backward: {e}"))?;
    let ones = vec![1.0; c];
    let r = ref_backward(
        &x64,
        &f64s(&g_host),
        c,
        if w.is_some() { &w64 } else { &ones },
        EPS as f64,
    );
    let grad = |t: &Tensor, d: &[usize]| -> Result<Vec<f32>, String> {
        let g = t.grad().ok_or(format!("{what}: no gradient"))?;
        download(&g, d, dtype).map_err(|e| format!("{what}: {e}"))
    };
    let want = expect_in(f32s(&r.dx), dtype);
    // The mean's rounding moves every xhat of a row by up to `cancel`, and dx by that times
    // its own scale: both terms of dx that hold xhat (directly and through mean(g w xhat)).
    check_close_by(&format!("{what}: dx"), &grad(&x, dims)?, &want, |i| {
        tol(dtype, want[i], (1e-5 + 2.0 * cancel[i / c]) * r.dx_scale[i])
    })?;
    for (t, sum, abs, name) in [(&w, &r.dw, &r.dw_abs, "dw"), (&b, &r.db, &r.db_abs, "db")] {
        if let Some(t) = t {
            let want = expect_in(f32s(sum), dtype);
            check_close_by(&format!("{what}: {name}"), &grad(t, &[c])?, &want, |j| {
                tol(dtype, want[j], 1e-5 * (1.0 + abs[j]))
            })?;
        }
    }
    Ok(())
}

/// Row lengths around the kernel's switches: one invocation per row below 64, then about
/// sqrt(C) invocations per row; odd and even (packed f16 odd rows go through f32).
fn row_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1usize..70,
        2 => prop::sample::select(vec![63usize, 64, 65, 100, 127, 255, 256, 257, 1000, 1025, 4097]),
    ]
}

fn layer_norm_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        lead in shape_rank(0, 3),
        c in row_len(),
        affine in 0u8..4,
        offset in prop::sample::select(vec![0.0f32, 10.0]),
        seed in any::<u64>(),
    )| {
        let mut dims = lead;
        dims.push(c);
        let dims = cap(dims, 8000);
        for dtype in DTYPES {
            check(dev, dtype, &dims, affine, offset, seed).map_err(TestCaseError::fail)?;
        }
    });
}

/// Shapes the random ones may miss: rows of one, empty inputs, tall inputs (several chunks of
/// 64 rows in the weight and bias gradients, and a partial last chunk), one long row.
fn layer_norm_fixed_shapes(dev: &Device) {
    let shapes: &[&[usize]] = &[
        &[1],
        &[7],
        &[5, 1],
        &[0, 4],
        &[3, 0],
        &[2, 0, 5],
        &[64, 3],
        &[65, 4],
        &[300, 7],
        &[2, 65, 9],
        &[1, 5000],
    ];
    for dtype in DTYPES {
        for (k, dims) in shapes.iter().enumerate() {
            check(dev, dtype, dims, 3, 1.0, 50 + k as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// A constant row has zero variance: (x - mean) is exactly 0, so the output is the bias.
fn constant_rows_give_the_bias(dev: &Device) {
    for dtype in DTYPES {
        for c in [5usize, 100] {
            let x = Tensor::full(dev, &[3, c], 2.5, dtype).unwrap();
            let b_host = as_dtype(&host_data(c as u64, c, -1.0, 1.0), dtype);
            let w = Tensor::full(dev, &[c], 3.0, dtype).unwrap();
            let b = upload(dev, &b_host, &[c], dtype);
            let y = x.layer_norm(Some(&w), Some(&b), EPS).unwrap();
            assert_eq!(
                y.to_vec_f32().unwrap(),
                b_host.repeat(3),
                "c {c} {dtype} on {}",
                label(dev)
            );
        }
    }
}

/// Every gradient against central differences (f32), with parts of the inputs requiring grad.
#[test]
fn layer_norm_gradients_match_finite_differences() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let cases: &[(&[usize], [bool; 3])] = &[
        (&[3, 5], [true, true, true]),
        (&[2, 2, 4], [true, false, true]),
        (&[1, 1], [true, true, true]),
        (&[2, 70], [true, true, false]),
        (&[130, 3], [false, true, true]),
        (&[4, 3], [true, false, false]),
    ];
    for (k, (dims, need)) in cases.iter().enumerate() {
        let c = *dims.last().unwrap();
        let seed = 7 + k as u64;
        let inputs = [
            input(host_data(seed, numel(dims), -2.0, 2.0), dims, need[0]),
            input(host_data(seed ^ 1, c, 0.5, 2.0), &[c], need[1]),
            input(host_data(seed ^ 2, c, -1.0, 1.0), &[c], need[2]),
        ];
        check_grads(
            &dev,
            &format!("layer_norm {dims:?} needs {need:?}"),
            &inputs,
            seed,
            &|t| t[0].layer_norm(Some(&t[1]), Some(&t[2]), EPS),
            &|x| ref_layer_norm(&x[0], c, Some(&x[1]), Some(&x[2]), EPS as f64),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    // Without affine parameters.
    check_grads(
        &dev,
        "layer_norm (3, 6) without weight and bias",
        &[input(host_data(99, 18, -2.0, 2.0), &[3, 6], true)],
        99,
        &|t| t[0].layer_norm(None, None, EPS),
        &|x| ref_layer_norm(&x[0], 6, None, None, EPS as f64),
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The same forward and backward twice give the same bits.
fn layer_norm_is_bitwise_repeatable(dev: &Device) {
    for dtype in DTYPES {
        let dims = [150, 301];
        let x_host = host_data(1, numel(&dims), -3.0, 3.0);
        let g_host = host_data(2, numel(&dims), -1.0, 1.0);
        let run = || {
            let x = upload(dev, &x_host, &dims, dtype).with_requires_grad();
            let w = Tensor::full(dev, &[301], 1.5, dtype)
                .unwrap()
                .with_requires_grad();
            let b = Tensor::zeros(dev, &[301], dtype)
                .unwrap()
                .with_requires_grad();
            let y = x.layer_norm(Some(&w), Some(&b), EPS).unwrap();
            y.backward_with(upload(dev, &g_host, &dims, dtype)).unwrap();
            [
                y.to_vec_f32(),
                x.grad().unwrap().to_vec_f32(),
                w.grad().unwrap().to_vec_f32(),
                b.grad().unwrap().to_vec_f32(),
            ]
            .map(|v| v.unwrap().into_iter().map(f32::to_bits).collect::<Vec<_>>())
        };
        assert_eq!(run(), run(), "layer_norm {dtype} on {}", label(dev));
    }
}

/// Bad shapes, dtypes and eps are typed errors, raised before anything is allocated.
#[test]
fn layer_norm_errors_come_before_device_work() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let x = Tensor::zeros(&dev, &[2, 3], DType::F32).unwrap();
    let w = Tensor::ones(&dev, &[3], DType::F32).unwrap();
    let w4 = Tensor::ones(&dev, &[4], DType::F32).unwrap();
    let w2d = Tensor::ones(&dev, &[1, 3], DType::F32).unwrap();
    let h = Tensor::ones(&dev, &[3], DType::F16).unwrap();
    let s = Tensor::scalar(&dev, 1.0f32).unwrap();
    let before = dev.memory_stats().allocations;
    assert!(matches!(
        s.layer_norm(None, None, EPS),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        x.layer_norm(Some(&w4), None, EPS),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        x.layer_norm(Some(&w), Some(&w2d), EPS),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        x.layer_norm(None, Some(&h), EPS),
        Err(Error::DType { .. })
    ));
    for eps in [-1e-5, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            x.layer_norm(Some(&w), None, eps),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert_eq!(dev.memory_stats().allocations, before);
    assert!(matches!(
        LayerNorm::new(&dev, 0),
        Err(Error::InvalidArgument { .. })
    ));
    let ln = LayerNorm::new(&dev, 4).unwrap();
    assert!(matches!(ln.forward(&x), Err(Error::Shape { .. })));
}

/// `nn::LayerNorm`: ones and zeros, eps 1e-5, the functional op's bits, gradients for its
/// parameters, and f32 parameters under an f16 input (mixed precision).
fn layer_norm_layer(dev: &Device) {
    let ln = LayerNorm::new(dev, 9).unwrap();
    assert_eq!(ln.eps, 1e-5);
    assert_eq!(ln.weight.to_vec_f32().unwrap(), vec![1.0; 9]);
    assert_eq!(ln.bias.to_vec_f32().unwrap(), vec![0.0; 9]);
    let names: Vec<String> = ln.named_parameters().into_iter().map(|p| p.0).collect();
    assert_eq!(names, ["weight", "bias"]);
    let x_host = host_data(5, 4 * 9, -2.0, 2.0);
    let x = upload(dev, &x_host, &[4, 9], DType::F32);
    let y = ln.forward(&x).unwrap();
    let f = x
        .layer_norm(Some(&ln.weight), Some(&ln.bias), 1e-5)
        .unwrap();
    assert_eq!(y.to_vec_f32().unwrap(), f.to_vec_f32().unwrap());
    y.sum().unwrap().backward().unwrap();
    // d sum(y) / d b = the row count; d / d w = the column sums of xhat (about 0).
    assert_eq!(ln.bias.grad().unwrap().to_vec_f32().unwrap(), vec![4.0; 9]);
    assert!(ln.weight.grad().is_some());

    let xh = upload(dev, &x_host, &[4, 9], DType::F16);
    let yh = ln.forward(&xh).unwrap();
    assert_eq!(yh.dtype(), DType::F16);
    yh.to_dtype(DType::F32)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let gb = ln.bias.grad().unwrap();
    assert_eq!(gb.dtype(), DType::F32);
    assert_eq!(gb.to_vec_f32().unwrap(), vec![8.0; 9]);
}
