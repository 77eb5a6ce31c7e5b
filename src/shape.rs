//! Shapes of rank 0 to 4, row-major and contiguous, and numpy-style broadcasting.

use crate::{Error, Result};
use std::fmt;

/// Highest rank a tensor may have; kernels carry shapes as `vec4<u32>`.
pub const MAX_RANK: usize = 4;

/// A tensor's dims: rank 0 to [`MAX_RANK`], row-major, with at most 2^32 - 1 elements.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape of rank 0..=4 whose element count fits in the kernels' 32-bit indices.
    pub fn new(dims: &[usize]) -> Result<Self> {
        if dims.len() > MAX_RANK {
            return Err(Error::InvalidArgument {
                op: "shape",
                reason: format!(
                    "rank {} is above the maximum of {MAX_RANK}: {dims:?}",
                    dims.len()
                ),
            });
        }
        let numel = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= u32::MAX as usize);
        if numel.is_none() {
            return Err(Error::InvalidArgument {
                op: "shape",
                reason: format!("{dims:?} has more than 2^32 - 1 elements"),
            });
        }
        Ok(Shape(dims.to_vec()))
    }

    /// The rank-0 shape (one element).
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }

    /// The dims, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for rank 0).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1] * self.0[i + 1];
        }
        s
    }

    /// The broadcast of two shapes (numpy rules: align right, 1 stretches).
    pub fn broadcast(op: &'static str, a: &Shape, b: &Shape) -> Result<Shape> {
        let rank = a.rank().max(b.rank());
        let mut out = vec![0; rank];
        for (i, o) in out.iter_mut().enumerate() {
            let da = dim_from_right(a, rank - 1 - i);
            let db = dim_from_right(b, rank - 1 - i);
            *o = match (da, db) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => {
                    return Err(Error::Shape {
                        op,
                        lhs: a.0.clone(),
                        rhs: b.0.clone(),
                        reason: "cannot broadcast".into(),
                    })
                }
            };
        }
        Shape::new(&out)
    }

    /// Strides for reading `self` as if it had shape `out` (0 where broadcast), padded on the
    /// left to rank 4 so kernels can index with a fixed `vec4<u32>`.
    pub fn broadcast_strides4(&self, out: &Shape) -> [u32; 4] {
        let strides = self.strides();
        let mut res = [0u32; 4];
        for k in 0..out.rank() {
            // k counts dims from the right.
            let pos = MAX_RANK - 1 - k;
            if k < self.rank() {
                let i = self.rank() - 1 - k;
                if self.0[i] != 1 {
                    res[pos] = strides[i] as u32;
                }
            }
        }
        res
    }

    /// The dims left-padded with 1 to rank 4.
    pub fn dims4(&self) -> [u32; 4] {
        let mut res = [1u32; 4];
        for (k, &d) in self.0.iter().rev().enumerate() {
            res[MAX_RANK - 1 - k] = d as u32;
        }
        res
    }
}

fn dim_from_right(s: &Shape, k: usize) -> usize {
    if k < s.rank() {
        s.0[s.rank() - 1 - k]
    } else {
        1
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<&Shape> for Vec<usize> {
    fn from(s: &Shape) -> Self {
        s.0.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_rules() {
        let a = Shape::new(&[3, 1, 5]).unwrap();
        let b = Shape::new(&[4, 1]).unwrap();
        let o = Shape::broadcast("t", &a, &b).unwrap();
        assert_eq!(o.dims(), &[3, 4, 5]);
        assert_eq!(a.broadcast_strides4(&o), [0, 5, 0, 1]);
        assert_eq!(b.broadcast_strides4(&o), [0, 0, 1, 0]);
        assert!(
            Shape::broadcast("t", &Shape::new(&[3]).unwrap(), &Shape::new(&[4]).unwrap()).is_err()
        );
    }

    #[test]
    fn rank_and_size_limits() {
        assert!(Shape::new(&[1, 1, 1, 1, 1]).is_err());
        assert!(Shape::new(&[1 << 20, 1 << 20]).is_err());
        assert_eq!(Shape::new(&[]).unwrap().numel(), 1);
        assert_eq!(Shape::new(&[2, 0, 3]).unwrap().numel(), 0);
    }
}
