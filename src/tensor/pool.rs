//! 2-D pooling on (N, C, H, W) and `flatten`: validation and autograd here, kernels in
//! src/kernels/pool2d.rs. Max pooling keeps no indices: its backward finds each window's
//! largest input again from the input.

use super::{Shape, Tensor};
use crate::kernels::pool2d::{self, Pool, PoolMode};
use crate::tensor::autograd::record;
use crate::{Error, Result};

impl Tensor {
    /// Max pooling of (N, C, H, W) over `kernel` windows every `stride` with implicit -inf
    /// `padding`, as torch's `max_pool2d` (dilation 1, floor rounding): the output is (N, C, OH,
    /// OW), OH = (H + 2 padding - kernel) / stride + 1. The gradient goes to each window's first
    /// largest input (rows, then columns). Errors: not rank 4 or an empty plane, an output of
    /// size 0 ([`Error::Shape`]), a kernel or stride of 0 or padding past half the kernel
    /// ([`Error::InvalidArgument`]).
    pub fn max_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<Tensor> {
        let pool = self.fixed_pool("max_pool2d", PoolMode::Max, kernel, stride, padding)?;
        self.pool("max_pool2d", pool)
    }

    /// Average pooling, as torch's `avg_pool2d` (floor rounding): windows as
    /// [`Tensor::max_pool2d`], zero padding; `count_include_pad` divides every window by
    /// kernel[0] kernel[1] (torch's default), otherwise by the inputs it covers. Errors as
    /// [`Tensor::max_pool2d`].
    pub fn avg_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        count_include_pad: bool,
    ) -> Result<Tensor> {
        let mode = PoolMode::Avg {
            include_pad: count_include_pad,
        };
        let pool = self.fixed_pool("avg_pool2d", mode, kernel, stride, padding)?;
        self.pool("avg_pool2d", pool)
    }

    /// Adaptive average pooling to (N, C, out[0], out[1]), as torch's `adaptive_avg_pool2d`:
    /// output row i averages input rows floor(i H / OH) .. ceil((i + 1) H / OH), and so for
    /// columns. Errors: not rank 4 or an empty plane ([`Error::Shape`]), an output size of 0
    /// ([`Error::InvalidArgument`]).
    pub fn adaptive_avg_pool2d(&self, out: [usize; 2]) -> Result<Tensor> {
        const OP: &str = "adaptive_avg_pool2d";
        let [n, c, h, w] = self.nchw(OP)?;
        if out.contains(&0) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!("the output size {out:?} must be >= 1"),
            });
        }
        let pool = Pool {
            mode: PoolMode::AdaptiveAvg,
            planes: n * c,
            h,
            w,
            oh: out[0],
            ow: out[1],
            kernel: [1, 1],
            stride: [1, 1],
            padding: [0, 0],
        };
        self.pool(OP, pool)
    }

    /// The mean of each (N, C) plane, (N, C, 1, 1): [`Tensor::adaptive_avg_pool2d`] to 1 x 1.
    pub fn global_avg_pool2d(&self) -> Result<Tensor> {
        self.adaptive_avg_pool2d([1, 1])
    }

    /// Dims `start..` merged into one, as torch's `flatten(x, start)`: (N, C, H, W) with start 1
    /// is (N, C H W). Shares the memory (a reshape). Errors: `start` past the last dim
    /// ([`Error::InvalidArgument`]).
    pub fn flatten(&self, start: usize) -> Result<Tensor> {
        let dims = self.dims();
        if start >= dims.len().max(1) {
            return Err(Error::InvalidArgument {
                op: "flatten",
                reason: format!("start dim {start} of a rank-{} tensor", dims.len()),
            });
        }
        let mut out = dims[..start].to_vec();
        out.push(dims[start..].iter().product());
        self.reshape(&out)
    }

    /// (N, C, H, W), or the error for anything else (an empty plane included).
    fn nchw(&self, op: &'static str) -> Result<[usize; 4]> {
        match *self.dims() {
            [n, c, h, w] if h > 0 && w > 0 => Ok([n, c, h, w]),
            _ => Err(Error::Shape {
                op,
                lhs: self.dims().to_vec(),
                rhs: vec![],
                reason: "2-D pooling takes (N, C, H, W) with H and W >= 1".into(),
            }),
        }
    }

    /// The geometry of a fixed-window pool, checked.
    fn fixed_pool(
        &self,
        op: &'static str,
        mode: PoolMode,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<Pool> {
        let [n, c, h, w] = self.nchw(op)?;
        if kernel.contains(&0) || stride.contains(&0) {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("kernel {kernel:?} and stride {stride:?} must be >= 1"),
            });
        }
        // torch's rule: each window holds at least one input.
        if padding[0] > kernel[0] / 2 || padding[1] > kernel[1] / 2 {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("padding {padding:?} must be at most half the kernel {kernel:?}"),
            });
        }
        let out = |size: usize, i: usize| {
            (size + 2 * padding[i])
                .checked_sub(kernel[i])
                .map(|d| d / stride[i] + 1)
        };
        let (Some(oh), Some(ow)) = (out(h, 0), out(w, 1)) else {
            return Err(Error::Shape {
                op,
                lhs: self.dims().to_vec(),
                rhs: kernel.to_vec(),
                reason: format!("the kernel {kernel:?} is larger than the padded input"),
            });
        };
        Ok(Pool {
            mode,
            planes: n * c,
            h,
            w,
            oh,
            ow,
            kernel,
            stride,
            padding,
        })
    }

    /// Runs `pool` and records its backward (the input's gradient only).
    fn pool(&self, op: &'static str, pool: Pool) -> Result<Tensor> {
        let elems = (pool.planes as u128) * (pool.h.max(pool.oh) * pool.w.max(pool.ow)) as u128;
        if elems >= u32::MAX as u128 {
            return Err(Error::Limit {
                op,
                what: "elements a pooling kernel indexes",
                value: elems.min(u64::MAX as u128) as u64,
                limit: u32::MAX as u64,
            });
        }
        let [n, c, _, _] = self.nchw(op)?;
        let out = Tensor::uninit(
            self.device(),
            Shape::new(&[n, c, pool.oh, pool.ow])?,
            self.dtype(),
        )?;
        pool2d::forward(self, &pool, &out)?;
        Ok(record(op, out, &[self], || {
            // Only the max needs the input again; averages keep nothing.
            let x = (pool.mode == PoolMode::Max).then(|| self.detach());
            let (shape, dtype) = (self.shape().clone(), self.dtype());
            Box::new(move |g, _| {
                let dx = Tensor::uninit(g.device(), shape.clone(), dtype)?;
                pool2d::backward(x.as_ref().unwrap_or(g), g, &pool, &dx)?;
                Ok(vec![Some(dx)])
            })
        }))
    }
}
