//! Matmul kernels against a plain-loop reference: every variant, transposed operands, batches,
//! the fused bias + activation, f32 and f16, on every device.

use crate::common;

use common::*;
use fitgrad::MatmulVariant as Variant;
use fitgrad::{Activation, DType, Device, Error, MatmulOptions, Tensor};
use proptest::prelude::*;

device_tests!(
    kernels_match_the_reference_on_random_shapes,
    every_variant_in_every_transposed_form,
    edges_and_empty,
    transposed_forms_match_explicit_transposes,
    k_blocks_add_their_block_sums_in_order,
    folds_onto_the_gradient_held_in_k_order,
    bad_shapes_are_errors
);

/// The variants under test: the reference, register blocks (skinny TM = 1 included), workgroup
/// tiles and subgroup blocks (where the device has 8-lane subgroups, as lavapipe does).
const VARIANTS: [Variant; 8] = [
    Variant::Naive,
    Variant::Reg {
        tm: 1,
        tn: 16,
        wg_x: 16,
        wg_y: 1,
    },
    Variant::Reg {
        tm: 4,
        tn: 4,
        wg_x: 16,
        wg_y: 4,
    },
    // 32 x 16 would cover more, but lavapipe needs minutes to compile it cold.
    Variant::Reg {
        tm: 8,
        tn: 16,
        wg_x: 16,
        wg_y: 1,
    },
    Variant::Tiled {
        bm: 64,
        bn: 64,
        bk: 16,
    },
    Variant::Tiled {
        bm: 32,
        bn: 32,
        bk: 16,
    },
    Variant::Subgroup {
        sg: 8,
        tm: 16,
        tn: 8,
        wgs: 1,
    },
    Variant::Subgroup {
        sg: 8,
        tm: 8,
        tn: 4,
        wgs: 2,
    },
];

#[derive(Clone, Copy, Debug)]
struct Case {
    /// 0: no batch; 1: A batched, B shared; 2: A shared, B batched; 3: both batched.
    batch_mode: u8,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    bias: bool,
    act: Activation,
    /// `MatmulOptions::k_blocks`.
    kb: bool,
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + (0.7978845608028654 * (x + 0.044715 * x * x * x)).tanh())
}

/// Plain loops in f64 over the (already rounded) inputs: C[b, i, j].
fn reference(c: &Case, a: &[f32], b: &[f32], bias: &[f32]) -> Vec<f32> {
    let (m, n, k) = (c.m, c.n, c.k);
    let batches = if c.batch_mode == 0 { 1 } else { c.batch };
    let a_step = if matches!(c.batch_mode, 1 | 3) {
        m * k
    } else {
        0
    };
    let b_step = if matches!(c.batch_mode, 2 | 3) {
        k * n
    } else {
        0
    };
    let mut out = Vec::with_capacity(batches * m * n);
    for bi in 0..batches {
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f64;
                for q in 0..k {
                    let x = if c.ta {
                        a[bi * a_step + q * m + i]
                    } else {
                        a[bi * a_step + i * k + q]
                    };
                    let y = if c.tb {
                        b[bi * b_step + j * k + q]
                    } else {
                        b[bi * b_step + q * n + j]
                    };
                    s += x as f64 * y as f64;
                }
                if c.bias {
                    s += bias[j] as f64;
                }
                s = match c.act {
                    Activation::None => s,
                    Activation::Relu => s.max(0.0),
                    Activation::Gelu => gelu(s),
                    Activation::Tanh => s.tanh(),
                    Activation::Sigmoid => 1.0 / (1.0 + (-s).exp()),
                    Activation::Silu => s / (1.0 + (-s).exp()),
                };
                out.push(s as f32);
            }
        }
    }
    out
}

fn dims(c: &Case) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let a2 = if c.ta { vec![c.k, c.m] } else { vec![c.m, c.k] };
    let b2 = if c.tb { vec![c.n, c.k] } else { vec![c.k, c.n] };
    let lead = |batched: bool, mut d: Vec<usize>| {
        if batched {
            d.insert(0, c.batch);
        }
        d
    };
    let a = lead(matches!(c.batch_mode, 1 | 3), a2);
    let b = lead(matches!(c.batch_mode, 2 | 3), b2);
    let mut o = if c.batch_mode == 0 {
        vec![]
    } else {
        vec![c.batch]
    };
    o.extend([c.m, c.n]);
    (a, b, o)
}

fn check(
    dev: &Device,
    dtype: DType,
    c: &Case,
    variants: &[Variant],
    seed: u64,
) -> Result<(), String> {
    let (ad, bd, od) = dims(c);
    let a_host = as_dtype(&host_data(seed, numel(&ad), -1.0, 1.0), dtype);
    let b_host = as_dtype(&host_data(seed ^ 7, numel(&bd), -1.0, 1.0), dtype);
    let bias_host = as_dtype(&host_data(seed ^ 9, c.n, -1.0, 1.0), dtype);
    let a = upload(dev, &a_host, &ad, dtype);
    let b = upload(dev, &b_host, &bd, dtype);
    let bias = upload(dev, &bias_host, &[c.n], dtype);
    let mut opts = MatmulOptions::new()
        .trans_a(c.ta)
        .trans_b(c.tb)
        .k_blocks(c.kb)
        .activation(c.act);
    opts.bias = c.bias.then_some(&bias);
    let want = expect_in(reference(c, &a_host, &b_host, &bias_host), dtype);
    // Sums of k products of values in [-1, 1]: f32 accumulation error grows with k.
    let tol = match dtype {
        DType::F32 => Tol {
            abs: 2e-6 * (c.k as f32 + 1.0),
            rel: 1e-5,
            f16_ulps: 0.0,
        },
        DType::F16 => Tol {
            abs: 1e-4 * (c.k as f32 + 1.0),
            rel: 2e-3,
            f16_ulps: 2.0,
        },
    };
    for &v in variants.iter().filter(|&&v| v.supported_on(dev, dtype)) {
        let what = format!("{} {dtype:?} {c:?} {v:?}", label(dev));
        let out = a
            .matmul_variant(&b, &opts, v)
            .map_err(|e| format!("{what}: {e}"))?;
        if out.dims() != od.as_slice() {
            return Err(format!("{what}: shape {:?}, expected {od:?}", out.dims()));
        }
        check_close(&what, &download(&out, &od, dtype)?, &want, tol)?;
    }
    // The autotuned path (built-in choice for these small sizes) agrees too.
    let out = a.matmul_with(&b, &opts).map_err(|e| e.to_string())?;
    check_close(
        &format!("{} {dtype:?} {c:?} matmul_with", label(dev)),
        &download(&out, &od, dtype)?,
        &want,
        tol,
    )
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        2 => Just(1usize),
        4 => 2usize..9,
        3 => 9usize..40,
        2 => prop::sample::select(vec![63usize, 64, 65, 100, 129]),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (
        (0u8..4, 1usize..4, size(), size(), size()),
        (
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            0u8..3,
            any::<bool>(),
        ),
    )
        .prop_map(
            |((batch_mode, batch, m, n, k), (ta, tb, bias, act, kb))| Case {
                batch_mode,
                batch,
                m,
                n,
                k,
                ta,
                tb,
                bias,
                act: [Activation::None, Activation::Relu, Activation::Gelu][act as usize],
                kb,
            },
        )
}

/// One of each kernel family. A random case mostly compiles a pipeline per variant it runs
/// (transposes, the operands' vec4 alignment and, for subgroup blocks, bias and activation are
/// part of the pipeline), and a cold compile costs lavapipe about a second, so each random case
/// runs one of these, drawn with the case; the fixed cases below run all of VARIANTS in every
/// transposed form (`fixed_variants`).
const SAMPLED: [Variant; 4] = [VARIANTS[1], VARIANTS[3], VARIANTS[5], VARIANTS[6]];

/// The variants the fixed cases run on `dev`: all of them, except on GL, where each family
/// runs once (the naive reference, a skinny and a square register block, a workgroup tile; GL
/// has no subgroups): the kernels are the same WGSL on every backend, GL's translation of
/// each construct is covered by one variant of each family, and GL's cold compiles were the
/// largest part of this file's cold run (docs/design-notes.md, the cost of a cold `cargo test`).
fn fixed_variants(dev: &Device) -> &'static [Variant] {
    const GL: [Variant; 4] = [VARIANTS[0], VARIANTS[1], VARIANTS[2], VARIANTS[5]];
    if dev.info().adapter.wgpu_backend == fitgrad::wgpu::Backend::Gl {
        &GL
    } else {
        &VARIANTS
    }
}

fn kernels_match_the_reference_on_random_shapes(dev: &Device) {
    proptest!(
        ProptestConfig::with_cases(12),
        |(c in case(), v in 0..SAMPLED.len(), seed in any::<u64>())| {
            for &dtype in dtypes(dev) {
                check(dev, dtype, &c, &SAMPLED[v..=v], seed).map_err(TestCaseError::fail)?;
            }
        }
    );
}

fn every_variant_in_every_transposed_form(dev: &Device) {
    for (i, (ta, tb)) in [(false, false), (true, false), (false, true), (true, true)]
        .into_iter()
        .enumerate()
    {
        let c = Case {
            batch_mode: i as u8,
            batch: 2,
            m: 37,
            n: 20,
            k: 24,
            ta,
            tb,
            bias: true,
            act: [Activation::Relu, Activation::Gelu][i % 2],
            kb: false,
        };
        for &dtype in dtypes(dev) {
            check(dev, dtype, &c, fixed_variants(dev), i as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

fn edges_and_empty(dev: &Device) {
    let plain = |m, n, k| Case {
        batch_mode: 0,
        batch: 1,
        m,
        n,
        k,
        ta: false,
        tb: false,
        bias: true,
        // The first transposed form's epilogue, which subgroup blocks compile in: cases of the
        // same alignment share its pipelines.
        act: Activation::Relu,
        kb: false,
    };
    // k = 0 gives relu(bias) alone; m or n = 0 gives an empty result.
    for c in [
        plain(1, 1, 1),
        plain(3, 5, 0),
        plain(0, 4, 3),
        plain(4, 0, 3),
        plain(65, 67, 130),
    ] {
        for &dtype in dtypes(dev) {
            check(dev, dtype, &c, fixed_variants(dev), 5).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

fn transposed_forms_match_explicit_transposes(dev: &Device) {
    let x = Tensor::randn(dev, &[7, 5], 0.0, 1.0, 1, DType::F32).unwrap();
    let y = Tensor::randn(dev, &[7, 6], 0.0, 1.0, 2, DType::F32).unwrap();
    // xᵀ·y without materializing xᵀ, against the transpose kernel.
    let tn = x
        .matmul_with(&y, &MatmulOptions::new().trans_a(true))
        .unwrap();
    let explicit = x.transpose().unwrap().matmul(&y).unwrap();
    assert_close(
        "xT.y",
        &tn.to_vec_f32().unwrap(),
        &explicit.to_vec_f32().unwrap(),
        Tol::elementwise(DType::F32),
    );
    let z = Tensor::randn(dev, &[6, 5], 0.0, 1.0, 3, DType::F32).unwrap();
    let nt = x
        .matmul_with(&z, &MatmulOptions::new().trans_b(true))
        .unwrap();
    let explicit = x.matmul(&z.transpose().unwrap()).unwrap();
    assert_close(
        "x.zT",
        &nt.to_vec_f32().unwrap(),
        &explicit.to_vec_f32().unwrap(),
        Tol::elementwise(DType::F32),
    );
}

/// With `k_blocks` a variant of each family sums k in blocks of 16, each from zero, and adds the block sums
/// in order: the product over K rows is, bit for bit, the in-order f32 sum of the products over
/// each block's rows alone (the tail block shorter; K = 33 starts one in the tail loop), so a batch split at multiples of 16 rows sums
/// each block with the same bits. One block (K <= 16) is the plain product's bits.
fn k_blocks_add_their_block_sums_in_order(dev: &Device) {
    if !dtypes(dev).contains(&DType::F32) {
        return; // the same WGSL runs in f32 on this adapter's other backend
    }
    let (m, n) = (13, 9);
    // The form of a weight gradient's Xᵀ·dY (the random cases cover the others).
    let (ta, tb) = (true, false);
    {
        for k in [5, 33, 48] {
            let a_host = host_data(k as u64, m * k, -1.0, 1.0);
            let b_host = host_data(k as u64 ^ 7, k * n, -1.0, 1.0);
            // op(A)[i, q] and op(B)[q, j] of the stored operands.
            let a_at = |i: usize, q: usize| {
                if ta {
                    a_host[q * m + i]
                } else {
                    a_host[i * k + q]
                }
            };
            let b_at = |q: usize, j: usize| {
                if tb {
                    b_host[j * k + q]
                } else {
                    b_host[q * n + j]
                }
            };
            // The operands of rows `r` of K, stored as the whole ones are.
            let part = |r: std::ops::Range<usize>| {
                let kk = r.len();
                let (mut a, mut b) = (vec![0.0; m * kk], vec![0.0; kk * n]);
                for (q, row) in r.enumerate() {
                    for i in 0..m {
                        a[if ta { q * m + i } else { i * kk + q }] = a_at(i, row);
                    }
                    for j in 0..n {
                        b[if tb { j * kk + q } else { q * n + j }] = b_at(row, j);
                    }
                }
                let ad = if ta { [kk, m] } else { [m, kk] };
                let bd = if tb { [n, kk] } else { [kk, n] };
                (
                    upload(dev, &a, &ad, DType::F32),
                    upload(dev, &b, &bd, DType::F32),
                )
            };
            let (a, b) = part(0..k);
            for &v in fixed_variants(dev)
                .iter()
                .filter(|v| v.supported_on(dev, DType::F32))
            {
                let what = format!("{} {v:?} ta {ta} tb {tb} k {k}", label(dev));
                let run = |a: &Tensor, b: &Tensor, kb: bool| {
                    let opts = MatmulOptions::new().trans_a(ta).trans_b(tb).k_blocks(kb);
                    let c = a.matmul_variant(b, &opts, v).unwrap();
                    c.to_vec::<f32>().unwrap()
                };
                let mut want = vec![0.0f32; m * n];
                for (i, start) in (0..k).step_by(16).enumerate() {
                    let (pa, pb) = part(start..(start + 16).min(k));
                    let block = run(&pa, &pb, false);
                    if i == 0 {
                        want = block;
                    } else {
                        want.iter_mut().zip(&block).for_each(|(w, x)| *w += x);
                    }
                }
                let got = run(&a, &b, true);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{what}: not the block sums in order"
                );
                if k <= 16 {
                    assert_eq!(bits(&run(&a, &b, false)), bits(&got), "{what}: one block");
                } else {
                    // Blocks change the rounding only: the plain product is close.
                    let plain = run(&a, &b, false);
                    check_close(&what, &plain, &got, Tol::elementwise(DType::F32)).unwrap();
                }
            }
        }
    }
}

/// The batch-invariant weight gradient (`Tensor::fold_rows_onto`): a variant of each family folds Xᵀ·dY
/// onto what the gradient holds, k in order, so all give the naive kernel's bits, folding the
/// rows in two runs gives the bits of folding them at once, no rows leave the gradient as it
/// was, and the result is the gradient plus the product within f32 rounding.
fn folds_onto_the_gradient_held_in_k_order(dev: &Device) {
    if !dtypes(dev).contains(&DType::F32) {
        return; // the same WGSL runs in f32 on this adapter's other backend
    }
    let (m, n) = (13, 9);
    let start = host_data(3, m * n, -1.0, 1.0);
    for k in [0, 1, 7, 33] {
        let x = host_data(k as u64, k * m, -1.0, 1.0);
        let dy = host_data(k as u64 ^ 5, k * n, -1.0, 1.0);
        let up = |v: &[f32], d: &[usize]| upload(dev, v, d, DType::F32);
        let fold = |v: Variant, rows: std::ops::Range<usize>, onto: &Tensor| {
            let (xs, ys) = (
                &x[rows.start * m..rows.end * m],
                &dy[rows.start * n..rows.end * n],
            );
            up(xs, &[rows.len(), m])
                .fold_rows_onto(&up(ys, &[rows.len(), n]), onto, v)
                .unwrap();
        };
        let bits = |t: &Tensor| {
            let v = t.to_vec::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        let naive = up(&start, &[m, n]);
        fold(Variant::Naive, 0..k, &naive);
        let mut want = start.clone();
        for (i, w) in want.iter_mut().enumerate() {
            let (r, c) = (i / n, i % n);
            *w += (0..k).map(|q| x[q * m + r] * dy[q * n + c]).sum::<f32>();
        }
        let what = format!("{} k {k}", label(dev));
        let got = naive.to_vec::<f32>().unwrap();
        check_close(&what, &got, &want, Tol::elementwise(DType::F32)).unwrap();
        if k == 0 {
            assert_eq!(got, start, "{what}: no rows change nothing");
        }
        for &v in fixed_variants(dev)
            .iter()
            .filter(|v| v.supported_on(dev, DType::F32))
        {
            let whole = up(&start, &[m, n]);
            fold(v, 0..k, &whole);
            assert_eq!(
                bits(&whole),
                bits(&naive),
                "{what} {v:?}: not the naive kernel's bits"
            );
            let split = up(&start, &[m, n]);
            fold(v, 0..k / 2, &split);
            fold(v, k / 2..k, &split);
            assert_eq!(bits(&split), bits(&whole), "{what} {v:?}: two runs differ");
        }
    }
}

fn bad_shapes_are_errors(dev: &Device) {
    let t = |d: &[usize]| Tensor::zeros(dev, d, DType::F32).unwrap();
    let shape_err = |r: fitgrad::Result<Tensor>| matches!(r, Err(Error::Shape { op, .. }) if op.starts_with("matmul"));
    assert!(shape_err(t(&[2, 3]).matmul(&t(&[4, 5]))));
    assert!(shape_err(t(&[3]).matmul(&t(&[3, 2]))));
    assert!(shape_err(t(&[2, 2, 3]).matmul(&t(&[3, 3, 2]))));
    let bias = t(&[3]);
    let opts = MatmulOptions::new().bias(&bias);
    assert!(shape_err(t(&[2, 3]).matmul_with(&t(&[3, 2]), &opts)));
    let h = Tensor::zeros(dev, &[3, 2], DType::F16).unwrap();
    assert!(matches!(t(&[2, 3]).matmul(&h), Err(Error::DType { .. })));
    // The device still works.
    let ok = Tensor::ones(dev, &[2, 3], DType::F32)
        .unwrap()
        .matmul(&t(&[3, 2]))
        .unwrap();
    assert_eq!(ok.to_vec::<f32>().unwrap(), vec![0.0; 4]);
}
