//! Dispatch for binary (broadcast), unary / scalar / cast, and fill kernels.

use super::{assemble, pair_groups, specialize, Storage, BINARY, FILL, UNARY};
use crate::{Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BinaryOp {
    Add = 0,
    Sub = 1,
    Mul = 2,
    Div = 3,
    /// out = a broadcast to out's shape (b ignored).
    Expand = 4,
    /// out = a where b > 0 (relu backward: a = grad, b = relu output).
    ReluBackward = 5,
    /// out = a * gelu'(b) (b = gelu input).
    GeluBackward = 6,
    /// out = a * (1 - b^2) (b = tanh output).
    TanhBackward = 7,
    /// out = a * b * (1 - b) (b = sigmoid output).
    SigmoidBackward = 8,
}

impl BinaryOp {
    /// The backward ops get a pipeline each (see shaders/binary.wgsl).
    fn has_own_pipeline(self) -> bool {
        self as u32 >= BinaryOp::Expand as u32
    }
}

/// Op codes of shaders/unary.wgsl.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UnaryOp {
    /// Copy, or cast when the output dtype differs.
    Identity = 0,
    Relu = 1,
    Neg = 2,
    AddScalar = 3,
    SubScalar = 4,
    MulScalar = 5,
    DivScalar = 6,
    /// s - x
    RSubScalar = 7,
    /// s / x
    RDivScalar = 8,
    /// gelu, tanh form.
    Gelu = 9,
    Tanh = 10,
    Sigmoid = 11,
    Exp = 12,
    /// NaN below 0.
    Log = 13,
    /// NaN below 0.
    Sqrt = 14,
    /// x^s (s finite).
    PowScalar = 15,
    /// min(max(x, s), s2), NaN kept (s, s2 not NaN).
    Clamp = 16,
}

impl UnaryOp {
    /// The ops compiled into a pipeline of their own rather than switched on at run time.
    fn has_own_pipeline(self) -> bool {
        self as u32 >= UnaryOp::Gelu as u32
    }
}

/// out = a (op) b with out's shape the broadcast of both; all three share a dtype.
pub(crate) fn binary(op: BinaryOp, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let s = Storage::of(dev, out.dtype());
    let k = if op.has_own_pipeline() {
        let key = format!("binary_op{}_{}", op as u32, s.tag());
        dev.kernel(&key, &[], false, || {
            let body = specialize(BINARY.body, &[("OP", op as u32)]);
            assemble(&body, &BINARY.with_storage(&[s, s, s]))
        })?
    } else {
        BINARY.kernel(dev, &[s, s, s])?
    };
    let shape = out.shape();
    let mut params = vec![n as u32, op as u32, 0, 0];
    params.extend(shape.dims4());
    params.extend(a.shape().broadcast_strides4(shape));
    params.extend(b.shape().broadcast_strides4(shape));
    dev.dispatch(
        &k,
        &params,
        &[a.block(), b.block(), out.block()],
        pair_groups(n),
    )
}

/// out = op(x, s); `out` may have another dtype than `x` (a cast).
pub(crate) fn unary(op: UnaryOp, x: &Tensor, s: f32, out: &Tensor) -> Result<()> {
    unary2(op, x, s, 0.0, out)
}

/// out = op(x, s, s2), for ops with two scalars (clamp).
pub(crate) fn unary2(op: UnaryOp, x: &Tensor, s: f32, s2: f32, out: &Tensor) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let storage = [Storage::of(dev, x.dtype()), Storage::of(dev, out.dtype())];
    let k = if op.has_own_pipeline() {
        // Ops past the arithmetic ones get a pipeline each (see shaders/unary.wgsl).
        let key = format!(
            "unary_op{}_{}_{}",
            op as u32,
            storage[0].tag(),
            storage[1].tag()
        );
        dev.kernel(&key, &[], false, || {
            let body = specialize(UNARY.body, &[("OP", op as u32)]);
            assemble(&body, &UNARY.with_storage(&storage))
        })?
    } else {
        UNARY.kernel(dev, &storage)?
    };
    let params = [n as u32, op as u32, s.to_bits(), s2.to_bits()];
    dev.dispatch(&k, &params, &[x.block(), out.block()], pair_groups(n))
}

pub(crate) fn fill(out: &Tensor, value: f32) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let k = FILL.kernel(dev, &[Storage::of(dev, out.dtype())])?;
    dev.dispatch(
        &k,
        &[n as u32, value.to_bits(), 0, 0],
        &[out.block()],
        pair_groups(n),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{validate_wgsl, variants};

    /// Every op with a pipeline of its own validates in every storage variant.
    #[test]
    fn specialized_unary_ops_validate() {
        for op in [
            UnaryOp::Gelu,
            UnaryOp::Tanh,
            UnaryOp::Sigmoid,
            UnaryOp::Exp,
            UnaryOp::Log,
            UnaryOp::Sqrt,
            UnaryOp::PowScalar,
            UnaryOp::Clamp,
        ] {
            assert!(op.has_own_pipeline());
            for bind in variants(&UNARY) {
                let src = assemble(&specialize(UNARY.body, &[("OP", op as u32)]), &bind);
                if let Err(e) = validate_wgsl(&src) {
                    panic!("{op:?} {bind:?}: {e}");
                }
            }
        }
        for op in [
            BinaryOp::Expand,
            BinaryOp::ReluBackward,
            BinaryOp::GeluBackward,
            BinaryOp::TanhBackward,
            BinaryOp::SigmoidBackward,
        ] {
            assert!(op.has_own_pipeline());
            for bind in variants(&BINARY) {
                let src = assemble(&specialize(BINARY.body, &[("OP", op as u32)]), &bind);
                if let Err(e) = validate_wgsl(&src) {
                    panic!("{op:?} {bind:?}: {e}");
                }
            }
        }
        assert!(!UnaryOp::Identity.has_own_pipeline());
        assert!(!UnaryOp::RDivScalar.has_own_pipeline());
    }
}
