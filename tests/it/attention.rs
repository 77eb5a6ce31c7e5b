//! Fused self-attention (`Tensor::attention` and friends) against an f64 plain-loop reference on
//! every device, in f32 and f16: forward and all three gradients on random (B, H, T, D) shapes
//! (T of 1, odd, not a multiple of the tiles, longer than a tile; D from 1 to 128, odd), causal
//! and not; each fused variant forced (subgroup blocks, workgroup tiles) and the tiles of a
//! 16 KiB adapter; finite differences; fused = composed; bitwise repeatability; the memory the
//! fused forward saves; empty inputs; and the typed errors.

use crate::common;

use common::gradcheck::{check_grads, input};
use common::*;
use fitgrad::{AttentionKind, AttentionOptions, DType, Device, Error, Tensor};
use proptest::prelude::*;

/// q, k, v and the output's gradient of one case, as the tensors of `dtype` hold them.
struct Case {
    dims: [usize; 4],
    causal: bool,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dy: Vec<f32>,
}

impl Case {
    fn new(dims: [usize; 4], causal: bool, dtype: DType, seed: u64) -> Case {
        let n = numel(&dims);
        let data = |s: u64, lo: f32, hi: f32| as_dtype(&host_data(seed ^ s, n, lo, hi), dtype);
        Case {
            dims,
            causal,
            q: data(1, -2.0, 2.0),
            k: data(2, -2.0, 2.0),
            v: data(3, -1.0, 1.0),
            dy: data(4, -1.0, 1.0),
        }
    }
}

/// The reference's results: the output and the gradients of q, k and v for upstream dy.
struct Reference {
    o: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    /// What f16 storage of the output adds to |dq| and |dk|'s error (see `reference`).
    f16_dq: Vec<f64>,
    f16_dk: Vec<f64>,
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// softmax(q kᵀ / sqrt(D), causal) v per (T, D) matrix in f64: the output and the weights
/// (BH, T, T). Causal query i sees keys j <= i.
fn ref_forward(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    dims: [usize; 4],
    causal: bool,
) -> (Vec<f64>, Vec<f64>) {
    let [b, h, t, d] = dims;
    let scale = 1.0 / (d as f64).sqrt();
    let mut o = vec![0.0; b * h * t * d];
    let mut w = vec![0.0; b * h * t * t];
    for m in 0..b * h {
        let (x, pw) = (m * t * d, m * t * t);
        for i in 0..t {
            let seen = if causal { i + 1 } else { t };
            let mut s = vec![f64::NEG_INFINITY; t];
            for (j, sj) in s.iter_mut().enumerate().take(seen) {
                let mut acc = 0.0;
                for c in 0..d {
                    acc += q[x + i * d + c] * k[x + j * d + c];
                }
                *sj = scale * acc;
            }
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = s.iter().map(|v| (v - mx).exp()).sum();
            for j in 0..t {
                let p = (s[j] - mx).exp() / sum;
                w[pw + i * t + j] = p;
                for c in 0..d {
                    o[x + i * d + c] += p * v[x + j * d + c];
                }
            }
        }
    }
    (o, w)
}

/// The forward and, for upstream `dy`, dV = Pᵀ dO, dP = dO vᵀ, dS = P (dP - rowsum(dP P)),
/// dQ = scale dS k, dK = scale dSᵀ q, in f64.
fn reference(c: &Case) -> Reference {
    let (q, k, v, dy) = (f64s(&c.q), f64s(&c.k), f64s(&c.v), f64s(&c.dy));
    let [b, h, t, d] = c.dims;
    let scale = 1.0 / (d as f64).sqrt();
    let (o, w) = ref_forward(&q, &k, &v, c.dims, c.causal);
    let n = b * h * t * d;
    let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let (mut f16_dq, mut f16_dk) = (vec![0.0; n], vec![0.0; n]);
    for m in 0..b * h {
        let (x, pw) = (m * t * d, m * t * t);
        for i in 0..t {
            let dp: Vec<f64> = (0..t)
                .map(|j| (0..d).map(|e| dy[x + i * d + e] * v[x + j * d + e]).sum())
                .collect();
            let row: f64 = (0..t).map(|j| dp[j] * w[pw + i * t + j]).sum();
            // The fused backward takes rowsum(dP P) as rowsum(dO O) from the stored output:
            // in f16 each o is off by up to an ulp (2^-10 relative, rounding and accumulation),
            // and dP - row cancels, so that error reaches dS unscaled.
            let row_err: f64 = (0..d)
                .map(|e| (dy[x + i * d + e] * o[x + i * d + e]).abs() * 2f64.powi(-10))
                .sum();
            for j in 0..t {
                let p = w[pw + i * t + j];
                let ds = p * (dp[j] - row);
                for e in 0..d {
                    dv[x + j * d + e] += p * dy[x + i * d + e];
                    dq[x + i * d + e] += scale * ds * k[x + j * d + e];
                    dk[x + j * d + e] += scale * ds * q[x + i * d + e];
                    f16_dq[x + i * d + e] += scale * p * row_err * k[x + j * d + e].abs();
                    f16_dk[x + j * d + e] += scale * p * row_err * q[x + i * d + e].abs();
                }
            }
        }
    }
    Reference {
        o,
        dq,
        dk,
        dv,
        f16_dq,
        f16_dk,
    }
}

/// `got` against `want` with a tolerance of `rel` times the largest |want| (the size of the
/// sums' terms), plus two f16 ulps of each value for f16 results. The floor of 0.01: where
/// every gradient is tiny (T = 2, a row whose `dp - delta` cancels to 0), the rounding is that
/// of the cancelled O(0.01..1) terms, not of the result.
fn check_scaled(
    what: &str,
    got: &[f32],
    want: &[f64],
    dtype: DType,
    rel: f64,
) -> Result<(), String> {
    check_scaled_plus(what, got, want, dtype, rel, &[])
}

/// `check_scaled` with a further per-element allowance for f16 storage (`extra[i]`, ignored
/// in f32; empty for none).
fn check_scaled_plus(
    what: &str,
    got: &[f32],
    want: &[f64],
    dtype: DType,
    rel: f64,
    extra: &[f64],
) -> Result<(), String> {
    let big = want.iter().fold(1e-2f64, |m, v| m.max(v.abs()));
    let want: Vec<f32> = expect_in(want.iter().map(|&v| v as f32).collect(), dtype);
    check_close_by(what, got, &want, |i| {
        let f16 = match dtype {
            DType::F32 => 0.0,
            DType::F16 => 2.0 * f16_ulp(want[i]) + extra.get(i).map_or(0.0, |&x| x as f32),
        };
        (rel * big) as f32 + f16
    })
}

/// The relative tolerances of the output and of the gradients.
fn rel(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F32 => (2e-5, 1e-4),
        DType::F16 => (1e-3, 1e-2),
    }
}

/// The tensors of a case; q, k and v require grad.
fn tensors(dev: &Device, c: &Case, dtype: DType) -> [Tensor; 4] {
    let up = |x: &[f32]| upload(dev, x, &c.dims, dtype);
    [
        up(&c.q).with_requires_grad(),
        up(&c.k).with_requires_grad(),
        up(&c.v).with_requires_grad(),
        up(&c.dy),
    ]
}

/// Runs `attend` forward and backward: the output and the gradients of q, k and v, as f32.
fn run(
    dev: &Device,
    c: &Case,
    dtype: DType,
    attend: &dyn Fn(&Tensor, &Tensor, &Tensor) -> fitgrad::Result<Tensor>,
) -> Result<[Vec<f32>; 4], String> {
    let [q, k, v, dy] = tensors(dev, c, dtype);
    let e = |e: fitgrad::Error| e.to_string();
    let o = attend(&q, &k, &v).map_err(e)?;
    let out = download(&o, &c.dims, dtype)?;
    o.backward_with(dy).map_err(e)?;
    let grad = |t: &Tensor| match t.grad() {
        Some(g) => download(&g, &c.dims, dtype),
        None => Err("no gradient".to_string()),
    };
    Ok([out, grad(&q)?, grad(&k)?, grad(&v)?])
}

/// One case through `attend` against the reference.
fn check_case(
    dev: &Device,
    c: &Case,
    dtype: DType,
    what: &str,
    attend: &dyn Fn(&Tensor, &Tensor, &Tensor) -> fitgrad::Result<Tensor>,
) -> Result<(), String> {
    let what = format!(
        "{what} {:?} causal {} {dtype} on {}",
        c.dims,
        c.causal,
        label(dev)
    );
    let [o, dq, dk, dv] = run(dev, c, dtype, attend).map_err(|e| format!("{what}: {e}"))?;
    let r = reference(c);
    let (ro, rg) = rel(dtype);
    check_scaled(&format!("{what}: out"), &o, &r.o, dtype, ro)?;
    check_scaled_plus(&format!("{what}: dq"), &dq, &r.dq, dtype, rg, &r.f16_dq)?;
    check_scaled_plus(&format!("{what}: dk"), &dk, &r.dk, dtype, rg, &r.f16_dk)?;
    check_scaled(&format!("{what}: dv"), &dv, &r.dv, dtype, rg)
}

fn fused(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> fitgrad::Result<Tensor> {
    let opts = AttentionOptions::new()
        .causal(causal)
        .kind(AttentionKind::Fused);
    q.attention_with(k, v, &opts)
}

/// Sequence lengths around the tiles (8, 16 and 32 rows): 1, odd, past one tile, not a multiple.
fn seq_len() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![1usize, 2, 5, 8, 9, 16, 17, 31, 33, 40, 47, 70])
}

/// Head dims: the smallest, odd ones, and each bucket's (32, 64, 128) edges.
fn head_dim() -> impl Strategy<Value = usize> {
    prop::sample::select(vec![1usize, 3, 16, 24, 32, 40, 63, 64, 100, 128])
}

device_tests!(
    fused_matches_the_reference,
    small_workgroup_tiles_match_the_reference,
    each_fused_variant_matches_the_reference,
    gradients_match_finite_differences,
    fused_matches_composed,
    fused_is_bitwise_repeatable,
    empty_inputs_give_empty_outputs,
);

/// The shapes the task names, then random ones.
fn fused_matches_the_reference(dev: &Device) {
    let fixed: [([usize; 4], bool); 6] = [
        ([1, 1, 1, 1], true),
        ([1, 2, 17, 16], true),
        ([2, 1, 33, 24], false),
        ([1, 1, 40, 64], true),
        ([1, 1, 9, 128], false),
        ([1, 2, 47, 3], true),
    ];
    for (k, (dims, causal)) in fixed.into_iter().enumerate() {
        for &dtype in dtypes(dev) {
            let c = Case::new(dims, causal, dtype, 10 + k as u64);
            check_case(dev, &c, dtype, "attention", &|q, k, v| {
                fused(q, k, v, causal)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    // Each new (head-dim bucket, causal, dtype) draws cold compiles of a second or more per
    // kernel on lavapipe; the fixed shapes above cover every bucket in both dtypes.
    proptest!(
        ProptestConfig::with_cases(8),
        |(b in 1usize..3, h in 1usize..3, t in seq_len(), d in head_dim(), causal in any::<bool>(),
          f16 in any::<bool>(), seed in any::<u64>())| {
            let dtype = dtype_for(dev, f16);
            // Keep lavapipe quick: at most ~12k elements.
            let b = if b * h * t * d > 12_000 { 1 } else { b };
            let c = Case::new([b, h, t, d], causal, dtype, seed);
            check_case(dev, &c, dtype, "attention", &|q, k, v| fused(q, k, v, causal))
                .map_err(TestCaseError::fail)?;
        }
    );
}

/// Smaller adapters' tiles on this one: WebGPU's default 16 KiB stages 16 keys per tile at
/// D = 128, 4 KiB stages 8 at D = 40 (tiles that do not divide T, causal and not).
fn small_workgroup_tiles_match_the_reference(dev: &Device) {
    let cases = [
        ([1, 2, 37, 128], true, 16 << 10),
        ([1, 1, 21, 40], false, 4 << 10),
    ];
    for (k, (dims, causal, bytes)) in cases.into_iter().enumerate() {
        let c = Case::new(dims, causal, DType::F32, 30 + k as u64);
        let what = format!("attention in {bytes} bytes");
        check_case(dev, &c, DType::F32, &what, &|q, k, v| {
            q.attention_fused_within(k, v, causal, bytes)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The fused kernels forced to each variant against the reference: the subgroup blocks (what
/// `Auto` runs on CPU adapters with subgroups, lavapipe) and the workgroup tiles at the
/// adapter's full workgroup memory (what it runs on GPUs and GL). An adapter without the
/// subgroup kernels says so with an `Error::InvalidArgument`; 8-lane subgroups (lavapipe's)
/// must run them.
fn each_fused_variant_matches_the_reference(dev: &Device) {
    let probe = Tensor::zeros(dev, &[1, 1, 2, 4], DType::F32).unwrap();
    let subgroups = match probe.attention_fused_subgroup(&probe, &probe, true) {
        Ok(_) => true,
        Err(Error::InvalidArgument { reason, .. }) => {
            assert_ne!(dev.info().subgroup_size, Some(8), "{reason}");
            assert!(reason.contains("subgroup"), "{reason}");
            false
        }
        Err(e) => panic!("forcing the subgroup kernels on {}: {e}", label(dev)),
    };
    // T of 1, within one block, past one tile and not a multiple of it; D of each bucket, odd
    // and not a multiple of 4; several heads; f16.
    let fixed: [([usize; 4], bool, DType); 7] = [
        ([1, 1, 1, 1], true, DType::F32),
        ([1, 3, 17, 16], true, DType::F16),
        ([2, 1, 33, 24], false, DType::F32),
        ([1, 2, 45, 64], true, DType::F16),
        ([1, 1, 9, 128], true, DType::F32),
        ([1, 2, 47, 3], true, DType::F16),
        ([1, 1, 70, 40], false, DType::F32),
    ];
    if subgroups {
        for (k, &(dims, causal, dtype)) in fixed.iter().enumerate() {
            let c = Case::new(dims, causal, dtype, 80 + k as u64);
            check_case(dev, &c, dtype, "subgroup attention", &|q, k, v| {
                q.attention_fused_subgroup(k, v, causal)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        }
        proptest!(
            ProptestConfig::with_cases(4),
            |(h in 1usize..4, t in seq_len(), d in head_dim(), causal in any::<bool>(),
              f16 in any::<bool>(), seed in any::<u64>())| {
                let dtype = dtype_for(dev, f16);
                let c = Case::new([1, h, t, d], causal, dtype, seed);
                check_case(dev, &c, dtype, "subgroup attention", &|q, k, v| {
                    q.attention_fused_subgroup(k, v, causal)
                })
                .map_err(TestCaseError::fail)?;
            }
        );
    }
    for (k, &(dims, causal, dtype)) in [fixed[3], fixed[2]].iter().enumerate() {
        let c = Case::new(dims, causal, dtype, 90 + k as u64);
        check_case(dev, &c, dtype, "tiled attention", &|q, k, v| {
            q.attention_fused_within(k, v, causal, u32::MAX)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Every gradient against central differences of the f64 reference (f32).
fn gradients_match_finite_differences(dev: &Device) {
    for (k, (dims, causal)) in [([1, 2, 5, 3], true), ([2, 1, 4, 5], false)]
        .into_iter()
        .enumerate()
    {
        let n = numel(&dims);
        let seed = 40 + k as u64;
        let inputs = [
            input(host_data(seed, n, -1.5, 1.5), &dims, true),
            input(host_data(seed ^ 1, n, -1.5, 1.5), &dims, true),
            input(host_data(seed ^ 2, n, -1.0, 1.0), &dims, true),
        ];
        check_grads(
            dev,
            &format!("attention {dims:?} causal {causal}"),
            &inputs,
            seed,
            &|t| fused(&t[0], &t[1], &t[2], causal),
            &|x| ref_forward(&x[0], &x[1], &x[2], dims, causal).0,
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The fused kernels and the composed ops agree, forward and backward.
fn fused_matches_composed(dev: &Device) {
    for &dtype in dtypes(dev) {
        for causal in [true, false] {
            let c = Case::new([2, 2, 19, 24], causal, dtype, 50);
            let what = format!(
                "fused vs composed, causal {causal} {dtype} on {}",
                label(dev)
            );
            let a = run(dev, &c, dtype, &|q, k, v| fused(q, k, v, causal)).unwrap();
            let b = run(dev, &c, dtype, &|q, k, v| {
                q.attention_composed(k, v, causal)
            })
            .unwrap();
            let (ro, rg) = rel(dtype);
            for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
                let want = f64s(&b[i]);
                let tol = 2.0 * if i == 0 { ro } else { rg };
                check_scaled(&format!("{what}: {name}"), &a[i], &want, dtype, tol)
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

/// The same inputs twice give the same bits, forward and backward.
fn fused_is_bitwise_repeatable(dev: &Device) {
    for &dtype in dtypes(dev) {
        let c = Case::new([1, 2, 45, 40], true, dtype, 60);
        let bits = || -> Vec<Vec<u32>> {
            run(dev, &c, dtype, &|q, k, v| fused(q, k, v, true))
                .unwrap()
                .iter()
                .map(|v| v.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        assert_eq!(bits(), bits(), "attention {dtype} on {}", label(dev));
    }
}

/// B, H, T or D of 0: an empty output of q's shape, and empty gradients.
fn empty_inputs_give_empty_outputs(dev: &Device) {
    for dims in [[0, 2, 3, 4], [1, 2, 0, 8], [1, 1, 5, 0]] {
        for kind in [
            AttentionKind::Fused,
            AttentionKind::Composed,
            AttentionKind::Auto,
        ] {
            let z = || {
                Tensor::zeros(dev, &dims, DType::F32)
                    .unwrap()
                    .with_requires_grad()
            };
            let (q, k, v) = (z(), z(), z());
            let o = q
                .attention_with(&k, &v, &AttentionOptions::new().kind(kind))
                .unwrap();
            assert_eq!(o.dims(), dims);
            o.sum().unwrap().backward().unwrap();
            for t in [&q, &k, &v] {
                assert_eq!(t.grad().unwrap().dims(), dims, "{dims:?} {kind:?}");
            }
        }
    }
}

/// The fused forward's peak is below the composed one by at least the (B, H, T, T) scores, and
/// so is a forward plus backward.
#[test]
fn fused_attention_saves_the_scores_memory() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let dims = [1, 2, 256, 32];
    let scores = (2 * 256 * 256 * 4) as u64;
    let n = numel(&dims);
    let make = |s: u64| upload(&dev, &host_data(s, n, -1.0, 1.0), &dims, DType::F32);
    let (q, k, v) = (make(1), make(2), make(3));
    let peak = |kind: AttentionKind, train: bool| -> u64 {
        let (q, k, v) = if train {
            let g = |t: &Tensor| t.detach().with_requires_grad();
            (g(&q), g(&k), g(&v))
        } else {
            (q.clone(), k.clone(), v.clone())
        };
        dev.sync().unwrap();
        dev.reset_peak();
        let before = dev.memory_stats().bytes_in_use;
        let o = q
            .attention_with(&k, &v, &AttentionOptions::new().kind(kind))
            .unwrap();
        if train {
            o.sum().unwrap().backward().unwrap();
        }
        dev.sync().unwrap();
        dev.memory_stats().peak_bytes_in_use - before
    };
    let fused_fwd = peak(AttentionKind::Fused, false);
    let composed_fwd = peak(AttentionKind::Composed, false);
    assert!(
        composed_fwd >= fused_fwd + scores,
        "forward peaks: fused {fused_fwd}, composed {composed_fwd}, scores {scores}"
    );
    let fused_train = peak(AttentionKind::Fused, true);
    let composed_train = peak(AttentionKind::Composed, true);
    assert!(
        composed_train >= fused_train + scores,
        "forward + backward peaks: fused {fused_train}, composed {composed_train}"
    );
}

/// Bad ranks, shapes, dtypes and head dims are typed errors, raised before anything is
/// allocated; Auto falls back to the composed ops where the fused kernels cannot run.
#[test]
fn attention_errors_come_before_device_work() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let t = |dims: &[usize], dtype| Tensor::zeros(&dev, dims, dtype).unwrap();
    let q = t(&[1, 2, 3, 4], DType::F32);
    let q3 = t(&[2, 3, 4], DType::F32);
    let longer = t(&[1, 2, 5, 4], DType::F32);
    let wide = t(&[1, 2, 3, 8], DType::F32);
    let h = t(&[1, 2, 3, 4], DType::F16);
    let big = t(&[1, 1, 3, 129], DType::F32);
    let fused = AttentionOptions::new().kind(AttentionKind::Fused);
    let before = dev.memory_stats().allocations;
    for (a, b) in [(&q3, &q), (&q, &q3)] {
        assert!(matches!(a.attention(b, b, true), Err(Error::Shape { .. })));
    }
    assert!(matches!(
        q.attention(&longer, &longer, true),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        q.attention(&q, &wide, false),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        q.attention(&h, &q, true),
        Err(Error::DType { .. })
    ));
    assert!(matches!(
        q.attention_composed(&q, &h, true),
        Err(Error::DType { .. })
    ));
    match big.attention_with(&big, &big, &fused) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("head dim"), "{reason}")
        }
        other => panic!("expected InvalidArgument for D = 129, got {other:?}"),
    }
    assert_eq!(dev.memory_stats().allocations, before);

    // D = 129: Auto runs the composed ops.
    let dims = [1, 1, 3, 129];
    let c = Case::new(dims, true, DType::F32, 70);
    let up = |x: &[f32]| upload(&dev, x, &dims, DType::F32);
    let o = up(&c.q).attention(&up(&c.k), &up(&c.v), true).unwrap();
    let r = reference(&c);
    check_scaled(
        "auto at D = 129",
        &o.to_vec_f32().unwrap(),
        &r.o,
        DType::F32,
        2e-5,
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn tensors_of_another_device_are_an_error() {
    let devs = devices();
    if devs.len() < 2 {
        return;
    }
    let a = Tensor::zeros(&devs[0], &[1, 1, 2, 4], DType::F32).unwrap();
    let b = Tensor::zeros(&devs[1], &[1, 1, 2, 4], DType::F32).unwrap();
    assert!(matches!(
        a.attention(&b, &a, true),
        Err(Error::DeviceMismatch { .. })
    ));
    assert!(matches!(
        a.attention(&a, &b, false),
        Err(Error::DeviceMismatch { .. })
    ));
}
