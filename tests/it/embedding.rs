//! index_select (the embedding lookup) and its scatter-add backward against plain loops on every
//! device in f32 and f16: random tables of rank 1-4 and id lists (repeats, rows never used, one
//! row, odd sizes, lengths around the workgroup, empty), finite differences, bitwise
//! repeatability, the errors (checked before any device work), and `nn::Embedding`.

use crate::common;

use common::gradcheck::{check_grads, input};
use common::strategies::cap;
use common::*;
use fitgrad::nn::{Embedding, Module};
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};
use proptest::prelude::*;

device_tests!(
    index_select_matches_reference,
    index_select_fixed_shapes,
    index_select_is_bitwise_repeatable,
    embedding_layer
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

/// out (n, d) = table rows `ids`; the table is (v, d) flattened.
fn ref_gather(table: &[f32], d: usize, ids: &[u32]) -> Vec<f32> {
    let mut out = Vec::with_capacity(ids.len() * d);
    for &id in ids {
        for j in 0..d {
            out.push(table[id as usize * d + j]);
        }
    }
    out
}

/// The table's gradient (v, d): rows of `g` (n, d) added into rows `ids`, in increasing
/// position, in f32 (the kernel's order, so the result is exact), then rounded to `dtype`.
fn ref_scatter(g: &[f32], v: usize, d: usize, ids: &[u32], dtype: DType) -> Vec<f32> {
    let mut out = vec![0.0f32; v * d];
    for (i, &id) in ids.iter().enumerate() {
        for j in 0..d {
            out[id as usize * d + j] += g[i * d + j];
        }
    }
    as_dtype(&out, dtype)
}

/// Forward and backward of `table.index_select(ids)` on one device, compared exactly.
fn check(dev: &Device, dtype: DType, dims: &[usize], ids: &[u32], seed: u64) -> Result<(), String> {
    let what = format!(
        "index_select {dims:?} of {} ids {dtype} on {}",
        ids.len(),
        label(dev)
    );
    let (v, d) = (dims[0], dims[1..].iter().product::<usize>());
    let host = as_dtype(&host_data(seed, numel(dims), -4.0, 4.0), dtype);
    let table = upload(dev, &host, dims, dtype).with_requires_grad();
    let out = table
        .index_select(ids)
        .map_err(|e| format!("{what}: {e}"))?;
    let mut out_dims = dims.to_vec();
    out_dims[0] = ids.len();
    let got = download(&out, &out_dims, dtype).map_err(|e| format!("{what}: {e}"))?;
    check_close(&what, &got, &ref_gather(&host, d, ids), Tol::EXACT)?;

    let g_host = as_dtype(&host_data(seed ^ 1, ids.len() * d, -1.0, 1.0), dtype);
    let g = upload(dev, &g_host, &out_dims, dtype);
    out.backward_with(g)
        .map_err(|e| format!("{what}: backward: {e}"))?;
    let grad = table.grad().ok_or(format!("{what}: no gradient"))?;
    let got = download(&grad, dims, dtype).map_err(|e| format!("{what}: grad: {e}"))?;
    let want = ref_scatter(&g_host, v, d, ids, dtype);
    check_close(&format!("{what}: grad"), &got, &want, Tol::EXACT)
}

/// `n` ids below `v`, drawn from `seed`; with `few` they crowd onto a few rows (many repeats).
fn ids_for(seed: u64, n: usize, v: usize, few: bool) -> Vec<u32> {
    let mut r = HostRng::new(seed);
    let span = if few { v.min(3) } else { v } as u64;
    (0..n).map(|_| (r.next_u64() % span) as u32).collect()
}

fn index_select_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        v in prop_oneof![Just(1usize), 2usize..40, Just(257usize)],
        rest in prop::collection::vec(prop_oneof![Just(1usize), 2usize..9, Just(33usize), Just(257usize)], 0..=3),
        n in prop_oneof![Just(0usize), Just(1usize), 2usize..40, Just(513usize)],
        few in any::<bool>(),
        seed in any::<u64>(),
    )| {
        let mut dims = vec![v];
        dims.extend(rest);
        let dims = cap(dims, 4000);
        let n = n.min(8000 / dims[1..].iter().product::<usize>().max(1)).max(usize::from(n > 0));
        let ids = ids_for(seed, n, dims[0], few);
        for dtype in DTYPES {
            check(dev, dtype, &dims, &ids, seed).map_err(TestCaseError::fail)?;
        }
    });
}

/// Edges the random cases may miss: one row of one element, empty id lists, a table with no
/// columns, every id on one row (a long sum), and pairs of outputs that straddle rows.
fn index_select_fixed_shapes(dev: &Device) {
    let cases: &[(&[usize], &[u32])] = &[
        (&[1], &[0, 0, 0]),
        (&[1, 1], &[0]),
        (&[5, 3], &[]),
        (&[0, 4], &[]),
        (&[4, 0], &[1, 3, 3]),
        (
            &[3, 7],
            &[2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
        ),
        (&[6, 3, 3], &[5, 0, 4, 0, 1]),
        (&[2, 2, 3, 1], &[1, 0, 1]),
    ];
    for dtype in DTYPES {
        for (k, (dims, ids)) in cases.iter().enumerate() {
            check(dev, dtype, dims, ids, 40 + k as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// The lookup's gradient against central differences (f32, small shapes).
#[test]
fn index_select_gradient_matches_finite_differences() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    for (k, (dims, ids)) in [
        (vec![4usize, 3], vec![1u32, 3, 1, 0, 1]),
        (vec![5], vec![4, 4, 2]),
        (vec![3, 2, 2], vec![2, 0]),
    ]
    .into_iter()
    .enumerate()
    {
        let d: usize = dims[1..].iter().product();
        let data = host_data(k as u64, numel(&dims), -2.0, 2.0);
        let ids2 = ids.clone();
        check_grads(
            &dev,
            &format!("index_select {dims:?} ids {ids:?}"),
            &[input(data, &dims, true)],
            k as u64,
            &|t| t[0].index_select(&ids),
            &|x| {
                ids2.iter()
                    .flat_map(|&id| (0..d).map(move |j| x[0][id as usize * d + j]))
                    .collect()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// The same lookup and backward twice give the same bits (many repeated ids: long sums).
fn index_select_is_bitwise_repeatable(dev: &Device) {
    for dtype in DTYPES {
        let ids = ids_for(9, 700, 5, false);
        let host = host_data(3, 5 * 37, -3.0, 3.0);
        let g_host = host_data(4, 700 * 37, -1.0, 1.0);
        let run = || {
            let t = upload(dev, &host, &[5, 37], dtype).with_requires_grad();
            let out = t.index_select(&ids).unwrap();
            out.backward_with(upload(dev, &g_host, &[700, 37], dtype))
                .unwrap();
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            (
                bits(out.to_vec_f32().unwrap()),
                bits(t.grad().unwrap().to_vec_f32().unwrap()),
            )
        };
        assert_eq!(run(), run(), "index_select {dtype} on {}", label(dev));
    }
}

/// Ids out of range and rank-0 tables are typed errors, raised before anything is allocated.
#[test]
fn index_select_errors_come_before_device_work() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let table = Tensor::zeros(&dev, &[4, 3], DType::F32).unwrap();
    let scalar = Tensor::scalar(&dev, 1.0f32).unwrap();
    let before = dev.memory_stats().allocations;
    match table.index_select(&[0, 3, 4, 1]) {
        Err(Error::InvalidArgument { op, reason }) => {
            assert_eq!(op, "index_select");
            assert!(
                reason.contains("id 4") && reason.contains("4 rows"),
                "{reason}"
            );
            assert!(reason.contains("position 2"), "{reason}");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(matches!(
        table.index_select(&[u32::MAX]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        scalar.index_select(&[0]),
        Err(Error::Shape { .. })
    ));
    assert_eq!(dev.memory_stats().allocations, before);
    let emb = Embedding::new(&dev, 4, 3, 0).unwrap();
    let before_emb = dev.memory_stats().allocations;
    assert!(matches!(
        emb.forward_ids(&[1, 2, 3], &[2, 2]),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        emb.forward_ids(&[1; 16], &[2, 2, 2, 2]),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        emb.forward_ids(&[9], &[1]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        emb.forward(&table),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(dev.memory_stats().allocations, before_emb);
    assert!(matches!(
        Embedding::new(&dev, 0, 3, 0),
        Err(Error::InvalidArgument { .. })
    ));
}

/// `nn::Embedding`: N(0, 1) init from its seed, (dims.., D) outputs, gradients that add up for
/// repeated ids and accumulate across backward calls.
fn embedding_layer(dev: &Device) {
    let (v, d) = (6, 5);
    let emb = Embedding::new(dev, v, d, 11).unwrap();
    assert_eq!(emb.weight.dims(), [v, d]);
    let want = Tensor::randn(dev, &[v, d], 0.0, 1.0, 11, DType::F32).unwrap();
    let table = emb.weight.to_vec_f32().unwrap();
    assert_eq!(table, want.to_vec_f32().unwrap());
    assert_eq!(emb.named_parameters()[0].0, "weight");

    // ids (2, 3) -> (2, 3, D); row 1 three times, row 4 twice, row 0 once.
    let ids = [1u32, 4, 1, 0, 1, 4];
    let out = emb.forward_ids(&ids, &[2, 3]).unwrap();
    assert_eq!(out.dims(), [2, 3, d]);
    assert_eq!(out.to_vec_f32().unwrap(), ref_gather(&table, d, &ids));
    out.sum().unwrap().backward().unwrap();
    let counts = [1.0f32, 3.0, 0.0, 0.0, 2.0, 0.0];
    let want: Vec<f32> = counts.iter().flat_map(|&c| [c; 5]).collect();
    assert_eq!(emb.weight.grad().unwrap().to_vec_f32().unwrap(), want);
    // A second backward adds to the gradient.
    emb.forward_ids(&[2, 1], &[2])
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    let mut want2 = want.clone();
    for j in 0..d {
        want2[2 * d + j] += 1.0;
        want2[d + j] += 1.0;
    }
    assert_eq!(emb.weight.grad().unwrap().to_vec_f32().unwrap(), want2);
    emb.zero_grad();
    assert!(emb.weight.grad().is_none());
}
