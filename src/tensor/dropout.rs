//! Dropout with a seeded mask: validation and autograd here, the kernel in
//! src/kernels/dropout.rs.

use super::Tensor;
use crate::kernels::dropout::{self, Mask};
use crate::tensor::autograd::record;
use crate::{Error, Result};

impl Tensor {
    /// Dropout: each element is kept with probability `1 - p` and scaled by `1 / (1 - p)`, or
    /// set to 0 (`x * 0`, so NaN stays NaN, as in torch). The mask is a pure function of
    /// `(seed, element index)`, computed in the shader with 32-bit integer hashing only, so
    /// the same seed gives the same mask on every adapter and dtype; the backward regenerates
    /// it from the seed (nothing else is saved). `p = 0` returns `self` unchanged; `p` outside
    /// `[0, 1)` (or NaN) is an [`Error::InvalidArgument`].
    ///
    /// Element i is dropped when `hash(seed, i) < round(p * 2^32)`, with
    /// `key = mix(lo ^ mix(hi ^ 0x9e3779b9))`, `hash = mix(mix(i ^ key) + key)` (wrapping),
    /// `lo` / `hi` the seed's low and high 32 bits and `mix` the lowbias32 integer hash
    /// (`x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16`).
    pub fn dropout(&self, p: f32, seed: u64) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::InvalidArgument {
                op: "dropout",
                reason: format!("p must be in [0, 1), got {p}"),
            });
        }
        if p == 0.0 {
            return Ok(self.clone());
        }
        let mask = Mask::new(p, seed);
        let out = Tensor::uninit(self.device(), self.shape().clone(), self.dtype())?;
        dropout::apply(self, mask, &out)?;
        Ok(record("dropout", out, &[self], || {
            // d(x * m)/dx = m: the same mask applied to the gradient.
            Box::new(move |g, _| {
                let dx = Tensor::uninit(g.device(), g.shape().clone(), g.dtype())?;
                dropout::apply(g, mask, &dx)?;
                Ok(vec![Some(dx)])
            })
        }))
    }
}
