//! Layout ops: `narrow` (a slice along any axis), `cat`, `permute` and `transpose_dims`, with
//! their validation and backward rules. Each writes a new contiguous tensor.

use super::{Shape, Tensor, MAX_RANK};
use crate::kernels::layout::{self, Span};
use crate::tensor::autograd::{grad_if, record};
use crate::{Error, Result};

/// `dims` seen as (outer, dims[axis], inner) around `axis`.
fn around(dims: &[usize], axis: usize) -> (usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis + 1..].iter().product(),
    )
}

fn check_axis(op: &'static str, dims: &[usize], axis: usize) -> Result<()> {
    if axis >= dims.len() {
        return Err(Error::InvalidArgument {
            op,
            reason: format!("axis {axis} is out of range for shape {dims:?}"),
        });
    }
    Ok(())
}

impl Tensor {
    /// Elements `start..start + len` along `axis`, as a new tensor of the same rank (torch's
    /// `narrow`). `len` may be 0. The gradient lands in a zero tensor of this tensor's shape, at
    /// that range.
    ///
    /// Errors: [`Error::InvalidArgument`] for an axis out of range, [`Error::Shape`] when
    /// `start + len` passes the axis' length.
    pub fn narrow(&self, axis: usize, start: usize, len: usize) -> Result<Tensor> {
        const OP: &str = "narrow";
        let dims = self.dims().to_vec();
        check_axis(OP, &dims, axis)?;
        if start.checked_add(len).is_none_or(|end| end > dims[axis]) {
            return Err(Error::Shape {
                op: OP,
                lhs: dims.clone(),
                rhs: vec![start, len],
                reason: format!(
                    "start {start} + length {len} passes axis {axis} of length {}",
                    dims[axis]
                ),
            });
        }
        let (outer, inner) = around(&dims, axis);
        let mut out_dims = dims.clone();
        out_dims[axis] = len;
        let out = Tensor::uninit(self.device(), Shape::new(&out_dims)?, self.dtype())?;
        let from = Span {
            axis_len: dims[axis],
            offset: start,
        };
        let to = Span {
            axis_len: len,
            offset: 0,
        };
        layout::copy_block(self, from, &out, to, (outer, len, inner))?;
        Ok(record(OP, out, &[self], || {
            Box::new(move |g, _| {
                // dx (.., dims[axis], ..) is zero but for g at start..start + len.
                let dx = Tensor::zeros(g.device(), &dims, g.dtype())?;
                layout::copy_block(g, to, &dx, from, (outer, len, inner))?;
                Ok(vec![Some(dx)])
            })
        }))
    }

    /// The tensors joined along `axis`: every other dim, the rank, the dtype and the device must
    /// agree (torch's `cat`). One tensor gives a copy. The gradient of each input is its range of
    /// the output's gradient.
    ///
    /// Errors: [`Error::InvalidArgument`] for an empty list or an axis out of range,
    /// [`Error::Shape`] for other dims or ranks that differ, [`Error::DType`],
    /// [`Error::DeviceMismatch`].
    pub fn cat(tensors: &[&Tensor], axis: usize) -> Result<Tensor> {
        const OP: &str = "cat";
        let Some(first) = tensors.first() else {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "needs at least one tensor".into(),
            });
        };
        let dims = first.dims().to_vec();
        check_axis(OP, &dims, axis)?;
        let mut total = 0usize;
        for t in tensors {
            first.same_device_and_dtype(OP, t)?;
            let d = t.dims();
            let fits = d.len() == dims.len()
                && d.iter()
                    .zip(&dims)
                    .enumerate()
                    .all(|(i, (a, b))| i == axis || a == b);
            if !fits {
                return Err(Error::Shape {
                    op: OP,
                    lhs: dims.clone(),
                    rhs: d.to_vec(),
                    reason: format!("every dim but axis {axis} must agree, and the rank"),
                });
            }
            total = total
                .checked_add(d[axis])
                .ok_or_else(|| Error::InvalidArgument {
                    op: OP,
                    reason: "the joined axis overflows".into(),
                })?;
        }
        let (outer, inner) = around(&dims, axis);
        let mut out_dims = dims.clone();
        out_dims[axis] = total;
        let out = Tensor::uninit(first.device(), Shape::new(&out_dims)?, first.dtype())?;
        // Each input's block and offset along the axis; one dispatch each, in order (a packed
        // f16 word on a boundary is finished by the later one, see shaders/strided_copy.wgsl).
        let mut ranges = Vec::with_capacity(tensors.len());
        let mut offset = 0;
        for t in tensors {
            let len = t.dims()[axis];
            let from = Span {
                axis_len: len,
                offset: 0,
            };
            let to = Span {
                axis_len: total,
                offset,
            };
            layout::copy_block(*t, from, &out, to, (outer, len, inner))?;
            ranges.push((offset, len));
            offset += len;
        }
        Ok(record(OP, out, tensors, || {
            Box::new(move |g, need| {
                ranges
                    .iter()
                    .zip(need)
                    .map(|(&(start, len), &n)| grad_if(n, || g.narrow(axis, start, len)))
                    .collect()
            })
        }))
    }

    /// The axes reordered: axis `j` of the result is axis `perm[j]` of this tensor (torch's
    /// `permute`), as a new contiguous tensor. Any rank up to 4; the gradient is the inverse
    /// permutation of the output's gradient.
    ///
    /// Errors: [`Error::InvalidArgument`] when `perm` is not a permutation of `0..rank`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        const OP: &str = "permute";
        let dims = self.dims();
        let mut seen = [false; MAX_RANK];
        let valid = perm.len() == dims.len()
            && perm
                .iter()
                .all(|&a| a < dims.len() && !std::mem::replace(&mut seen[a], true));
        if !valid {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "{perm:?} is not a permutation of the {} axes of shape {dims:?}",
                    dims.len()
                ),
            });
        }
        let out_dims: Vec<usize> = perm.iter().map(|&a| dims[a]).collect();
        let out = Tensor::uninit(self.device(), Shape::new(&out_dims)?, self.dtype())?;
        layout::permute(self, perm, &out)?;
        let mut inverse = vec![0; perm.len()];
        for (j, &a) in perm.iter().enumerate() {
            inverse[a] = j;
        }
        Ok(record(OP, out, &[self], || {
            Box::new(move |g, _| Ok(vec![Some(g.permute(&inverse)?)]))
        }))
    }

    /// Axes `a` and `b` swapped (any two, torch's `transpose(a, b)`), through [`Tensor::permute`].
    /// [`Tensor::transpose`] swaps the last two.
    ///
    /// Errors: [`Error::InvalidArgument`] for an axis out of range.
    pub fn transpose_dims(&self, a: usize, b: usize) -> Result<Tensor> {
        let rank = self.rank();
        for axis in [a, b] {
            check_axis("transpose_dims", self.dims(), axis)?;
        }
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }
}
