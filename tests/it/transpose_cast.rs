//! transpose (last two dims) and to_dtype (f32 <-> f16 casts and same-dtype copies) against the
//! CPU reference, on every device.

use crate::common;

use common::strategies::{shape, shape_rank};
use common::*;
use fitgrad::{DType, Device, Tensor};
use half::f16;
use proptest::prelude::*;

device_tests!(
    transpose_matches_reference,
    casts_round_like_half,
    transpose_fixed_shapes,
    casts_of_special_values,
    casts_of_subnormals_and_overflow,
    cast_of_nan_stays_nan,
    f16_conversions_bit_exact
);

fn check_transpose(dev: &Device, dtype: DType, dims: &[usize], seed: u64) -> Result<(), String> {
    let what = format!("transpose of {dims:?} {dtype} on {}", label(dev));
    let host = as_dtype(&host_data(seed, numel(dims), -10.0, 10.0), dtype);
    let x = upload(dev, &host, dims, dtype);
    let out = x.transpose().map_err(|e| format!("{what}: {e}"))?;
    let (want, od) = ref_transpose(&host, dims);
    let got = download(&out, &od, dtype).map_err(|e| format!("{what}: {e}"))?;
    // A transpose moves values: exact.
    check_close(&what, &got, &want, Tol::EXACT)?;
    // Twice is the identity.
    let back = out.transpose().map_err(|e| format!("{what} twice: {e}"))?;
    let got = download(&back, dims, dtype).map_err(|e| format!("{what} twice: {e}"))?;
    check_close(&format!("{what} twice"), &got, &host, Tol::EXACT)
}

/// f32 -> f16 must round exactly like half::f16::from_f32 (to nearest, ties to even); f16 -> f32
/// is exact; same-dtype to_dtype is a bitwise copy.
fn check_casts(dev: &Device, xs: &[f32], dims: &[usize]) -> Result<(), String> {
    let what = format!("to_dtype on {dims:?} on {}", label(dev));
    let x = Tensor::from_slice(dev, xs, dims).map_err(|e| format!("{what}: {e}"))?;
    let h = x.to_dtype(DType::F16).map_err(|e| format!("{what}: {e}"))?;
    if h.dtype() != DType::F16 || h.dims() != dims {
        return Err(format!("{what}: got {h:?}"));
    }
    let got: Vec<u16> = h
        .to_vec::<f16>()
        .map_err(|e| format!("{what}: {e}"))?
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let want: Vec<u16> = xs.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    if let Some(i) = (0..xs.len()).find(|&i| got[i] != want[i]) {
        return Err(format!(
            "{what}: f32 -> f16 of {:e} (bits {:#010x}) gave {:#06x} ({}), half gives {:#06x} ({})",
            xs[i],
            xs[i].to_bits(),
            got[i],
            f16::from_bits(got[i]),
            want[i],
            f16::from_bits(want[i])
        ));
    }
    // f16 -> f32 is exact.
    let back = h.to_dtype(DType::F32).map_err(|e| format!("{what}: {e}"))?;
    let got = back.to_vec::<f32>().map_err(|e| format!("{what}: {e}"))?;
    let want: Vec<f32> = want.iter().map(|&b| f16::from_bits(b).to_f32()).collect();
    check_close(&format!("{what}: f16 -> f32"), &got, &want, Tol::EXACT)?;
    // Same dtype: a copy, bitwise.
    let c = x.to_dtype(DType::F32).map_err(|e| format!("{what}: {e}"))?;
    let got = c.to_vec::<f32>().map_err(|e| format!("{what}: {e}"))?;
    if got
        .iter()
        .map(|v| v.to_bits())
        .ne(xs.iter().map(|v| v.to_bits()))
    {
        return Err(format!("{what}: f32 -> f32 copy differs"));
    }
    let c = h.to_dtype(DType::F16).map_err(|e| format!("{what}: {e}"))?;
    let got: Vec<u16> = c
        .to_vec::<f16>()
        .map_err(|e| format!("{what}: {e}"))?
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let want: Vec<u16> = xs.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    if got != want {
        return Err(format!("{what}: f16 -> f16 copy differs"));
    }
    Ok(())
}

/// Values in f16's normal range, with exact ties between neighbouring f16 values (which must
/// round to even) and values just beside them.
fn cast_values(seed: u64, n: usize) -> Vec<f32> {
    let mut r = HostRng::new(seed);
    (0..n)
        .map(|i| {
            // A random finite normal f16 below the largest (so it has an upper neighbour).
            let exp = 1 + (r.next_u64() % 30) as u16; // 1..=30
            let bits =
                (exp << 10) | (r.next_u64() as u16 & 0x3ff) | ((r.next_u64() as u16 & 1) << 15);
            let lo = f16::from_bits(bits).to_f32();
            let hi = f16::from_bits(bits + 1).to_f32();
            let mid = (lo + hi) / 2.0; // exact in f32
            match i % 4 {
                0 => mid,
                1 => f32::from_bits(mid.to_bits() + 1),
                2 => f32::from_bits(mid.to_bits() - 1),
                _ => lo + (hi - lo) * r.uniform(0.0, 1.0),
            }
        })
        .filter(|v| v.is_finite() && v.abs() <= 65504.0)
        .collect()
}

fn transpose_matches_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(24), |(dims in shape_rank(2, 4), seed in any::<u64>())| {
        for &dtype in dtypes(dev) {
            check_transpose(dev, dtype, &dims, seed).map_err(TestCaseError::fail)?;
        }
    });
}

fn casts_round_like_half(dev: &Device) {
    proptest!(ProptestConfig::with_cases(24), |(dims in shape(), seed in any::<u64>())| {
        let xs = cast_values(seed, numel(&dims) * 2);
        let xs = &xs[..numel(&dims).min(xs.len())];
        prop_assume!(xs.len() == numel(&dims));
        check_casts(dev, xs, &dims).map_err(TestCaseError::fail)?;
    });
}

fn transpose_fixed_shapes(dev: &Device) {
    let shapes: &[&[usize]] = &[
        &[1, 1],
        &[1, 7],
        &[7, 1],
        &[2, 3],
        &[16, 16],
        &[17, 31],
        &[255, 3],
        &[3, 257],
        &[511, 2],
        &[2, 513],
        &[4, 5, 6],
        &[2, 3, 4, 5],
        &[3, 1, 1, 9],
        &[0, 5],
        &[5, 0],
        &[2, 0, 3],
        &[100, 100],
    ];
    for &dtype in dtypes(dev) {
        for (i, dims) in shapes.iter().enumerate() {
            check_transpose(dev, dtype, dims, i as u64).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// Casting specific values: ties to even, signed zeros, the largest f16, and lengths around the
/// packed pairs and the workgroup.
fn casts_of_special_values(dev: &Device) {
    let xs: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.1,
        1.0 + 1.0 / 2048.0, // tie between 1 and 1 + 2^-10: to even (1.0)
        1.0 + 3.0 / 2048.0, // tie: to even (1 + 2^-9)
        65504.0,
        -65504.0,
        65519.0, // rounds down to 65504
        2048.5,
        6.1035156e-5, // smallest normal f16
        3.3,
    ];
    for len in [1usize, 2, 3, xs.len()] {
        check_casts(dev, &xs[..len], &[len]).unwrap_or_else(|e| panic!("{e}"));
    }
    for n in [255usize, 256, 257, 511, 512, 513, 1025] {
        let v = cast_values(n as u64, n * 2);
        check_casts(dev, &v[..n], &[n]).unwrap_or_else(|e| panic!("{e}"));
    }
    check_casts(dev, &[], &[0]).unwrap_or_else(|e| panic!("{e}"));
    check_casts(dev, &[2.5], &[]).unwrap_or_else(|e| panic!("{e}"));
}

/// f32 values outside f16's normal range: subnormal results and overflow to infinity also round
/// exactly like half::f16::from_f32.
fn check_cast_edge(dev: &Device) -> Result<(), String> {
    let xs = [
        1e-6f32,
        -3e-7,
        5.9604645e-8, // smallest f16 subnormal
        6.0e-5,       // just below the smallest normal
        65520.0,      // rounds to inf
        1e6,
        -1e6,
        f32::INFINITY,
        f32::NEG_INFINITY,
    ];
    check_casts(dev, &xs, &[xs.len()])
}

fn casts_of_subnormals_and_overflow(dev: &Device) {
    check_cast_edge(dev).unwrap_or_else(|e| panic!("{e}"));
}

fn cast_of_nan_stays_nan(dev: &Device) {
    let x = Tensor::from_slice(dev, &[f32::NAN, 1.0, f32::NAN], &[3]).unwrap();
    let h = x.to_dtype(DType::F16).unwrap().to_vec::<f16>().unwrap();
    assert!(
        h[0].is_nan() && h[2].is_nan() && h[1] == f16::ONE,
        "on {}: {h:?}",
        label(dev)
    );
    let hx = Tensor::from_slice(dev, &[f16::NAN, f16::ONE, f16::NAN], &[3]).unwrap();
    let f = hx.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    assert!(
        f[0].is_nan() && f[2].is_nan() && f[1] == 1.0,
        "on {}: {f:?}",
        label(dev)
    );
}

/// Every f16 bit pattern to f32, and f32 values of every class (random bits, values around each
/// f16 boundary and rounding tie, signed zeros, f32 subnormals, infinities, quiet and signalling
/// NaN with payloads of both signs) to f16, bit for bit against the `half` crate, on every
/// adapter. The packed path converts with fitgrad's own integer code (shaders/include/
/// f16_bits.wgsl), so these bits are the same on every driver; `pack2x16float` would leave inf
/// and NaN indeterminate (SwiftShader made NaN of inf) and an inexact value free to round either
/// way.
fn f16_conversions_bit_exact(dev: &Device) {
    let what = format!("f16 conversions on {}", label(dev));
    // f16 -> f32: all 65,536 patterns.
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let x = Tensor::from_slice(dev, &all, &[all.len()]).unwrap();
    let got = x.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    for (h, g) in all.iter().zip(&got) {
        let want = h.to_f32();
        assert_eq!(
            g.to_bits(),
            want.to_bits(),
            "{what}: f16 {:#06x} -> f32 gave {:#010x} ({g:e}), half gives {:#010x} ({want:e})",
            h.to_bits(),
            g.to_bits(),
            want.to_bits()
        );
    }
    // ... and back to f16: every pattern returns (a signalling NaN as its quiet twin, as half).
    let back: Vec<u16> = Tensor::from_slice(dev, &got, &[got.len()])
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap()
        .to_vec::<f16>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    // The native f16 path stores through WGSL's f16(): naga 30 has no 16-bit bitcast, so a
    // NaN's payload and sign there are the hardware's (the spec leaves them open); any NaN is
    // right. Every other value, and every NaN on the packed path, is the half crate's bits.
    let native = dev.info().f16_native;
    let same = |got: u16, want: u16| {
        got == want || (native && f16::from_bits(want).is_nan() && f16::from_bits(got).is_nan())
    };
    for (h, b) in all.iter().zip(&back) {
        let want = f16::from_f32(h.to_f32()).to_bits();
        assert!(
            same(*b, want),
            "{what}: f16 {:#06x} -> f32 -> f16 gave {b:#06x}, half gives {want:#06x}",
            h.to_bits()
        );
    }
    // f32 -> f16: random bits (every class in proportion) and the edges of each class.
    let mut r = HostRng::new(38);
    let mut xs: Vec<f32> = (0..1 << 15)
        .map(|_| f32::from_bits(r.next_u64() as u32))
        .collect();
    for sign in [0u32, 0x8000_0000] {
        let f = |bits: u32| f32::from_bits(sign | bits);
        xs.extend([
            f(0),           // zero
            f(1),           // the smallest f32 subnormal
            f(0x007f_ffff), // the largest f32 subnormal
            f(0x7f80_0000), // inf
            f(0x7fc0_0000), // the quiet NaN
            f(0x7fc0_0001), // quiet, payload only in bits f16 drops
            f(0x7fff_ffff), // quiet, full payload
            f(0x7f80_0001), // signalling, payload only in bits f16 drops
            f(0x7fa0_0000), // signalling, payload kept
            f(0x3300_0000), // 2^-25: the tie between 0 and the smallest subnormal
            f(0x3300_0001), // just above it: rounds up
            f(0x337f_ffff), // just below 2^-24
            f(0x3380_0000), // 2^-24: the smallest f16 subnormal
            f(0x387f_c000), // tie between the largest subnormal and the smallest normal
            f(0x3880_0000), // 2^-14: the smallest normal f16
            f(0x477f_e000), // 65504: the largest f16
            f(0x477f_efff), // just below the tie with 65536: 65504
            f(0x477f_f000), // the tie with 65536: rounds to even, inf
            f(0x4780_0000), // 65536: inf
            f(0x7f7f_ffff), // the largest f32: inf
        ]);
        // Every f32 exponent, with tie, just-below and just-above mantissas.
        for e in 0..=255u32 {
            for m in [
                0u32, 0x1000, 0x0fff, 0x1001, 0x3000, 0x2000, 0x7f_ffff, 0x40_0000,
            ] {
                xs.push(f((e << 23) | m));
            }
        }
        // Every f16 subnormal's neighbourhood, where the shift varies.
        for k in 0..24u32 {
            let base = 0x3300_0000u32 + (k << 22);
            xs.extend([f(base), f(base + 1), f(base - 1), f(base | 0x0040_0000)]);
        }
    }
    let h: Vec<u16> = Tensor::from_slice(dev, &xs, &[xs.len()])
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap()
        .to_vec::<f16>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    for (x, g) in xs.iter().zip(&h) {
        let want = f16::from_f32(*x).to_bits();
        assert!(
            same(*g, want),
            "{what}: f32 {:#010x} ({x:e}) -> f16 gave {g:#06x}, half gives {want:#06x}",
            x.to_bits()
        );
    }
}
