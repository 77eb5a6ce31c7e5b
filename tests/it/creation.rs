//! Creating tensors: zeros / ones / full, from_slice / to_vec round trips, scalar, reshape, and
//! the seeded random constructors, on every device and in f32 and f16.

use crate::common;

use common::strategies::shape;
use common::*;
use fitgrad::{DType, Device, DeviceOptions, Tensor};
use half::f16;
use proptest::prelude::*;

device_tests!(
    zeros_ones_full,
    from_slice_to_vec_round_trip,
    round_trip_odd_lengths,
    scalar_and_item,
    reused_blocks_hold_the_new_contents,
    random_different_seeds_differ,
    rand_uniform_values_are_in_range,
    rand_uniform_f16_values_are_in_closed_range,
    rand_uniform_f16_values_are_below_high,
    randn_mean_and_std,
    copy_duplicates_data
);

/// The bits a tensor of `dtype` holding `v` has, widened to u32 for comparison.
fn bits_in(dtype: DType, v: f32) -> u32 {
    match dtype {
        DType::F32 => v.to_bits(),
        DType::F16 => f16::from_f32(v).to_bits() as u32,
    }
}

fn read_bits(t: &Tensor) -> Vec<u32> {
    match t.dtype() {
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::F16 => t
            .to_vec::<f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
    }
}

/// Every element of `t` has exactly the bits of `v` in its dtype.
fn check_filled(what: &str, t: &Tensor, dims: &[usize], v: f32) -> Result<(), String> {
    if t.dims() != dims {
        return Err(format!("{what}: dims {:?}, expected {dims:?}", t.dims()));
    }
    let want = bits_in(t.dtype(), v);
    let got = read_bits(t);
    if got.len() != numel(dims) {
        return Err(format!("{what}: {} values for {dims:?}", got.len()));
    }
    match got.iter().position(|&b| b != want) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i} has bits {:#x}, expected {want:#x} ({v})",
            got[i]
        )),
    }
}

fn zeros_ones_full(dev: &Device) {
    proptest!(ProptestConfig::with_cases(24), |(
        dims in shape(),
        v in prop_oneof![Just(0.1f32), Just(-3.7f32), Just(1e-3f32), Just(65504.0f32), -1e3f32..1e3],
    )| {
        for &dtype in dtypes(dev) {
            let what = |op: &str| format!("{op} {dims:?} {dtype} on {}", label(dev));
            let z = Tensor::zeros(dev, &dims, dtype).unwrap();
            check_filled(&what("zeros"), &z, &dims, 0.0).map_err(TestCaseError::fail)?;
            let o = Tensor::ones(dev, &dims, dtype).unwrap();
            check_filled(&what("ones"), &o, &dims, 1.0).map_err(TestCaseError::fail)?;
            let f = Tensor::full(dev, &dims, v, dtype).unwrap();
            check_filled(&what(&format!("full({v})")), &f, &dims, v)
                .map_err(TestCaseError::fail)?;
        }
    });
}

fn from_slice_to_vec_round_trip(dev: &Device) {
    proptest!(ProptestConfig::with_cases(24), |(dims in shape(), seed in any::<u64>())| {
        let n = numel(&dims);
        // Arbitrary bit patterns (NaN payloads included) must survive bitwise.
        let mut r = HostRng::new(seed);
        let raw32: Vec<f32> = (0..n).map(|_| f32::from_bits(r.next_u64() as u32)).collect();
        let raw16: Vec<f16> = (0..n).map(|_| f16::from_bits(r.next_u64() as u16)).collect();
        let what = format!("{dims:?} on {}", label(dev));
        let t = Tensor::from_slice(dev, &raw32, &dims).unwrap();
        prop_assert_eq!(t.dims(), &dims[..], "{}", what);
        prop_assert_eq!(t.dtype(), DType::F32);
        prop_assert_eq!(t.numel(), n);
        prop_assert_eq!(t.rank(), dims.len());
        let back = t.to_vec::<f32>().unwrap();
        prop_assert!(
            back.iter().map(|v| v.to_bits()).eq(raw32.iter().map(|v| v.to_bits())),
            "f32 round trip {}", what
        );
        let h = Tensor::from_slice(dev, &raw16, &dims).unwrap();
        prop_assert_eq!(h.dtype(), DType::F16);
        let back = h.to_vec::<f16>().unwrap();
        prop_assert!(
            back.iter().map(|v| v.to_bits()).eq(raw16.iter().map(|v| v.to_bits())),
            "f16 round trip {}", what
        );
        let f = h.to_vec_f32().unwrap();
        prop_assert!(
            f.iter().zip(&raw16).all(|(a, b)| {
                let b = b.to_f32();
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
            }),
            "to_vec_f32 of f16 {}", what
        );
    });
}

/// Lengths that end in the middle of a packed f16 pair or a 4-byte word, and around workgroups.
fn round_trip_odd_lengths(dev: &Device) {
    for n in [
        0usize, 1, 2, 3, 5, 255, 256, 257, 511, 512, 513, 1025, 20_001,
    ] {
        let xs = host_data(n as u64, n, -100.0, 100.0);
        let t = upload(dev, &xs, &[n], DType::F32);
        assert_eq!(
            t.to_vec::<f32>().unwrap(),
            xs,
            "f32 [{n}] on {}",
            label(dev)
        );
        let h: Vec<f16> = xs.iter().map(|&v| f16::from_f32(v)).collect();
        let t = Tensor::from_slice(dev, &h, &[n]).unwrap();
        assert_eq!(t.to_vec::<f16>().unwrap(), h, "f16 [{n}] on {}", label(dev));
        // And an op reading the packed tail sees the right values.
        let y = t.add_scalar(0.0).unwrap().to_vec::<f16>().unwrap();
        assert_eq!(y, h, "f16 [{n}] + 0 on {}", label(dev));
    }
}

fn scalar_and_item(dev: &Device) {
    let s = Tensor::scalar(dev, 2.5f32).unwrap();
    assert_eq!(s.dims(), &[] as &[usize]);
    assert_eq!(s.numel(), 1);
    assert_eq!(s.item().unwrap(), 2.5);
    let h = Tensor::scalar(dev, f16::from_f32(-0.1)).unwrap();
    assert_eq!(h.dtype(), DType::F16);
    assert_eq!(h.item().unwrap(), f16::from_f32(-0.1).to_f32());
    let one = Tensor::ones(dev, &[1, 1, 1, 1], DType::F32).unwrap();
    assert_eq!(one.item().unwrap(), 1.0);
}

/// A block handed back to the arena and reused by zeros() reads as zeros, and one reused by
/// from_slice() holds the uploaded data even though work that wrote the old tensor was still
/// pending (not yet submitted) when it was dropped.
fn reused_blocks_hold_the_new_contents(dev: &Device) {
    for &dtype in dtypes(dev) {
        let what = format!("{dtype} on {}", label(dev));
        for _ in 0..5 {
            let x = Tensor::full(dev, &[1000], 7.0, dtype).unwrap();
            let y = x.add_scalar(1.0).unwrap(); // recorded, not submitted
            drop(y);
            drop(x);
            let z = Tensor::zeros(dev, &[1000], dtype).unwrap();
            check_filled(&format!("zeros after reuse, {what}"), &z, &[1000], 0.0).unwrap();
            let x = Tensor::full(dev, &[1000], 7.0, dtype).unwrap();
            let y = x.mul_scalar(3.0).unwrap();
            drop(y);
            let data = host_data(3, 1000, -1.0, 1.0);
            let u = upload(dev, &data, &[1000], dtype);
            let got = u.to_vec_f32().unwrap();
            assert_close(
                &format!("upload after reuse, {what}"),
                &got,
                &as_dtype(&data, dtype),
                Tol::EXACT,
            );
            check_filled(&format!("the original, {what}"), &x, &[1000], 7.0).unwrap();
        }
    }
}

/// reshape shares the block: no allocation, the same bytes, and it outlives the original.
#[test]
fn reshape_shares_data() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    for &dtype in dtypes(&dev) {
        let data = host_data(11, 24, -5.0, 5.0);
        let x = upload(&dev, &data, &[2, 3, 4], dtype);
        let before = dev.memory_stats();
        let views = [
            x.reshape(&[24]).unwrap(),
            x.reshape(&[4, 6]).unwrap(),
            x.reshape(&[1, 2, 12, 1]).unwrap(),
        ];
        let after = dev.memory_stats();
        assert_eq!(after.allocations, before.allocations, "reshape allocated");
        assert_eq!(after.bytes_in_use, before.bytes_in_use);
        let want = as_dtype(&data, dtype);
        for v in &views {
            assert_eq!(v.allocated_bytes(), x.allocated_bytes());
            assert_eq!(v.to_vec_f32().unwrap(), want, "{:?}", v.dims());
        }
        assert_eq!(views[1].dims(), &[4, 6]);
        drop(x);
        // Still alive through the views.
        assert_eq!(dev.memory_stats().bytes_in_use, before.bytes_in_use);
        assert_eq!(views[2].to_vec_f32().unwrap(), want);
        // An op on a view sees the shared data in the view's shape.
        let t = views[1].transpose().unwrap();
        let (wt, _) = ref_transpose(&want, &[4, 6]);
        assert_eq!(t.to_vec_f32().unwrap(), wt);
        drop(views);
        drop(t);
        assert_eq!(dev.memory_stats().bytes_in_use, 0);
    }
    // Rank 0 and empty reshapes.
    let s = Tensor::from_slice(&dev, &[4.0f32], &[1, 1]).unwrap();
    assert_eq!(s.reshape(&[]).unwrap().item().unwrap(), 4.0);
    let e = Tensor::zeros(&dev, &[0, 3], DType::F32).unwrap();
    assert_eq!(e.reshape(&[3, 0, 2]).unwrap().dims(), &[3, 0, 2]);
}

// ---- random tensors ----

fn bits_of(t: &Tensor) -> Vec<u32> {
    read_bits(t)
}

#[test]
fn random_same_seed_same_values_on_every_device() {
    let devs = devices();
    for dtype in [DType::F32, DType::F16] {
        let mut reference: Option<(Vec<u32>, Vec<u32>)> = None;
        for dev in &devs {
            let u = Tensor::rand_uniform(dev, &[7, 33], -1.0, 2.0, 1234, dtype).unwrap();
            let n = Tensor::randn(dev, &[7, 33], 0.5, 2.0, 1234, dtype).unwrap();
            assert_eq!(u.dims(), &[7, 33]);
            assert_eq!(n.dtype(), dtype);
            let got = (bits_of(&u), bits_of(&n));
            // The same call twice on one device, too.
            let u2 = Tensor::rand_uniform(dev, &[7, 33], -1.0, 2.0, 1234, dtype).unwrap();
            assert_eq!(bits_of(&u2), got.0, "{dtype} on {}", label(dev));
            match &reference {
                None => reference = Some(got),
                Some(r) => assert_eq!(r, &got, "{dtype}: {} differs", label(dev)),
            }
        }
    }
}

fn random_different_seeds_differ(dev: &Device) {
    for &dtype in dtypes(dev) {
        let a = bits_of(&Tensor::rand_uniform(dev, &[1000], 0.0, 1.0, 1, dtype).unwrap());
        let b = bits_of(&Tensor::rand_uniform(dev, &[1000], 0.0, 1.0, 2, dtype).unwrap());
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        assert!(
            same < 100,
            "uniform seeds 1 and 2 share {same} of 1000 values"
        );
        let a = bits_of(&Tensor::randn(dev, &[1000], 0.0, 1.0, 1, dtype).unwrap());
        let b = bits_of(&Tensor::randn(dev, &[1000], 0.0, 1.0, 2, dtype).unwrap());
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        assert!(
            same < 100,
            "randn seeds 1 and 2 share {same} of 1000 values"
        );
    }
}

fn mean_std(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

fn rand_uniform_values_are_in_range(dev: &Device) {
    let t = Tensor::rand_uniform(dev, &[100, 100], -2.0, 3.0, 77, DType::F32).unwrap();
    let v = t.to_vec::<f32>().unwrap();
    assert!(
        v.iter().all(|&x| (-2.0..3.0).contains(&x)),
        "f32 uniform value out of [-2, 3) on {}",
        label(dev)
    );
    let (m, s) = mean_std(&v);
    // Uniform on [-2, 3): mean 0.5, std 5 / sqrt(12).
    assert!((m - 0.5).abs() < 0.06, "uniform mean {m}");
    assert!((s - 5.0 / 12f64.sqrt()).abs() < 0.05, "uniform std {s}");
    let lo = v.iter().cloned().fold(f32::INFINITY, f32::min);
    let hi = v.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    assert!(
        lo < -1.99 && hi > 2.99,
        "uniform does not cover the range: [{lo}, {hi}]"
    );
    // A degenerate range gives the one value.
    let c = Tensor::rand_uniform(dev, &[10], 1.5, 1.5, 3, DType::F32).unwrap();
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![1.5; 10]);
}

fn rand_uniform_f16_values_are_in_closed_range(dev: &Device) {
    let t = Tensor::rand_uniform(dev, &[100, 100], -2.0, 3.0, 77, DType::F16).unwrap();
    let v = t.to_vec_f32().unwrap();
    assert!(v.iter().all(|&x| (-2.0..=3.0).contains(&x)));
    let (m, _) = mean_std(&v);
    assert!((m - 0.5).abs() < 0.06, "f16 uniform mean {m}");
}

/// Regression: rand_uniform promises [low, high), but rounding a draw just below `high` to f16
/// gave `high` (10k values of seed 77 in [-2, 3) included a 3.0).
fn rand_uniform_f16_values_are_below_high(dev: &Device) {
    let t = Tensor::rand_uniform(dev, &[100, 100], -2.0, 3.0, 77, DType::F16).unwrap();
    let v = t.to_vec_f32().unwrap();
    let bad = v.iter().filter(|&&x| !(-2.0..3.0).contains(&x)).count();
    assert_eq!(
        bad,
        0,
        "{bad} f16 uniform values outside [-2, 3) on {}",
        label(dev)
    );
}

fn randn_mean_and_std(dev: &Device) {
    for &dtype in dtypes(dev) {
        for (mean, std, seed) in [(0.0f32, 1.0f32, 5u64), (3.0, 0.5, 6), (-1.0, 2.0, 7)] {
            let t = Tensor::randn(dev, &[10_000], mean, std, seed, dtype).unwrap();
            let (m, s) = mean_std(&t.to_vec_f32().unwrap());
            // 10k samples: the sample mean is within 5 standard errors, the std within 5%.
            let se = std as f64 / 100.0;
            assert!(
                (m - mean as f64).abs() < 5.0 * se,
                "randn({mean}, {std}) {dtype}: sample mean {m}"
            );
            assert!(
                (s / std as f64 - 1.0).abs() < 0.05,
                "randn({mean}, {std}) {dtype}: sample std {s}"
            );
        }
        let z = Tensor::randn(dev, &[10], 2.0, 0.0, 1, dtype).unwrap();
        assert_eq!(z.to_vec_f32().unwrap(), vec![2.0; 10], "std 0");
        let e = Tensor::randn(dev, &[0, 5], 0.0, 1.0, 1, dtype).unwrap();
        assert_eq!(e.dims(), &[0, 5]);
    }
}

/// `copy()` (the copy engine) gives an independent tensor with the same bits, odd f16 lengths
/// and empty tensors included.
fn copy_duplicates_data(dev: &Device) {
    for n in [0usize, 1, 5, 1001] {
        let host: Vec<f32> = host_data(n as u64, n, -3.0, 3.0);
        let t = Tensor::from_slice(dev, &host, &[n]).unwrap();
        let c = t.copy().unwrap();
        drop(t);
        assert_eq!(c.to_vec::<f32>().unwrap(), host);
        let h: Vec<half::f16> = host.iter().map(|&x| half::f16::from_f32(x)).collect();
        let c16 = Tensor::from_slice(dev, &h, &[n]).unwrap().copy().unwrap();
        assert_eq!(c16.to_vec::<half::f16>().unwrap(), h);
    }
}
