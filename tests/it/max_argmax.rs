//! max, max_axis, argmax_axis and max_axis_with_indices against the CPU reference on every
//! device and in f32 and f16: ties (first index wins), NaN (the first NaN wins), -inf, rows
//! short and long, determinism, and the errors.

use crate::common;

use common::strategies::shape_rank;
use common::*;
use fitgrad::{DType, Device, Error, Tensor};
use proptest::prelude::*;

device_tests!(
    max_argmax_match_reference,
    max_fixed_cases,
    max_is_deterministic,
    max_errors
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

/// Small integers (many ties), sometimes -inf or NaN.
fn tie_data(seed: u64, n: usize, specials: bool) -> Vec<f32> {
    let mut r = HostRng::new(seed);
    (0..n)
        .map(|_| {
            let k = r.next_u64() % 64;
            match k {
                0 if specials => f32::NAN,
                1 if specials => f32::NEG_INFINITY,
                _ => (k % 7) as f32 - 3.0,
            }
        })
        .collect()
}

/// Max and argmax of every axis (keepdim both ways), and max of everything, exactly.
fn check_max(dev: &Device, dtype: DType, dims: &[usize], host: &[f32]) -> Result<(), String> {
    let x = upload(dev, host, dims, dtype);
    let bits = |v: &[f32]| -> Vec<u32> {
        v.iter()
            .map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() })
            .collect()
    };
    for axis in 0..dims.len() {
        for keepdim in [false, true] {
            let what = format!(
                "max/argmax axis {axis} keepdim {keepdim} of {dims:?} {dtype} on {}",
                label(dev)
            );
            let (want_v, want_i, od) = ref_max_axis(host, dims, axis, keepdim);
            let (v, i) = x
                .max_axis_with_indices(axis, keepdim)
                .map_err(|e| format!("{what}: {e}"))?;
            let m = x
                .max_axis(axis, keepdim)
                .map_err(|e| format!("{what}: {e}"))?;
            let a = x
                .argmax_axis(axis, keepdim)
                .map_err(|e| format!("{what}: {e}"))?;
            for (name, t, want, dt) in [
                ("values", &v, &want_v, dtype),
                ("max_axis", &m, &want_v, dtype),
                ("indices", &i, &want_i, DType::F32),
                ("argmax_axis", &a, &want_i, DType::F32),
            ] {
                let got = download(t, &od, dt).map_err(|e| format!("{what} {name}: {e}"))?;
                if bits(&got) != bits(want) {
                    return Err(format!("{what} {name}: got {got:?}, expected {want:?}"));
                }
            }
        }
    }
    let flat = [numel(dims)];
    let (want, _, _) = ref_max_axis(host, &flat, 0, false);
    let got = download(&x.max().map_err(|e| e.to_string())?, &[], dtype)?;
    if bits(&got) != bits(&want) {
        return Err(format!(
            "max of {dims:?} {dtype} on {}: got {got:?}, expected {want:?}",
            label(dev)
        ));
    }
    Ok(())
}

fn max_argmax_match_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        dims in shape_rank(1, 4),
        seed in any::<u64>(),
        specials in any::<bool>(),
    )| {
        prop_assume!(dims.iter().all(|&d| d > 0));
        let host = tie_data(seed, numel(&dims), specials);
        for dtype in DTYPES {
            check_max(dev, dtype, &dims, &host).map_err(TestCaseError::fail)?;
        }
    });
}

/// Rows around the 64-element switch and the 256-invocation workgroup, a row with its only NaN
/// last, all -inf, the max at the very end, and one long row.
fn max_fixed_cases(dev: &Device) {
    for dtype in DTYPES {
        for (i, dims) in [
            &[63usize][..],
            &[64],
            &[65],
            &[3, 300],
            &[300, 3],
            &[2, 257, 3],
            &[20_000],
            &[1, 1, 1, 1],
        ]
        .iter()
        .enumerate()
        {
            let host = tie_data(i as u64, numel(dims), i % 2 == 0);
            check_max(dev, dtype, dims, &host).unwrap_or_else(|e| panic!("{e}"));
        }
        for c in [10usize, 1000] {
            let mut rows = Vec::new();
            rows.extend((0..c).map(|k| if k + 1 == c { f32::NAN } else { 1.0 }));
            rows.extend(vec![f32::NEG_INFINITY; c]);
            rows.extend((0..c).map(|k| k as f32 / 16.0));
            rows.extend(vec![2.0; c]);
            check_max(dev, dtype, &[4, c], &rows).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

fn max_is_deterministic(dev: &Device) {
    let host = host_data(3, 100_000, -1.0, 1.0);
    let x = upload(dev, &host, &[100, 1000], DType::F32);
    let (v1, i1) = x.max_axis_with_indices(1, false).unwrap();
    let (v2, i2) = x.max_axis_with_indices(1, false).unwrap();
    assert_eq!(v1.to_vec::<f32>().unwrap(), v2.to_vec::<f32>().unwrap());
    assert_eq!(i1.to_vec::<f32>().unwrap(), i2.to_vec::<f32>().unwrap());
    assert_eq!(
        x.max().unwrap().item().unwrap(),
        x.max().unwrap().item().unwrap()
    );
}

fn max_errors(dev: &Device) {
    let x = Tensor::zeros(dev, &[3, 0], DType::F32).unwrap();
    assert!(matches!(
        x.max_axis(1, false),
        Err(Error::InvalidArgument { op: "max_axis", .. })
    ));
    assert!(matches!(
        x.argmax_axis(1, false),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(x.max(), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        x.max_axis(2, false),
        Err(Error::InvalidArgument { .. })
    ));
    // Along the non-empty axis of an empty tensor the result is empty, not an error.
    let e = Tensor::zeros(dev, &[0, 3], DType::F16).unwrap();
    let (v, i) = e.max_axis_with_indices(1, true).unwrap();
    assert_eq!((v.dims(), i.dims()), (&[0usize, 1][..], &[0usize, 1][..]));
    assert_eq!((v.dtype(), i.dtype()), (DType::F16, DType::F32));
    let s = Tensor::scalar(dev, 4.0f32).unwrap();
    assert_eq!(s.max().unwrap().item().unwrap(), 4.0);
}
