//! Binary (broadcast), scalar and unary kernels against the CPU reference, on every device and
//! in f32 and f16.

use crate::common;

use common::strategies::{broadcast_pair, shape};
use common::*;
use fitgrad::{DType, Device, Tensor};
use proptest::prelude::*;

device_tests!(
    binary_ops_broadcast_like_numpy,
    scalar_and_unary_ops,
    binary_edge_shapes,
    unary_edge_shapes,
    relu_special_values,
    relu_keeps_nan,
    division_by_zero_gives_inf_and_nan,
    long_op_chain_crosses_flushes,
    ops_from_several_threads,
    in_place_add_and_fill
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

type BinFn = fn(&Tensor, &Tensor) -> fitgrad::Result<Tensor>;
/// (name, op, reference).
type BinCase = (&'static str, BinFn, fn(f32, f32) -> f32);

fn binary_ops() -> [BinCase; 4] {
    [
        ("add", Tensor::add, |x, y| x + y),
        ("sub", Tensor::sub, |x, y| x - y),
        ("mul", Tensor::mul, |x, y| x * y),
        ("div", Tensor::div, |x, y| x / y),
    ]
}

/// Runs every binary op on (ad, bd) shapes with data from `seed` on one device and dtype.
fn check_binary(
    dev: &Device,
    dtype: DType,
    ad: &[usize],
    bd: &[usize],
    seed: u64,
) -> Result<(), String> {
    let a_host = as_dtype(&host_data(seed, numel(ad), -4.0, 4.0), dtype);
    // b is a divisor too: keep it away from zero so f16 results stay finite.
    let b_host = as_dtype(
        &host_data_away_from_zero(seed ^ 1, numel(bd), 0.25, 4.0),
        dtype,
    );
    let a = upload(dev, &a_host, ad, dtype);
    let b = upload(dev, &b_host, bd, dtype);
    for (name, op, f) in binary_ops() {
        let what = format!("{name} {ad:?} {bd:?} {dtype} on {}", label(dev));
        let out = op(&a, &b).map_err(|e| format!("{what}: {e}"))?;
        let (want, od) = ref_binary(&a_host, ad, &b_host, bd, f);
        let got = download(&out, &od, dtype).map_err(|e| format!("{what}: {e}"))?;
        check_close(
            &what,
            &got,
            &expect_in(want, dtype),
            Tol::elementwise(dtype),
        )?;
    }
    Ok(())
}

type UnFn = fn(&Tensor, f32) -> fitgrad::Result<Tensor>;
/// (name, op, reference, whether x must stay away from zero).
type UnCase = (&'static str, UnFn, fn(f32, f32) -> f32, bool);

/// The scalar and unary ops.
fn unary_ops() -> Vec<UnCase> {
    vec![
        ("add_scalar", Tensor::add_scalar, |x, s| x + s, false),
        ("sub_scalar", Tensor::sub_scalar, |x, s| x - s, false),
        ("mul_scalar", Tensor::mul_scalar, |x, s| x * s, false),
        ("div_scalar", Tensor::div_scalar, |x, s| x / s, false),
        ("rsub_scalar", Tensor::rsub_scalar, |x, s| s - x, false),
        ("rdiv_scalar", Tensor::rdiv_scalar, |x, s| s / x, true),
        ("neg", |t, _| t.neg(), |x, _| -x, false),
        ("relu", |t, _| t.relu(), |x, _| relu(x), false),
    ]
}

fn check_unary(
    dev: &Device,
    dtype: DType,
    dims: &[usize],
    s: f32,
    seed: u64,
) -> Result<(), String> {
    let n = numel(dims);
    let x_host = as_dtype(&host_data(seed, n, -4.0, 4.0), dtype);
    let x_nz = as_dtype(&host_data_away_from_zero(seed, n, 0.25, 4.0), dtype);
    let x = upload(dev, &x_host, dims, dtype);
    let xnz = upload(dev, &x_nz, dims, dtype);
    for (name, op, f, nonzero) in unary_ops() {
        let what = format!("{name}({s}) {dims:?} {dtype} on {}", label(dev));
        let (xt, xh) = if nonzero {
            (&xnz, &x_nz)
        } else {
            (&x, &x_host)
        };
        let out = op(xt, s).map_err(|e| format!("{what}: {e}"))?;
        let want = ref_unary(xh, |v| f(v, s));
        let got = download(&out, dims, dtype).map_err(|e| format!("{what}: {e}"))?;
        check_close(
            &what,
            &got,
            &expect_in(want, dtype),
            Tol::elementwise(dtype),
        )?;
    }
    Ok(())
}

fn binary_ops_broadcast_like_numpy(dev: &Device) {
    proptest!(ProptestConfig::with_cases(24), |(
        (ad, bd) in broadcast_pair(),
        seed in any::<u64>(),
    )| {
        for dtype in DTYPES {
            check_binary(dev, dtype, &ad, &bd, seed).map_err(TestCaseError::fail)?;
        }
    });
}

fn scalar_and_unary_ops(dev: &Device) {
    proptest!(ProptestConfig::with_cases(24), |(
        dims in shape(),
        s in prop_oneof![Just(0.5f32), Just(-3.0f32), 0.25f32..4.0],
        seed in any::<u64>(),
    )| {
        for dtype in DTYPES {
            check_unary(dev, dtype, &dims, s, seed).map_err(TestCaseError::fail)?;
        }
    });
}

/// Fixed shapes the random ones might miss: both sides broadcasting, rank 0 with rank 4, empty
/// with broadcast, and sizes around the 512 elements one workgroup handles.
fn binary_edge_shapes(dev: &Device) {
    let cases: &[(&[usize], &[usize])] = &[
        (&[3, 1, 5], &[4, 1]),
        (&[4, 1], &[3, 1, 5]),
        (&[], &[2, 3, 4, 5]),
        (&[2, 3, 4, 5], &[]),
        (&[], &[]),
        (&[1], &[7]),
        (&[0], &[1]),
        (&[2, 0, 3], &[3]),
        (&[0, 4], &[1, 4]),
        (&[255], &[255]),
        (&[256], &[1]),
        (&[257], &[257]),
        (&[511], &[511]),
        (&[512], &[512]),
        (&[513], &[1]),
        (&[1025], &[1025]),
        (&[3, 1, 513], &[5, 1]),
        (&[2, 1, 3, 1], &[1, 4, 1, 5]),
        (&[1, 1, 1, 1], &[9, 1, 1, 1]),
        (&[4000], &[4000]),
    ];
    for dtype in DTYPES {
        for (i, (ad, bd)) in cases.iter().enumerate() {
            check_binary(dev, dtype, ad, bd, 100 + i as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

fn unary_edge_shapes(dev: &Device) {
    let shapes: &[&[usize]] = &[
        &[],
        &[0],
        &[1],
        &[2, 0],
        &[255],
        &[256],
        &[257],
        &[511],
        &[512],
        &[513],
        &[1023],
        &[1025],
        &[3, 5, 7, 11],
    ];
    for dtype in DTYPES {
        for (i, dims) in shapes.iter().enumerate() {
            check_unary(dev, dtype, dims, 1.5, 7 + i as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// relu maps -0.0 and negatives to 0 and keeps infinities' signs apart (-inf -> 0, inf -> inf).
fn relu_special_values(dev: &Device) {
    let xs = [
        -1.0,
        -0.0,
        0.0,
        2.5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -1e-3,
    ];
    for dtype in DTYPES {
        let what = format!("relu special values {dtype} on {}", label(dev));
        let x = upload(dev, &xs, &[xs.len()], dtype);
        let got = download(&x.relu().unwrap(), &[xs.len()], dtype).unwrap();
        assert_close(
            &what,
            &got,
            &[0.0, 0.0, 0.0, 2.5, f32::INFINITY, 0.0, 0.0],
            Tol::EXACT,
        );
    }
}

/// relu keeps NaN, as torch.relu does. Regression: on GL (Mesa llvmpipe) `select(x, 0.0, x <
/// 0.0)`, emitted as GLSL `(x < 0.0) ? 0.0 : x`, was optimised into `max(x, 0.0)` and NaN became
/// 0 (`relu_keeps_nan::gl`).
fn relu_keeps_nan(dev: &Device) {
    let xs = [f32::NAN, -1.0, 3.0, f32::NAN];
    for dtype in DTYPES {
        let x = upload(dev, &xs, &[4], dtype);
        let got = download(&x.relu().unwrap(), &[4], dtype).unwrap_or_else(|e| panic!("{e}"));
        assert_close(
            &format!("relu of NaN {dtype} on {}", label(dev)),
            &got,
            &[f32::NAN, 0.0, 3.0, f32::NAN],
            Tol::EXACT,
        );
    }
}

/// Division follows IEEE: x / 0 is +-inf, 0 / 0 is NaN; f16 results overflow to inf.
fn division_by_zero_gives_inf_and_nan(dev: &Device) {
    for dtype in DTYPES {
        let what = format!("div by zero {dtype} on {}", label(dev));
        let a = upload(dev, &[1.0, -2.0, 0.0], &[3], dtype);
        let b = upload(dev, &[0.0, 0.0, 0.0], &[3], dtype);
        let got = download(&a.div(&b).unwrap(), &[3], dtype).unwrap();
        assert_close(
            &what,
            &got,
            &[f32::INFINITY, f32::NEG_INFINITY, f32::NAN],
            Tol::EXACT,
        );
    }
}

/// A chain of many ops (more than the 256 dispatches after which the device flushes on its own)
/// gives the same result as the host.
fn long_op_chain_crosses_flushes(dev: &Device) {
    let host = host_data(5, 300, -1.0, 1.0);
    let mut t = upload(dev, &host, &[300], DType::F32);
    let mut want = host.clone();
    for step in 0..300 {
        let s = (step % 7) as f32 * 0.25;
        t = t.add_scalar(s).unwrap().mul_scalar(0.5).unwrap();
        for v in want.iter_mut() {
            *v = (*v + s) * 0.5;
        }
    }
    let got = t.to_vec::<f32>().unwrap();
    assert_close(
        &format!("300-step chain on {}", label(dev)),
        &got,
        &want,
        Tol::elementwise(DType::F32),
    );
}

/// Ops on the same device from several threads at once all give correct results.
fn ops_from_several_threads(dev: &Device) {
    std::thread::scope(|s| {
        for th in 0..4u64 {
            let dev = dev.clone();
            s.spawn(move || {
                for round in 0..10u64 {
                    let seed = th * 100 + round;
                    check_binary(&dev, DType::F32, &[33, 7], &[7], seed)
                        .unwrap_or_else(|e| panic!("thread {th}: {e}"));
                }
            });
        }
    });
}

/// `add_` writes over its own block the bits `add` returns; `fill_` sets every element; both
/// refuse what would hide a change from autograd or need a broadcast.
fn in_place_add_and_fill(dev: &Device) {
    for &dtype in dtypes(dev) {
        for (i, dims) in [&[0][..], &[1], &[7], &[3, 171]].iter().enumerate() {
            let n = numel(dims);
            let a_host = as_dtype(&host_data(40 + i as u64, n, -4.0, 4.0), dtype);
            let b_host = as_dtype(&host_data(50 + i as u64, n, -4.0, 4.0), dtype);
            let a = upload(dev, &a_host, dims, dtype);
            let b = upload(dev, &b_host, dims, dtype);
            let want = download(&a.add(&b).unwrap(), dims, dtype).unwrap();
            a.add_(&b).unwrap();
            let got = download(&a, dims, dtype).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "add_ {dims:?} {dtype}");
            a.fill_(-2.5).unwrap();
            assert_eq!(
                download(&a, dims, dtype).unwrap(),
                vec![-2.5; n],
                "fill_ {dims:?}"
            );
        }
        let a = Tensor::zeros(dev, &[3, 4], dtype).unwrap();
        let wrong = Tensor::zeros(dev, &[4], dtype).unwrap();
        assert!(matches!(a.add_(&wrong), Err(fitgrad::Error::Shape { .. })));
        let leaf = Tensor::zeros(dev, &[3], DType::F32)
            .unwrap()
            .with_requires_grad();
        let err = leaf.fill_(1.0).unwrap_err().to_string();
        assert!(err.contains("detach"), "{err}");
    }
}
