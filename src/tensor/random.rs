//! Seeded random tensors. Values are drawn on the host with a fixed generator and uploaded, so
//! the same seed gives the same values on every adapter (GPU transcendentals differ in the last
//! bits between vendors). The transcendentals are libm's, not std's: std calls the platform's C
//! library, whose `log` and `cos` differ in the last bit between glibc, musl, macOS and Windows,
//! while libm is one portable implementation, so a seed gives the same bits on every OS too.

use super::{DType, Tensor};
use crate::device::Device;
use crate::{Error, Result};

/// SplitMix64: tiny, fast, and statistically good enough for weight init and data shuffling.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The generator's position, for checkpoints: `Rng::from_state(r.state())` continues the
    /// same stream.
    pub fn state(&self) -> u64 {
        self.0
    }

    /// A generator at a position taken with [`Rng::state`].
    pub fn from_state(state: u64) -> Rng {
        Rng(state)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box-Muller; one value per call, the pair's second is dropped to keep
    /// the stream position simple).
    pub fn next_normal(&mut self) -> f64 {
        let u1 = 1.0 - self.next_f64(); // (0, 1]: ln is finite
        let u2 = self.next_f64();
        // sqrt is correctly rounded (IEEE 754) everywhere, so std's is portable.
        (-2.0 * libm::log(u1)).sqrt() * libm::cos(std::f64::consts::TAU * u2)
    }
}

fn upload(device: &Device, dims: &[usize], dtype: DType, values: Vec<f32>) -> Result<Tensor> {
    match dtype {
        DType::F32 => Tensor::from_slice(device, &values, dims),
        DType::F16 => {
            let h: Vec<half::f16> = values.into_iter().map(half::f16::from_f32).collect();
            Tensor::from_slice(device, &h, dims)
        }
    }
}

/// The largest f16 below `x` (x finite).
fn f16_below(x: half::f16) -> half::f16 {
    let b = x.to_bits();
    half::f16::from_bits(match b {
        0x0000 | 0x8000 => 0x8001,     // below ±0: the smallest negative subnormal
        _ if b & 0x8000 == 0 => b - 1, // positive: one step toward zero
        _ => b + 1,                    // negative: one step away from zero
    })
}

fn check_numel(op: &'static str, dims: &[usize]) -> Result<usize> {
    Ok(super::Shape::new(dims)
        .map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => Error::InvalidArgument { op, reason },
            other => other,
        })?
        .numel())
}

impl Tensor {
    /// Uniform values in [low, high).
    pub fn rand_uniform(
        device: &Device,
        dims: &[usize],
        low: f32,
        high: f32,
        seed: u64,
        dtype: DType,
    ) -> Result<Tensor> {
        if !(low.is_finite() && high.is_finite() && low <= high) {
            return Err(Error::InvalidArgument {
                op: "rand_uniform",
                reason: format!("need finite low <= high, got [{low}, {high})"),
            });
        }
        let n = check_numel("rand_uniform", dims)?;
        // Before any host work: a tensor the device cannot hold must not cost host memory first.
        device.check_tensor_bytes("rand_uniform", n as u64 * dtype.size() as u64)?;
        if device.is_planning() {
            // Nothing is uploaded while planning: the values need not exist.
            return Tensor::uninit(device, super::Shape::new(dims)?, dtype);
        }
        let mut rng = Rng::new(seed);
        let span = (high - low) as f64;
        // Rounding to the dtype can land on `high`; keep the interval half-open.
        let v: Vec<f32> = (0..n)
            .map(|_| {
                let x = (low as f64 + span * rng.next_f64()) as f32;
                match dtype {
                    _ if low == high => low,
                    DType::F32 if x >= high => high.next_down(),
                    DType::F16 if half::f16::from_f32(x) >= half::f16::from_f32(high) => {
                        f16_below(half::f16::from_f32(high)).to_f32().max(low)
                    }
                    _ => x,
                }
            })
            .collect();
        upload(device, dims, dtype, v)
    }

    /// Normal values with the given mean and standard deviation.
    pub fn randn(
        device: &Device,
        dims: &[usize],
        mean: f32,
        std: f32,
        seed: u64,
        dtype: DType,
    ) -> Result<Tensor> {
        if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
            return Err(Error::InvalidArgument {
                op: "randn",
                reason: format!("need finite mean and std >= 0, got mean {mean}, std {std}"),
            });
        }
        let n = check_numel("randn", dims)?;
        // Before any host work: a tensor the device cannot hold must not cost host memory first.
        device.check_tensor_bytes("randn", n as u64 * dtype.size() as u64)?;
        if device.is_planning() {
            return Tensor::uninit(device, super::Shape::new(dims)?, dtype);
        }
        let mut rng = Rng::new(seed);
        let v = (0..n)
            .map(|_| (mean as f64 + std as f64 * rng.next_normal()) as f32)
            .collect();
        upload(device, dims, dtype, v)
    }
}
