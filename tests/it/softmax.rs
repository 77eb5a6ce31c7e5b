//! softmax, log_softmax and the fused cross-entropy against the f64 CPU reference on every device
//! and in f32 and f16: random shapes (rank 1-4, short rows taking one invocation each, long rows
//! shared by many, rows past what the registers hold), -inf entries, all -inf rows, NaN, huge
//! values, determinism, and the errors of cross-entropy.

use crate::common;

use common::strategies::{cap, shape_rank, MAX_NUMEL};
use common::*;
use fitgrad::{DType, Device, Error, Tensor};
use proptest::prelude::*;

device_tests!(
    softmax_matches_reference,
    cross_entropy_matches_reference,
    softmax_fixed_shapes,
    softmax_edge_values,
    softmax_is_deterministic,
    cross_entropy_errors_and_empty_batch
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

/// Tolerance of a softmax output `want` (f32: exp is a few ulp off on GPUs; f16: the rounding of
/// the result, and subnormals that drivers may flush).
fn softmax_tol(dtype: DType, want: f32, log: bool) -> f32 {
    let w = want.abs();
    match (dtype, log) {
        (DType::F32, false) => 1e-7 + 2e-5 * w,
        (DType::F32, true) => 2e-6 + 1e-5 * w,
        (DType::F16, _) => 6.2e-5 + 1e-3 * w + 2.0 * f16_ulp(w),
    }
}

/// softmax and log_softmax of `host` (already in `dtype`) with shape `dims`.
fn check_softmax(dev: &Device, dtype: DType, dims: &[usize], host: &[f32]) -> Result<(), String> {
    let x = upload(dev, host, dims, dtype);
    let c = dims.last().copied().unwrap_or(1);
    for log in [false, true] {
        let name = if log { "log_softmax" } else { "softmax" };
        let what = format!("{name} {dims:?} {dtype} on {}", label(dev));
        let out =
            if log { x.log_softmax() } else { x.softmax() }.map_err(|e| format!("{what}: {e}"))?;
        let got = download(&out, dims, dtype).map_err(|e| format!("{what}: {e}"))?;
        let want = expect_in(ref_softmax(host, c, log), dtype);
        check_close_by(&what, &got, &want, |i| softmax_tol(dtype, want[i], log))?;
    }
    Ok(())
}

/// Mean loss and gradient of cross_entropy (and the loss of cross_entropy_loss) on logits
/// `host` (b, c) in `dtype`.
fn check_ce(
    dev: &Device,
    dtype: DType,
    b: usize,
    c: usize,
    host: &[f32],
    targets: &[u32],
) -> Result<(), String> {
    let what = format!("cross_entropy ({b}, {c}) {dtype} on {}", label(dev));
    let x = upload(dev, host, &[b, c], dtype);
    let (loss, grad) = x
        .cross_entropy(targets)
        .map_err(|e| format!("{what}: {e}"))?;
    let only = x
        .cross_entropy_loss(targets)
        .map_err(|e| format!("{what}: {e}"))?;
    let (want_loss, want_grad) = ref_cross_entropy(host, b, c, targets);
    let want_loss = expect_in(vec![want_loss], dtype);
    let want_grad = expect_in(want_grad, dtype);
    // The loss is (logsumexp - x_t) averaged in f32: its error scales with the logits.
    let scale = 1.0 + host.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let loss_tol = match dtype {
        DType::F32 => 1e-5 * scale + 1e-5 * want_loss[0].abs(),
        DType::F16 => 1e-5 * scale + 1e-3 * want_loss[0].abs() + 2.0 * f16_ulp(want_loss[0]),
    };
    for (name, t) in [("loss", &loss), ("cross_entropy_loss", &only)] {
        let got = download(t, &[], dtype).map_err(|e| format!("{what} {name}: {e}"))?;
        check_close_by(&format!("{what} {name}"), &got, &want_loss, |_| loss_tol)?;
    }
    let got = download(&grad, &[b, c], dtype).map_err(|e| format!("{what} grad: {e}"))?;
    check_close_by(&format!("{what} grad"), &got, &want_grad, |i| {
        let w = want_grad[i].abs();
        match dtype {
            DType::F32 => 2e-7 + 2e-5 * w,
            DType::F16 => 6.2e-5 + 1e-3 * w + 2.0 * f16_ulp(w),
        }
    })
}

/// Row lengths around every switch of the kernels: one invocation per row below 64, 16 to 256
/// invocations per row above, vec4 or not, rows held in registers up to 8192 elements.
fn row_len() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1usize..70,
        2 => prop::sample::select(vec![63usize, 64, 65, 100, 127, 128, 255, 256, 257, 511, 512, 1000, 1023, 1024, 1025, 4097]),
        1 => 70usize..2000,
    ]
}

fn softmax_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(20), |(
        lead in shape_rank(0, 3),
        c in row_len(),
        scale in prop::sample::select(vec![1.0f32, 10.0, 100.0]),
        seed in any::<u64>(),
    )| {
        let mut dims = lead;
        dims.push(c);
        let dims = cap(dims, MAX_NUMEL);
        let host = host_data(seed, numel(&dims), -scale, scale);
        for dtype in DTYPES {
            check_softmax(dev, dtype, &dims, &as_dtype(&host, dtype)).map_err(TestCaseError::fail)?;
        }
    });
}

fn cross_entropy_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(20), |(
        b in prop_oneof![Just(1usize), 1usize..40, Just(0usize)],
        c in row_len(),
        scale in prop::sample::select(vec![1.0f32, 5.0, 30.0]),
        seed in any::<u64>(),
    )| {
        let b = b.min(MAX_NUMEL / c).max(usize::from(b > 0));
        let host = host_data(seed, b * c, -scale, scale);
        let mut r = HostRng::new(seed ^ 7);
        let targets: Vec<u32> = (0..b).map(|_| (r.next_u64() % c as u64) as u32).collect();
        for dtype in DTYPES {
            check_ce(dev, dtype, b, c, &as_dtype(&host, dtype), &targets).map_err(TestCaseError::fail)?;
        }
    });
}

/// Shapes the random ones may miss: rank 0 and 1, empty, rows of 1, rows too long for the
/// registers (streamed), and the sizes around each switch.
fn softmax_fixed_shapes(dev: &Device) {
    let shapes: &[&[usize]] = &[
        &[],
        &[1],
        &[7],
        &[0],
        &[0, 5],
        &[5, 0],
        &[3, 1],
        &[2, 3, 4, 5],
        &[5, 63],
        &[5, 64],
        &[3, 65],
        &[3, 1000],
        &[2, 4097],
        &[1, 8192],
        &[1, 8193],
        &[1, 20_000],
        &[2, 9999],
        &[257, 66],
    ];
    for dtype in DTYPES {
        for (i, dims) in shapes.iter().enumerate() {
            let host = as_dtype(&host_data(70 + i as u64, numel(dims), -8.0, 8.0), dtype);
            check_softmax(dev, dtype, dims, &host).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// Rows with -inf entries, all -inf (NaN, as in torch), NaN, +inf, and huge values, at short
/// (one invocation per row), medium and streamed row lengths.
fn softmax_edge_values(dev: &Device) {
    let ninf = f32::NEG_INFINITY;
    for dtype in DTYPES {
        let huge = if dtype == DType::F32 { 1e30 } else { 6e4 };
        for c in [10usize, 100, 1000, 9000] {
            let mut rows: Vec<Vec<f32>> = Vec::new();
            let base = host_data(c as u64, c, -3.0, 3.0);
            // Half -inf.
            rows.push(
                base.iter()
                    .enumerate()
                    .map(|(i, &v)| if i % 2 == 0 { ninf } else { v })
                    .collect(),
            );
            // All -inf but the last entry (for c = 9000 it sits past the registers).
            rows.push(
                (0..c)
                    .map(|i| if i + 1 == c { 1.5 } else { ninf })
                    .collect(),
            );
            // All -inf: NaN.
            rows.push(vec![ninf; c]);
            // One NaN: NaN.
            rows.push(
                base.iter()
                    .enumerate()
                    .map(|(i, &v)| if i == c / 3 { f32::NAN } else { v })
                    .collect(),
            );
            // One +inf: NaN (inf - inf).
            rows.push(
                base.iter()
                    .enumerate()
                    .map(|(i, &v)| if i == c / 2 { f32::INFINITY } else { v })
                    .collect(),
            );
            // Huge values of both signs.
            rows.push(
                base.iter()
                    .enumerate()
                    .map(|(i, &v)| {
                        if i % 3 == 0 {
                            huge
                        } else if i % 3 == 1 {
                            -huge
                        } else {
                            v
                        }
                    })
                    .collect(),
            );
            rows.push(vec![huge; c]);
            rows.push(vec![-huge; c]);
            let host: Vec<f32> = as_dtype(&rows.concat(), dtype);
            let dims = [rows.len(), c];
            check_softmax(dev, dtype, &dims, &host).unwrap_or_else(|e| panic!("{e}"));
            // And the same rows as logits of cross-entropy (targets on finite entries).
            let targets: Vec<u32> = vec![1, c as u32 - 1, 0, 1, 1, 2, 0, 0];
            let x = upload(dev, &host, &dims, dtype);
            let (_, grad) = x.cross_entropy(&targets).unwrap();
            let got = grad.to_vec_f32().unwrap();
            let (_, want) = ref_cross_entropy(&host, dims[0], c, &targets);
            let want = expect_in(want, dtype);
            check_close_by(
                &format!(
                    "cross_entropy grad of edge rows, c {c} {dtype} on {}",
                    label(dev)
                ),
                &got,
                &want,
                |i| {
                    let w = want[i].abs();
                    6.2e-5 + 1e-3 * w + 2.0 * f16_ulp(w)
                },
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// The same input gives bitwise the same softmax, log_softmax and cross-entropy twice.
fn softmax_is_deterministic(dev: &Device) {
    for dtype in DTYPES {
        for dims in [[64usize, 1000], [4, 9000], [300, 10]] {
            let host = host_data(5, numel(&dims), -20.0, 20.0);
            let x = upload(dev, &host, &dims, dtype);
            let bits = |t: Tensor| -> Vec<u32> {
                t.to_vec_f32()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(
                bits(x.softmax().unwrap()),
                bits(x.softmax().unwrap()),
                "{dims:?} {dtype} on {}",
                label(dev)
            );
            assert_eq!(
                bits(x.log_softmax().unwrap()),
                bits(x.log_softmax().unwrap()),
                "{dims:?} {dtype} on {}",
                label(dev)
            );
            let t: Vec<u32> = (0..dims[0] as u32).map(|i| i % dims[1] as u32).collect();
            let (l1, g1) = x.cross_entropy(&t).unwrap();
            let (l2, g2) = x.cross_entropy(&t).unwrap();
            assert_eq!(bits(l1), bits(l2), "{dims:?} {dtype} on {}", label(dev));
            assert_eq!(bits(g1), bits(g2), "{dims:?} {dtype} on {}", label(dev));
        }
    }
}

/// Out-of-range targets, a wrong number of targets and logits that are not (B, C) are errors;
/// an empty batch has a NaN loss, as in torch.
fn cross_entropy_errors_and_empty_batch(dev: &Device) {
    let x = Tensor::zeros(dev, &[3, 5], DType::F32).unwrap();
    for bad in [[0u32, 5, 1], [0, 1, u32::MAX]] {
        match x.cross_entropy(&bad) {
            Err(Error::InvalidArgument {
                op: "cross_entropy",
                reason,
            }) => {
                assert!(reason.contains("out of range"), "{reason}")
            }
            other => panic!("target out of range: {other:?}"),
        }
        assert!(matches!(
            x.cross_entropy_loss(&bad),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert!(matches!(x.cross_entropy(&[0, 1]), Err(Error::Shape { .. })));
    let v = Tensor::zeros(dev, &[5], DType::F32).unwrap();
    assert!(matches!(v.cross_entropy(&[0]), Err(Error::Shape { .. })));
    let e = Tensor::zeros(dev, &[0, 5], DType::F16).unwrap();
    let (loss, grad) = e.cross_entropy(&[]).unwrap();
    assert!(loss.item().unwrap().is_nan());
    assert_eq!(loss.dtype(), DType::F16);
    assert_eq!(grad.dims(), &[0, 5]);
    // Uniform logits: the loss is ln(C).
    let (loss, _) = x.cross_entropy(&[0, 1, 4]).unwrap();
    assert!((loss.item().unwrap() - 5f32.ln()).abs() < 1e-6);
}
