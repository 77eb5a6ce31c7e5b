//! Rotary position embeddings (RoPE), rotate-half form as Hugging Face Llama applies them:
//! the angle table, validation and autograd here, the kernel in src/kernels/rope.rs.

use super::operand::staged_f32;
use super::Tensor;
use crate::autograd::record;
use crate::kernels::rope as kernel;
use crate::{Device, Error, Result};

const OP: &str = "rope";

/// Positions past this lose integer precision in f32 (the angle is position * frequency).
const MAX_POSITION: usize = 1 << 24;

/// The angles of positions `offset..offset + t` for heads of dim `d`: cosines and sines of
/// `(offset + p) * theta^(-2i / d)`, i < d / 2, kept on the device as one f32 (2, t, d / 2)
/// tensor so every layer's queries and keys share one upload. The frequencies are computed in
/// f32 as transformers computes them (`1 / theta^(2i / d)`), the cosines and sines in f64 and
/// rounded.
#[derive(Clone, Debug)]
pub struct Rope {
    table: Tensor,
    t: usize,
    d: usize,
}

impl Rope {
    /// The table for `t` positions from `offset`, head dim `d` (even) and base `theta`.
    ///
    /// Errors, before any device work: an odd `d` ([`Error::Shape`]); `theta` not finite and
    /// > 0, or `offset + t` past 2^24 ([`Error::InvalidArgument`]).
    pub fn new(device: &Device, t: usize, d: usize, theta: f32, offset: usize) -> Result<Rope> {
        Ok(Rope {
            table: Tensor::from_slice(device, &rope_table(t, d, theta, offset)?, &[2, t, d / 2])?,
            t,
            d,
        })
    }

    /// The (2, t, d / 2) table: cosines, then sines.
    pub fn table(&self) -> &Tensor {
        &self.table
    }
}

/// The host values of [`Rope::new`]'s table, checked.
pub fn rope_table(t: usize, d: usize, theta: f32, offset: usize) -> Result<Vec<f32>> {
    if !d.is_multiple_of(2) {
        return Err(Error::Shape {
            op: OP,
            lhs: vec![d],
            rhs: vec![],
            reason: format!("the head dim must be even to rotate its halves, got {d}"),
        });
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!("rope_theta must be finite and > 0, got {theta}"),
        });
    }
    if offset.checked_add(t).is_none_or(|end| end > MAX_POSITION) {
        return Err(Error::InvalidArgument {
            op: OP,
            reason: format!(
                "positions {offset}..{offset}+{t} pass {MAX_POSITION}, past which f32 angles lose \
                 whole positions"
            ),
        });
    }
    let half = d / 2;
    // inv_freq = 1 / theta^(2i / d) in f32, as transformers' default rope.
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / d as f32))
        .collect();
    let mut out = vec![0.0f32; 2 * t * half];
    for p in 0..t {
        for (i, &f) in inv.iter().enumerate() {
            let angle = ((offset + p) as f32 * f) as f64;
            out[p * half + i] = angle.cos() as f32;
            out[t * half + p * half + i] = angle.sin() as f32;
        }
    }
    Ok(out)
}

impl Tensor {
    /// Rotary position embedding, rotate-half form (Hugging Face Llama's `apply_rotary_pos_emb`):
    /// `self` is (B, H, T, D) with D even, position t of every head is at `offset + t`, and
    /// for i < D / 2 with angle a = (offset + t) theta^(-2i / D):
    /// `y[i] = x[i] cos a - x[i + D/2] sin a`, `y[i + D/2] = x[i + D/2] cos a + x[i] sin a`.
    /// `offset` is the count of positions already in a KV cache. Builds a [`Rope`] table; use
    /// [`Tensor::rope_with`] to share one between tensors.
    ///
    /// Errors, before any device work: those of [`Rope::new`] and [`Tensor::rope_with`].
    pub fn rope(&self, theta: f32, offset: usize) -> Result<Tensor> {
        let (t, d) = check(self)?;
        self.rope_with(&Rope::new(self.device(), t, d, theta, offset)?)
    }

    /// [`Tensor::rope`] with a table made for this T and D. One kernel, in f32 whatever the
    /// storage; the backward rotates the gradient back (the same kernel, the sines negated).
    ///
    /// Errors, before any device work: `self` not rank 4, or its T or D not the table's
    /// ([`Error::Shape`]); another device ([`Error::DeviceMismatch`]).
    pub fn rope_with(&self, rope: &Rope) -> Result<Tensor> {
        let (t, d) = check(self)?;
        if (t, d) != (rope.t, rope.d) {
            return Err(Error::Shape {
                op: OP,
                lhs: self.dims().to_vec(),
                rhs: vec![rope.t, rope.d],
                reason: format!(
                    "the table was made for T = {} and D = {}, the input is (.., {t}, {d})",
                    rope.t, rope.d
                ),
            });
        }
        if self.device() != rope.table.device() {
            return Err(Error::DeviceMismatch { op: OP });
        }
        let m = self.dims()[0] * self.dims()[1];
        let y = rotate(self, &rope.table, m, t, d, false)?;
        Ok(record(OP, y, &[self], || {
            let table = rope.table.clone();
            Box::new(move |g, _| Ok(vec![Some(rotate(g, &table, m, t, d, true)?)]))
        }))
    }
}

/// (T, D) of a rank-4 input with D even.
fn check(x: &Tensor) -> Result<(usize, usize)> {
    let &[_, _, t, d] = x.dims() else {
        return Err(Error::Shape {
            op: OP,
            lhs: x.dims().to_vec(),
            rhs: vec![],
            reason: format!(
                "the input must be (B, H, T, D), rank 4; it has rank {}",
                x.rank()
            ),
        });
    };
    if !d.is_multiple_of(2) {
        return Err(Error::Shape {
            op: OP,
            lhs: x.dims().to_vec(),
            rhs: vec![],
            reason: format!("the head dim must be even to rotate its halves, got {d}"),
        });
    }
    Ok((t, d))
}

fn rotate(
    x: &Tensor,
    table: &Tensor,
    m: usize,
    t: usize,
    d: usize,
    inverse: bool,
) -> Result<Tensor> {
    let y = Tensor::uninit(x.device(), x.shape().clone(), x.dtype())?;
    let staged = kernel::needs_staging(x.device(), x.dtype(), d);
    staged_f32(&y, staged, |y| kernel::rope(x, table, m, t, d, inverse, y))?;
    Ok(y)
}
