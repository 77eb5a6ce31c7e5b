//! Block-wise 8-bit optimizer state (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
//! Quantization"), as bitsandbytes stores it: each moment is one u8 code per element into a
//! dynamic quantization map, with one f32 absmax per block of [`BLOCK`] elements, so a value is
//! `map[code] * absmax`. The first moment uses the signed map, the second (never negative) the
//! unsigned one, which spends all 256 codes on magnitudes.
//!
//! **The map** ([`dynamic_map`]) is the paper's dynamic tree type: a decimal exponent from
//! 10^-6 to 10^0 and a linear fraction whose resolution grows with the exponent (1, 2, 4, ... 64
//! means per decade signed, twice as many unsigned), plus 0 and 1. It is bitsandbytes'
//! `create_dynamic_map(signed)`: relative error stays near 1% from 1 down to 1e-6 of a block's
//! absmax, where a linear 8-bit map would round anything under 1/256 of it to zero.
//!
//! **Quantizing** a value x of a block picks the map value nearest x / absmax (the lower one on a
//! tie), found as the count of midpoints t between neighbouring map values with t * absmax < x:
//! products are correctly rounded on every adapter, quotients are not, so the device and a host
//! reference agree bit for bit.
//!
//! **Blocks of 256.** A workgroup owns a block and each of its 64 invocations one u32 word of
//! codes per moment (four elements), so no two invocations share a word, the absmax is a
//! 64-wide workgroup max, and p and g are read as whole quads. Smaller blocks isolate outliers
//! better (the point of block-wise quantization); the price is one f32 per 256 codes, 2.03 bytes
//! of state per parameter instead of 2.004 with bitsandbytes' 2048: 0.254x of f32 AdamW's 8
//! bytes rather than 0.2505x.
//!
//! Tensors under [`MIN_NUMEL`] elements (biases, norms) keep f32 state, as bitsandbytes does:
//! their state is small and they are the most sensitive to rounding.

pub(crate) use crate::kernels::adamw8bit::code_words;
use crate::kernels::adamw8bit::{self, blocks, Codes};
use crate::kernels::optim::AdamWHyper;
use crate::{DType, Device, Result, Tensor};

/// Elements per block: one f32 absmax per `BLOCK` codes.
pub const BLOCK: usize = adamw8bit::BLOCK;

/// Tensors with fewer elements keep f32 state.
pub const MIN_NUMEL: usize = 4096;

/// The paper's dynamic quantization map, ascending: signed (127 negative values, 0, 128
/// positive ones up to 1) for first moments, unsigned (0, 254 positive values, 1) for second
/// moments. bitsandbytes' `create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8)`,
/// computed in f64 and rounded once.
pub fn dynamic_map(signed: bool) -> [f32; 256] {
    let mut data: Vec<f64> = Vec::with_capacity(256);
    for i in 0..7i32 {
        // Decade 10^(i - 6): 2^i linear means signed, 2^(i + 1) unsigned.
        let items = if signed { 1usize << i } else { 2usize << i };
        let scale = 10f64.powi(i - 6);
        for j in 0..items {
            let lo = 0.1 + 0.9 * j as f64 / items as f64;
            let hi = 0.1 + 0.9 * (j + 1) as f64 / items as f64;
            let mean = (lo + hi) / 2.0;
            data.push(scale * mean);
            if signed {
                data.push(-scale * mean);
            }
        }
    }
    data.push(0.0);
    data.push(1.0);
    assert_eq!(data.len(), 256);
    let mut map: Vec<f32> = data.into_iter().map(|v| v as f32).collect();
    map.sort_by(f32::total_cmp);
    map.try_into().expect("256 values")
}

/// The midpoints between neighbours of `map` (255 of them, then a padding 0): a value's code is
/// the number of midpoints `t` with `t * absmax < x`.
pub fn midpoints(map: &[f32; 256]) -> [f32; 256] {
    let mut mid = [0f32; 256];
    for k in 0..255 {
        mid[k] = 0.5 * (map[k] + map[k + 1]);
    }
    mid
}

/// The device table the kernel copies to workgroup memory: signed map, unsigned map, then
/// their midpoints (1024 f32, 4 KiB).
pub(crate) fn table(dev: &Device) -> Result<Tensor> {
    let (s, u) = (dynamic_map(true), dynamic_map(false));
    let mut t = Vec::with_capacity(1024);
    t.extend_from_slice(&s);
    t.extend_from_slice(&u);
    t.extend_from_slice(&midpoints(&s));
    t.extend_from_slice(&midpoints(&u));
    Tensor::from_slice(dev, &t, &[1024])
}

/// A tensor quantized block-wise to 8 bits on its device ([`Quantized::new`]).
pub struct Quantized {
    /// `ceil(len / 4)` u32 words of codes, element i in byte i % 4 of word i / 4 (held in an
    /// f32-typed tensor: fitgrad has no integer dtype; only the kernels read it, as u32).
    codes: Tensor,
    /// (ceil(len / BLOCK)) f32.
    absmax: Tensor,
    table: Tensor,
    len: usize,
    signed: bool,
}

impl Quantized {
    /// Quantizes `x` (any shape and dtype) with the signed map or the unsigned one (on which
    /// negative values become 0). Values should be finite: a NaN gets code 0.
    pub fn new(x: &Tensor, signed: bool) -> Result<Quantized> {
        let dev = x.device();
        let len = x.numel();
        let q = Quantized {
            codes: word_tensor(dev, len)?,
            absmax: Tensor::zeros(dev, &[blocks(len)], DType::F32)?,
            table: table(dev)?,
            len,
            signed,
        };
        let x = x.detach();
        adamw8bit::quantize(&x, q.codes(), &q.table, signed)?;
        Ok(q)
    }

    fn codes(&self) -> Codes<'_, Tensor> {
        Codes {
            codes: &self.codes,
            absmax: &self.absmax,
        }
    }

    /// The values `map[code] * absmax`, f32, in a tensor of `len` elements.
    pub fn dequantize(&self) -> Result<Tensor> {
        let x = Tensor::zeros(self.codes.device(), &[self.len], DType::F32)?;
        adamw8bit::dequantize(self.codes(), &x, &self.table, self.signed)?;
        Ok(x)
    }

    /// The codes, one byte per element (one readback).
    pub fn code_bytes(&self) -> Result<Vec<u8>> {
        words_to_bytes(&self.codes, self.len)
    }

    /// The absmax of each block (one readback).
    pub fn absmax(&self) -> Result<Vec<f32>> {
        self.absmax.to_vec()
    }
}

/// Zeroed code words for `len` elements.
pub(crate) fn word_tensor(dev: &Device, len: usize) -> Result<Tensor> {
    Tensor::zeros(dev, &[code_words(len)], DType::F32)
}

/// The first `len` code bytes of a word tensor (little-endian words: byte i is element i).
pub(crate) fn words_to_bytes(words: &Tensor, len: usize) -> Result<Vec<u8>> {
    let w: Vec<f32> = words.to_vec()?;
    let mut b: Vec<u8> = bytemuck::cast_slice(&w).to_vec();
    b.truncate(len);
    Ok(b)
}

/// A word tensor on `dev` holding `bytes` (padded with zero codes to whole words).
pub(crate) fn bytes_to_words(dev: &Device, bytes: &[u8]) -> Result<Tensor> {
    let mut padded = bytes.to_vec();
    padded.resize(code_words(bytes.len()) * 4, 0);
    let words: Vec<f32> = bytemuck::pod_collect_to_vec(&padded);
    Tensor::from_slice(dev, &words, &[words.len()])
}

/// AdamW's two moments of one parameter in 8 bits: (codes, absmax) each.
#[derive(Clone)]
pub(crate) struct Moments8 {
    pub m: Tensor,
    pub am: Tensor,
    pub v: Tensor,
    pub av: Tensor,
}

/// The state names of [`Moments8`], as bitsandbytes names them: codes, then absmax, of m, then v.
pub(crate) const NAMES8: [&str; 4] = ["state1", "absmax1", "state2", "absmax2"];

impl Moments8 {
    /// Zero moments for `p` (all codes 0 with absmax 0 dequantize to 0).
    pub fn zeros(p: &Tensor) -> Result<Moments8> {
        let (dev, n) = (p.device(), p.numel());
        Ok(Moments8 {
            m: word_tensor(dev, n)?,
            am: Tensor::zeros(dev, &[blocks(n)], DType::F32)?,
            v: word_tensor(dev, n)?,
            av: Tensor::zeros(dev, &[blocks(n)], DType::F32)?,
        })
    }

    /// Both moments of an `n`-element parameter as f32 tensors of `n` elements.
    pub fn dequantize(&self, n: usize, table: &Tensor) -> Result<(Tensor, Tensor)> {
        let dev = self.m.device();
        let (m, v) = (
            Tensor::zeros(dev, &[n], DType::F32)?,
            Tensor::zeros(dev, &[n], DType::F32)?,
        );
        let codes = |c, a| Codes {
            codes: c,
            absmax: a,
        };
        adamw8bit::dequantize(codes(&self.m, &self.am), &m, table, true)?;
        adamw8bit::dequantize(codes(&self.v, &self.av), &v, table, false)?;
        Ok((m, v))
    }

    /// One fused update of `p` from `g`.
    pub fn step(&self, p: &Tensor, g: &Tensor, table: &Tensor, hp: &AdamWHyper) -> Result<()> {
        let m = Codes {
            codes: &self.m,
            absmax: &self.am,
        };
        let v = Codes {
            codes: &self.v,
            absmax: &self.av,
        };
        adamw8bit::adamw8bit_step(p, g, m, v, table, hp)
    }
}

/// The bytes f32 AdamW state (two f32 moments, each block 256-byte aligned as in the arena)
/// takes for `params`: the reference 8-bit state is compared with (`--json`'s
/// `optimizer_state_bytes_f32`).
pub fn f32_adamw_state_bytes(params: &[Tensor]) -> u64 {
    params
        .iter()
        .map(|p| 2 * (4 * p.numel() as u64).next_multiple_of(256))
        .sum()
}
