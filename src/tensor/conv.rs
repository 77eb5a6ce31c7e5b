//! conv2d (NCHW): options, validation and autograd here; the implicit-GEMM kernels in
//! src/kernels/conv2d.rs. A 1x1 convolution without stride, padding or groups is a matmul and
//! runs as one (but for an f16 one with a bias, which the kernel adds before rounding).

use super::invariant;
use super::operand::staged_f32;
use super::{DType, Shape, Tensor};
use crate::kernels::conv2d::{self, Geometry};
use crate::kernels::reduce;
use crate::kernels::softmax::needs_f32_staging;
use crate::tensor::autograd::{self, record};
use crate::{Error, Result};

/// How a [`Tensor::conv2d`] slides its kernel, as torch's `conv2d` arguments: (height, width)
/// pairs for stride, zero padding and dilation, and `groups` splitting the channels (groups =
/// channels is a depthwise convolution).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dOptions {
    /// Steps between windows, each >= 1.
    pub stride: [usize; 2],
    /// Zeros added on each side (any size).
    pub padding: [usize; 2],
    /// Spacing of the kernel's taps, each >= 1.
    pub dilation: [usize; 2],
    /// Channel groups: >= 1, dividing the input and output channels.
    pub groups: usize,
}

impl Default for Conv2dOptions {
    fn default() -> Self {
        Conv2dOptions {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

impl Conv2dOptions {
    /// Stride 1, no padding, dilation 1, one group.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same stride along height and width.
    pub fn stride(mut self, s: usize) -> Self {
        self.stride = [s, s];
        self
    }

    /// The same padding along height and width.
    pub fn padding(mut self, p: usize) -> Self {
        self.padding = [p, p];
        self
    }

    /// The same dilation along height and width.
    pub fn dilation(mut self, d: usize) -> Self {
        self.dilation = [d, d];
        self
    }

    /// Channel groups.
    pub fn groups(mut self, g: usize) -> Self {
        self.groups = g;
        self
    }
}

/// Output size along one axis, (size + 2 pad - dil (k - 1) - 1) / stride + 1, or `None` where
/// the dilated kernel is larger than the padded input (an output of zero or fewer).
fn out_size(size: usize, k: usize, stride: usize, pad: usize, dil: usize) -> Option<usize> {
    let padded = size as u128 + 2 * pad as u128;
    let span = dil as u128 * (k as u128 - 1) + 1;
    (padded >= span).then(|| ((padded - span) / stride as u128 + 1) as usize)
}

/// The geometry of `x` (N, C, H, W) convolved with `weight` (OC, C / groups, KH, KW) and an
/// optional bias (OC), with every user error found before device work.
fn geometry(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    opts: &Conv2dOptions,
) -> Result<Geometry> {
    const OP: &str = "conv2d";
    let shape_err = |rhs: &[usize], reason: String| Error::Shape {
        op: OP,
        lhs: x.dims().to_vec(),
        rhs: rhs.to_vec(),
        reason,
    };
    let (&[n, c, h, w], &[oc, cw, kh, kw]) = (x.dims(), weight.dims()) else {
        return Err(shape_err(
            weight.dims(),
            "conv2d takes an input (N, C, H, W) and a weight (OC, C / groups, KH, KW)".into(),
        ));
    };
    x.same_device_and_dtype(OP, weight)?;
    if let Some(b) = bias {
        x.same_device_and_dtype(OP, b)?;
        if b.dims() != [oc] {
            return Err(shape_err(
                b.dims(),
                format!("the bias must be (OC) = ({oc})"),
            ));
        }
    }
    let bad = |reason: String| Error::InvalidArgument { op: OP, reason };
    if opts.stride.contains(&0) || opts.dilation.contains(&0) {
        return Err(bad(format!(
            "stride {:?} and dilation {:?} must be >= 1",
            opts.stride, opts.dilation
        )));
    }
    let g = opts.groups;
    if g == 0 || !c.is_multiple_of(g) || !oc.is_multiple_of(g) {
        return Err(shape_err(
            weight.dims(),
            format!("groups {g} must be >= 1 and divide the input channels {c} and the output channels {oc}"),
        ));
    }
    if cw * g != c {
        return Err(shape_err(
            weight.dims(),
            format!("the weight's second dim must be C / groups = {c} / {g}, got {cw}"),
        ));
    }
    if kh == 0 || kw == 0 {
        return Err(shape_err(weight.dims(), "an empty kernel".into()));
    }
    let [sh, sw] = opts.stride;
    let [ph, pw] = opts.padding;
    let [dh, dw] = opts.dilation;
    let (Some(oh), Some(ow)) = (out_size(h, kh, sh, ph, dh), out_size(w, kw, sw, pw, dw)) else {
        return Err(shape_err(
            weight.dims(),
            format!(
                "the output would be empty or negative: input {h}x{w} with padding {ph}x{pw} is \
                 smaller than the kernel {kh}x{kw} at dilation {dh}x{dw}"
            ),
        ));
    };
    // The kernels index in u32 (the largest tensor, padded input coordinates as i32).
    let biggest = [
        n as u128 * c as u128 * h as u128 * w as u128,
        n as u128 * oc as u128 * oh as u128 * ow as u128,
        h as u128 + ph as u128 + dh as u128 * kh as u128,
        w as u128 + pw as u128 + dw as u128 * kw as u128,
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    if biggest >= i32::MAX as u128 {
        return Err(Error::Limit {
            op: OP,
            what: "elements or coordinates a conv2d kernel indexes",
            value: biggest.min(u64::MAX as u128) as u64,
            limit: i32::MAX as u64,
        });
    }
    Ok(Geometry {
        n,
        c,
        h,
        w,
        oc,
        kh,
        kw,
        stride: opts.stride,
        padding: opts.padding,
        dilation: opts.dilation,
        groups: g,
        oh,
        ow,
    })
}

impl Tensor {
    /// 2-D convolution of `self` (N, C, H, W) with `weight` (OC, C / groups, KH, KW) and an
    /// optional `bias` (OC), as torch's `conv2d`: the output is (N, OC, OH, OW) with
    /// OH = (H + 2 padding - dilation (KH - 1) - 1) / stride + 1 (and so for OW), in `self`'s
    /// dtype, accumulated in f32.
    ///
    /// Implicit GEMM: the kernels gather each input value where the product needs it, so no
    /// column buffer (im2col's N OH OW C KH KW elements) ever exists; the backward keeps only
    /// `self` and the weight, and its one workspace is the weight gradient's partial sums (at
    /// most 512 KiB). Sums run in a fixed order: bitwise repeatable.
    ///
    /// Errors, before any device work: inputs not of rank 4, groups that do not divide both
    /// channel counts, a weight or bias of another shape, or an output of size 0
    /// ([`Error::Shape`]); stride or dilation 0 ([`Error::InvalidArgument`]); dtypes
    /// ([`Error::DType`]) or devices ([`Error::DeviceMismatch`]) that differ; sizes past what a
    /// kernel can index ([`Error::Limit`]).
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        opts: &Conv2dOptions,
    ) -> Result<Tensor> {
        const OP: &str = "conv2d";
        let geo = geometry(self, weight, bias, opts)?;
        // An f16 bias added after the matmul would round twice; the kernel adds it in f32.
        let one_rounding = bias.is_none() || self.dtype() == DType::F32;
        let pointwise = geo.kh == 1 && geo.kw == 1 && geo.stride == [1, 1] && geo.padding == [0, 0];
        // Batch-invariant sums need the conv kernel's own weight gradient.
        let matmul_ok = !invariant::is_batch_invariant(self.device());
        if pointwise && geo.groups == 1 && one_rounding && matmul_ok {
            return self.conv1x1(weight, bias, &geo);
        }
        let dev = self.device();
        let dtype = self.dtype();
        let y = Tensor::uninit(dev, Shape::new(&[geo.n, geo.oc, geo.oh, geo.ow])?, dtype)?;
        let w = weight.detach();
        staged_f32(&y, needs_f32_staging(dev, dtype, geo.oh * geo.ow), |y| {
            conv2d::forward(self, &w, bias, &geo, y)
        })?;
        let mut inputs = vec![self, weight];
        inputs.extend(bias);
        let has_b = bias.is_some();
        Ok(record(OP, y, &inputs, || {
            let x = self.detach();
            Box::new(move |g, need| {
                let dev = x.device();
                let dx = autograd::grad_if(need[0], || {
                    let dx = Tensor::uninit(dev, x.shape().clone(), dtype)?;
                    let staged = conv2d::dx_needs_staging(dev, dtype, &geo);
                    staged_f32(&dx, staged, |dx| conv2d::backward_dx(g, &w, &geo, dx))?;
                    Ok(dx)
                })?;
                let dw = if !need[1] {
                    None
                } else if invariant::is_batch_invariant(dev) {
                    match invariant::fold_target(dev, 1) {
                        Some(held) => {
                            // Onto the gradient the weight holds, in place: nothing to add.
                            conv2d::backward_dw_fold(g, &x, &geo, true, &held)?;
                            None
                        }
                        None => {
                            let dw = Tensor::uninit(dev, w.shape().clone(), DType::F32)?;
                            conv2d::backward_dw_fold(g, &x, &geo, false, &dw)?;
                            Some(dw.cast(dtype)?)
                        }
                    }
                } else {
                    let dw = Tensor::uninit(dev, w.shape().clone(), DType::F32)?;
                    // Partial sums per fixed range of positions, freed at once.
                    let partials = match conv2d::dw_partials(&geo) {
                        Some(dims) => Some(Tensor::uninit(dev, Shape::new(&dims)?, DType::F32)?),
                        None => None,
                    };
                    conv2d::backward_dw(g, &x, &geo, partials.as_ref(), &dw)?;
                    drop(partials);
                    Some(dw.cast(dtype)?)
                };
                let mut grads = vec![dx, dw];
                if has_b {
                    grads.push(if need[2] { bias_grad(g, &geo)? } else { None });
                }
                Ok(grads)
            })
        }))
    }

    /// A 1x1 convolution with unit stride and one group as the matmul it is: W (OC, C) times
    /// each sample's (C, H W), recorded as that matmul, a broadcast bias add and reshapes.
    fn conv1x1(&self, weight: &Tensor, bias: Option<&Tensor>, geo: &Geometry) -> Result<Tensor> {
        let plane = geo.h * geo.w;
        let y = weight
            .reshape(&[geo.oc, geo.c])?
            .matmul(&self.reshape(&[geo.n, geo.c, plane])?)?;
        let y = match bias {
            Some(b) => y.add(&b.reshape(&[1, geo.oc, 1])?)?,
            None => y,
        };
        y.reshape(&[geo.n, geo.oc, geo.h, geo.w])
    }
}

/// The bias's gradient: dy (N, OC, OH, OW) summed over OH OW, then over N, both in f32 (an f16
/// partial sum would round twice), in dy's dtype; `None` where batch-invariant sums added it
/// onto the gradient the bias holds.
fn bias_grad(g: &Tensor, geo: &Geometry) -> Result<Option<Tensor>> {
    let dev = g.device();
    if geo.n == 0 {
        let _ng = autograd::no_grad();
        return Tensor::zeros(dev, &[geo.oc], g.dtype()).map(Some);
    }
    // per_sample is (N, OC) f32.
    let per_sample = Tensor::uninit(dev, Shape::new(&[geo.n, geo.oc])?, DType::F32)?;
    reduce::reduce(g, geo.n * geo.oc, geo.oh * geo.ow, 1, 1.0, &per_sample)?;
    let db = if invariant::is_batch_invariant(dev) {
        let onto = invariant::fold_target(dev, 2);
        invariant::fold_rows(&per_sample, geo.n, &[geo.oc], onto)?
    } else {
        let db = Tensor::uninit(dev, Shape::new(&[geo.oc])?, DType::F32)?;
        reduce::reduce(&per_sample, 1, geo.n, geo.oc, 1.0, &db)?;
        Some(db)
    };
    drop(per_sample);
    db.map(|db| db.cast(g.dtype())).transpose()
}
