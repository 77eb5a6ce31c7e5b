//! clip_grad_norm against a plain-loop CPU reference on every device: f32 and f16 gradients of
//! many shapes (one element, odd, empty, large enough to take several slots), parameters without
//! a gradient, the no-clip case (gradients bit for bit unchanged), a single parameter, the norm
//! as a tensor, bitwise repeatability, and the errors.

use crate::common;

use common::*;
use fitgrad::optim::{clip_grad_norm, clip_grad_norm_tensor};
use fitgrad::{DType, Device, Error, Tensor};

device_tests!(
    clips_like_the_reference,
    no_clip_leaves_gradients_unchanged,
    norm_tensor_repeatable_and_empty_cases
);

/// One element, odd, empty, multiples of 4 (quads), 2-D, and 20001 elements (two slots).
const SHAPES: [&[usize]; 8] = [
    &[1],
    &[7],
    &[0],
    &[4],
    &[3, 5],
    &[12, 20],
    &[20001],
    &[2, 2],
];
/// The parameter that has no gradient.
const NO_GRAD: usize = 4;

/// The norm (f64) and the clipped gradients (f32, then rounded to `dtype`) of torch's
/// clip_grad_norm_.
fn ref_clip(
    grads: &[Option<Vec<f32>>],
    max_norm: f32,
    dtype: DType,
) -> (f64, Vec<Option<Vec<f32>>>) {
    let mut sq = 0.0f64;
    for g in grads.iter().flatten() {
        for &v in g {
            sq += v as f64 * v as f64;
        }
    }
    let norm = sq.sqrt();
    let factor = (max_norm as f64 / (norm + 1e-6)).min(1.0) as f32;
    let clipped = grads
        .iter()
        .map(|g| {
            g.as_ref()
                .map(|g| as_dtype(&g.iter().map(|&v| v * factor).collect::<Vec<_>>(), dtype))
        })
        .collect();
    (norm, clipped)
}

/// Parameters of `shapes` with host gradients (none for `no_grad`) of `dtype`, scaled by `mag`.
fn setup(
    dev: &Device,
    shapes: &[&[usize]],
    no_grad: Option<usize>,
    dtype: DType,
    mag: f32,
    seed: u64,
) -> (Vec<Tensor>, Vec<Option<Vec<f32>>>) {
    let mut params = Vec::new();
    let mut grads = Vec::new();
    for (i, d) in shapes.iter().enumerate() {
        let p = Tensor::zeros(dev, d, DType::F32)
            .unwrap()
            .with_requires_grad();
        let g = (Some(i) != no_grad)
            .then(|| as_dtype(&host_data(seed + i as u64, numel(d), -mag, mag), dtype));
        p.set_grad(g.as_ref().map(|g| upload(dev, g, d, dtype)))
            .unwrap();
        params.push(p);
        grads.push(g);
    }
    (params, grads)
}

/// Clips and compares the norm and every gradient with the reference.
fn check(dev: &Device, shapes: &[&[usize]], no_grad: Option<usize>, dtype: DType, max_norm: f32) {
    let what = format!(
        "clip {shapes:?} {dtype} max_norm {max_norm} on {}",
        label(dev)
    );
    let (params, host) = setup(dev, shapes, no_grad, dtype, 1.0, 5);
    let (want_norm, want) = ref_clip(&host, max_norm, dtype);
    let norm = clip_grad_norm(&params, max_norm).unwrap_or_else(|e| panic!("{what}: {e}"));
    // f32 sums of up to ~20000 squares.
    let tol = 1e-5 * want_norm + 1e-7;
    assert!(
        (norm as f64 - want_norm).abs() <= tol,
        "{what}: norm {norm}, expected {want_norm}"
    );
    for (i, (p, w)) in params.iter().zip(&want).enumerate() {
        match w {
            None => assert!(p.grad().is_none(), "{what}: parameter {i} got a gradient"),
            Some(w) => {
                let got = download(&p.grad().unwrap(), shapes[i], dtype).unwrap();
                let tol = match dtype {
                    DType::F32 => Tol {
                        abs: 1e-7,
                        rel: 2e-5,
                        f16_ulps: 0.0,
                    },
                    DType::F16 => Tol {
                        abs: 1e-7,
                        rel: 1e-3,
                        f16_ulps: 1.0,
                    },
                };
                assert_close(&format!("{what}: gradient {i}"), &got, w, tol);
            }
        }
    }
}

fn clips_like_the_reference(dev: &Device) {
    for dtype in [DType::F32, DType::F16] {
        // The norm is about 82: clipped to 1, and to 10.
        check(dev, &SHAPES, Some(NO_GRAD), dtype, 1.0);
        check(dev, &SHAPES, Some(NO_GRAD), dtype, 10.0);
        // A single parameter, clipped.
        check(dev, &[&[3, 7]], None, dtype, 0.5);
    }
}

/// Below max_norm nothing is written: the gradients keep their bits.
fn no_clip_leaves_gradients_unchanged(dev: &Device) {
    for dtype in [DType::F32, DType::F16] {
        let (params, host) = setup(dev, &SHAPES, Some(NO_GRAD), dtype, 1.0, 9);
        let (want_norm, _) = ref_clip(&host, 1.0, dtype);
        let norm = clip_grad_norm(&params, 1000.0).unwrap();
        assert!((norm as f64 - want_norm).abs() <= 1e-5 * want_norm);
        for (i, (p, h)) in params.iter().zip(&host).enumerate() {
            if let Some(h) = h {
                let got = p.grad().unwrap().to_vec_f32().unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(h),
                    "gradient {i} {dtype} on {}",
                    label(dev)
                );
            }
        }
    }
}

/// The tensor form gives the same norm, rank 0 f32, and clips the same way; two runs on the same
/// gradients give the same bits; no gradient at all gives 0.
fn norm_tensor_repeatable_and_empty_cases(dev: &Device) {
    let run = || {
        let (params, _) = setup(dev, &SHAPES, Some(NO_GRAD), DType::F32, 3.0, 1);
        let t = clip_grad_norm_tensor(&params, 2.0).unwrap();
        assert_eq!((t.dims(), t.dtype()), (&[][..], DType::F32));
        let grads: Vec<Vec<u32>> = params
            .iter()
            .filter_map(|p| p.grad())
            .map(|g| {
                g.to_vec_f32()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            })
            .collect();
        (t.item().unwrap().to_bits(), grads)
    };
    let a = run();
    assert_eq!(a, run(), "{}", label(dev));
    let (params, _) = setup(dev, &SHAPES, Some(NO_GRAD), DType::F32, 3.0, 1);
    assert_eq!(clip_grad_norm(&params, 2.0).unwrap().to_bits(), a.0);

    // No gradients, or only empty ones: 0, nothing changes.
    let (params, _) = setup(dev, &[&[3]], Some(0), DType::F32, 1.0, 1);
    assert_eq!(clip_grad_norm(&params, 1.0).unwrap(), 0.0);
    assert_eq!(
        clip_grad_norm_tensor(&params, 1.0).unwrap().item().unwrap(),
        0.0
    );
    let (params, _) = setup(dev, &[&[0], &[2, 0]], None, DType::F16, 1.0, 1);
    assert_eq!(clip_grad_norm(&params, 1.0).unwrap(), 0.0);
    assert_eq!(clip_grad_norm(&[], 1.0).unwrap(), 0.0);
}

#[test]
fn errors() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let (params, _) = setup(&dev, &[&[3], &[4]], None, DType::F32, 1.0, 1);
    for max_norm in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        let e = clip_grad_norm(&params, max_norm).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }),
            "{max_norm}: {e}"
        );
    }
    let e = clip_grad_norm(&[params[0].clone(), params[0].clone()], 1.0).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = clip_grad_norm_tensor(&[], 1.0).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    // Nothing was scaled by the failed calls.
    let g = params[0].grad().unwrap().to_vec_f32().unwrap();
    assert_eq!(g, host_data(1, 3, -1.0, 1.0));
}
