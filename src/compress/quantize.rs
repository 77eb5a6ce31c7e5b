//! Post-training int8 quantization of a Linear layer: symmetric, one f32 scale per output
//! channel, the int8 weights packed four per u32 on the device, and a matmul kernel
//! (shaders/qmatmul.wgsl) that dequantizes them in registers, so inference never holds the
//! f32 weights.
//!
//! Row `n` of W (out, in) gets `scale[n] = max_k |W[n, k]| / 127` and `q[n, k] =
//! round(W[n, k] / scale[n])` (half away from zero, of the f32 quotient), so
//! `|W - scale q| <= scale / 2` up to that quotient's rounding (2^-18 of a step) and every
//! q is in [-127, 127] (-128 is never used: the range is symmetric). A row of zeros gets scale
//! 0. The scales are computed on the host from one readback of the weights, a one-time cost of
//! post-training quantization.
//!
//! Bytes: the weights take `out * 16 * ceil(in / 16)` bytes (rows padded to 16 int8, the
//! kernel's loads) plus `4 * out` for the scales, about a quarter of the f32 weights'
//! `4 * out * in`.

use crate::autograd::record_nondiff;
use crate::kernels::matmul::Epilogue;
use crate::kernels::qmatmul::{self, words_per_row};
use crate::memory::Category;
use crate::nn::Linear;
use crate::{Activation, DType, Device, Error, Result, Shape, Tensor};

/// The int8 weights and per-row scales of a row-major (rows, cols) f32 matrix (see the module
/// docs for the rule). A NaN or infinite weight is an [`Error::InvalidArgument`]: it has no
/// int8 value.
pub fn quantize_rows(w: &[f32], rows: usize, cols: usize) -> Result<(Vec<i8>, Vec<f32>)> {
    if w.len() != rows * cols {
        return Err(Error::Shape {
            op: "quantize_rows",
            lhs: vec![w.len()],
            rhs: vec![rows, cols],
            reason: format!("{} values are not a ({rows}, {cols}) matrix", w.len()),
        });
    }
    if let Some(i) = w.iter().position(|v| !v.is_finite()) {
        return Err(Error::InvalidArgument {
            op: "quantize",
            reason: format!(
                "weight ({}, {}) is {}: only finite weights have an int8 value",
                i / cols.max(1),
                i % cols.max(1),
                w[i]
            ),
        });
    }
    let mut q = Vec::with_capacity(w.len());
    let mut scales = Vec::with_capacity(rows);
    for row in w.chunks(cols.max(1)).take(rows) {
        let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        scales.push(scale);
        q.extend(row.iter().map(|&v| {
            if scale == 0.0 {
                0
            } else {
                (v / scale).round().clamp(-127.0, 127.0) as i8
            }
        }));
    }
    Ok((q, scales))
}

/// Four int8 per u32 word, k = 4j + b in byte b of word j of a row; rows padded with zero
/// bytes to [`words_per_row`] words.
fn pack(q: &[i8], rows: usize, cols: usize) -> Vec<u32> {
    let kw = words_per_row(cols);
    let mut words = vec![0u32; rows * kw];
    for r in 0..rows {
        for c in 0..cols {
            words[r * kw + c / 4] |= (q[r * cols + c] as u8 as u32) << (8 * (c % 4));
        }
    }
    words
}

/// [`pack`] undone.
fn unpack(words: &[u32], rows: usize, cols: usize) -> Vec<i8> {
    let kw = words_per_row(cols);
    let mut q = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            q.push((words[r * kw + c / 4] >> (8 * (c % 4))) as u8 as i8);
        }
    }
    q
}

/// An f32 device tensor from host values, counted as parameters.
fn parameter(dev: &Device, values: &[f32], dims: &[usize]) -> Result<Tensor> {
    let t = Tensor::from_slice(dev, values, dims)?;
    dev.retag(&t, Category::Parameters);
    Ok(t)
}

/// A [`Linear`] layer with int8 weights, for inference: `y = x · dequant(W)ᵀ + b` in one
/// dispatch that dequantizes W in registers (relu and gelu fused, as in the f32 layer).
#[derive(Clone)]
pub struct QuantizedLinear {
    /// W's int8 values as raw u32 words (four per word, rows padded to 16 int8), held in an
    /// f32-typed tensor of `out * words_per_row(in)` elements: fitgrad has no integer dtype, and
    /// only the quantized matmul ever reads it (as `array<u32>`).
    words: Tensor,
    /// (out) f32.
    scale: Tensor,
    /// (out) f32.
    bias: Option<Tensor>,
    in_features: usize,
    out_features: usize,
}

impl QuantizedLinear {
    /// Quantizes `weight` (out, in), f32 or f16, with an optional `bias` (out) kept in f32.
    /// A weight that is not 2-D, or a bias of another length, is an [`Error::Shape`]; a
    /// dimension of 0 or a non-finite weight an [`Error::InvalidArgument`]; a bias on another
    /// device an [`Error::DeviceMismatch`]. All before any device work but one readback.
    pub fn quantize(weight: &Tensor, bias: Option<&Tensor>) -> Result<QuantizedLinear> {
        const OP: &str = "QuantizedLinear::quantize";
        let &[out, inp] = weight.dims() else {
            return Err(Error::Shape {
                op: OP,
                lhs: weight.dims().to_vec(),
                rhs: vec![],
                reason: "only a 2-D (out, in) weight quantizes per output channel".into(),
            });
        };
        if let Some(b) = bias {
            if b.dims() != [out] {
                return Err(Error::Shape {
                    op: OP,
                    lhs: weight.dims().to_vec(),
                    rhs: b.dims().to_vec(),
                    reason: format!("the bias must be ({out}), one value per output"),
                });
            }
            if b.device() != weight.device() {
                return Err(Error::DeviceMismatch { op: OP });
            }
        }
        let (q, scale) = quantize_rows(&weight.to_vec_f32()?, out, inp)?;
        let bias = bias.map(Tensor::to_vec_f32).transpose()?;
        QuantizedLinear::from_int8(weight.device(), &q, &scale, bias.as_deref(), out, inp)
    }

    /// Quantizes a Linear layer (its weight and bias).
    pub fn from_linear(linear: &Linear) -> Result<QuantizedLinear> {
        QuantizedLinear::quantize(&linear.weight, linear.bias.as_ref())
    }

    /// A layer from int8 values `q` (out, in) row-major, `scale` (out) and an optional
    /// `bias` (out), as a file stores them. Lengths that do not match `out` and `inp` are an
    /// [`Error::Shape`], a dimension of 0 an [`Error::InvalidArgument`].
    pub fn from_int8(
        device: &Device,
        q: &[i8],
        scale: &[f32],
        bias: Option<&[f32]>,
        out: usize,
        inp: usize,
    ) -> Result<QuantizedLinear> {
        const OP: &str = "QuantizedLinear::from_int8";
        if out == 0 || inp == 0 {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("features must be positive, got in {inp}, out {out}"),
            });
        }
        let bias_len = bias.map_or(out, <[f32]>::len);
        if q.len() != out * inp || scale.len() != out || bias_len != out {
            return Err(Error::Shape {
                op: OP,
                lhs: vec![q.len(), scale.len(), bias_len],
                rhs: vec![out, inp],
                reason: format!(
                    "need {} int8 values, {out} scales and {out} biases for a ({out}, {inp}) layer",
                    out * inp
                ),
            });
        }
        let words = pack(q, out, inp);
        Ok(QuantizedLinear {
            words: parameter(device, bytemuck::cast_slice(&words), &[words.len()])?,
            scale: parameter(device, scale, &[out])?,
            bias: bias.map(|b| parameter(device, b, &[out])).transpose()?,
            in_features: inp,
            out_features: out,
        })
    }

    /// Width of the input.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Width of the output.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The per-output scales, (out) f32.
    pub fn scale(&self) -> &Tensor {
        &self.scale
    }

    /// The bias, (out) f32.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The int8 weights read back, (out, in) row-major.
    pub fn int8(&self) -> Result<Vec<i8>> {
        let words: Vec<f32> = self.words.to_vec()?;
        Ok(unpack(
            bytemuck::cast_slice(&words),
            self.out_features,
            self.in_features,
        ))
    }

    /// `scale[n] * q[n, k]` as an f32 (out, in) tensor (for checks; inference never needs it).
    pub fn dequantize(&self) -> Result<Tensor> {
        let q = self.int8()?;
        let s = self.scale.to_vec_f32()?;
        let w: Vec<f32> = q
            .iter()
            .enumerate()
            .map(|(i, &v)| s[i / self.in_features] * v as f32)
            .collect();
        Tensor::from_slice(
            self.scale.device(),
            &w,
            &[self.out_features, self.in_features],
        )
    }

    /// Device bytes of the quantized weight: the packed int8 and the scales.
    pub fn weight_bytes(&self) -> u64 {
        self.words.allocated_bytes() + self.scale.allocated_bytes()
    }

    /// Device bytes of the layer: [`QuantizedLinear::weight_bytes`] and the bias.
    pub fn parameter_bytes(&self) -> u64 {
        self.weight_bytes() + self.bias.as_ref().map_or(0, Tensor::allocated_bytes)
    }

    /// `x · dequant(W)ᵀ + b`; x is (.., in), f32 or f16, and the result (.., out) has its
    /// dtype.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_act(x, Activation::None)
    }

    /// `act(x · dequant(W)ᵀ + b)`: relu and gelu in the same dispatch, tanh and sigmoid after
    /// it. Inference only: a backward through the result is an [`Error::Autograd`]. An input
    /// whose last dim is not `in_features` is an [`Error::Shape`], one on another device an
    /// [`Error::DeviceMismatch`].
    pub fn forward_act(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        const OP: &str = "QuantizedLinear::forward";
        let (k, n) = (self.in_features, self.out_features);
        if x.dims().last() != Some(&k) {
            return Err(Error::Shape {
                op: OP,
                lhs: x.dims().to_vec(),
                rhs: vec![n, k],
                reason: format!("input's last dim must be in_features = {k}"),
            });
        }
        if x.device() != self.scale.device() {
            return Err(Error::DeviceMismatch { op: OP });
        }
        let dev = x.device();
        let m = x.numel() / k;
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("rank >= 1") = n;
        let epilogue = match act {
            Activation::Relu => Epilogue::Relu,
            Activation::Gelu => Epilogue::Gelu,
            Activation::None | Activation::Tanh | Activation::Sigmoid | Activation::Silu => {
                Epilogue::None
            }
        };
        // out is (M, N), written as f32 where packed f16 words would be split.
        let staged = qmatmul::needs_f32_staging(dev, n, x.dtype());
        let out_dtype = if staged { DType::F32 } else { x.dtype() };
        let out = Tensor::uninit(dev, Shape::new(&dims)?, out_dtype)?;
        qmatmul::qmatmul(
            x,
            &self.words,
            &self.scale,
            self.bias.as_ref(),
            epilogue,
            (m, n, k),
            &out,
        )?;
        let out = if staged {
            out.to_dtype(x.dtype())?
        } else {
            out
        };
        let out = match act {
            Activation::Tanh => out.tanh()?,
            Activation::Sigmoid => out.sigmoid()?,
            Activation::Silu => out.silu()?,
            _ => out,
        };
        Ok(record_nondiff("QuantizedLinear::forward", out, &[x]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_and_pads_rows() {
        let q: Vec<i8> = vec![1, -1, 127, -127, 5, 0, -2, 3, 4, -128];
        // (2, 5): four words per row (16 int8, zero past the fifth).
        let w = pack(&q, 2, 5);
        assert_eq!(w.len(), 8);
        assert_eq!(w[..4], [0x81_7f_ff_01, 0x05, 0, 0]);
        assert_eq!(w[4..], [0x04_03_fe_00, 0x80, 0, 0]);
        assert_eq!(unpack(&w, 2, 5), q);
    }

    #[test]
    fn rows_quantize_symmetrically() {
        let (q, s) = quantize_rows(&[0.6, -1.0, 0.25, 0.0, 0.0, 0.0], 2, 3).unwrap();
        assert_eq!(s, [1.0 / 127.0, 0.0]);
        // 0.6 * 127 = 76.2, 0.25 * 127 = 31.75.
        assert_eq!(q, [76, -127, 32, 0, 0, 0]);
        assert!(quantize_rows(&[f32::NAN], 1, 1).is_err());
    }
}
