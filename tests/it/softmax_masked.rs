//! softmax_masked (scale, causal mask and additive mask fused into the softmax kernels) against
//! an f64 CPU reference on every device, in f32 and f16: random (.., T_q, T_k) shapes (T_k of 1,
//! odd, past the workgroup size and past what the registers hold; rows not a multiple of the
//! subgroup; T_q above and below T_k), masks of every broadcast form with -inf entries and
//! entirely masked rows; the backward rule against central finite differences; bitwise
//! repeatability; the default options matching plain softmax bit for bit; and the typed errors.

use crate::common;

use common::*;
use fitgrad::{DType, Device, Error, SoftmaxOptions, Tensor};
use proptest::prelude::*;

device_tests!(
    softmax_masked_matches_reference,
    softmax_masked_edges,
    default_options_match_softmax_bitwise
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

/// How the mask of a case is shaped, relative to the input (.., T_q, T_k).
#[derive(Clone, Copy, Debug)]
enum MaskForm {
    None,
    /// The input's own shape.
    Full,
    /// (T_q, T_k), shared by every leading index.
    Matrix,
    /// (d0, 1, T_q, T_k) for a rank-4 input, else like `Matrix` with a leading 1.
    PerBatch,
    /// (1, T_k): one row of keys for every query (a padding mask).
    Keys,
    /// (T_q, 1): constant along the keys (expanded by the host).
    Queries,
}

/// The mask dims of `form` for input `dims` (rank >= 1).
fn mask_dims(form: MaskForm, dims: &[usize]) -> Option<Vec<usize>> {
    let r = dims.len();
    let tk = dims[r - 1];
    let tq = if r >= 2 { dims[r - 2] } else { 1 };
    Some(match form {
        MaskForm::None => return None,
        MaskForm::Full => dims.to_vec(),
        MaskForm::Matrix => vec![tq, tk],
        MaskForm::PerBatch if r == 4 => vec![dims[0], 1, tq, tk],
        MaskForm::PerBatch => vec![1, tq, tk],
        MaskForm::Keys => vec![1, tk],
        MaskForm::Queries => vec![tq, 1],
    })
    .map(|d: Vec<usize>| {
        // Never of a higher rank than the input.
        let extra = d.len().saturating_sub(r);
        d[extra..].to_vec()
    })
}

/// Mask values: mostly in [-2, 2), some -inf, and with `dead_row` set, the first mask row all
/// -inf (a row masked entirely).
fn mask_data(seed: u64, dims: &[usize], dead_row: bool) -> Vec<f32> {
    let n = numel(dims);
    let mut r = HostRng::new(seed);
    let mut m: Vec<f32> = (0..n)
        .map(|_| {
            if r.next_u64().is_multiple_of(8) {
                f32::NEG_INFINITY
            } else {
                r.uniform(-2.0, 2.0)
            }
        })
        .collect();
    let c = dims.last().copied().unwrap_or(1);
    if dead_row && c > 0 {
        for v in m.iter_mut().take(c) {
            *v = f32::NEG_INFINITY;
        }
    }
    m
}

/// softmax(scale * x + mask) over the last dim in f64, causal columns k > i + T_k - T_q at
/// -inf; a row of all -inf gives zeros, a NaN anywhere in a row NaN.
fn ref_softmax_masked(
    x: &[f64],
    dims: &[usize],
    scale: f32,
    causal: bool,
    mask: Option<(&[f32], &[usize])>,
) -> Vec<f64> {
    let r = dims.len();
    let tk = dims.last().copied().unwrap_or(1);
    let tq = if r >= 2 { dims[r - 2] } else { 1 };
    let mut out = Vec::with_capacity(x.len());
    if tk == 0 {
        return out;
    }
    let xs = strides(dims);
    for (row, xr) in x.chunks(tk).enumerate() {
        let i = row % tq;
        let mut vals = Vec::with_capacity(tk);
        for (k, &xv) in xr.iter().enumerate() {
            let mut v = scale as f64 * xv;
            if let Some((m, md)) = mask {
                // The element's multi-index, then the mask's (broadcast dims pinned to 0).
                let mut lin = row * tk + k;
                let mut idx = vec![0; r];
                for a in 0..r {
                    idx[a] = lin / xs[a];
                    lin %= xs[a];
                }
                let ms = strides(md);
                let shift = r - md.len();
                let mut off = 0;
                for a in 0..md.len() {
                    if md[a] != 1 {
                        off += idx[a + shift] * ms[a];
                    }
                }
                v += m[off] as f64;
            }
            if causal && k as i64 > i as i64 + tk as i64 - tq as i64 {
                v = f64::NEG_INFINITY;
            }
            vals.push(v);
        }
        let mx = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        if vals.iter().any(|v| v.is_nan()) {
            out.extend(vals.iter().map(|_| f64::NAN));
        } else if mx == f64::NEG_INFINITY {
            out.extend(vals.iter().map(|_| 0.0));
        } else {
            let s: f64 = vals.iter().map(|v| (v - mx).exp()).sum();
            out.extend(vals.iter().map(|v| (v - mx).exp() / s));
        }
    }
    out
}

fn tol(dtype: DType, want: f32) -> f32 {
    let w = want.abs();
    match dtype {
        DType::F32 => 1e-7 + 2e-5 * w,
        DType::F16 => 6.2e-5 + 1e-3 * w + 2.0 * f16_ulp(w),
    }
}

/// One case on one device and dtype: the result against the reference, bitwise equal on a
/// second run.
#[allow(clippy::too_many_arguments)]
fn check_case(
    dev: &Device,
    dtype: DType,
    dims: &[usize],
    host: &[f32],
    scale: f32,
    causal: bool,
    mask: Option<(&[f32], &[usize])>,
) -> Result<(), String> {
    let what = format!(
        "softmax_masked {dims:?} {dtype} scale {scale} causal {causal} mask {:?} on {}",
        mask.map(|(_, d)| d),
        label(dev)
    );
    let host = as_dtype(host, dtype);
    let mask_host = mask.map(|(m, d)| (as_dtype(m, dtype), d));
    let x = upload(dev, &host, dims, dtype);
    let mut opts = SoftmaxOptions::new().scale(scale).causal(causal);
    opts.mask = mask_host.as_ref().map(|(m, d)| upload(dev, m, d, dtype));
    let run = || -> Result<Vec<f32>, String> {
        let y = x
            .softmax_masked(opts.clone())
            .map_err(|e| format!("{what}: {e}"))?;
        download(&y, dims, dtype).map_err(|e| format!("{what}: {e}"))
    };
    let got = run()?;
    let x64: Vec<f64> = host.iter().map(|&v| v as f64).collect();
    let want: Vec<f32> = ref_softmax_masked(
        &x64,
        dims,
        scale,
        causal,
        mask_host.as_ref().map(|(m, d)| (m.as_slice(), *d)),
    )
    .into_iter()
    .map(|v| v as f32)
    .collect();
    let want = expect_in(want, dtype);
    check_close_by(&what, &got, &want, |i| tol(dtype, want[i]))?;
    let again = run()?;
    if got
        .iter()
        .map(|v| v.to_bits())
        .ne(again.iter().map(|v| v.to_bits()))
    {
        return Err(format!("{what}: a second run differs"));
    }
    Ok(())
}

/// T_k around the kernels' switches: one invocation per row below 64, a subgroup or 16-256
/// invocations per row above, vec4 or not, past the 1024 elements a subgroup keeps in registers.
fn keys() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1usize..70,
        2 => prop::sample::select(vec![1usize, 63, 64, 65, 100, 127, 256, 257, 1024, 1030]),
    ]
}

fn mask_form() -> impl Strategy<Value = MaskForm> {
    prop::sample::select(vec![
        MaskForm::None,
        MaskForm::Full,
        MaskForm::Matrix,
        MaskForm::PerBatch,
        MaskForm::Keys,
        MaskForm::Queries,
    ])
}

fn softmax_masked_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        lead in prop::collection::vec(prop_oneof![Just(1usize), 2usize..4], 0..3),
        tq in prop_oneof![Just(1usize), 2usize..12, Just(33usize)],
        tk in keys(),
        causal in any::<bool>(),
        form in mask_form(),
        dead_row in any::<bool>(),
        scale in prop::sample::select(vec![1.0f32, 0.125, 3.0]),
        seed in any::<u64>(),
    )| {
        let mut dims = lead;
        dims.extend([tq, tk]);
        // Keep the case small for lavapipe: drop leading dims, then halve T_q.
        while numel(&dims) > 12_000 && dims.len() > 2 {
            dims.remove(0);
        }
        while numel(&dims) > 12_000 {
            dims[0] = (dims[0] / 2).max(1);
        }
        let host = host_data(seed, numel(&dims), -4.0, 4.0);
        let md = mask_dims(form, &dims);
        let mh = md.as_ref().map(|d| mask_data(seed ^ 3, d, dead_row));
        for dtype in DTYPES {
            let mask = mh.as_deref().zip(md.as_deref());
            check_case(dev, dtype, &dims, &host, scale, causal, mask).map_err(TestCaseError::fail)?;
        }
    });
}

/// Edges the random shapes may miss: T = 1, causal with T_q > T_k (the first queries see
/// nothing: zero rows), a KV-cache block (T_q < T_k), rows masked entirely by the mask, a rank-1
/// input with a mask, an input of all -inf (zeros, where plain softmax gives NaN), empty tensors.
fn softmax_masked_edges(dev: &Device) {
    type Case = (Vec<usize>, bool, Option<Vec<usize>>);
    let cases: Vec<Case> = vec![
        (vec![1, 1], true, None),
        (vec![1, 1], false, Some(vec![1, 1])),
        (vec![7, 3], true, None),
        (vec![2, 5, 9], true, Some(vec![5, 9])),
        (vec![3, 70], true, Some(vec![3, 70])),
        (vec![5], false, Some(vec![5])),
        (vec![4, 300], false, Some(vec![1, 300])),
        (vec![0, 5], true, None),
        (vec![3, 0], false, None),
    ];
    for dtype in DTYPES {
        for (k, (dims, causal, md)) in cases.iter().enumerate() {
            let host = host_data(k as u64, numel(dims), -3.0, 3.0);
            let mh = md.as_ref().map(|d| mask_data(k as u64 + 9, d, true));
            let mask = mh.as_deref().zip(md.as_deref());
            check_case(dev, dtype, dims, &host, 0.5, *causal, mask)
                .unwrap_or_else(|e| panic!("{e}"));
        }
        // Every row all -inf: zeros, not NaN.
        let x = upload(dev, &[f32::NEG_INFINITY; 6], &[2, 3], dtype);
        let y = x.softmax_masked(SoftmaxOptions::new()).unwrap();
        assert_eq!(y.to_vec_f32().unwrap(), vec![0.0; 6], "{}", label(dev));
    }
}

/// With the default options the kernels compute exactly what plain softmax computes (scale 1 is
/// exact), bit for bit, on every path: one invocation per row, subgroups, streamed rows.
fn default_options_match_softmax_bitwise(dev: &Device) {
    for dtype in DTYPES {
        for dims in [[5usize, 7], [9, 64], [3, 1030], [2, 4096]] {
            let host = host_data(11, numel(&dims), -5.0, 5.0);
            let x = upload(dev, &host, &dims, dtype);
            let a = x.softmax().unwrap().to_vec_f32().unwrap();
            let b = x
                .softmax_masked(SoftmaxOptions::default())
                .unwrap()
                .to_vec_f32()
                .unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "{dims:?} {dtype} on {}", label(dev));
        }
    }
}

/// dL/dx of L = sum(softmax_masked(x) * w) against central differences of the f64 reference,
/// with a scale, the causal mask and an additive mask with -inf entries (their gradient is
/// exactly 0); the mask itself gets no gradient.
#[test]
fn softmax_masked_gradient_matches_finite_differences() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let dims = [2usize, 3, 5];
    let md = [3usize, 5];
    let xh = host_data(21, numel(&dims), -2.0, 2.0);
    let mut mh = host_data(22, numel(&md), -1.0, 1.0);
    mh[1] = f32::NEG_INFINITY;
    mh[7] = f32::NEG_INFINITY;
    let wh = host_data(23, numel(&dims), -1.0, 1.0);
    let scale = 0.7f32;
    for causal in [false, true] {
        let x = upload(&dev, &xh, &dims, DType::F32).with_requires_grad();
        let mask = upload(&dev, &mh, &md, DType::F32).with_requires_grad();
        let w = upload(&dev, &wh, &dims, DType::F32);
        let y = x
            .softmax_masked(
                SoftmaxOptions::new()
                    .scale(scale)
                    .causal(causal)
                    .mask(mask.clone()),
            )
            .unwrap();
        y.mul(&w).unwrap().sum().unwrap().backward().unwrap();
        let got = x.grad().expect("x gets a gradient").to_vec_f32().unwrap();
        assert!(mask.grad().is_none(), "the mask gets no gradient");
        let loss = |xv: &[f64]| -> f64 {
            ref_softmax_masked(xv, &dims, scale, causal, Some((&mh, &md)))
                .iter()
                .zip(&wh)
                .map(|(y, &w)| y * w as f64)
                .sum()
        };
        let x64: Vec<f64> = xh.iter().map(|&v| v as f64).collect();
        for j in 0..xh.len() {
            let h = 1e-3 * x64[j].abs().max(1.0);
            let mut xp = x64.clone();
            xp[j] += h;
            let mut xm = x64.clone();
            xm[j] -= h;
            let fd = (loss(&xp) - loss(&xm)) / (2.0 * h);
            let err = (got[j] as f64 - fd).abs();
            assert!(
                err <= 1e-4 + 1e-3 * fd.abs(),
                "causal {causal}: d/dx[{j}] got {}, finite differences {fd}",
                got[j]
            );
            // Masked positions: exactly zero.
            let (row, k) = (j / 5, j % 5);
            let (i, mi) = (row % 3, (row % 3) * 5 + k);
            if mh[mi] == f32::NEG_INFINITY || (causal && k > i + 2) {
                assert_eq!(got[j], 0.0, "masked position {j}");
            }
        }
    }
}

#[test]
fn softmax_masked_errors() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let x = Tensor::zeros(&dev, &[2, 3, 4], DType::F32).unwrap();
    let opts = SoftmaxOptions::new;
    for scale in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        let e = x.softmax_masked(opts().scale(scale)).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { .. }),
            "scale {scale}: {e}"
        );
    }
    for dims in [&[4usize][..], &[]] {
        let t = Tensor::zeros(&dev, dims, DType::F32).unwrap();
        let e = t.softmax_masked(opts().causal(true)).unwrap_err();
        assert!(
            matches!(e, Error::Shape { .. }),
            "causal rank {}: {e}",
            dims.len()
        );
    }
    for md in [&[3usize, 5][..], &[2, 3], &[1, 2, 3, 4], &[3, 2, 4]] {
        let m = Tensor::zeros(&dev, md, DType::F32).unwrap();
        let e = x.softmax_masked(opts().mask(m)).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "mask {md:?}: {e}");
    }
    let m = Tensor::zeros(&dev, &[3, 4], DType::F16).unwrap();
    let e = x.softmax_masked(opts().mask(m)).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    // Broadcastable masks are accepted.
    for md in [&[3usize, 4][..], &[2, 1, 4], &[1], &[], &[3, 1]] {
        let m = Tensor::zeros(&dev, md, DType::F32).unwrap();
        x.softmax_masked(opts().mask(m).causal(true))
            .unwrap_or_else(|e| panic!("mask {md:?}: {e}"));
    }
}
