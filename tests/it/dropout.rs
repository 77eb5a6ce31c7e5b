//! dropout against a host reference that computes the same integer hash, on every device in f32
//! and f16: the exact mask on random shapes (rank 0-4, odd sizes, around the workgroup, empty)
//! and probabilities, the scaled values, the backward (the same mask regenerated from the seed),
//! finite differences, the kept fraction, bitwise repeatability, p = 0, the errors, and
//! `nn::Dropout` (eval identity, a new mask per training call, reproducible from the seed,
//! replayable with `next_seed` / `forward_with_seed`).

use crate::common;

use common::gradcheck::{check_grads, input};
use common::strategies::shape;
use common::*;
use fitgrad::nn::{Dropout, Module};
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};
use proptest::prelude::*;

device_tests!(
    dropout_matches_reference,
    dropout_fixed_shapes,
    dropout_seeds_and_p_zero,
    dropout_layer
);

const DTYPES: [DType; 2] = [DType::F32, DType::F16];

/// lowbias32.
fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^= x >> 16;
    x
}

/// Whether dropout with (`p`, `seed`) keeps element `i`, as documented on `Tensor::dropout`.
fn keeps(p: f32, seed: u64, i: usize) -> bool {
    let key = mix(seed as u32 ^ mix((seed >> 32) as u32 ^ 0x9e37_79b9));
    let bits = mix(mix(i as u32 ^ key).wrapping_add(key));
    let threshold = ((p as f64 * 4_294_967_296.0).round()).min(u32::MAX as f64) as u32;
    bits >= threshold
}

/// x * mask * 1 / (1 - p), in f32, rounded to `dtype`.
fn ref_dropout(x: &[f32], p: f32, seed: u64, dtype: DType) -> Vec<f32> {
    let scale = (1.0 / (1.0 - p as f64)) as f32;
    let out: Vec<f32> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| v * if keeps(p, seed, i) { scale } else { 0.0 })
        .collect();
    as_dtype(&out, dtype)
}

/// Forward and backward of one case: the zeros must sit exactly where the reference mask drops
/// (inputs are never 0), the kept values must be the scaled inputs.
fn check(dev: &Device, dtype: DType, dims: &[usize], p: f32, seed: u64) -> Result<(), String> {
    let what = format!(
        "dropout {dims:?} p {p} seed {seed:#x} {dtype} on {}",
        label(dev)
    );
    let n = numel(dims);
    let host = as_dtype(&host_data_away_from_zero(seed, n, 0.5, 4.0), dtype);
    let x = upload(dev, &host, dims, dtype).with_requires_grad();
    let y = x.dropout(p, seed).map_err(|e| format!("{what}: {e}"))?;
    let got = download(&y, dims, dtype).map_err(|e| format!("{what}: {e}"))?;
    let want = ref_dropout(&host, p, seed, dtype);
    if let Some(i) = (0..n).find(|&i| (got[i] == 0.0) != (want[i] == 0.0)) {
        return Err(format!(
            "{what}: the mask differs at {i}: got {}, expected {}",
            got[i], want[i]
        ));
    }
    check_close(&what, &got, &want, Tol::elementwise(dtype))?;
    let g_host = as_dtype(&host_data_away_from_zero(seed ^ 5, n, 0.5, 2.0), dtype);
    y.backward_with(upload(dev, &g_host, dims, dtype))
        .map_err(|e| format!("{what}: backward: {e}"))?;
    let dx = x.grad().ok_or(format!("{what}: no gradient"))?;
    let got = download(&dx, dims, dtype).map_err(|e| format!("{what}: {e}"))?;
    let want = ref_dropout(&g_host, p, seed, dtype);
    if let Some(i) = (0..n).find(|&i| (got[i] == 0.0) != (want[i] == 0.0)) {
        return Err(format!("{what}: the backward's mask differs at {i}"));
    }
    check_close(&format!("{what}: dx"), &got, &want, Tol::elementwise(dtype))
}

fn dropout_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(16), |(
        dims in shape(),
        p in prop::sample::select(vec![1e-6f32, 0.1, 0.5, 0.9, 0.999]),
        seed in any::<u64>(),
    )| {
        for dtype in DTYPES {
            check(dev, dtype, &dims, p, seed).map_err(TestCaseError::fail)?;
        }
    });
}

/// Rank 0, one element, empty, odd counts and counts around the workgroup's 512 elements.
fn dropout_fixed_shapes(dev: &Device) {
    let shapes: &[&[usize]] = &[
        &[],
        &[1],
        &[0],
        &[3, 0],
        &[7],
        &[511],
        &[512],
        &[513],
        &[3, 5, 7],
    ];
    for dtype in DTYPES {
        for (k, dims) in shapes.iter().enumerate() {
            check(dev, dtype, dims, 0.3, 0xDEAD_BEEF_0000_0000 + k as u64)
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// The gradient against central differences (the mask is a constant of the seed).
#[test]
fn dropout_gradient_matches_finite_differences() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    for (dims, p, seed) in [(vec![3usize, 5], 0.4f32, 1u64), (vec![17], 0.7, u64::MAX)] {
        let n = numel(&dims);
        check_grads(
            &dev,
            &format!("dropout {dims:?} p {p}"),
            &[input(host_data(seed, n, -2.0, 2.0), &dims, true)],
            seed,
            &|t| t[0].dropout(p, seed),
            &|x| {
                let scale = 1.0 / (1.0 - p as f64);
                (0..n)
                    .map(|i| {
                        if keeps(p, seed, i) {
                            x[0][i] * scale
                        } else {
                            0.0
                        }
                    })
                    .collect()
            },
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// About 1 - p of the elements are kept, for several p and seeds; the hash is not biased
/// toward some indices (first and second halves keep alike).
#[test]
fn dropout_keeps_about_one_minus_p() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let n = 20_000;
    let x = Tensor::ones(&dev, &[n], DType::F32).unwrap();
    for (p, seed) in [(0.1f32, 0u64), (0.5, 1), (0.5, 1 << 32), (0.9, 12345)] {
        let y = x.dropout(p, seed).unwrap().to_vec_f32().unwrap();
        for half in y.chunks(n / 2) {
            let kept = half.iter().filter(|&&v| v != 0.0).count() as f64 / half.len() as f64;
            // 5 standard deviations of a binomial fraction over 10,000 draws.
            let sd = ((p * (1.0 - p)) as f64 / half.len() as f64).sqrt();
            assert!(
                (kept - (1.0 - p as f64)).abs() < 5.0 * sd,
                "p {p} seed {seed}: kept {kept}"
            );
        }
    }
}

/// The same seed gives the same bits; another seed (either half) another mask; p = 0 is the
/// input itself.
fn dropout_seeds_and_p_zero(dev: &Device) {
    for dtype in DTYPES {
        let host = host_data(8, 1001, -2.0, 2.0);
        let x = upload(dev, &host, &[7, 143], dtype);
        let bits = |t: Tensor| {
            t.to_vec_f32()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect::<Vec<_>>()
        };
        let a = bits(x.dropout(0.5, 42).unwrap());
        assert_eq!(
            a,
            bits(x.dropout(0.5, 42).unwrap()),
            "{dtype} on {}",
            label(dev)
        );
        assert_ne!(a, bits(x.dropout(0.5, 43).unwrap()));
        assert_ne!(a, bits(x.dropout(0.5, 42 | 1 << 40).unwrap()));
        assert_eq!(bits(x.dropout(0.0, 42).unwrap()), bits(x.clone()));
    }
}

/// p outside [0, 1) is an error before any device work.
#[test]
fn dropout_errors_come_before_device_work() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let x = Tensor::zeros(&dev, &[4], DType::F32).unwrap();
    let before = dev.memory_stats().allocations;
    for p in [-0.1f32, 1.0, 1.5, f32::NAN, f32::INFINITY] {
        assert!(
            matches!(x.dropout(p, 0), Err(Error::InvalidArgument { .. })),
            "p {p}"
        );
        assert!(
            matches!(Dropout::new(p, 0), Err(Error::InvalidArgument { .. })),
            "p {p}"
        );
    }
    assert_eq!(dev.memory_stats().allocations, before);
}

/// `nn::Dropout`: training by default with a new mask per call, the same sequence of masks
/// from the same seed, replay through `next_seed` / `forward_with_seed`, the identity in eval
/// mode (without using up a mask), and gradients through the layer.
fn dropout_layer(dev: &Device) {
    let host = host_data_away_from_zero(3, 600, 0.5, 2.0);
    let x = upload(dev, &host, &[20, 30], DType::F32);
    let read = |t: Tensor| t.to_vec_f32().unwrap();
    let d = Dropout::new(0.4, 9).unwrap();
    assert!(d.is_training());
    assert!(d.named_parameters().is_empty());
    let s0 = d.peek_seed();
    assert_eq!(d.peek_seed(), s0, "peek_seed does not use up a seed");
    let y1 = read(d.forward(&x).unwrap());
    let y2 = read(d.forward(&x).unwrap());
    assert_ne!(y1, y2, "each training call draws a new mask");
    assert_eq!(d.calls(), 2);
    assert_eq!(y1, ref_dropout(&host, 0.4, s0, DType::F32));
    assert_eq!(y2, ref_dropout(&host, 0.4, d.seed_for_call(1), DType::F32));

    // The same seed replays the same sequence.
    let e = Dropout::new(0.4, 9).unwrap();
    assert_eq!(read(e.forward(&x).unwrap()), y1);
    assert_eq!(read(e.forward(&x).unwrap()), y2);
    assert_ne!(Dropout::new(0.4, 10).unwrap().peek_seed(), s0);

    // A mask taken once can be applied again (what checkpointing needs).
    let s = d.next_seed();
    let r1 = read(d.forward_with_seed(&x, s).unwrap());
    assert_eq!(read(d.forward_with_seed(&x, s).unwrap()), r1);
    assert_eq!(d.calls(), 3);

    // Eval: the identity, and no mask is used up.
    d.set_training(false);
    assert!(!d.is_training());
    assert_eq!(read(d.forward(&x).unwrap()), host);
    assert_eq!(read(d.forward_with_seed(&x, s).unwrap()), host);
    assert_eq!(d.calls(), 3);
    d.set_training(true);
    let y4 = read(d.forward(&x).unwrap());
    assert_eq!(y4, ref_dropout(&host, 0.4, d.seed_for_call(3), DType::F32));

    // Gradients flow through the mask.
    let xg = x.detach().with_requires_grad();
    let seed = d.peek_seed();
    d.forward(&xg).unwrap().sum().unwrap().backward().unwrap();
    let ones = vec![1.0f32; 600];
    assert_eq!(
        read(xg.grad().unwrap()),
        ref_dropout(&ones, 0.4, seed, DType::F32)
    );
}
