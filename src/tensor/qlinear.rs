//! A frozen weight held quantized on the device, int8 per output row or NF4 (4-bit
//! NormalFloat in blocks of 64, optionally with double-quantized statistics), and its linear
//! map `y = x · dequant(W)ᵀ + b` with the input gradient `dx = dy · dequant(W)`: both
//! dequantize inside the shader (src/kernels/dqmatmul.rs), so no dense copy of the weight
//! exists on the device. The codes are made on the host (src/compress/nf4.rs,
//! src/compress/quantize.rs); this file only holds and multiplies them.

use super::autograd::record;
use super::Tensor;
use crate::kernels::dqmatmul::{dqmatmul, Format, Weight};
use crate::kernels::qmatmul::{self, words_per_row};
use crate::memory::Category;
use crate::{Activation, DType, Device, Error, Result, Shape};

/// The elements of one NF4 block (one absmax each).
pub const NF4_BLOCK: usize = 64;
/// NF4 blocks per second-level absmax under double quantization.
pub const NF4_DQ_BLOCK: usize = 256;

/// The double-quantized statistics of an NF4 weight: 8-bit codes of each block's absmax minus
/// `offset` (their mean), one f32 absmax per [`NF4_DQ_BLOCK`] codes, and the 256-value code
/// map the codes index (bitsandbytes' signed dynamic map).
#[derive(Clone, Debug, PartialEq)]
pub struct DoubleQuant {
    /// One code per NF4 block.
    pub codes: Vec<u8>,
    /// One absmax per 256 codes.
    pub absmax: Vec<f32>,
    /// Added back after decoding.
    pub offset: f32,
    /// The code values.
    pub map: [f32; 256],
}

/// How a [`QuantWeight`] stores W.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantFormat {
    /// int8, one f32 scale per output row.
    Int8,
    /// NF4 codes, one f32 absmax per 64 elements, or double-quantized statistics.
    Nf4 {
        /// Whether the statistics are double-quantized.
        double_quant: bool,
    },
}

/// A frozen (out, in) weight in a quantized format on the device.
pub struct QuantWeight {
    words: Tensor,
    scale: Tensor,
    dq: Option<(Tensor, Tensor)>,
    format: QuantFormat,
    out_features: usize,
    in_features: usize,
}

/// Raw u32 words in an f32-typed tensor (fitgrad has no integer dtype; only the shaders read
/// them, as `array<u32>`), counted as parameters.
fn words_tensor(dev: &Device, words: &[u32]) -> Result<Tensor> {
    let words = if words.is_empty() { &[0u32][..] } else { words };
    let t = Tensor::from_slice(dev, bytemuck::cast_slice::<u32, f32>(words), &[words.len()])?;
    dev.retag(&t, Category::Parameters);
    Ok(t)
}

fn f32_tensor(dev: &Device, v: &[f32]) -> Result<Tensor> {
    let t = Tensor::from_slice(dev, v, &[v.len()])?;
    dev.retag(&t, Category::Parameters);
    Ok(t)
}

fn check_dims(op: &'static str, out: usize, inp: usize) -> Result<()> {
    if out == 0 || inp == 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("features must be positive, got in {inp}, out {out}"),
        });
    }
    Ok(())
}

impl QuantWeight {
    /// An int8 weight: `q` (out, in) row-major and one scale per row, W = scale[r] q[r, k].
    /// Lengths that do not match are an [`Error::Shape`].
    pub fn int8(
        dev: &Device,
        q: &[i8],
        scale: &[f32],
        out: usize,
        inp: usize,
    ) -> Result<QuantWeight> {
        const OP: &str = "QuantWeight::int8";
        check_dims(OP, out, inp)?;
        if q.len() != out * inp || scale.len() != out {
            return Err(Error::Shape {
                op: OP,
                lhs: vec![q.len(), scale.len()],
                rhs: vec![out, inp],
                reason: format!("need {} int8 values and {out} scales", out * inp),
            });
        }
        let kw = words_per_row(inp);
        let mut words = vec![0u32; out * kw];
        for r in 0..out {
            for c in 0..inp {
                words[r * kw + c / 4] |= (q[r * inp + c] as u8 as u32) << (8 * (c % 4));
            }
        }
        Ok(QuantWeight {
            words: words_tensor(dev, &words)?,
            scale: f32_tensor(dev, scale)?,
            dq: None,
            format: QuantFormat::Int8,
            out_features: out,
            in_features: inp,
        })
    }

    /// An NF4 weight: `codes` one 4-bit code (0..16) per element of the (out, in) row-major W,
    /// and either `absmax` (one per [`NF4_BLOCK`] elements of the flattened W) or `double`.
    /// Lengths that do not match, or a code of 16 or more, are an [`Error::Shape`] /
    /// [`Error::InvalidArgument`].
    pub fn nf4(
        dev: &Device,
        codes: &[u8],
        absmax: &[f32],
        double: Option<&DoubleQuant>,
        out: usize,
        inp: usize,
    ) -> Result<QuantWeight> {
        const OP: &str = "QuantWeight::nf4";
        check_dims(OP, out, inp)?;
        let n = out * inp;
        let blocks = n.div_ceil(NF4_BLOCK);
        let stats = match double {
            Some(d) => (d.codes.len(), d.absmax.len(), blocks.div_ceil(NF4_DQ_BLOCK)),
            None => (absmax.len(), absmax.len(), blocks),
        };
        if codes.len() != n || stats.0 != blocks || stats.1 != stats.2 {
            return Err(Error::Shape {
                op: OP,
                lhs: vec![codes.len(), stats.0, stats.1],
                rhs: vec![out, inp],
                reason: format!(
                    "need {n} codes, {blocks} block statistics and {} second-level ones",
                    stats.2
                ),
            });
        }
        if let Some(i) = codes.iter().position(|&c| c > 15) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("code {} at {i} is not a 4-bit value", codes[i]),
            });
        }
        let mut words = vec![0u32; n.div_ceil(8)];
        for (i, &c) in codes.iter().enumerate() {
            words[i / 8] |= (c as u32) << (4 * (i % 8));
        }
        let (scale, dq) = match double {
            Some(d) => {
                let mut qa = vec![0u32; blocks.div_ceil(4)];
                for (b, &c) in d.codes.iter().enumerate() {
                    qa[b / 4] |= (c as u32) << (8 * (b % 4));
                }
                let mut table = d.map.to_vec();
                table.push(d.offset);
                (
                    f32_tensor(dev, &d.absmax)?,
                    Some((words_tensor(dev, &qa)?, f32_tensor(dev, &table)?)),
                )
            }
            None => (f32_tensor(dev, absmax)?, None),
        };
        Ok(QuantWeight {
            words: words_tensor(dev, &words)?,
            scale,
            dq,
            format: QuantFormat::Nf4 {
                double_quant: double.is_some(),
            },
            out_features: out,
            in_features: inp,
        })
    }

    /// The format.
    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// Width of the input.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Width of the output.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Device bytes of the quantized weight: codes and statistics (as allocated).
    pub fn weight_bytes(&self) -> u64 {
        let dq = self
            .dq
            .as_ref()
            .map_or(0, |(a, b)| a.allocated_bytes() + b.allocated_bytes());
        self.words.allocated_bytes() + self.scale.allocated_bytes() + dq
    }

    fn kernel_weight(&self) -> Weight<'_, Tensor> {
        let (qa, dq) = match &self.dq {
            Some((qa, dq)) => (qa, dq),
            None => (&self.words, &self.scale),
        };
        let format = match self.format {
            QuantFormat::Int8 => Format::Int8 {
                kw: words_per_row(self.in_features),
            },
            QuantFormat::Nf4 { double_quant } if double_quant => Format::Nf4Double,
            QuantFormat::Nf4 { .. } => Format::Nf4,
        };
        Weight {
            w: &self.words,
            scale: &self.scale,
            qa,
            dq,
            format,
            rows: self.out_features,
            cols: self.in_features,
        }
    }

    /// `a` (M, K) · dequant(W) when `trans`, else `a` (M, R) · dequant(W)ᵀ (+ bias): f32 (M, .).
    fn matmul(&self, a: &Tensor, bias: Option<&Tensor>, trans: bool) -> Result<Tensor> {
        let m = a.numel() / a.dims().last().copied().unwrap_or(1).max(1);
        let n = if trans {
            self.in_features
        } else {
            self.out_features
        };
        let out = Tensor::uninit(a.device(), Shape::new(&[m, n])?, DType::F32)?;
        let w = self.kernel_weight();
        if !trans && self.format == QuantFormat::Int8 {
            // The forward of an int8 weight is the inference kernel's (same layout).
            let e = crate::kernels::matmul::Epilogue::None;
            qmatmul::qmatmul(a, w.w, w.scale, bias, e, (m, n, self.in_features), &out)?;
        } else {
            dqmatmul(a, &w, bias, trans, m, &out)?;
        }
        Ok(out)
    }

    /// `act(x · dequant(W)ᵀ + bias)` for x (M, in), f32 or f16 (an f16 x is computed in f32
    /// and the result cast back), the result (M, out) in x's dtype. Recorded: the gradient
    /// flows to x through `dy · dequant(W)` (the weight is frozen). A bias that requires grad
    /// is an [`Error::InvalidArgument`] (a quantized layer's bias is frozen with it); a bias
    /// that is not (out) f32 an [`Error::Shape`]; an input whose last dim is not `in` too.
    pub fn linear(
        self: &std::sync::Arc<Self>,
        x: &Tensor,
        bias: Option<&Tensor>,
        act: Activation,
    ) -> Result<Tensor> {
        const OP: &str = "QuantWeight::linear";
        let (k, r) = (self.in_features, self.out_features);
        if x.dims().last() != Some(&k) || x.rank() != 2 {
            return Err(Error::Shape {
                op: OP,
                lhs: x.dims().to_vec(),
                rhs: vec![r, k],
                reason: format!("the input must be (rows, {k})"),
            });
        }
        if let Some(b) = bias {
            if b.requires_grad() {
                return Err(Error::InvalidArgument {
                    op: OP,
                    reason: "the bias of a quantized layer is frozen; detach it".into(),
                });
            }
            if b.dims() != [r] || b.dtype() != DType::F32 {
                return Err(Error::Shape {
                    op: OP,
                    lhs: b.dims().to_vec(),
                    rhs: vec![r],
                    reason: format!("the bias must be ({r}) f32"),
                });
            }
        }
        let dtype = x.dtype();
        let x32 = x.cast(DType::F32)?;
        let y = self.matmul(&x32, bias, false)?;
        let me = self.clone();
        let y = record(OP, y, &[&x32], move || {
            Box::new(move |g, _| Ok(vec![Some(me.matmul(g, None, true)?)]))
        });
        let y = y.cast(dtype)?;
        match act {
            Activation::None => Ok(y),
            Activation::Relu => y.relu(),
            Activation::Gelu => y.gelu(),
            Activation::Tanh => y.tanh(),
            Activation::Sigmoid => y.sigmoid(),
            Activation::Silu => y.silu(),
        }
    }
}
