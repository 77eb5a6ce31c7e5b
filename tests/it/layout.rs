//! Layout ops against plain-loop references on every device, f32 and f16: `narrow`, `cat`,
//! `permute`, `transpose_dims` (random shapes with proptest, empty and odd sizes, packed f16 words
//! split between inputs), their errors, bitwise repeatability, and their gradients against
//! finite differences; and batched matmuls shaped like attention ((B, H, T, D) operands, the
//! transposed operand read in place, a shared operand), forward on every device and backward
//! against finite differences.

use crate::common;

use common::gradcheck::{check_grads, input, Res};
use common::strategies::{cap, dim, shape, shape_rank, MAX_NUMEL};
use common::*;
use fitgrad::{DType, Device, Error, MatmulOptions, Tensor};
use proptest::prelude::*;

device_tests!(
    narrow_matches_reference,
    cat_matches_reference,
    permute_matches_reference,
    layout_edge_cases,
    layout_ops_are_bitwise_repeatable,
    attention_shaped_matmuls_match_reference
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

/// (axis, start, len) of a narrow.
type NarrowArgs = (usize, usize, usize);

// ---------------------------------------------------------------------------------------------
// Plain-loop references
// ---------------------------------------------------------------------------------------------

/// (outer, inner) of `dims` around `axis`.
fn around(dims: &[usize], axis: usize) -> (usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis + 1..].iter().product(),
    )
}

/// x[.., start..start + len, ..] along `axis`.
fn ref_narrow<T: Copy>(x: &[T], dims: &[usize], axis: usize, start: usize, len: usize) -> Vec<T> {
    let (outer, inner) = around(dims, axis);
    let mut out = Vec::new();
    for o in 0..outer {
        for l in start..start + len {
            for i in 0..inner {
                out.push(x[(o * dims[axis] + l) * inner + i]);
            }
        }
    }
    out
}

/// The inputs joined along `axis` (same dims elsewhere).
fn ref_cat<T: Copy>(xs: &[(&[T], &[usize])], axis: usize) -> Vec<T> {
    let (outer, inner) = around(xs[0].1, axis);
    let mut out = Vec::new();
    for o in 0..outer {
        for (x, d) in xs {
            for l in 0..d[axis] {
                for i in 0..inner {
                    out.push(x[(o * d[axis] + l) * inner + i]);
                }
            }
        }
    }
    out
}

/// out[j0, j1, ..] = x[i] with i[perm[k]] = j[k].
fn ref_permute<T: Copy>(x: &[T], dims: &[usize], perm: &[usize]) -> (Vec<T>, Vec<usize>) {
    let od: Vec<usize> = perm.iter().map(|&a| dims[a]).collect();
    let st = strides(dims);
    let n = numel(&od);
    let mut out = Vec::with_capacity(n);
    for lin in 0..n {
        let mut rem = lin;
        let mut src = 0;
        for k in (0..od.len()).rev() {
            src += (rem % od[k]) * st[perm[k]];
            rem /= od[k];
        }
        out.push(x[src]);
    }
    (out, od)
}

// ---------------------------------------------------------------------------------------------
// Forward checks
// ---------------------------------------------------------------------------------------------

fn fail(what: &str) -> impl Fn(fitgrad::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn check_narrow(
    dev: &Device,
    dtype: DType,
    dims: &[usize],
    (axis, start, len): NarrowArgs,
    seed: u64,
) -> Res<()> {
    let what = format!(
        "narrow({axis}, {start}, {len}) of {dims:?} {dtype} on {}",
        label(dev)
    );
    let host = as_dtype(&host_data(seed, numel(dims), -10.0, 10.0), dtype);
    let x = upload(dev, &host, dims, dtype);
    let out = x.narrow(axis, start, len).map_err(fail(&what))?;
    let mut od = dims.to_vec();
    od[axis] = len;
    let got = download(&out, &od, dtype).map_err(|e| format!("{what}: {e}"))?;
    // Values are moved, not computed: exact.
    check_close(
        &what,
        &got,
        &ref_narrow(&host, dims, axis, start, len),
        Tol::EXACT,
    )
}

fn check_cat(dev: &Device, dtype: DType, shapes: &[Vec<usize>], axis: usize, seed: u64) -> Res<()> {
    let what = format!("cat of {shapes:?} along {axis} {dtype} on {}", label(dev));
    let hosts: Vec<Vec<f32>> = shapes
        .iter()
        .enumerate()
        .map(|(i, d)| as_dtype(&host_data(seed + i as u64, numel(d), -10.0, 10.0), dtype))
        .collect();
    let ts: Vec<Tensor> = hosts
        .iter()
        .zip(shapes)
        .map(|(h, d)| upload(dev, h, d, dtype))
        .collect();
    let refs: Vec<&Tensor> = ts.iter().collect();
    let out = Tensor::cat(&refs, axis).map_err(fail(&what))?;
    let mut od = shapes[0].clone();
    od[axis] = shapes.iter().map(|d| d[axis]).sum();
    let got = download(&out, &od, dtype).map_err(|e| format!("{what}: {e}"))?;
    let pairs: Vec<(&[f32], &[usize])> = hosts
        .iter()
        .zip(shapes)
        .map(|(h, d)| (&h[..], &d[..]))
        .collect();
    check_close(&what, &got, &ref_cat(&pairs, axis), Tol::EXACT)
}

fn check_permute(dev: &Device, dtype: DType, dims: &[usize], perm: &[usize], seed: u64) -> Res<()> {
    let what = format!("permute {perm:?} of {dims:?} {dtype} on {}", label(dev));
    let host = as_dtype(&host_data(seed, numel(dims), -10.0, 10.0), dtype);
    let x = upload(dev, &host, dims, dtype);
    let out = x.permute(perm).map_err(fail(&what))?;
    let (want, od) = ref_permute(&host, dims, perm);
    let got = download(&out, &od, dtype).map_err(|e| format!("{what}: {e}"))?;
    check_close(&what, &got, &want, Tol::EXACT)?;
    // transpose_dims of the first and last axes is the permutation swapping them.
    if dims.len() >= 2 {
        let last = dims.len() - 1;
        let mut swap: Vec<usize> = (0..dims.len()).collect();
        swap.swap(0, last);
        let t = x.transpose_dims(last, 0).map_err(fail(&what))?;
        let (want, od) = ref_permute(&host, dims, &swap);
        let got = download(&t, &od, dtype).map_err(|e| format!("{what}: {e}"))?;
        check_close(
            &format!("{what}: transpose_dims({last}, 0)"),
            &got,
            &want,
            Tol::EXACT,
        )?;
    }
    Ok(())
}

/// (axis, start, len) of a narrow of `dims` (rank >= 1) from random bits.
fn narrow_args(dims: &[usize], bits: u64) -> NarrowArgs {
    let axis = (bits % dims.len() as u64) as usize;
    let d = dims[axis] as u64;
    let start = ((bits >> 8) % (d + 1)) as usize;
    let len = ((bits >> 24) % (d + 1 - start as u64)) as usize;
    (axis, start, len)
}

/// Shapes of 1 to 4 tensors that cat along some axis: one base shape, each input with its own
/// length along the axis (0 and odd lengths included), each at most a quarter of MAX_NUMEL.
fn cat_case() -> impl Strategy<Value = (Vec<Vec<usize>>, usize)> {
    (
        shape_rank(1, 4),
        any::<u64>(),
        prop::collection::vec(dim(), 1..=4),
    )
        .prop_map(|(base, bits, lens)| {
            let axis = (bits % base.len() as u64) as usize;
            let rest: usize = base
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != axis)
                .map(|(_, &d)| d)
                .product();
            let most = MAX_NUMEL / 4 / rest.max(1);
            let shapes = lens
                .iter()
                .map(|&l| {
                    let mut d = base.clone();
                    d[axis] = l.min(most);
                    d
                })
                .collect();
            (shapes, axis)
        })
}

/// A shape of rank 0..=4 and a random permutation of its axes.
fn permute_case() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    shape().prop_flat_map(|dims| {
        let perm: Vec<usize> = (0..dims.len()).collect();
        (Just(dims), Just(perm).prop_shuffle())
    })
}

fn narrow_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        dims in shape_rank(1, 4),
        bits in any::<u64>(),
        seed in any::<u64>(),
    )| {
        let args = narrow_args(&dims, bits);
        for dtype in DTYPES {
            check_narrow(dev, dtype, &dims, args, seed).map_err(TestCaseError::fail)?;
        }
    });
}

fn cat_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        (shapes, axis) in cat_case(),
        seed in any::<u64>(),
    )| {
        for dtype in DTYPES {
            check_cat(dev, dtype, &shapes, axis, seed).map_err(TestCaseError::fail)?;
        }
    });
}

fn permute_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        (dims, perm) in permute_case(),
        seed in any::<u64>(),
    )| {
        for dtype in DTYPES {
            check_permute(dev, dtype, &dims, &perm, seed).map_err(TestCaseError::fail)?;
        }
    });
}

/// The edges: odd element offsets that split packed f16 words between cat inputs and narrow
/// ranges, empty ranges and inputs, rank 1, the whole axis, workgroup-sized blocks.
fn layout_edge_cases(dev: &Device) {
    let narrows: &[(&[usize], NarrowArgs)] = &[
        (&[1], (0, 0, 1)),
        (&[7], (0, 3, 3)),
        (&[7], (0, 1, 0)),
        (&[7], (0, 7, 0)),
        (&[3, 5], (1, 1, 3)),
        (&[3, 5], (0, 1, 1)),
        (&[0, 5], (1, 2, 2)),
        (&[2, 3, 513], (2, 255, 257)),
        (&[3, 1, 5, 3], (2, 1, 3)),
        (&[2, 3, 4, 5], (3, 0, 5)),
    ];
    let cats: &[(&[&[usize]], usize)] = &[
        (&[&[3], &[5]], 0),
        (&[&[1], &[1], &[1]], 0),
        (&[&[3], &[0], &[2]], 0),
        (&[&[0], &[0]], 0),
        (&[&[2, 3], &[2, 1], &[2, 2]], 1),
        (&[&[1, 3], &[2, 3]], 0),
        (&[&[3, 1, 5], &[3, 2, 5]], 1),
        (&[&[2, 0, 3], &[2, 0, 3]], 2),
        (&[&[5, 257], &[5, 1]], 1),
        (&[&[1, 2, 3, 3], &[1, 2, 3, 2]], 3),
    ];
    let perms: &[(&[usize], &[usize])] = &[
        (&[], &[]),
        (&[5], &[0]),
        (&[3, 5], &[1, 0]),
        (&[3, 1, 5], &[2, 0, 1]),
        (&[2, 3, 5, 7], &[0, 2, 1, 3]),
        (&[2, 3, 5, 7], &[3, 2, 1, 0]),
        (&[3, 0, 2], &[1, 2, 0]),
        (&[1, 513, 3], &[2, 1, 0]),
    ];
    for dtype in DTYPES {
        for (i, (dims, args)) in narrows.iter().enumerate() {
            check_narrow(dev, dtype, dims, *args, i as u64).unwrap_or_else(|e| panic!("{e}"));
        }
        for (i, (shapes, axis)) in cats.iter().enumerate() {
            let shapes: Vec<Vec<usize>> = shapes.iter().map(|s| s.to_vec()).collect();
            check_cat(dev, dtype, &shapes, *axis, i as u64).unwrap_or_else(|e| panic!("{e}"));
        }
        for (i, (dims, perm)) in perms.iter().enumerate() {
            check_permute(dev, dtype, dims, perm, i as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// The same inputs give the same bits, run after run.
fn layout_ops_are_bitwise_repeatable(dev: &Device) {
    for dtype in DTYPES {
        let host = host_data(3, 2 * 3 * 5 * 7, -10.0, 10.0);
        let x = upload(dev, &host, &[2, 3, 5, 7], dtype);
        let run = || -> Vec<u32> {
            let a = x.narrow(2, 1, 3).unwrap();
            let b = x.narrow(2, 0, 1).unwrap();
            let c = Tensor::cat(&[&a, &b], 2).unwrap();
            let p = c.permute(&[3, 1, 0, 2]).unwrap();
            p.to_vec_f32()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(run(), run(), "{dtype} on {}", label(dev));
    }
}

fn assert_err<T: std::fmt::Debug>(r: fitgrad::Result<T>, what: &str, ok: impl Fn(&Error) -> bool) {
    match r {
        Err(e) if ok(&e) => {}
        other => panic!("{what}: expected a typed error, got {other:?}"),
    }
}

#[test]
fn layout_errors_are_typed() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let x = Tensor::zeros(&dev, &[2, 3, 4], DType::F32).unwrap();
    let h = Tensor::zeros(&dev, &[2, 3, 4], DType::F16).unwrap();
    let s = Tensor::scalar(&dev, 1.0f32).unwrap();
    let arg = |e: &Error| matches!(e, Error::InvalidArgument { .. });
    let shape = |e: &Error| matches!(e, Error::Shape { .. });
    assert_err(x.narrow(3, 0, 1), "narrow axis 3", arg);
    assert_err(s.narrow(0, 0, 1), "narrow of a scalar", arg);
    assert_err(x.narrow(1, 2, 2), "narrow past the axis", shape);
    assert_err(x.narrow(1, 4, 0), "narrow starting past the axis", shape);
    assert_err(x.narrow(1, usize::MAX, 2), "narrow overflowing", shape);
    assert_err(Tensor::cat(&[], 0), "cat of nothing", arg);
    assert_err(Tensor::cat(&[&x, &x], 3), "cat axis 3", arg);
    assert_err(Tensor::cat(&[&s, &s], 0), "cat of scalars", arg);
    let y = Tensor::zeros(&dev, &[2, 5, 4], DType::F32).unwrap();
    assert_err(Tensor::cat(&[&x, &y], 0), "cat with other dims", shape);
    let r2 = Tensor::zeros(&dev, &[2, 3], DType::F32).unwrap();
    assert_err(Tensor::cat(&[&x, &r2], 0), "cat of other ranks", shape);
    assert_err(Tensor::cat(&[&x, &h], 0), "cat of dtypes", |e| {
        matches!(e, Error::DType { .. })
    });
    assert_err(x.permute(&[0, 1]), "permute too short", arg);
    assert_err(x.permute(&[0, 1, 1]), "permute repeating", arg);
    assert_err(x.permute(&[0, 1, 3]), "permute out of range", arg);
    assert_err(x.permute(&[0, 1, 2, 3]), "permute too long", arg);
    assert_err(x.transpose_dims(0, 3), "transpose_dims out of range", arg);
    assert_err(s.transpose_dims(0, 0), "transpose_dims of a scalar", arg);
    // Tensors on two devices.
    if let Some(other) = common::fresh_device(Default::default()) {
        let z = Tensor::zeros(&other, &[2, 3, 4], DType::F32).unwrap();
        assert_err(Tensor::cat(&[&x, &z], 0), "cat across devices", |e| {
            matches!(e, Error::DeviceMismatch { .. })
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Gradients
// ---------------------------------------------------------------------------------------------

/// A small shape (dims 1..=4, rank `lo..=hi`).
fn small_shape(lo: usize, hi: usize) -> impl Strategy<Value = Vec<usize>> {
    (lo..=hi)
        .prop_flat_map(|r| prop::collection::vec(1usize..=4, r))
        .prop_map(|d| cap(d, 96))
}

fn check_layout_grads(dev: &Device, dims: &[usize], bits: u64, seed: u64) -> Res<()> {
    let n = numel(dims);
    let x = host_data(seed, n, -2.0, 2.0);
    let (axis, start, len) = narrow_args(dims, bits);
    let d = dims.to_vec();
    check_grads(
        dev,
        &format!("narrow({axis}, {start}, {len}) of {dims:?}"),
        &[input(x.clone(), dims, true)],
        seed,
        &|t| t[0].narrow(axis, start, len),
        &|xs| ref_narrow(&xs[0], &d, axis, start, len),
    )?;
    // cat of x with a second tensor along the axis (either may require grad).
    let mut d2 = dims.to_vec();
    d2[axis] = 1 + (bits >> 40) as usize % 3;
    let y = host_data(seed ^ 3, numel(&d2), -2.0, 2.0);
    let (da, db) = (d.clone(), d2.clone());
    check_grads(
        dev,
        &format!("cat of {dims:?} and {d2:?} along {axis}"),
        &[input(x.clone(), dims, true), input(y, &d2, bits & 1 == 0)],
        seed,
        &|t| Tensor::cat(&[&t[0], &t[1]], axis),
        &|xs| ref_cat(&[(&xs[0][..], &da[..]), (&xs[1][..], &db[..])], axis),
    )?;
    // A reversed permutation, and transpose_dims of the first and last axes.
    let perm: Vec<usize> = (0..dims.len()).rev().collect();
    check_grads(
        dev,
        &format!("permute {perm:?} of {dims:?}"),
        &[input(x.clone(), dims, true)],
        seed,
        &|t| t[0].permute(&perm),
        &|xs| ref_permute(&xs[0], &d, &perm).0,
    )?;
    let last = dims.len() - 1;
    let mut swap: Vec<usize> = (0..dims.len()).collect();
    swap.swap(0, last);
    check_grads(
        dev,
        &format!("transpose_dims(0, {last}) of {dims:?}"),
        &[input(x, dims, true)],
        seed,
        &|t| t[0].transpose_dims(0, last),
        &|xs| ref_permute(&xs[0], &d, &swap).0,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn layout_gradients_match_finite_differences(
        dims in small_shape(1, 4),
        bits in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let Some(dev) = devices().into_iter().next() else { return Ok(()) };
        check_layout_grads(&dev, &dims, bits, seed).map_err(TestCaseError::fail)?;
    }
}

/// A permutation of rank 3 through a whole graph: each of three inputs used once in a cat, its
/// gradient routed back through permute and narrow.
#[test]
fn composed_layout_gradient() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let dims = [2usize, 3, 4];
    let x = host_data(11, 24, -1.0, 1.0);
    let d = dims.to_vec();
    check_grads(
        &dev,
        "cat(narrow(x), permute(x)) along 1",
        &[input(x, &dims, true)],
        1,
        &|t| {
            let a = t[0].narrow(1, 1, 2)?; // (2, 2, 4)
            let b = t[0]
                .permute(&[0, 2, 1])?
                .narrow(2, 0, 2)?
                .transpose_dims(1, 2)?; // (2, 2, 4)
            Tensor::cat(&[&a, &b, &a], 1) // (2, 6, 4)
        },
        &|xs| {
            let a = ref_narrow(&xs[0], &d, 1, 1, 2);
            let p = ref_permute(&xs[0], &d, &[0, 2, 1]).0; // (2, 4, 3)
            let q = ref_narrow(&p, &[2, 4, 3], 2, 0, 2); // (2, 4, 2)
            let b = ref_permute(&q, &[2, 4, 2], &[0, 2, 1]).0; // (2, 2, 4)
            let s: &[usize] = &[2, 2, 4];
            ref_cat(&[(&a[..], s), (&b[..], s), (&a[..], s)], 1)
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

// ---------------------------------------------------------------------------------------------
// Batched matmul, attention-shaped
// ---------------------------------------------------------------------------------------------

/// Stored operands (leading dims, then the stored matrix) of op(A) (M, K) · op(B) (K, N).
#[derive(Clone, Debug)]
struct Bmm {
    a: Vec<usize>,
    b: Vec<usize>,
    ta: bool,
    tb: bool,
}

impl Bmm {
    fn mkn(&self) -> (usize, usize, usize) {
        let (ra, rb) = (self.a.len(), self.b.len());
        let (m, k) = if self.ta {
            (self.a[ra - 1], self.a[ra - 2])
        } else {
            (self.a[ra - 2], self.a[ra - 1])
        };
        let n = if self.tb {
            self.b[rb - 2]
        } else {
            self.b[rb - 1]
        };
        (m, k, n)
    }

    /// The output's leading dims: the longer side's (the other is equal or a single matrix).
    fn lead(&self) -> Vec<usize> {
        let (la, lb) = (&self.a[..self.a.len() - 2], &self.b[..self.b.len() - 2]);
        if la.iter().product::<usize>() >= lb.iter().product::<usize>() && la.len() >= lb.len() {
            la.to_vec()
        } else {
            lb.to_vec()
        }
    }

    fn out_dims(&self) -> Vec<usize> {
        let (m, _, n) = self.mkn();
        let mut d = self.lead();
        d.extend([m, n]);
        d
    }

    /// op(A) · op(B) per batch in f64; a side whose leading dims hold one matrix is shared.
    fn reference(&self, a: &[f64], b: &[f64]) -> Vec<f64> {
        let (m, k, n) = self.mkn();
        let batch: usize = self.lead().iter().product();
        let a_step = if a.len() == m * k { 0 } else { m * k };
        let b_step = if b.len() == k * n { 0 } else { k * n };
        let mut out = Vec::with_capacity(batch * m * n);
        for bi in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0;
                    for p in 0..k {
                        let x = if self.ta {
                            a[bi * a_step + p * m + i]
                        } else {
                            a[bi * a_step + i * k + p]
                        };
                        let y = if self.tb {
                            b[bi * b_step + j * k + p]
                        } else {
                            b[bi * b_step + p * n + j]
                        };
                        s += x * y;
                    }
                    out.push(s);
                }
            }
        }
        out
    }

    fn run(&self, a: &Tensor, b: &Tensor) -> fitgrad::Result<Tensor> {
        a.matmul_with(b, &MatmulOptions::new().trans_a(self.ta).trans_b(self.tb))
    }
}

/// The attention products at (B, H, T, D): Q·Kᵀ with Kᵀ stored and with K read transposed in
/// place, P·V, the transposed-A form of a weight gradient, and shared operands (no leading dims,
/// or all 1s).
fn attention_cases(b: usize, h: usize, t: usize, d: usize) -> Vec<Bmm> {
    let bh = |x: usize, y: usize| vec![b, h, x, y];
    let case = |a: Vec<usize>, bb: Vec<usize>, ta: bool, tb: bool| Bmm { a, b: bb, ta, tb };
    vec![
        case(bh(t, d), bh(d, t), false, false), // Q (B,H,T,D) · Kᵀ (B,H,D,T)
        case(bh(t, d), bh(t, d), false, true),  // Q · K (B,H,T,D)ᵀ, read in place
        case(bh(t, t), bh(t, d), false, false), // P (B,H,T,T) · V (B,H,T,D)
        case(bh(t, t), bh(t, d), true, false),  // Pᵀ · dO: the gradient of V
        case(bh(d, t), bh(t, d), true, true),   // both read transposed
        case(bh(t, d), vec![d, t], false, false), // a shared matrix
        case(vec![1, 1, t, d], bh(d, t), false, false), // leading 1s: shared
        case(bh(t, d), vec![1, 1, t, d], false, true),
        case(vec![h, t, d], vec![1, h, d, t], false, false), // equal up to a leading 1
    ]
}

fn check_bmm(dev: &Device, dtype: DType, c: &Bmm, seed: u64) -> Res<()> {
    let what = format!("matmul {c:?} {dtype} on {}", label(dev));
    let a_host = as_dtype(&host_data(seed, numel(&c.a), -1.0, 1.0), dtype);
    let b_host = as_dtype(&host_data(seed ^ 7, numel(&c.b), -1.0, 1.0), dtype);
    let (a, b) = (
        upload(dev, &a_host, &c.a, dtype),
        upload(dev, &b_host, &c.b, dtype),
    );
    let out = c.run(&a, &b).map_err(fail(&what))?;
    let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let want: Vec<f32> = c
        .reference(&f(&a_host), &f(&b_host))
        .iter()
        .map(|&v| v as f32)
        .collect();
    let k = c.mkn().1 as f32;
    let tol = match dtype {
        DType::F32 => Tol {
            abs: 2e-6 * (k + 1.0),
            rel: 1e-5,
            f16_ulps: 0.0,
        },
        DType::F16 => Tol {
            abs: 1e-4 * (k + 1.0),
            rel: 2e-3,
            f16_ulps: 2.0,
        },
    };
    let got = download(&out, &c.out_dims(), dtype).map_err(|e| format!("{what}: {e}"))?;
    check_close(&what, &got, &expect_in(want, dtype), tol)?;
    // Bitwise repeatable.
    let again = c.run(&a, &b).map_err(fail(&what))?;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    if bits(&again.to_vec_f32().map_err(fail(&what))?) != bits(&got) {
        return Err(format!("{what}: a second run differs"));
    }
    Ok(())
}

fn attention_shaped_matmuls_match_reference(dev: &Device) {
    for dtype in DTYPES {
        for (b, h, t, d) in [(2, 3, 5, 4), (2, 3, 1, 4), (1, 2, 9, 8)] {
            for (i, c) in attention_cases(b, h, t, d).iter().enumerate() {
                check_bmm(dev, dtype, c, i as u64).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

#[test]
fn attention_shaped_matmul_gradients() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    for (b, h, t, d) in [(2, 3, 5, 4), (2, 3, 1, 4)] {
        for (i, c) in attention_cases(b, h, t, d).into_iter().enumerate() {
            let a_host = host_data(i as u64, numel(&c.a), -1.0, 1.0);
            let b_host = host_data(i as u64 ^ 9, numel(&c.b), -1.0, 1.0);
            let c2 = c.clone();
            check_grads(
                &dev,
                &format!("matmul {c:?}"),
                &[input(a_host, &c.a, true), input(b_host, &c.b, true)],
                i as u64,
                &|ts| c.run(&ts[0], &ts[1]),
                &|xs| c2.reference(&xs[0], &xs[1]),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// Scores through the whole attention pattern: Q·Kᵀ read in place equals Q times Kᵀ made by
/// transpose_dims, and leading dims that cannot be shared are a shape error.
#[test]
fn attention_transpose_forms_agree_and_bad_batches_fail() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let q = upload(
        &dev,
        &host_data(1, 120, -1.0, 1.0),
        &[2, 3, 5, 4],
        DType::F32,
    );
    let k = upload(
        &dev,
        &host_data(2, 120, -1.0, 1.0),
        &[2, 3, 5, 4],
        DType::F32,
    );
    let in_place = q
        .matmul_with(&k, &MatmulOptions::new().trans_b(true))
        .unwrap();
    let stored = q.matmul(&k.transpose_dims(2, 3).unwrap()).unwrap();
    assert_eq!(in_place.dims(), &[2, 3, 5, 5]);
    assert_close(
        "Q·Kᵀ in place against Q·transpose_dims(K)",
        &in_place.to_vec_f32().unwrap(),
        &stored.to_vec_f32().unwrap(),
        Tol {
            abs: 1e-5,
            rel: 1e-5,
            f16_ulps: 0.0,
        },
    );
    let k3 = Tensor::zeros(&dev, &[3, 4, 5], DType::F32).unwrap();
    assert_err(q.matmul(&k3), "(2,3,5,4)·(3,4,5)", |e| {
        matches!(e, Error::Shape { .. })
    });
    let k2 = Tensor::zeros(&dev, &[3, 2, 4, 5], DType::F32).unwrap();
    assert_err(q.matmul(&k2), "(2,3,5,4)·(3,2,4,5)", |e| {
        matches!(e, Error::Shape { .. })
    });
}
