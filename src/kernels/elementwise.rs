//! Dispatch for binary (broadcast), unary / scalar / cast, three-input select (where), and fill
//! kernels.

use super::Operand;
use super::Splits;
use super::{
    assemble, pair_groups, specialize, Binding, ShaderFile, Storage, BINARY, FILL, UNARY, WG, WHERE,
};
use crate::device::Kernel;
use crate::memory::Block;
use crate::{Device, Result};
use std::sync::Arc;

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
    /// out = a * sign(b) (b = abs input; 0 at 0).
    AbsBackward = 9,
    /// max(a, b), NaN if either is NaN.
    Maximum = 10,
    /// min(a, b), NaN if either is NaN.
    Minimum = 11,
    /// 0 where a < b, 0.5 where a == b, else 1: the share of maximum(a, b)'s gradient that
    /// goes to a (torch's split; minimum(a, b) gives a the share of (b, a)).
    Share = 12,
    /// out = a * silu'(b) (b = silu input).
    SiluBackward = 13,
    /// out = silu(a) * b: the SwiGLU product (a = gate, b = up).
    Swiglu = 14,
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
    /// |x|, NaN kept.
    Abs = 17,
    /// x * sigmoid(x).
    Silu = 18,
}

impl UnaryOp {
    /// The ops compiled into a pipeline of their own rather than switched on at run time.
    fn has_own_pipeline(self) -> bool {
        self as u32 >= UnaryOp::Gelu as u32
    }
}

/// The pipeline of an elementwise shader file: `op` specialized into OP (ops with a pipeline of
/// their own) or switched on at run time (None), and with `vec` four elements per invocation
/// through vec4 bindings (VEC).
fn kernel(
    dev: &Device,
    file: &ShaderFile,
    op: Option<u32>,
    storage: &[Storage],
    vec: bool,
    blocks: &[&Block],
) -> Result<Arc<Kernel>> {
    let splits = Splits::of(dev, blocks)?;
    let mut key = file.name.to_string();
    let mut consts = vec![("VEC", u32::from(vec))];
    if let Some(op) = op {
        key += &format!("_op{op}");
        consts.push(("OP", op));
    }
    for s in storage {
        key += "_";
        key += s.tag();
    }
    if vec {
        key += "_x4";
    }
    key += &splits.key();
    dev.kernel(&key, &[], false, || {
        let bind: Vec<Binding> = file
            .with_storage(storage)
            .into_iter()
            .map(|b| Binding { vec4: vec, ..b })
            .collect();
        assemble(&specialize(file.body, &consts), &splits.apply(bind))
    })
}

/// Workgroups for `n` elements, four per invocation with `vec`, else two.
fn groups(n: usize, vec: bool) -> u32 {
    if vec {
        (n.div_ceil(4) as u32).div_ceil(WG)
    } else {
        pair_groups(n)
    }
}

/// out = a (op) b with out's shape the broadcast of both; all three share a dtype.
pub(crate) fn binary<T: Operand>(op: BinaryOp, a: &T, b: &T, out: &T) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let s = Storage::of(dev, out.dtype());
    // Without broadcasting, whole quads: a row of four elements needs no index arithmetic.
    let vec = n.is_multiple_of(4) && a.shape() == out.shape() && b.shape() == out.shape();
    let own = op.has_own_pipeline().then_some(op as u32);
    let blocks = [a.block(), b.block(), out.block()];
    let k = kernel(dev, &BINARY, own, &[s, s, s], vec, &blocks)?;
    let shape = out.shape();
    let mut params = vec![n as u32, op as u32, 0, 0];
    params.extend(shape.dims4());
    params.extend(a.shape().broadcast_strides4(shape));
    params.extend(b.shape().broadcast_strides4(shape));
    dev.dispatch(&k, &params, &blocks, groups(n, vec))
}

/// out = op(x, s); `out` may have another dtype than `x` (a cast).
pub(crate) fn unary<T: Operand>(op: UnaryOp, x: &T, s: f32, out: &T) -> Result<()> {
    unary2(op, x, s, 0.0, out)
}

/// out = op(x, s, s2), for ops with two scalars (clamp).
pub(crate) fn unary2<T: Operand>(op: UnaryOp, x: &T, s: f32, s2: f32, out: &T) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let storage = [Storage::of(dev, x.dtype()), Storage::of(dev, out.dtype())];
    let vec = n.is_multiple_of(4);
    // Ops past the arithmetic ones get a pipeline each (see shaders/unary.wgsl).
    let own = op.has_own_pipeline().then_some(op as u32);
    let blocks = [x.block(), out.block()];
    let k = kernel(dev, &UNARY, own, &storage, vec, &blocks)?;
    let params = [n as u32, op as u32, s.to_bits(), s2.to_bits()];
    dev.dispatch(&k, &params, &blocks, groups(n, vec))
}

/// out = a where c is nonzero, else b, all three broadcast to out's shape; a, b and out share a
/// dtype, c may have another.
pub(crate) fn select<T: Operand>(c: &T, a: &T, b: &T, out: &T) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let s = Storage::of(dev, out.dtype());
    let k = WHERE.kernel(dev, &[Storage::of(dev, c.dtype()), s, s, s])?;
    let shape = out.shape();
    let mut params = vec![n as u32, 0, 0, 0];
    params.extend(shape.dims4());
    for t in [c, a, b] {
        params.extend(t.shape().broadcast_strides4(shape));
    }
    dev.dispatch(
        &k,
        &params,
        &[c.block(), a.block(), b.block(), out.block()],
        pair_groups(n),
    )
}

pub(crate) fn fill<T: Operand>(out: &T, value: f32) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let k = FILL.kernel_for(dev, &[Storage::of(dev, out.dtype())], &[], &[out.block()])?;
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
            UnaryOp::Abs,
            UnaryOp::Silu,
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
            BinaryOp::AbsBackward,
            BinaryOp::Maximum,
            BinaryOp::Minimum,
            BinaryOp::Share,
            BinaryOp::SiluBackward,
            BinaryOp::Swiglu,
        ] {
            assert!(op.has_own_pipeline());
            for bind in variants(&BINARY) {
                let src = assemble(&specialize(BINARY.body, &[("OP", op as u32)]), &bind);
                if let Err(e) = validate_wgsl(&src) {
                    panic!("{op:?} {bind:?}: {e}");
                }
            }
        }
        // Four elements per invocation, every storage (vec4 bindings), switched and specialized.
        for file in [&UNARY, &BINARY] {
            for op in [0xffffffff, 5, 12] {
                for bind in variants(file) {
                    let bind: Vec<Binding> = bind
                        .into_iter()
                        .map(|b| Binding { vec4: true, ..b })
                        .collect();
                    let body = specialize(file.body, &[("OP", op), ("VEC", 1)]);
                    if let Err(e) = validate_wgsl(&assemble(&body, &bind)) {
                        panic!("{} VEC op {op} {bind:?}: {e}", file.name);
                    }
                }
            }
        }
        assert!(!UnaryOp::Identity.has_own_pipeline());
        assert!(!UnaryOp::RDivScalar.has_own_pipeline());
    }
}
