//! Selection ops against plain-loop references on every device, f32 and f16: `abs`, `maximum`,
//! `minimum` (broadcast, NaN propagating), `where_` (three inputs broadcast, a condition of
//! either dtype), `masked_fill`; random shapes with proptest (rank 0, size 1, odd sizes, empty
//! tensors), NaN, infinities and signed zeros, their errors, bitwise repeatability, and their
//! gradients against finite differences (ties and zeros included: the central difference there
//! is torch's 0.5 split and 0).

use crate::common;

use common::gradcheck::{check_grads, input, Res};
use common::strategies::{cap, shape};
use common::*;
use fitgrad::{DType, Device, Error, Tensor};
use proptest::prelude::*;

device_tests!(
    abs_matches_reference,
    maximum_and_minimum_match_reference,
    where_matches_reference,
    masked_fill_matches_reference,
    selection_edge_shapes,
    selection_ops_are_bitwise_repeatable
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

/// maximum or minimum, and its f64 reference for the gradient check.
type BinOp = fn(&Tensor, &Tensor) -> fitgrad::Result<Tensor>;
type Ref64 = fn(f64, f64) -> f64;
type Ref32 = fn(f32, f32) -> f32;

// ---------------------------------------------------------------------------------------------
// Data and references
// ---------------------------------------------------------------------------------------------

/// Multiples of 0.25 in [-2, 2] (exact in f16, so ties between operands are frequent), with NaN,
/// -0 and infinities sprinkled in when `specials`.
fn grid_data(seed: u64, n: usize, specials: bool) -> Vec<f32> {
    let mut r = HostRng::new(seed);
    (0..n)
        .map(|_| {
            let k = r.next_u64();
            if specials && k.is_multiple_of(12) {
                [f32::NAN, -0.0, f32::INFINITY, f32::NEG_INFINITY][(k >> 8) as usize % 4]
            } else {
                ((k >> 16) % 17) as f32 * 0.25 - 2.0
            }
        })
        .collect()
}

/// Conditions: zeros of both signs, other numbers, NaN (nonzero).
fn cond_data(seed: u64, n: usize) -> Vec<f32> {
    let mut r = HostRng::new(seed);
    let vals = [0.0, -0.0, 1.0, -3.5, 0.5, f32::NAN];
    (0..n)
        .map(|_| vals[(r.next_u64() % vals.len() as u64) as usize])
        .collect()
}

/// Multi-index of linear index `lin` in `dims`.
fn unravel(mut lin: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for i in (0..dims.len()).rev() {
        idx[i] = lin % dims[i];
        lin /= dims[i];
    }
    idx
}

/// Linear index into `dims` of output multi-index `idx`, broadcast dims pinned to 0.
fn bcast_index(idx: &[usize], dims: &[usize]) -> usize {
    let st = strides(dims);
    let shift = idx.len() - dims.len();
    (0..dims.len())
        .map(|i| {
            if dims[i] == 1 {
                0
            } else {
                idx[i + shift] * st[i]
            }
        })
        .sum()
}

/// `c != 0 ? a : b` with all three broadcast (NaN is nonzero, -0 is zero).
fn ref_where<T: Copy>(
    (c, cd): (&[f32], &[usize]),
    (a, ad): (&[T], &[usize]),
    (b, bd): (&[T], &[usize]),
) -> (Vec<T>, Vec<usize>) {
    let od = broadcast_dims(&broadcast_dims(cd, ad).unwrap(), bd).unwrap();
    let out = (0..numel(&od))
        .map(|lin| {
            let idx = unravel(lin, &od);
            if c[bcast_index(&idx, cd)] != 0.0 {
                a[bcast_index(&idx, ad)]
            } else {
                b[bcast_index(&idx, bd)]
            }
        })
        .collect();
    (out, od)
}

/// torch.maximum / torch.minimum: NaN if either operand is NaN.
fn ref_max(x: f32, y: f32) -> f32 {
    if x.is_nan() || y.is_nan() {
        f32::NAN
    } else {
        x.max(y)
    }
}

fn ref_min(x: f32, y: f32) -> f32 {
    if x.is_nan() || y.is_nan() {
        f32::NAN
    } else {
        x.min(y)
    }
}

/// Three shapes that broadcast together, derived from one output shape by dropping leading dims
/// and setting dims to 1.
fn broadcast_triple() -> impl Strategy<Value = [Vec<usize>; 3]> {
    (shape(), any::<u64>()).prop_map(|(out, bits)| {
        let derive = |bits: u64| -> Vec<usize> {
            let drop = if bits & 8 == 0 {
                0
            } else {
                (bits & 7) as usize % (out.len() + 1)
            };
            out[drop..]
                .iter()
                .enumerate()
                .map(|(i, &d)| if (bits >> (4 + 2 * i)) & 3 == 0 { 1 } else { d })
                .collect()
        };
        [derive(bits), derive(bits >> 16), derive(bits >> 32)]
    })
}

fn fail(what: &str) -> impl Fn(fitgrad::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// Bit-exact comparison (NaN matches any NaN; -0 and 0 differ).
fn check_bits(what: &str, got: &[f32], want: &[f32]) -> Res<()> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    match (0..got.len())
        .find(|&i| !(got[i].to_bits() == want[i].to_bits() || got[i].is_nan() && want[i].is_nan()))
    {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: at index {i} got {:?}, expected {:?}",
            got[i], want[i]
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// Forward checks
// ---------------------------------------------------------------------------------------------

fn check_abs(dev: &Device, dtype: DType, dims: &[usize], seed: u64) -> Res<()> {
    let what = format!("abs of {dims:?} {dtype} on {}", label(dev));
    let host = as_dtype(&grid_data(seed, numel(dims), true), dtype);
    let out = upload(dev, &host, dims, dtype).abs().map_err(fail(&what))?;
    let got = download(&out, dims, dtype)?;
    // -0 becomes +0.
    check_bits(&what, &got, &ref_unary(&host, f32::abs))
}

fn check_extrema(dev: &Device, dtype: DType, ad: &[usize], bd: &[usize], seed: u64) -> Res<()> {
    let a_host = as_dtype(&grid_data(seed, numel(ad), true), dtype);
    let b_host = as_dtype(&grid_data(seed ^ 5, numel(bd), true), dtype);
    let (a, b) = (
        upload(dev, &a_host, ad, dtype),
        upload(dev, &b_host, bd, dtype),
    );
    let ops: [(&str, BinOp, Ref32); 2] = [
        ("maximum", Tensor::maximum, ref_max),
        ("minimum", Tensor::minimum, ref_min),
    ];
    for (name, op, f) in ops {
        let what = format!("{name} of {ad:?} and {bd:?} {dtype} on {}", label(dev));
        let out = op(&a, &b).map_err(fail(&what))?;
        let (want, od) = ref_binary(&a_host, ad, &b_host, bd, f);
        let got = download(&out, &od, dtype).map_err(|e| format!("{what}: {e}"))?;
        check_close(&what, &got, &want, Tol::EXACT)?;
    }
    Ok(())
}

fn check_where(
    dev: &Device,
    (cond_dtype, dtype): (DType, DType),
    [cd, ad, bd]: &[Vec<usize>; 3],
    seed: u64,
) -> Res<()> {
    let what = format!(
        "where_ of {cd:?} {cond_dtype}, {ad:?} and {bd:?} {dtype} on {}",
        label(dev)
    );
    let c_host = as_dtype(&cond_data(seed, numel(cd)), cond_dtype);
    let a_host = as_dtype(&grid_data(seed ^ 1, numel(ad), true), dtype);
    let b_host = as_dtype(&grid_data(seed ^ 2, numel(bd), true), dtype);
    let c = upload(dev, &c_host, cd, cond_dtype);
    let (a, b) = (
        upload(dev, &a_host, ad, dtype),
        upload(dev, &b_host, bd, dtype),
    );
    let out = Tensor::where_(&c, &a, &b).map_err(fail(&what))?;
    let (want, od) = ref_where((&c_host, cd), (&a_host, ad), (&b_host, bd));
    let got = download(&out, &od, dtype).map_err(|e| format!("{what}: {e}"))?;
    check_bits(&what, &got, &want)
}

fn check_masked_fill(
    dev: &Device,
    (mask_dtype, dtype): (DType, DType),
    dims: &[usize],
    md: &[usize],
    value: f32,
    seed: u64,
) -> Res<()> {
    let what = format!(
        "masked_fill of {dims:?} {dtype} with mask {md:?} {mask_dtype}, value {value} on {}",
        label(dev)
    );
    let m_host = as_dtype(&cond_data(seed, numel(md)), mask_dtype);
    let x_host = as_dtype(&grid_data(seed ^ 1, numel(dims), true), dtype);
    let m = upload(dev, &m_host, md, mask_dtype);
    let out = upload(dev, &x_host, dims, dtype)
        .masked_fill(&m, value)
        .map_err(fail(&what))?;
    let v = as_dtype(&[value], dtype);
    let (want, od) = ref_where((&m_host, md), (&v, &[]), (&x_host, dims));
    if od != dims {
        return Err(format!("{what}: test bug: the mask does not fit"));
    }
    let got = download(&out, dims, dtype).map_err(|e| format!("{what}: {e}"))?;
    check_bits(&what, &got, &want)
}

/// The (condition, values) dtype pairs: all four.
const DTYPE_PAIRS: [(DType, DType); 4] = [
    (DType::F32, DType::F32),
    (DType::F16, DType::F16),
    (DType::F32, DType::F16),
    (DType::F16, DType::F32),
];

fn abs_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(dims in shape(), seed in any::<u64>())| {
        for dtype in DTYPES {
            check_abs(dev, dtype, &dims, seed).map_err(TestCaseError::fail)?;
        }
    });
}

fn maximum_and_minimum_match_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        (ad, bd) in common::strategies::broadcast_pair(),
        seed in any::<u64>(),
    )| {
        for dtype in DTYPES {
            check_extrema(dev, dtype, &ad, &bd, seed).map_err(TestCaseError::fail)?;
        }
    });
}

fn where_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        shapes in broadcast_triple(),
        pair in 0usize..4,
        seed in any::<u64>(),
    )| {
        check_where(dev, DTYPE_PAIRS[pair], &shapes, seed).map_err(TestCaseError::fail)?;
    });
}

fn masked_fill_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        [dims, md, _] in broadcast_triple(),
        pair in 0usize..4,
        value in prop_oneof![Just(f32::NEG_INFINITY), Just(f32::NAN), -1e4f32..1e4],
        seed in any::<u64>(),
    )| {
        // The mask must broadcast to the tensor: pin the tensor to the full shape.
        let full = broadcast_dims(&dims, &md).unwrap();
        check_masked_fill(dev, DTYPE_PAIRS[pair], &full, &md, value, seed)
            .map_err(TestCaseError::fail)?;
    });
}

/// Sizes around the pair and the workgroup, and empty tensors.
fn selection_edge_shapes(dev: &Device) {
    let shapes: &[&[usize]] = &[
        &[],
        &[1],
        &[2],
        &[3],
        &[0],
        &[255],
        &[513],
        &[3, 0, 2],
        &[7, 37],
    ];
    for dtype in DTYPES {
        for (i, &d) in shapes.iter().enumerate() {
            let seed = i as u64;
            check_abs(dev, dtype, d, seed).unwrap_or_else(|e| panic!("{e}"));
            check_extrema(dev, dtype, d, d, seed).unwrap_or_else(|e| panic!("{e}"));
            check_extrema(dev, dtype, d, &[], seed).unwrap_or_else(|e| panic!("{e}"));
            let three = [d.to_vec(), d.to_vec(), vec![]];
            for pair in DTYPE_PAIRS {
                check_where(dev, pair, &three, seed).unwrap_or_else(|e| panic!("{e}"));
                check_masked_fill(dev, pair, d, d, -1.5, seed).unwrap_or_else(|e| panic!("{e}"));
            }
        }
    }
}

fn selection_ops_are_bitwise_repeatable(dev: &Device) {
    for dtype in DTYPES {
        let a = upload(dev, &host_data(1, 60, -3.0, 3.0), &[3, 4, 5], dtype);
        let b = upload(dev, &host_data(2, 5, -3.0, 3.0), &[5], dtype);
        let c = upload(dev, &cond_data(3, 20), &[4, 5], DType::F32);
        let run = || -> Vec<u32> {
            let m = a.maximum(&b).unwrap().minimum(&a.abs().unwrap()).unwrap();
            let w = Tensor::where_(&c, &m, &b)
                .unwrap()
                .masked_fill(&c, 0.5)
                .unwrap();
            w.to_vec_f32()
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
fn selection_errors_are_typed() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let x = Tensor::zeros(&dev, &[2, 3], DType::F32).unwrap();
    let h = Tensor::zeros(&dev, &[2, 3], DType::F16).unwrap();
    let y = Tensor::zeros(&dev, &[4], DType::F32).unwrap();
    let big = Tensor::zeros(&dev, &[5, 2, 3], DType::F32).unwrap();
    let shape = |e: &Error| matches!(e, Error::Shape { .. });
    let dtype = |e: &Error| matches!(e, Error::DType { .. });
    assert_err(x.maximum(&y), "maximum of (2,3) and (4)", shape);
    assert_err(x.minimum(&h), "minimum of f32 and f16", dtype);
    assert_err(Tensor::where_(&x, &x, &y), "where_ with (4)", shape);
    assert_err(
        Tensor::where_(&y, &x, &x),
        "where_ with a (4) condition",
        shape,
    );
    assert_err(Tensor::where_(&x, &x, &h), "where_ of f32 and f16", dtype);
    assert_err(x.masked_fill(&y, 0.0), "masked_fill with a (4) mask", shape);
    assert_err(
        x.masked_fill(&big, 0.0),
        "masked_fill with a larger mask",
        shape,
    );
    // An f16 condition or mask on f32 values is fine.
    assert!(Tensor::where_(&h, &x, &x).is_ok());
    assert!(x.masked_fill(&h, 1.0).is_ok());
    if let Some(other) = common::fresh_device(Default::default()) {
        let z = Tensor::zeros(&other, &[2, 3], DType::F32).unwrap();
        let dm = |e: &Error| matches!(e, Error::DeviceMismatch { .. });
        assert_err(x.maximum(&z), "maximum across devices", dm);
        assert_err(
            Tensor::where_(&z, &x, &x),
            "where_ condition on another device",
            dm,
        );
        assert_err(
            Tensor::where_(&x, &x, &z),
            "where_ values across devices",
            dm,
        );
        assert_err(
            x.masked_fill(&z, 0.0),
            "masked_fill mask on another device",
            dm,
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Gradients
// ---------------------------------------------------------------------------------------------

/// A small shape (dims 1..=4, rank 0..=3).
fn small_shape() -> impl Strategy<Value = Vec<usize>> {
    (0usize..=3)
        .prop_flat_map(|r| prop::collection::vec(1usize..=4, r))
        .prop_map(|d| cap(d, 64))
}

/// Two shapes that broadcast together (either side may broadcast or be rank 0).
fn small_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    (small_shape(), any::<u64>()).prop_map(|(out, bits)| {
        let derive = |bits: u64| -> Vec<usize> {
            let drop = if bits & 8 == 0 {
                0
            } else {
                (bits & 7) as usize % (out.len() + 1)
            };
            out[drop..]
                .iter()
                .enumerate()
                .map(|(i, &d)| if (bits >> (4 + 2 * i)) & 3 == 0 { 1 } else { d })
                .collect()
        };
        (derive(bits), derive(bits >> 16))
    })
}

fn check_selection_grads(
    dev: &Device,
    (ad, bd): (&[usize], &[usize]),
    bits: u64,
    seed: u64,
) -> Res<()> {
    // Grid values: ties between the operands and zeros are frequent, other values 0.25 apart.
    let a = grid_data(seed, numel(ad), false);
    let b = grid_data(seed ^ 1, numel(bd), false);
    let (a_d, b_d) = (ad.to_vec(), bd.to_vec());
    check_grads(
        dev,
        &format!("abs of {ad:?}"),
        &[input(a.clone(), ad, true)],
        seed,
        &|t| t[0].abs(),
        &|xs| xs[0].iter().map(|v| v.abs()).collect(),
    )?;
    let (ga, gb) = (bits & 1 == 0, bits & 2 == 0 || bits & 1 == 1);
    let ops: [(&str, BinOp, Ref64); 2] = [
        ("maximum", Tensor::maximum, f64::max),
        ("minimum", Tensor::minimum, f64::min),
    ];
    for (name, op, f) in ops {
        check_grads(
            dev,
            &format!("{name} of {ad:?} and {bd:?}"),
            &[input(a.clone(), ad, ga), input(b.clone(), bd, gb)],
            seed,
            &|t| op(&t[0], &t[1]),
            &|xs| ref_binary64(&xs[0], &a_d, &xs[1], &b_d, f),
        )?;
    }
    // where_: the condition broadcast over one operand's shape, the other operand's shape.
    let c = cond_data(seed ^ 2, numel(ad));
    let c2 = c.clone();
    check_grads(
        dev,
        &format!("where_ of {ad:?} over {ad:?} and {bd:?}"),
        &[
            input(c, ad, false),
            input(a.clone(), ad, ga),
            input(b.clone(), bd, gb),
        ],
        seed,
        &|t| Tensor::where_(&t[0], &t[1], &t[2]),
        &|xs| ref_where((&c2, &a_d), (&xs[1], &a_d), (&xs[2], &b_d)).0,
    )?;
    // masked_fill of the full shape with a mask of a's shape.
    let full = broadcast_dims(ad, bd).unwrap();
    let x = grid_data(seed ^ 3, numel(&full), false);
    let m = cond_data(seed ^ 4, numel(ad));
    let full2 = full.clone();
    check_grads(
        dev,
        &format!("masked_fill of {full:?} with a {ad:?} mask"),
        &[input(x, &full, true)],
        seed,
        &|t| {
            let mask = upload(dev, &m, &a_d, DType::F32);
            t[0].masked_fill(&mask, 3.0)
        },
        &|xs| ref_where((&m, &a_d), (&[3.0f64][..], &[]), (&xs[0], &full2)).0,
    )
}

/// `f(a, b)` with numpy broadcasting, in f64.
fn ref_binary64(
    a: &[f64],
    ad: &[usize],
    b: &[f64],
    bd: &[usize],
    f: fn(f64, f64) -> f64,
) -> Vec<f64> {
    let od = broadcast_dims(ad, bd).unwrap();
    (0..numel(&od))
        .map(|lin| {
            let idx = unravel(lin, &od);
            f(a[bcast_index(&idx, ad)], b[bcast_index(&idx, bd)])
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn selection_gradients_match_finite_differences(
        (ad, bd) in small_pair(),
        bits in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let Some(dev) = devices().into_iter().next() else { return Ok(()) };
        check_selection_grads(&dev, (&ad, &bd), bits, seed).map_err(TestCaseError::fail)?;
    }
}

/// Ties split the gradient evenly, as torch does; a zero gets none from abs.
#[test]
fn ties_split_and_zero_has_no_abs_gradient() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let a = Tensor::from_slice(&dev, &[1.0f32, 2.0, 3.0, 0.0], &[4])
        .unwrap()
        .with_requires_grad();
    let b = Tensor::from_slice(&dev, &[1.0f32, 5.0, -1.0, 0.0], &[4])
        .unwrap()
        .with_requires_grad();
    a.maximum(&b).unwrap().sum().unwrap().backward().unwrap();
    assert_eq!(
        a.grad().unwrap().to_vec::<f32>().unwrap(),
        [0.5, 0.0, 1.0, 0.5]
    );
    assert_eq!(
        b.grad().unwrap().to_vec::<f32>().unwrap(),
        [0.5, 1.0, 0.0, 0.5]
    );
    a.zero_grad();
    b.zero_grad();
    a.minimum(&b).unwrap().sum().unwrap().backward().unwrap();
    assert_eq!(
        a.grad().unwrap().to_vec::<f32>().unwrap(),
        [0.5, 1.0, 0.0, 0.5]
    );
    assert_eq!(
        b.grad().unwrap().to_vec::<f32>().unwrap(),
        [0.5, 0.0, 1.0, 0.5]
    );
    a.zero_grad();
    a.abs().unwrap().sum().unwrap().backward().unwrap();
    assert_eq!(
        a.grad().unwrap().to_vec::<f32>().unwrap(),
        [1.0, 1.0, 1.0, 0.0]
    );
    // The condition of where_ gets no gradient, even when it requires one.
    let c = Tensor::from_slice(&dev, &[1.0f32, 0.0, 1.0, 0.0], &[4])
        .unwrap()
        .with_requires_grad();
    a.zero_grad();
    Tensor::where_(&c, &a, &b)
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert!(c.grad().is_none());
    assert_eq!(
        a.grad().unwrap().to_vec::<f32>().unwrap(),
        [1.0, 0.0, 1.0, 0.0]
    );
}
