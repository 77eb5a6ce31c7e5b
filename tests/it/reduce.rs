//! sum, mean, sum_axis and mean_axis against an f64 CPU reference, on every device and in f32 and
//! f16. Rows of 64 or more elements take the workgroup tree reduction, shorter ones a serial
//! loop; both are covered.

use crate::common;

use common::strategies::shape;
use common::*;
use fitgrad::{DType, Device, Tensor};
use proptest::prelude::*;

device_tests!(
    reductions_match_reference,
    reductions_fixed_shapes,
    empty_mean_is_nan_and_empty_sum_is_zero,
    sum_is_deterministic
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

/// Per-element tolerance of a reduction whose terms have absolute sum `abs_sum` over `len`
/// elements: f32 accumulation error (bounded by ~90 roundings in either kernel mode), plus for f16
/// the final rounding.
fn reduce_tol(dtype: DType, abs_sum: f32, len: usize, mean: bool, want: f32) -> f32 {
    let scale = if mean && len > 0 {
        abs_sum / len as f32
    } else {
        abs_sum
    };
    let acc = 1e-5 * scale + 1e-6;
    match dtype {
        DType::F32 => acc + 1e-6 * want.abs(),
        DType::F16 => acc + 1e-3 * want.abs() + 2.0 * f16_ulp(want),
    }
}

/// One input tensor with its host copy.
struct Input<'a> {
    dev: &'a Device,
    dtype: DType,
    x: &'a Tensor,
    host: &'a [f32],
    dims: &'a [usize],
}

/// sum_axis / mean_axis of `x` along `axis` with `keepdim`, checked against the reference.
fn check_axis(inp: &Input, axis: usize, keepdim: bool, mean: bool) -> Result<(), String> {
    let Input {
        dev,
        dtype,
        x,
        host,
        dims,
    } = *inp;
    let name = if mean { "mean_axis" } else { "sum_axis" };
    let what = format!(
        "{name}(axis {axis}, keepdim {keepdim}) of {dims:?} {dtype} on {}",
        label(dev)
    );
    let out = if mean {
        x.mean_axis(axis, keepdim)
    } else {
        x.sum_axis(axis, keepdim)
    }
    .map_err(|e| format!("{what}: {e}"))?;
    let (want, od) = ref_reduce_axis(host, dims, axis, keepdim, mean);
    let want = expect_in(want, dtype);
    let abs = ref_abs_sum_axis(host, dims, axis);
    let got = download(&out, &od, dtype).map_err(|e| format!("{what}: {e}"))?;
    let len = dims[axis];
    check_close_by(&what, &got, &want, |i| {
        reduce_tol(dtype, abs[i], len, mean, want[i])
    })
}

/// sum() and mean() of everything, then every axis with keepdim true and false.
fn check_all(dev: &Device, dtype: DType, dims: &[usize], seed: u64) -> Result<(), String> {
    let n = numel(dims);
    let host = as_dtype(&host_data(seed, n, -2.0, 3.0), dtype);
    let x = upload(dev, &host, dims, dtype);
    let abs_sum = ref_sum(&host.iter().map(|v| v.abs()).collect::<Vec<_>>()) as f32;
    for mean in [false, true] {
        let what = format!(
            "{} of {dims:?} {dtype} on {}",
            if mean { "mean" } else { "sum" },
            label(dev)
        );
        let out = if mean { x.mean() } else { x.sum() }.map_err(|e| format!("{what}: {e}"))?;
        let total = ref_sum(&host);
        let want = if mean {
            (total / n as f64) as f32 // NaN for n == 0, as in PyTorch
        } else {
            total as f32
        };
        let want = expect_in(vec![want], dtype);
        let got = download(&out, &[], dtype).map_err(|e| format!("{what}: {e}"))?;
        check_close_by(&what, &got, &want, |_| {
            reduce_tol(dtype, abs_sum, n, mean, want[0])
        })?;
    }
    let inp = Input {
        dev,
        dtype,
        x: &x,
        host: &host,
        dims,
    };
    for axis in 0..dims.len() {
        for keepdim in [true, false] {
            for mean in [false, true] {
                check_axis(&inp, axis, keepdim, mean)?;
            }
        }
    }
    Ok(())
}

fn reductions_match_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(24), |(dims in shape(), seed in any::<u64>())| {
        for dtype in DTYPES {
            check_all(dev, dtype, &dims, seed).map_err(TestCaseError::fail)?;
        }
    });
}

/// Long rows (tree reduction) and short rows (serial loop), contiguous and strided, around the
/// 64-element switch and the 256-invocation workgroup, and empty axes.
fn reductions_fixed_shapes(dev: &Device) {
    let shapes: &[&[usize]] = &[
        &[1000],
        &[3],
        &[3, 1000],
        &[1000, 3],
        &[2, 1000, 3],
        &[63],
        &[64],
        &[65],
        &[4, 63],
        &[4, 64],
        &[64, 4],
        &[255],
        &[256],
        &[257],
        &[511],
        &[512],
        &[513],
        &[5, 3],
        &[1, 1, 1, 1],
        &[2, 3, 4, 5],
        &[7, 1, 300],
        &[20_000],
        &[],
        &[0],
        &[3, 0],
        &[0, 3],
        &[2, 0, 70],
        &[1, 0],
    ];
    for dtype in DTYPES {
        for (i, dims) in shapes.iter().enumerate() {
            check_all(dev, dtype, dims, 40 + i as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// The mean of an empty tensor, or along an empty axis, is NaN (PyTorch); the sum is 0.
fn empty_mean_is_nan_and_empty_sum_is_zero(dev: &Device) {
    for dtype in DTYPES {
        let what = format!("{dtype} on {}", label(dev));
        let x = Tensor::zeros(dev, &[0, 4], dtype).unwrap();
        let m = x.mean().unwrap();
        assert_eq!(m.dims(), &[] as &[usize], "{what}");
        assert!(m.item().unwrap().is_nan(), "mean of empty, {what}");
        assert_eq!(
            x.sum().unwrap().item().unwrap(),
            0.0,
            "sum of empty, {what}"
        );
        let ma = x.mean_axis(0, false).unwrap();
        let got = download(&ma, &[4], dtype).unwrap();
        assert!(
            got.iter().all(|v| v.is_nan()),
            "mean over empty axis 0 of [0, 4], {what}: {got:?}"
        );
        let ma = x.mean_axis(0, true).unwrap();
        assert_eq!(ma.dims(), &[1, 4], "{what}");
        let sa = x.sum_axis(0, false).unwrap();
        assert_eq!(download(&sa, &[4], dtype).unwrap(), vec![0.0; 4], "{what}");
        // Along the non-empty axis the result itself is empty.
        let e = x.mean_axis(1, false).unwrap();
        assert_eq!(e.dims(), &[0], "{what}");
        assert!(e.to_vec_f32().unwrap().is_empty(), "{what}");
    }
}

/// Summing the same 100k-element tensor twice gives bitwise the same value (the order of the
/// additions is fixed by the shape).
fn sum_is_deterministic(dev: &Device) {
    for dtype in DTYPES {
        let host = host_data(99, 100_000, -1.0, 1.0);
        let x = upload(dev, &host, &[100_000], dtype);
        let a = x.sum().unwrap().item().unwrap();
        let b = x.sum().unwrap().item().unwrap();
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{dtype} on {}: {a} vs {b}",
            label(dev)
        );
        let x2 = x.reshape(&[100, 1000]).unwrap();
        let r1 = x2.sum_axis(1, false).unwrap().to_vec_f32().unwrap();
        let r2 = x2.sum_axis(1, false).unwrap().to_vec_f32().unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&r1), bits(&r2), "{dtype} on {}", label(dev));
        // And it is right.
        let host = as_dtype(&host, dtype);
        let want = ref_sum(&host) as f32;
        let abs: f32 = host.iter().map(|v| v.abs()).sum();
        let tol = reduce_tol(dtype, abs, host.len(), false, want) + f16_ulp(want);
        assert!(
            (a - want).abs() <= tol,
            "{dtype} on {}: sum {a}, expected {want}",
            label(dev)
        );
    }
}
