//! The Llama family: its ops against f64 plain-loop references on every device (rms_norm, rope
//! with a position offset, silu and the SwiGLU product, grouped-query heads in the fused
//! attention's forward and backward, workgroup and subgroup kernels), their finite-difference
//! gradients and errors; then `LlamaForCausalLM` folders against transformers' own numbers
//! (tests/fixtures/hf, made by scripts/make_hf_fixtures.py): per-position logits, the eval loss
//! of `finetune --steps 0`, generation with and without the KV cache, export and bad folders.

use crate::common;

use common::gradcheck::{check_grads, input};
use common::*;
use fitgrad::tensor::{rope_table, Rope};
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};
use proptest::prelude::*;

device_tests!(
    rms_norm_matches_reference,
    rope_matches_reference,
    silu_and_swiglu_match_reference,
    grouped_query_attention_matches_reference
);

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// Tolerance of a value `want` in `dtype` whose f32 computation errs by about `f32_err`.
fn tol(dtype: DType, want: f32, f32_err: f64) -> f32 {
    let e = f32_err as f32;
    match dtype {
        DType::F32 => 1e-6 + e + 1e-6 * want.abs(),
        DType::F16 => 1e-6 + e + 2.0 * f16_ulp(want),
    }
}

// ---------------------------------------------------------------------------------------------
// rms_norm
// ---------------------------------------------------------------------------------------------

/// y = x / sqrt(mean(x^2) + eps) * w per row of length c.
fn ref_rms_norm(x: &[f64], c: usize, w: Option<&[f64]>, eps: f64) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(c.max(1)) {
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
        for (j, &v) in row.iter().enumerate() {
            out.push(v * r * w.map_or(1.0, |w| w[j]));
        }
    }
    out
}

/// dx and dw of rms norm for upstream g (the magnitudes of their terms for the tolerance).
fn ref_rms_backward(x: &[f64], g: &[f64], c: usize, w: &[f64], eps: f64) -> [Vec<f64>; 4] {
    let (mut dx, mut dx_scale, mut dw, mut dw_abs) = (vec![], vec![], vec![0.0; c], vec![0.0; c]);
    for (row, gr) in x.chunks(c.max(1)).zip(g.chunks(c.max(1))) {
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps).sqrt();
        let xh: Vec<f64> = row.iter().map(|v| v * r).collect();
        let gw: Vec<f64> = gr.iter().zip(w).map(|(g, w)| g * w).collect();
        let m = gw.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / c as f64;
        let big = gw.iter().fold(0f64, |m, v| m.max(v.abs()));
        let bx = xh.iter().fold(0f64, |m, v| m.max(v.abs()));
        for j in 0..c {
            dx.push(r * (gw[j] - xh[j] * m));
            dx_scale.push(r * big * (1.0 + bx * bx));
            dw[j] += gr[j] * xh[j];
            dw_abs[j] += (gr[j] * xh[j]).abs();
        }
    }
    [dx, dx_scale, dw, dw_abs]
}

fn check_rms(
    dev: &Device,
    dtype: DType,
    dims: &[usize],
    weight: bool,
    seed: u64,
) -> Result<(), String> {
    const EPS: f32 = 1e-5;
    let what = format!(
        "rms_norm {dims:?} weight {weight} {dtype} on {}",
        label(dev)
    );
    let c = *dims.last().unwrap();
    let x_host = as_dtype(&host_data(seed, numel(dims), -3.0, 3.0), dtype);
    let w_host = as_dtype(&host_data(seed ^ 2, c, -2.0, 2.0), dtype);
    let g_host = as_dtype(&host_data(seed ^ 4, numel(dims), -1.0, 1.0), dtype);
    let x = upload(dev, &x_host, dims, dtype).with_requires_grad();
    let w = weight.then(|| upload(dev, &w_host, &[c], dtype).with_requires_grad());
    let y = x
        .rms_norm(w.as_ref(), EPS)
        .map_err(|e| format!("{what}: {e}"))?;
    let (x64, w64) = (f64s(&x_host), f64s(&w_host));
    let want = expect_in(
        f32s(&ref_rms_norm(
            &x64,
            c,
            w.as_ref().map(|_| &w64[..]),
            EPS as f64,
        )),
        dtype,
    );
    let got = download(&y, dims, dtype).map_err(|e| format!("{what}: {e}"))?;
    check_close_by(&what, &got, &want, |i| {
        let wj = if weight { w64[i % c].abs() } else { 1.0 };
        tol(
            dtype,
            want[i],
            4e-6 * (1.0 + want[i].abs() as f64) * (1.0 + wj),
        )
    })?;
    y.backward_with(upload(dev, &g_host, dims, dtype))
        .map_err(|e| format!("{what}: backward: {e}"))?;
    let ones = vec![1.0; c];
    let [dx, dx_scale, dw, dw_abs] = ref_rms_backward(
        &x64,
        &f64s(&g_host),
        c,
        if weight { &w64 } else { &ones },
        EPS as f64,
    );
    let gx = download(&x.grad().ok_or("no dx")?, dims, dtype)?;
    let want = expect_in(f32s(&dx), dtype);
    check_close_by(&format!("{what}: dx"), &gx, &want, |i| {
        tol(dtype, want[i], 1e-5 * dx_scale[i])
    })?;
    if let Some(w) = &w {
        let gw = download(&w.grad().ok_or("no dw")?, &[c], dtype)?;
        let want = expect_in(f32s(&dw), dtype);
        check_close_by(&format!("{what}: dw"), &gw, &want, |j| {
            tol(dtype, want[j], 1e-5 * (1.0 + dw_abs[j]))
        })?;
    }
    Ok(())
}

fn rms_norm_matches_reference(dev: &Device) {
    // Edges first: one element, odd rows, rows shared by several invocations, several chunks
    // of the weight gradient's column sums, empty.
    let fixed: &[&[usize]] = &[
        &[1],
        &[5, 1],
        &[3, 7],
        &[2, 64],
        &[130, 5],
        &[1, 1025],
        &[0, 4],
        &[3, 0],
    ];
    for &dtype in dtypes(dev) {
        for (k, dims) in fixed.iter().enumerate() {
            check_rms(dev, dtype, dims, k % 3 != 2, 10 + k as u64)
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    proptest!(ProptestConfig::with_cases(6), |(
        rows in 1usize..40,
        c in prop_oneof![1usize..70, prop::sample::select(vec![63usize, 100, 257, 1000])],
        weight in any::<bool>(),
        f16 in any::<bool>(),
        seed in any::<u64>(),
    )| {
        check_rms(dev, dtype_for(dev, f16), &[rows, c], weight, seed).map_err(TestCaseError::fail)?;
    });
}

// ---------------------------------------------------------------------------------------------
// rope
// ---------------------------------------------------------------------------------------------

/// Rotate-half RoPE of x (B, H, T, D) at positions offset.., from first principles in f64
/// (the frequencies rounded to f32 as transformers computes them).
fn ref_rope(x: &[f64], dims: &[usize], theta: f32, offset: usize, inverse: bool) -> Vec<f64> {
    let (t, d) = (dims[2], dims[3]);
    let half = d / 2;
    let mut out = x.to_vec();
    for (r, row) in x.chunks(d.max(1)).enumerate() {
        let pos = (offset + r % t.max(1)) as f32;
        for i in 0..half {
            let f = 1.0 / theta.powf((2 * i) as f32 / d as f32);
            let a = (pos * f) as f64;
            let (c, s) = (a.cos(), if inverse { -a.sin() } else { a.sin() });
            out[r * d + i] = row[i] * c - row[i + half] * s;
            out[r * d + i + half] = row[i + half] * c + row[i] * s;
        }
    }
    out
}

fn check_rope(
    dev: &Device,
    dtype: DType,
    dims: &[usize],
    theta: f32,
    offset: usize,
    seed: u64,
) -> Result<(), String> {
    let what = format!(
        "rope {dims:?} theta {theta} offset {offset} {dtype} on {}",
        label(dev)
    );
    let x_host = as_dtype(&host_data(seed, numel(dims), -2.0, 2.0), dtype);
    let g_host = as_dtype(&host_data(seed ^ 1, numel(dims), -1.0, 1.0), dtype);
    let x = upload(dev, &x_host, dims, dtype).with_requires_grad();
    let y = x.rope(theta, offset).map_err(|e| format!("{what}: {e}"))?;
    let want = expect_in(
        f32s(&ref_rope(&f64s(&x_host), dims, theta, offset, false)),
        dtype,
    );
    let got = download(&y, dims, dtype)?;
    check_close_by(&what, &got, &want, |i| tol(dtype, want[i], 2e-6 * 4.0))?;
    y.backward_with(upload(dev, &g_host, dims, dtype))
        .map_err(|e| format!("{what}: {e}"))?;
    let want = expect_in(
        f32s(&ref_rope(&f64s(&g_host), dims, theta, offset, true)),
        dtype,
    );
    let got = download(&x.grad().ok_or("no grad")?, dims, dtype)?;
    check_close_by(&format!("{what}: dx"), &got, &want, |i| {
        tol(dtype, want[i], 2e-6 * 4.0)
    })
}

fn rope_matches_reference(dev: &Device) {
    // D = 2 (one pair), D / 2 odd (packed f16 stages through f32), a KV cache's offset, empty.
    let fixed: &[(&[usize], usize)] = &[
        (&[1, 1, 1, 2], 0),
        (&[1, 2, 3, 6], 0),
        (&[2, 3, 5, 8], 7),
        (&[1, 1, 300, 4], 1000),
        (&[1, 2, 0, 8], 3),
        (&[2, 1, 3, 64], 1),
    ];
    for &dtype in dtypes(dev) {
        for (k, (dims, offset)) in fixed.iter().enumerate() {
            check_rope(dev, dtype, dims, 10000.0, *offset, 20 + k as u64)
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
    proptest!(ProptestConfig::with_cases(6), |(
        b in 1usize..3, h in 1usize..4, t in 1usize..40, half in 1usize..20,
        theta in prop::sample::select(vec![500.0f32, 10000.0, 500000.0]),
        offset in 0usize..100,
        f16 in any::<bool>(),
        seed in any::<u64>(),
    )| {
        check_rope(dev, dtype_for(dev, f16), &[b, h, t, 2 * half], theta, offset, seed)
            .map_err(TestCaseError::fail)?;
    });
}

// ---------------------------------------------------------------------------------------------
// silu and swiglu
// ---------------------------------------------------------------------------------------------

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn silu_grad(x: f64) -> f64 {
    let s = 1.0 / (1.0 + (-x).exp());
    s * (1.0 + x * (1.0 - s))
}

fn silu_and_swiglu_match_reference(dev: &Device) {
    for &dtype in dtypes(dev) {
        for (k, n) in [1usize, 2, 7, 64, 1001].into_iter().enumerate() {
            let what = format!("silu / swiglu n {n} {dtype} on {}", label(dev));
            let seed = 30 + k as u64;
            let a_host = as_dtype(&host_data(seed, n, -8.0, 8.0), dtype);
            let b_host = as_dtype(&host_data(seed ^ 1, n, -2.0, 2.0), dtype);
            let g_host = as_dtype(&host_data(seed ^ 2, n, -1.0, 1.0), dtype);
            let a = upload(dev, &a_host, &[n], dtype).with_requires_grad();
            let b = upload(dev, &b_host, &[n], dtype).with_requires_grad();
            let (a64, b64, g64) = (f64s(&a_host), f64s(&b_host), f64s(&g_host));
            let want = expect_in(a64.iter().map(|&x| silu(x) as f32).collect(), dtype);
            let got = download(&a.silu().unwrap(), &[n], dtype).unwrap();
            check_close_by(&format!("{what}: silu"), &got, &want, |i| {
                tol(dtype, want[i], 4e-6 * want[i].abs() as f64)
            })
            .unwrap_or_else(|e| panic!("{e}"));
            let y = a.swiglu(&b).unwrap();
            let want: Vec<f32> = a64
                .iter()
                .zip(&b64)
                .map(|(&x, &u)| (silu(x) * u) as f32)
                .collect();
            let want = expect_in(want, dtype);
            check_close_by(
                &format!("{what}: swiglu"),
                &download(&y, &[n], dtype).unwrap(),
                &want,
                |i| tol(dtype, want[i], 4e-6 * (1.0 + want[i].abs() as f64)),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            y.backward_with(upload(dev, &g_host, &[n], dtype)).unwrap();
            // f16 rounds the intermediate g * up before silu' (one more f16 ulp of it).
            let extra = if dtype == DType::F16 { 2e-3 } else { 1e-5 };
            let da: Vec<f64> = (0..n)
                .map(|i| g64[i] * b64[i] * silu_grad(a64[i]))
                .collect();
            let want = expect_in(f32s(&da), dtype);
            check_close_by(
                &format!("{what}: d gate"),
                &download(&a.grad().unwrap(), &[n], dtype).unwrap(),
                &want,
                |i| tol(dtype, want[i], extra * (g64[i] * b64[i]).abs() * 1.2),
            )
            .unwrap_or_else(|e| panic!("{e}"));
            let db: Vec<f64> = (0..n).map(|i| g64[i] * silu(a64[i])).collect();
            let want = expect_in(f32s(&db), dtype);
            check_close_by(
                &format!("{what}: d up"),
                &download(&b.grad().unwrap(), &[n], dtype).unwrap(),
                &want,
                |i| tol(dtype, want[i], extra * (g64[i] * silu(a64[i])).abs() + 1e-6),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// rms_norm, rope, silu and swiglu gradients against central differences (f32).
#[test]
fn llama_op_gradients_match_finite_differences() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let run = |what: &str,
               inputs: &[common::gradcheck::Input],
               f: &common::gradcheck::Forward,
               r: &common::gradcheck::Reference| {
        check_grads(&dev, what, inputs, 5, f, r).unwrap_or_else(|e| panic!("{e}"));
    };
    let c = 6;
    run(
        "rms_norm (3, 6)",
        &[
            input(host_data(1, 18, -2.0, 2.0), &[3, c], true),
            input(host_data(2, c, 0.5, 2.0), &[c], true),
        ],
        &|t| t[0].rms_norm(Some(&t[1]), 1e-5),
        &|x| ref_rms_norm(&x[0], c, Some(&x[1]), 1e-5),
    );
    run(
        "rms_norm (2, 70) without weight",
        &[input(host_data(3, 140, -2.0, 2.0), &[2, 70], true)],
        &|t| t[0].rms_norm(None, 1e-5),
        &|x| ref_rms_norm(&x[0], 70, None, 1e-5),
    );
    let dims = [1, 2, 3, 6];
    run(
        "rope (1, 2, 3, 6) offset 4",
        &[input(host_data(4, 36, -2.0, 2.0), &dims, true)],
        &|t| t[0].rope(100.0, 4),
        &|x| ref_rope(&x[0], &dims, 100.0, 4, false),
    );
    run(
        "silu",
        &[input(host_data(5, 9, -5.0, 5.0), &[9], true)],
        &|t| t[0].silu(),
        &|x| x[0].iter().map(|&v| silu(v)).collect(),
    );
    run(
        "swiglu, the up broadcast along rows",
        &[
            input(host_data(6, 12, -4.0, 4.0), &[3, 4], true),
            input(host_data(7, 4, -2.0, 2.0), &[4], true),
        ],
        &|t| t[0].swiglu(&t[1]),
        &|x| (0..12).map(|i| silu(x[0][i]) * x[1][i % 4]).collect(),
    );
}

// ---------------------------------------------------------------------------------------------
// grouped-query attention
// ---------------------------------------------------------------------------------------------

/// Causal or full attention of q (B, H, T, D) over k, v (B, KV, T, D), query head h reading kv
/// head h / (H / KV), in f64: the output and, for upstream g, dq, dk and dv.
#[allow(clippy::type_complexity)]
fn ref_gqa(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    g: &[f64],
    [b, h, t, d]: [usize; 4],
    kv: usize,
    causal: bool,
) -> [Vec<f64>; 4] {
    let group = h / kv;
    let scale = 1.0 / (d as f64).sqrt();
    let (mut o, mut dq) = (vec![0.0; q.len()], vec![0.0; q.len()]);
    let (mut dk, mut dv) = (vec![0.0; k.len()], vec![0.0; k.len()]);
    for bi in 0..b {
        for hi in 0..h {
            let qm = (bi * h + hi) * t * d;
            let km = (bi * kv + hi / group) * t * d;
            for i in 0..t {
                let n = if causal { i + 1 } else { t };
                let s: Vec<f64> = (0..n)
                    .map(|j| {
                        scale
                            * (0..d)
                                .map(|e| q[qm + i * d + e] * k[km + j * d + e])
                                .sum::<f64>()
                    })
                    .collect();
                let mx = s.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x));
                let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - mx).exp() / z).collect();
                for j in 0..n {
                    for e in 0..d {
                        o[qm + i * d + e] += p[j] * v[km + j * d + e];
                    }
                }
                // dP_j = g_i . v_j; dS_j = P_j (dP_j - sum P dP).
                let dp: Vec<f64> = (0..n)
                    .map(|j| (0..d).map(|e| g[qm + i * d + e] * v[km + j * d + e]).sum())
                    .collect();
                let dot: f64 = (0..n).map(|j| p[j] * dp[j]).sum();
                for j in 0..n {
                    let ds = p[j] * (dp[j] - dot) * scale;
                    for e in 0..d {
                        dq[qm + i * d + e] += ds * k[km + j * d + e];
                        dk[km + j * d + e] += ds * q[qm + i * d + e];
                        dv[km + j * d + e] += p[j] * g[qm + i * d + e];
                    }
                }
            }
        }
    }
    [o, dq, dk, dv]
}

/// Which fused kernels a case runs.
#[derive(Clone, Copy, Debug)]
enum Kernels {
    Auto,
    Tiles,
    Subgroup,
}

#[allow(clippy::too_many_arguments)]
fn check_gqa(
    dev: &Device,
    dtype: DType,
    dims: [usize; 4],
    kv: usize,
    causal: bool,
    kernels: Kernels,
    seed: u64,
) -> Result<(), String> {
    let [b, _, t, d] = dims;
    let what = format!(
        "attention q {dims:?} kv heads {kv} causal {causal} {kernels:?} {dtype} on {}",
        label(dev)
    );
    let kv_dims = [b, kv, t, d];
    let q_host = as_dtype(&host_data(seed, numel(&dims), -1.5, 1.5), dtype);
    let k_host = as_dtype(&host_data(seed ^ 1, numel(&kv_dims), -1.5, 1.5), dtype);
    let v_host = as_dtype(&host_data(seed ^ 2, numel(&kv_dims), -1.0, 1.0), dtype);
    let g_host = as_dtype(&host_data(seed ^ 3, numel(&dims), -1.0, 1.0), dtype);
    let q = upload(dev, &q_host, &dims, dtype).with_requires_grad();
    let k = upload(dev, &k_host, &kv_dims, dtype).with_requires_grad();
    let v = upload(dev, &v_host, &kv_dims, dtype).with_requires_grad();
    let y = match kernels {
        Kernels::Auto => q.attention(&k, &v, causal),
        Kernels::Tiles => q.attention_fused_within(&k, &v, causal, 16 << 10),
        Kernels::Subgroup => match q.attention_fused_subgroup(&k, &v, causal) {
            Err(Error::InvalidArgument { .. }) => return Ok(()), // no subgroups here
            r => r,
        },
    }
    .map_err(|e| format!("{what}: {e}"))?;
    let [o, dq, dk, dv] = ref_gqa(
        &f64s(&q_host),
        &f64s(&k_host),
        &f64s(&v_host),
        &f64s(&g_host),
        dims,
        kv,
        causal,
    );
    // f16 rounds the operands and partial results: a relative error of a few 1e-3.
    let rel = if dtype == DType::F16 { 6e-3 } else { 2e-5 };
    let cmp = |name: &str, got: &Tensor, want: &[f64], dims: &[usize]| -> Result<(), String> {
        let got = download(got, dims, dtype)?;
        let want = expect_in(f32s(want), dtype);
        let big = want.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        check_close_by(&format!("{what}: {name}"), &got, &want, |i| {
            tol(dtype, want[i], rel * (1.0 + big))
        })
    };
    cmp("o", &y, &o, &dims)?;
    y.backward_with(upload(dev, &g_host, &dims, dtype))
        .map_err(|e| format!("{what}: {e}"))?;
    cmp("dq", &q.grad().ok_or("no dq")?, &dq, &dims)?;
    cmp("dk", &k.grad().ok_or("no dk")?, &dk, &kv_dims)?;
    cmp("dv", &v.grad().ok_or("no dv")?, &dv, &kv_dims)
}

fn grouped_query_attention_matches_reference(dev: &Device) {
    // Groups of 1 (plain), 2, 3 and 4 (one kv head for all); T = 1, odd T and D, partial tiles
    // (T past the subgroup kernels' 16 rows and the tiles' 32), both masks.
    let cases: &[([usize; 4], usize, bool)] = &[
        ([1, 2, 1, 8], 1, true),
        ([1, 4, 5, 8], 2, true),
        ([2, 6, 19, 7], 2, false),
        ([1, 4, 37, 16], 1, true),
        ([1, 3, 9, 32], 3, true),
    ];
    for &dtype in dtypes(dev) {
        for (n, &(dims, kv, causal)) in cases.iter().enumerate() {
            for kernels in [Kernels::Auto, Kernels::Tiles, Kernels::Subgroup] {
                check_gqa(
                    dev,
                    dtype,
                    dims,
                    dims[1] / kv,
                    causal,
                    kernels,
                    40 + n as u64,
                )
                .unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

/// The composed path (matmul, softmax, matmul on repeated kv heads) gives what the fused
/// kernels give, forward and backward, and the backward of a group sums its heads.
#[test]
fn grouped_query_attention_composed_matches_fused() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let dims = [1, 4, 6, 8];
    let kv_dims = [1, 2, 6, 8];
    let mk = |seed, d: &[usize]| {
        upload(&dev, &host_data(seed, numel(d), -1.0, 1.0), d, DType::F32).with_requires_grad()
    };
    let run = |composed: bool| {
        let (q, k, v) = (mk(1, &dims), mk(2, &kv_dims), mk(3, &kv_dims));
        let y = if composed {
            q.attention_composed(&k, &v, true)
        } else {
            q.attention(&k, &v, true)
        }
        .unwrap();
        y.sum().unwrap().backward().unwrap();
        [
            y.to_vec_f32(),
            q.grad().unwrap().to_vec_f32(),
            k.grad().unwrap().to_vec_f32(),
            v.grad().unwrap().to_vec_f32(),
        ]
        .map(|r| r.unwrap())
    };
    let (a, b) = (run(false), run(true));
    for (x, y) in a.iter().zip(&b) {
        assert_close(
            "composed against fused",
            x,
            y,
            Tol {
                abs: 2e-5,
                rel: 1e-4,
                f16_ulps: 0.0,
            },
        );
    }
}

/// Bad shapes and arguments of the Llama ops are typed errors before any device work.
#[test]
fn llama_op_errors_come_before_device_work() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let x = Tensor::zeros(&dev, &[1, 4, 3, 8], DType::F32).unwrap();
    let k3 = Tensor::zeros(&dev, &[1, 3, 3, 8], DType::F32).unwrap();
    let k_short = Tensor::zeros(&dev, &[1, 2, 2, 8], DType::F32).unwrap();
    let k2 = Tensor::zeros(&dev, &[1, 2, 3, 8], DType::F32).unwrap();
    let odd = Tensor::zeros(&dev, &[1, 1, 3, 5], DType::F32).unwrap();
    let flat = Tensor::zeros(&dev, &[3, 8], DType::F32).unwrap();
    let w = Tensor::zeros(&dev, &[7], DType::F32).unwrap();
    let before = dev.memory_stats().allocations;
    // 3 kv heads do not divide 4 query heads; keys shorter than the queries; v unlike k.
    for (k, v) in [(&k3, &k3), (&k_short, &k_short), (&k2, &k3)] {
        assert!(matches!(x.attention(k, v, true), Err(Error::Shape { .. })));
    }
    assert!(matches!(odd.rope(10000.0, 0), Err(Error::Shape { .. })));
    assert!(matches!(flat.rope(10000.0, 0), Err(Error::Shape { .. })));
    for theta in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            x.rope(theta, 0),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert!(matches!(
        x.rope(10000.0, usize::MAX),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        flat.rms_norm(Some(&w), 1e-5),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        flat.rms_norm(None, -1.0),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(dev.memory_stats().allocations, before);
    let table = Rope::new(&dev, 4, 8, 10000.0, 0).unwrap();
    assert!(matches!(x.rope_with(&table), Err(Error::Shape { .. })));
    assert!(rope_table(2, 3, 10000.0, 0).is_err());
}

// ---------------------------------------------------------------------------------------------
// LlamaForCausalLM folders against transformers
// ---------------------------------------------------------------------------------------------

use fitgrad::checkpoint::HostTensor;
use fitgrad::hf::{save_llama, PretrainedLlama, Tokenizer};
use fitgrad::nn::{LanguageModel, Llama, Module, Sampling};
use fitgrad::train::window_loss;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Grouped-query heads with an untied head (f32), and one kv head per query head with a tied
/// head and attention biases (bf16 on disk).
const LLAMAS: [&str; 2] = ["llama-tiny-gqa", "llama-tiny-tied"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected_llama.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn load(dev: &Device, name: &str) -> Llama {
    let m = PretrainedLlama::open(&fixtures().join(name), DType::F32)
        .unwrap()
        .build(dev)
        .unwrap();
    m.set_training(false);
    m
}

fn eval_ids() -> Vec<u32> {
    let tok = Tokenizer::from_file(&fixtures().join("llama-tiny-gqa/tokenizer.json")).unwrap();
    tok.encode(&std::fs::read_to_string(fixtures().join("eval.txt")).unwrap())
        .unwrap()
}

/// Logits at every position within 1e-4 of transformers', and the eval loss of eval.txt in
/// finetune's windows at two contexts within 1e-4, for both fixtures; then the greedy KV-cache
/// run, export and read-back (one device of its own: one set of kernel compiles).
#[test]
fn llama_folders_match_transformers() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let exp = expected();
    let ids = ids_of(&exp["logits_ids"]);
    let bytes = std::fs::read(fixtures().join("expected_llama.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let eval = eval_ids();
    for name in LLAMAS {
        let model = load(&dev, name);
        let got = model
            .forward_ids(&ids, 1, ids.len())
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let want = st.tensor(name).unwrap();
        assert_eq!(want.shape(), [ids.len(), model.vocab_size()]);
        let want: Vec<f32> = bytemuck::pod_collect_to_vec(want.data());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-4,
            "{name}: logits differ from transformers' by up to {worst}"
        );
        for (context, want) in exp["models"][name]["eval"].as_object().unwrap() {
            let context: usize = context.parse().unwrap();
            let got = window_loss(&model, &eval, context, 4, DType::F32).unwrap();
            let loss = want["eval_loss"].as_f64().unwrap();
            assert_eq!(got.tokens as u64, want["tokens"].as_u64().unwrap());
            assert!(
                (got.loss - loss).abs() <= 1e-4,
                "{name} at context {context}: eval loss {} against transformers' {loss}",
                got.loss
            );
        }
    }
    greedy_generation_uses_the_cache(&dev);
    export_reads_back(&dev);
}

/// Greedy decoding through the KV cache (rotary positions offset by the cache, grouped kv
/// heads concatenated per layer), past the context where the window slides, equals argmax of a
/// whole forward of the last `context` tokens at every step.
fn greedy_generation_uses_the_cache(dev: &Device) {
    let model = load(dev, "llama-tiny-gqa");
    let prompt = &eval_ids()[..5];
    let mut greedy = Sampling::new(1.0, 7);
    greedy.top_k = Some(1);
    let cached = model.generate_with(prompt, 34, &greedy).unwrap();
    let (context, v) = (model.context(), model.vocab_size());
    let mut plain = prompt.to_vec();
    while plain.len() < cached.len() {
        let w = &plain[plain.len().saturating_sub(context)..];
        let logits = model
            .forward_ids(w, 1, w.len())
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let last = &logits[logits.len() - v..];
        let best = (0..v).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        plain.push(best as u32);
    }
    assert_eq!(cached, plain);
}

/// save_llama writes a folder PretrainedLlama reads back to the same bits (a tied head stays
/// tied), with the same loss.
fn export_reads_back(dev: &Device) {
    let dir = tempfile::tempdir().unwrap();
    let eval = eval_ids();
    for name in LLAMAS {
        let model = load(dev, name);
        let out = dir.path().join(name);
        save_llama(
            &model,
            &out,
            Some(&fixtures().join(name).join("tokenizer.json")),
        )
        .unwrap();
        let back = load(dev, out.to_str().unwrap());
        assert_eq!(back.llama_config(), model.llama_config());
        let (pa, pb) = (model.named_parameters(), back.named_parameters());
        assert_eq!(pa.len(), pb.len());
        for ((na, ta), (nb, tb)) in pa.iter().zip(&pb) {
            assert_eq!(na, nb);
            assert_eq!(
                HostTensor::read(ta).unwrap(),
                HostTensor::read(tb).unwrap(),
                "{na}"
            );
        }
        let a = window_loss(&model, &eval, 16, 4, DType::F32).unwrap().loss;
        let b = window_loss(&back, &eval, 16, 4, DType::F32).unwrap().loss;
        assert_eq!(a, b, "{name}");
        assert!(out.join("tokenizer.json").is_file());
    }
}

fn copy_of(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    (tmp, dir)
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string(&v).unwrap()).unwrap();
}

/// Rewrites the weights file with `f` applied to its tensors (name -> host tensor).
fn edit_weights(
    dir: &Path,
    f: impl FnOnce(&mut std::collections::BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut map: std::collections::BTreeMap<_, _> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    f(&mut map);
    let views: Vec<(String, safetensors::tensor::TensorView)> = map
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(&path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// `PretrainedLlama::open` refuses `dir` with an [`Error::Data`] naming `file` and saying each
/// of `words`.
fn refused(dir: &Path, dtype: DType, file: &str, words: &[&str]) {
    match PretrainedLlama::open(dir, dtype) {
        Err(Error::Data { path, reason }) => {
            assert!(path.ends_with(file), "{path} is not {file}: {reason}");
            for w in words {
                assert!(reason.contains(w), "'{reason}' lacks '{w}'");
            }
        }
        Err(e) => panic!("{file} {words:?}: {e}"),
        Ok(_) => panic!("{file} {words:?}: accepted"),
    }
}

/// Bad Llama folders are typed errors naming the file and the tensor, with no device opened.
#[test]
fn bad_llama_folders_are_refused_before_device_work() {
    let name = "llama-tiny-gqa";
    let q = "model.layers.1.self_attn.q_proj.weight";
    let (_t, dir) = copy_of(name);
    edit_config(&dir, |c| {
        c.insert(
            "rope_scaling".into(),
            serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
        );
    });
    refused(&dir, DType::F32, "config.json", &["rope_scaling", "llama3"]);
    let (_t, dir) = copy_of(name);
    edit_config(&dir, |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["MistralForCausalLM"]),
        );
    });
    refused(
        &dir,
        DType::F32,
        "config.json",
        &["architectures", "MistralForCausalLM"],
    );
    let (_t, dir) = copy_of(name);
    edit_config(&dir, |c| {
        c.insert("model_type".into(), "falcon".into());
    });
    refused(&dir, DType::F32, "config.json", &["falcon"]);
    let (_t, dir) = copy_of(name);
    edit_weights(&dir, |m| {
        m.remove(q);
    });
    refused(&dir, DType::F32, "model.safetensors", &["missing", q]);
    let (_t, dir) = copy_of(name);
    edit_weights(&dir, |m| {
        m.insert(
            "model.layers.9.mlp.up_proj.weight".into(),
            (safetensors::Dtype::F32, vec![1], vec![0; 4]),
        );
    });
    refused(
        &dir,
        DType::F32,
        "model.safetensors",
        &["model.layers.9.mlp.up_proj.weight", "not parameters"],
    );
    let k = "model.layers.0.self_attn.k_proj.weight";
    let (_t, dir) = copy_of(name);
    edit_weights(&dir, |m| {
        let e = m.get_mut(k).unwrap();
        e.1 = vec![e.1[1], e.1[0]];
    });
    refused(
        &dir,
        DType::F32,
        "model.safetensors",
        &[k, "[32, 16]", "needs [16, 32]"],
    );
    let (_t, dir) = copy_of(name);
    edit_weights(&dir, |m| {
        let e = m.get_mut(q).unwrap();
        e.0 = safetensors::Dtype::I32;
    });
    refused(&dir, DType::F32, "model.safetensors", &[q, "I32"]);
    // A bf16 value past f16's range, read as f16.
    let (_t, dir) = copy_of("llama-tiny-tied");
    edit_weights(&dir, |m| {
        let e = m.get_mut("model.norm.weight").unwrap();
        e.2[..2].copy_from_slice(&half::bf16::from_f32(1e6).to_le_bytes());
    });
    refused(
        &dir,
        DType::F16,
        "model.safetensors",
        &["model.norm.weight"],
    );
    // A tied head that is not the embedding.
    let (_t, dir) = copy_of("llama-tiny-tied");
    edit_weights(&dir, |m| {
        let mut e = m["model.embed_tokens.weight"].clone();
        e.2[0] ^= 1;
        m.insert("lm_head.weight".into(), e);
    });
    refused(
        &dir,
        DType::F32,
        "model.safetensors",
        &["lm_head.weight", "tie_word_embeddings"],
    );
    let (_t, dir) = copy_of(name);
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let folder = PretrainedLlama::open(&dir, DType::F32).unwrap();
    assert!(matches!(folder.tokenizer(), Err(Error::Data { .. })));
    assert_eq!(fitgrad::hf::model_type(&dir).unwrap(), "llama");
}

/// A Llama of 3 blocks (GQA: 4 query heads over 2 kv heads) trained 3 steps in micro-batches
/// of 2: with its blocks checkpointed the losses and weights are the plain run's bit for bit,
/// and the step's planned peak is the measured one and below the plain step's; with its blocks
/// streamed from host memory (made there by `born_on_host`) they follow within 1e-5.
#[test]
fn llama_blocks_checkpoint_and_stream() {
    use fitgrad::optim::AdamW;
    use fitgrad::train::text::TextDataset;
    use fitgrad::train::{TrainModel, Trainer, TrainerConfig};
    let tokens: Vec<u32> = (0..400u32).map(|i| (i * 5 + i / 3) % 19).collect();
    let data = TextDataset::new(tokens, 12).unwrap();
    let idx: Vec<usize> = (0..6).collect();
    let run = |mode: &str| {
        let dev = fresh_device(Default::default())?;
        let mut cfg = fitgrad::nn::LlamaConfig::new(19, 32, 48, 3, 4, 2, 12);
        cfg.seed = 4;
        let make = || Llama::new(&dev, cfg.clone());
        let mut model = match mode {
            "streamed" => fitgrad::residency::born_on_host(&dev, make).unwrap(),
            _ => make().unwrap(),
        };
        model.set_checkpointing(mode == "checkpointed");
        let opt = Box::new(AdamW::new(model.parameters(), 3e-3).unwrap());
        let config = TrainerConfig::default()
            .batch_size(6)
            .micro_batch(2)
            .lr(3e-3);
        let mut t = Trainer::new(model, opt, config).unwrap();
        assert_eq!(t.streams_parameters(), mode == "streamed");
        let plan = t.plan(&data).unwrap();
        dev.reset_peak();
        let mut losses = Vec::new();
        for s in 0..3 {
            let idx: Vec<usize> = idx.iter().map(|i| (i + s * 6) * 7 % 380).collect();
            t.step(&data, &idx).unwrap();
            losses.push(t.take_loss().unwrap());
        }
        dev.sync().unwrap();
        let measured = dev.memory_stats().peak_bytes_in_use;
        Some((losses, param_values(&t.model), plan.peak, measured))
    };
    let Some((l0, w0, plain_peak, _)) = run("plain") else {
        return;
    };
    let (l1, w1, planned, measured) = run("checkpointed").unwrap();
    assert_eq!(l1, l0, "checkpointed losses");
    assert_eq!(w1, w0, "checkpointed weights");
    assert_eq!(planned, measured, "checkpointed: planned vs measured peak");
    assert!(planned < plain_peak, "{planned} vs {plain_peak}");
    let (l2, w2, planned, measured) = run("streamed").unwrap();
    for (a, b) in l2.iter().zip(&l0) {
        assert!(
            ((a - b) / b).abs() <= 1e-5,
            "streamed losses {l2:?} vs {l0:?}"
        );
    }
    let r = worst_rel_diff(&w2, &w0);
    assert!(r <= 1e-5, "streamed weights {r:e} apart");
    assert_eq!(planned, measured, "streamed: planned vs measured peak");
}
