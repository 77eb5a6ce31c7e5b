//! gelu, tanh, sigmoid, exp, log, sqrt, pow_scalar and clamp against the f64 CPU reference, on
//! every device and in f32 and f16; the edges (+-1e4, +-inf, NaN, zeros, negative bases) and the
//! argument errors.

use crate::common;

use common::strategies::shape;
use common::*;
use fitgrad::{DType, Device, Error, Tensor};
use proptest::prelude::*;

device_tests!(
    activations_match_reference,
    activations_at_the_edges,
    pow_follows_torch,
    bad_scalars_are_errors,
    tanh_is_accurate_near_zero
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

/// Tolerance of a transcendental op computed in f32 (exp, log and friends are a few ulp off on
/// GPUs): |got - want| <= abs * (1 + |x|) + rel * |want| (+ 2 f16 ulps for f16 results). The
/// f16 absolute part is the smallest normal f16: drivers may flush f16 subnormals to 0.
fn check_op(what: &str, dtype: DType, x: &[f32], got: &[f32], want: &[f32]) -> Result<(), String> {
    let (abs, rel, ulps) = match dtype {
        DType::F32 => (1e-6, 2e-5, 0.0),
        DType::F16 => (6.2e-5, 1e-3, 2.0),
    };
    check_close_by(what, got, want, |i| {
        let w = want[i].abs();
        if !w.is_finite() {
            return 0.0;
        }
        let xi = if x[i].is_finite() { x[i].abs() } else { 0.0 };
        abs * (1.0 + xi) + rel * w + ulps * f16_ulp(w)
    })
}

type Op = fn(&Tensor) -> fitgrad::Result<Tensor>;
/// (name, op, reference, input range).
type Case = (&'static str, Op, fn(f32) -> f32, (f32, f32));

fn activations() -> Vec<Case> {
    vec![
        ("gelu", Tensor::gelu, ref_gelu, (-8.0, 8.0)),
        ("tanh", Tensor::tanh, ref_tanh, (-6.0, 6.0)),
        ("sigmoid", Tensor::sigmoid, ref_sigmoid, (-12.0, 12.0)),
        ("exp", Tensor::exp, ref_exp, (-8.0, 8.0)),
        ("log", Tensor::log, ref_log, (-1.0, 10.0)),
        ("sqrt", Tensor::sqrt, ref_sqrt, (-1.0, 10.0)),
    ]
}

/// Runs `op` on `host` (already in `dtype`) and compares with `f` applied on the host.
fn run_one(
    dev: &Device,
    dtype: DType,
    dims: &[usize],
    host: &[f32],
    name: &str,
    op: &dyn Fn(&Tensor) -> fitgrad::Result<Tensor>,
    f: &dyn Fn(f32) -> f32,
) -> Result<(), String> {
    let what = format!("{name} {dims:?} {dtype} on {}", label(dev));
    let x = upload(dev, host, dims, dtype);
    let out = op(&x).map_err(|e| format!("{what}: {e}"))?;
    let got = download(&out, dims, dtype).map_err(|e| format!("{what}: {e}"))?;
    let want = expect_in(ref_unary(host, f), dtype);
    check_op(&what, dtype, host, &got, &want)
}

fn check_all(
    dev: &Device,
    dtype: DType,
    dims: &[usize],
    seed: u64,
    p: f32,
    lo: f32,
    hi: f32,
) -> Result<(), String> {
    let n = numel(dims);
    for (k, (name, op, f, (a, b))) in activations().into_iter().enumerate() {
        let host = as_dtype(&host_data(seed ^ k as u64, n, a, b), dtype);
        run_one(dev, dtype, dims, &host, name, &op, &f)?;
    }
    // Bases away from 0, so negative exponents stay finite in f16.
    let bases = as_dtype(&host_data_away_from_zero(seed, n, 0.25, 3.0), dtype);
    run_one(
        dev,
        dtype,
        dims,
        &bases,
        &format!("pow_scalar({p})"),
        &|t| t.pow_scalar(p),
        &|x| ref_pow(x, p),
    )?;
    let host = as_dtype(&host_data(seed ^ 99, n, -4.0, 4.0), dtype);
    run_one(
        dev,
        dtype,
        dims,
        &host,
        &format!("clamp({lo}, {hi})"),
        &|t| t.clamp(lo, hi),
        &|x| ref_clamp(x, lo, hi),
    )
}

fn activations_match_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        dims in shape(),
        seed in any::<u64>(),
        p in prop::sample::select(vec![0.0f32, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5, 1.5, 2.5, -0.5]),
        lo in -3.0f32..1.0,
        hi in -1.0f32..3.0,
    )| {
        for dtype in DTYPES {
            check_all(dev, dtype, &dims, seed, p, lo, hi).map_err(TestCaseError::fail)?;
        }
    });
}

/// Values at the edges of every op's domain.
fn edge_values() -> Vec<f32> {
    vec![
        0.0,
        -0.0,
        1e-8,
        -1e-8,
        0.1,
        -0.1,
        0.5,
        -0.5,
        1.0,
        -1.0,
        2.0,
        -2.0,
        3.0,
        -3.0,
        10.0,
        -10.0,
        20.0,
        -20.0,
        88.0,
        -88.0,
        100.0,
        -100.0,
        1e4,
        -1e4,
        3e38,
        -3e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ]
}

/// Every op on the edge values matches the reference (NaN where it gives NaN, infinities of the
/// right sign), and gelu, tanh and sigmoid never give NaN for a finite input.
fn activations_at_the_edges(dev: &Device) {
    let vals = edge_values();
    for dtype in DTYPES {
        let host = as_dtype(&vals, dtype);
        let dims = [host.len()];
        for (name, op, f, _) in activations() {
            run_one(dev, dtype, &dims, &host, name, &op, &f).unwrap_or_else(|e| panic!("{e}"));
        }
        for (name, op) in [
            ("gelu", Tensor::gelu as Op),
            ("tanh", Tensor::tanh),
            ("sigmoid", Tensor::sigmoid),
        ] {
            let got = op(&upload(dev, &host, &dims, dtype))
                .unwrap()
                .to_vec_f32()
                .unwrap();
            for (x, y) in host.iter().zip(&got) {
                assert!(
                    !x.is_finite() || !y.is_nan(),
                    "{name}({x}) = NaN, {dtype} on {}",
                    label(dev)
                );
            }
        }
        for p in [
            0.0f32, 1.0, 2.0, 3.0, -1.0, -2.0, -3.0, 0.5, -0.5, 1.5, 1e-3, 40.0, -40.0,
        ] {
            run_one(
                dev,
                dtype,
                &dims,
                &host,
                &format!("pow_scalar({p})"),
                &|t| t.pow_scalar(p),
                &|x| ref_pow(x, p),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
        for (lo, hi) in [
            (-1.0f32, 1.0f32),
            (0.0, 0.0),
            (2.0, -2.0),
            (f32::NEG_INFINITY, 5.0),
            (-5.0, f32::INFINITY),
        ] {
            run_one(
                dev,
                dtype,
                &dims,
                &host,
                &format!("clamp({lo}, {hi})"),
                &|t| t.clamp(lo, hi),
                &|x| ref_clamp(x, lo, hi),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// A few values torch users know by heart, exactly.
fn pow_follows_torch(dev: &Device) {
    let cases: &[(f32, f32, f32)] = &[
        (-2.0, 3.0, -8.0),
        (-2.0, 2.0, 4.0),
        (-2.0, -1.0, -0.5),
        (0.0, -1.0, f32::INFINITY),
        (-0.0, -1.0, f32::NEG_INFINITY),
        (-0.0, -2.0, f32::INFINITY),
        (0.0, 0.0, 1.0),
        (f32::NAN, 0.0, 1.0),
        (f32::NEG_INFINITY, 3.0, f32::NEG_INFINITY),
        (f32::INFINITY, -1.0, 0.0),
        (4.0, 0.5, 2.0),
    ];
    for dtype in DTYPES {
        for &(x, p, want) in cases {
            let t = upload(dev, &[x], &[1], dtype);
            let got = t.pow_scalar(p).unwrap().to_vec_f32().unwrap()[0];
            assert!(
                got == want && got.is_sign_negative() == want.is_sign_negative(),
                "({x})^{p} = {got}, expected {want}, {dtype} on {}",
                label(dev)
            );
        }
        for (x, p) in [(-8.0f32, 1.0f32 / 3.0), (-1.0, 0.5), (f32::NAN, 2.0)] {
            let t = upload(dev, &[x], &[1], dtype);
            let got = t.pow_scalar(p).unwrap().to_vec_f32().unwrap()[0];
            assert!(
                got.is_nan(),
                "({x})^{p} = {got}, expected NaN, {dtype} on {}",
                label(dev)
            );
        }
    }
}

fn bad_scalars_are_errors(dev: &Device) {
    let t = Tensor::ones(dev, &[3], DType::F32).unwrap();
    for p in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        assert!(matches!(
            t.pow_scalar(p),
            Err(Error::InvalidArgument {
                op: "pow_scalar",
                ..
            })
        ));
    }
    assert!(matches!(
        t.clamp(f32::NAN, 1.0),
        Err(Error::InvalidArgument { op: "clamp", .. })
    ));
    assert!(matches!(
        t.clamp(0.0, f32::NAN),
        Err(Error::InvalidArgument { op: "clamp", .. })
    ));
}

/// tanh keeps its relative accuracy near 0, where 1 - exp(-2|x|) would cancel (tanh(1e-8) must
/// be 1e-8, not 0), on both sides of the switch to the polynomial.
fn tanh_is_accurate_near_zero(dev: &Device) {
    let xs = [
        1e-8f32, -1e-8, 1e-5, -3e-3, 0.05, 0.1, -0.124, 0.126, 0.2, -0.5, 1.0,
    ];
    let got = upload(dev, &xs, &[xs.len()], DType::F32)
        .tanh()
        .unwrap()
        .to_vec_f32()
        .unwrap();
    for (x, g) in xs.iter().zip(&got) {
        let want = ref_tanh(*x);
        assert!(
            (g - want).abs() <= 2e-6 * want.abs(),
            "tanh({x}) = {g}, expected {want} on {}",
            label(dev)
        );
    }
}
