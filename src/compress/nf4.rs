//! The frozen base of QLoRA (Dettmers et al. 2023): weights quantized on the host to int8 per
//! output row (the rule of src/compress/quantize.rs) or to NF4, bitsandbytes' 4-bit
//! NormalFloat: blocks of 64 consecutive elements of the flattened (out, in) weight, each
//! scaled by its absmax and rounded to the nearest of the 16 code values, optionally with the
//! absmax values themselves quantized (double quantization: their mean subtracted, 8-bit
//! dynamic codes in blocks of 256, one f32 absmax per block). The device holds only the codes
//! and statistics ([`QuantWeight`]); its matmuls dequantize inside the shader.
//!
//! Bytes per parameter: NF4 4 bits + 32 bits / 64 = 0.5625 (0.141x of f32), with double
//! quantization 0.5 + 1 / 64 + 4 / (64 · 256) ≈ 0.516 (0.129x); int8 1 + 4 / in (about 0.25x).

use super::quantize::quantize_rows;
use crate::nn::{Gpt, Linear, Llama};
use crate::optim::quant8::dynamic_map;
use crate::tensor::{DoubleQuant, QuantWeight, NF4_BLOCK, NF4_DQ_BLOCK};
use crate::{DType, Error, Result, Tensor};
use std::sync::Arc;

/// The 16 NF4 code values (bitsandbytes' `get_4bit_type("nf4")`, as in shaders/dqmatmul.wgsl).
pub const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// How a frozen base is held: `none` (dense, in the parameters' dtype), `int8` or `nf4`
/// (`nf4` with double quantization by default, as QLoRA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BaseQuant {
    /// The dense weights.
    None,
    /// int8 per output row.
    Int8,
    /// NF4 in blocks of 64, with or without double quantization.
    Nf4 {
        /// Whether the absmax values are double-quantized.
        double_quant: bool,
    },
}

impl std::str::FromStr for BaseQuant {
    type Err = Error;
    fn from_str(s: &str) -> Result<BaseQuant> {
        Ok(match s {
            "none" => BaseQuant::None,
            "int8" => BaseQuant::Int8,
            "nf4" => BaseQuant::Nf4 { double_quant: true },
            "nf4-single" => BaseQuant::Nf4 {
                double_quant: false,
            },
            _ => {
                return Err(Error::InvalidArgument {
                    op: "--quantize",
                    reason: format!("'{s}': the formats are none, int8, nf4 and nf4-single"),
                })
            }
        })
    }
}

impl std::fmt::Display for BaseQuant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BaseQuant::None => "none",
            BaseQuant::Int8 => "int8",
            BaseQuant::Nf4 { double_quant: true } => "nf4",
            BaseQuant::Nf4 {
                double_quant: false,
            } => "nf4-single",
        })
    }
}

/// The nearest code value's index for `x` in [-1, 1]: the number of midpoints between
/// neighbouring codes that `x` passes (a value on a midpoint takes the lower code, as
/// bitsandbytes' decision tree).
fn nearest(x: f32, table: &[f32]) -> u8 {
    let mut c = 0u8;
    for k in 0..table.len() - 1 {
        if x > 0.5 * (table[k] + table[k + 1]) {
            c = k as u8 + 1;
        }
    }
    c
}

fn check_finite(w: &[f32]) -> Result<()> {
    match w.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(Error::InvalidArgument {
            op: "quantize",
            reason: format!("weight {i} is {}: only finite weights have a code", w[i]),
        }),
        None => Ok(()),
    }
}

/// NF4 codes (one per element, 0..16) and the absmax of each block of [`NF4_BLOCK`] elements
/// of `w` (the last block may be shorter). A block of zeros gets absmax 0 and code 7 (0.0).
/// A non-finite weight is an [`Error::InvalidArgument`].
pub fn quantize_nf4(w: &[f32]) -> Result<(Vec<u8>, Vec<f32>)> {
    check_finite(w)?;
    let mut codes = Vec::with_capacity(w.len());
    let mut absmax = Vec::with_capacity(w.len().div_ceil(NF4_BLOCK));
    for block in w.chunks(NF4_BLOCK) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        absmax.push(amax);
        codes.extend(block.iter().map(|&v| {
            if amax == 0.0 {
                7
            } else {
                nearest(v / amax, &NF4)
            }
        }));
    }
    Ok((codes, absmax))
}

/// The values `NF4[code] * absmax[block]` of [`quantize_nf4`]'s output (plain loops).
pub fn dequantize_nf4(codes: &[u8], absmax: &[f32]) -> Vec<f32> {
    codes
        .iter()
        .enumerate()
        .map(|(i, &c)| NF4[c as usize] * absmax[i / NF4_BLOCK])
        .collect()
}

/// Double quantization of NF4 block statistics: `absmax - mean` in blocks of [`NF4_DQ_BLOCK`],
/// each scaled by its own absmax and given the nearest value of bitsandbytes' signed dynamic
/// map (`compress_statistics`).
pub fn double_quantize(absmax: &[f32]) -> DoubleQuant {
    let map = dynamic_map(true);
    let offset = if absmax.is_empty() {
        0.0
    } else {
        (absmax.iter().map(|&v| v as f64).sum::<f64>() / absmax.len() as f64) as f32
    };
    let mut codes = Vec::with_capacity(absmax.len());
    let mut second = Vec::new();
    for block in absmax.chunks(NF4_DQ_BLOCK) {
        let centered: Vec<f32> = block.iter().map(|&v| v - offset).collect();
        let amax = centered.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        second.push(amax);
        codes.extend(centered.iter().map(|&v| {
            if amax == 0.0 {
                nearest(0.0, &map)
            } else {
                nearest(v / amax, &map)
            }
        }));
    }
    DoubleQuant {
        codes,
        absmax: second,
        offset,
        map,
    }
}

/// The block absmax values a [`DoubleQuant`] decodes to: `map[code] * absmax[b / 256] +
/// offset`, the shader's rule.
pub fn double_dequantize(d: &DoubleQuant) -> Vec<f32> {
    d.codes
        .iter()
        .enumerate()
        .map(|(b, &c)| d.map[c as usize] * d.absmax[b / NF4_DQ_BLOCK] + d.offset)
        .collect()
}

/// `w` (out, in) f32 row-major as a device weight in `quant` (not `None`).
pub fn quantize_weight(
    dev: &crate::Device,
    w: &[f32],
    out: usize,
    inp: usize,
    quant: BaseQuant,
) -> Result<QuantWeight> {
    match quant {
        BaseQuant::None => Err(Error::InvalidArgument {
            op: "quantize_weight",
            reason: "BaseQuant::None keeps the dense weight".into(),
        }),
        BaseQuant::Int8 => {
            let (q, scale) = quantize_rows(w, out, inp)?;
            QuantWeight::int8(dev, &q, &scale, out, inp)
        }
        BaseQuant::Nf4 { double_quant } => {
            if w.len() != out * inp {
                return Err(Error::Shape {
                    op: "quantize_weight",
                    lhs: vec![w.len()],
                    rhs: vec![out, inp],
                    reason: "the values are not an (out, in) matrix".into(),
                });
            }
            let (codes, absmax) = quantize_nf4(w)?;
            let d = double_quant.then(|| double_quantize(&absmax));
            QuantWeight::nf4(dev, &codes, &absmax, d.as_ref(), out, inp)
        }
    }
}

/// Replaces a Linear's f32 weight by its quantized form (one readback): the dense block is
/// released and the weight and bias are frozen. An f16 weight, or a layer with a merged
/// adapter, is an [`Error::InvalidArgument`] naming `name`.
pub fn quantize_linear(name: &str, linear: &mut Linear, quant: BaseQuant) -> Result<()> {
    if quant == BaseQuant::None || linear.quantized.is_some() {
        return Ok(());
    }
    let bad = |reason: String| Error::InvalidArgument {
        op: "--quantize",
        reason: format!("{name}: {reason}"),
    };
    if linear.weight.dtype() != DType::F32 {
        return Err(bad(format!(
            "a {quant} base is quantized from f32 weights, this one is {} (use --precision \
             f32 or mixed)",
            linear.weight.dtype()
        )));
    }
    if linear.lora.as_ref().is_some_and(|l| l.is_merged()) {
        return Err(bad(
            "the adapter is merged into the weight; unmerge it first".into(),
        ));
    }
    if linear
        .bias
        .as_ref()
        .is_some_and(|b| b.dtype() != DType::F32)
    {
        return Err(bad("the bias must be f32".into()));
    }
    let dev = linear.weight.device().clone();
    let w = linear.weight.to_vec_f32()?;
    let q = quantize_weight(&dev, &w, linear.out_features, linear.in_features, quant)?;
    linear.weight = Tensor::zeros(&dev, &[0], DType::F32)?;
    linear.quantized = Some(Arc::new(q));
    linear.freeze();
    Ok(())
}

/// Quantizes every Linear of the blocks of `gpt` (the embeddings, norms and tied head stay
/// dense), freezing them; returns the quantized weights' device bytes and their parameter
/// count. The dense weights' memory goes back to the driver (the device's free segments are
/// released), so what the arena holds after is what the quantized model needs.
pub fn quantize_gpt_base(gpt: &mut Gpt, quant: BaseQuant) -> Result<(u64, usize)> {
    quantize_linears(gpt.linears_mut()?, quant)
}

/// [`quantize_gpt_base`] for a Llama: every Linear of its decoder layers (the embedding, norms
/// and head stay dense).
pub fn quantize_llama_base(llama: &mut Llama, quant: BaseQuant) -> Result<(u64, usize)> {
    quantize_linears(llama.linears_mut()?, quant)
}

/// Quantizes `linears` (named for errors) and releases the device's free segments; the
/// quantized weights' bytes and parameter count.
fn quantize_linears(linears: Vec<(String, &mut Linear)>, quant: BaseQuant) -> Result<(u64, usize)> {
    let (mut bytes, mut params) = (0u64, 0usize);
    let mut device = None;
    for (name, l) in linears {
        device.get_or_insert_with(|| l.weight.device().clone());
        quantize_linear(&name, l, quant)?;
        if let Some(q) = &l.quantized {
            bytes += q.weight_bytes();
            params += q.in_features() * q.out_features();
        }
    }
    if let (Some(d), true) = (device, quant != BaseQuant::None) {
        d.empty_cache();
    }
    Ok((bytes, params))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_the_shaders() {
        let src = include_str!("../../shaders/dqmatmul.wgsl");
        let start = src.find("array<f32, 16>(").expect("the shader's table") + 15;
        let end = start + src[start..].find(')').expect("the table's end");
        let values: Vec<f32> = src[start..end]
            .split(',')
            .map(|v| v.trim().parse::<f64>().expect("a number") as f32)
            .collect();
        assert_eq!(values, NF4);
    }

    #[test]
    fn nearest_codes_and_blocks() {
        // 0.8614784 is the midpoint of 0.7229568 and 1.0: on it the lower code.
        assert_eq!(nearest(0.5 * (NF4[14] + NF4[15]), &NF4), 14);
        assert_eq!(nearest(1.0, &NF4), 15);
        assert_eq!(nearest(-1.0, &NF4), 0);
        assert_eq!(nearest(0.0, &NF4), 7);
        let w: Vec<f32> = (0..130).map(|i| (i as f32 - 60.0) / 7.0).collect();
        let (codes, absmax) = quantize_nf4(&w).unwrap();
        assert_eq!(absmax.len(), 3);
        assert_eq!(absmax[0], 60.0 / 7.0);
        let back = dequantize_nf4(&codes, &absmax);
        for (i, (a, b)) in w.iter().zip(&back).enumerate() {
            assert!((a - b).abs() <= 0.16 * absmax[i / 64], "{i}: {a} {b}");
        }
        let (c, a) = quantize_nf4(&[0.0; 3]).unwrap();
        assert_eq!((c, a), (vec![7, 7, 7], vec![0.0]));
        assert!(quantize_nf4(&[f32::NAN]).is_err());
    }

    #[test]
    fn double_quantization_round_trips_closely() {
        let absmax: Vec<f32> = (0..600).map(|i| 0.5 + (i % 37) as f32 / 50.0).collect();
        let d = double_quantize(&absmax);
        assert_eq!((d.codes.len(), d.absmax.len()), (600, 3));
        for (a, b) in absmax.iter().zip(double_dequantize(&d)) {
            assert!((a - b).abs() < 0.01, "{a} {b}");
        }
    }
}
