//! Dispatch for the row-softmax family: softmax and log-softmax along the last dim (optionally
//! with a scale, a causal mask and an additive mask fused into the row's loads), and the fused
//! softmax cross-entropy (loss and gradient in one pass per row).

use super::Operand;
use super::{
    assemble, specialize, Binding, ShaderFile, Storage, CROSS_ENTROPY, MIN_LANES, SOFTMAX,
    SOFTMAX_SG, WG,
};
use crate::device::Kernel;
use crate::{DType, Device, Result};
use std::sync::Arc;

/// Rows at least this long are shared by several invocations (mode 0); shorter rows get one
/// invocation each (mode 1), which needs no barrier and leaves no invocation idle.
const ROW_PER_WORKGROUP: usize = 64;

/// Quads per invocation held in registers (CHUNKS in the shaders), which is also what a row aims
/// for: rows up to 4 * 256 * 8 = 8192 elements are read from memory once, and with fewer
/// invocations per row more elements share each invocation's fixed costs (the merge and its
/// exps) and each workgroup's two barriers (docs/design-notes.md, "Measurements behind the
/// constants").
const CHUNKS: usize = 8;

/// Quads per lane held in registers by the subgroup kernel at most (CHUNKS in softmax_sg.wgsl):
/// with lavapipe's 8 lanes, rows up to 1024 elements are read once.
const SG_CHUNKS: usize = 32;

/// How a (rows, c) problem is launched: mode (0: `lanes` invocations per row, 1: an invocation
/// per row; a specialization, see shaders/softmax.wgsl; 2: a subgroup of `lanes` per row,
/// shaders/softmax_sg.wgsl, holding `chunks` quads per lane), workgroups, and whether the tensors
/// are vec4 bindings.
struct Launch {
    mode: u32,
    groups: u32,
    lanes: u32,
    chunks: u32,
    vec4: bool,
}

/// The launch of a (rows, c) softmax; `subgroup` is the device's fixed subgroup size, if any.
fn launch(rows: usize, c: usize, subgroup: Option<u32>) -> Launch {
    let wg = WG as usize;
    if let (Some(sg), true) = (subgroup, c >= ROW_PER_WORKGROUP) {
        let sg = sg as usize;
        return Launch {
            mode: 2,
            groups: rows.div_ceil(wg / sg) as u32,
            lanes: sg as u32,
            chunks: c
                .div_ceil(4)
                .div_ceil(sg)
                .next_power_of_two()
                .min(SG_CHUNKS) as u32,
            vec4: c.is_multiple_of(4),
        };
    }
    if c >= ROW_PER_WORKGROUP {
        let quads = c.div_ceil(4);
        let lanes = quads
            .div_ceil(CHUNKS)
            .next_power_of_two()
            .clamp(MIN_LANES, wg);
        Launch {
            mode: 0,
            groups: rows.div_ceil(wg / lanes) as u32,
            lanes: lanes as u32,
            chunks: CHUNKS as u32,
            // Every row starts on a 16-byte boundary (and a whole packed word pair).
            vec4: c.is_multiple_of(4),
        }
    } else {
        Launch {
            mode: 1,
            groups: rows.div_ceil(wg) as u32,
            lanes: 1,
            chunks: CHUNKS as u32,
            vec4: false,
        }
    }
}

/// The bindings of `file` with these storages, vec4 where `vec4[i]`.
fn bindings(file: &ShaderFile, storage: &[Storage], vec4: &[bool]) -> Vec<Binding> {
    file.with_storage(storage)
        .into_iter()
        .zip(vec4)
        .map(|(b, &v)| Binding { vec4: v, ..b })
        .collect()
}

/// The kernel of `file` for these bindings and specialized constants, cached on the device.
fn kernel(
    dev: &Device,
    file: &ShaderFile,
    bind: &[Binding],
    consts: &[(&str, u32)],
) -> Result<Arc<Kernel>> {
    let mut key = file.name.to_string();
    for (name, v) in consts {
        key += &format!("_{name}{v}");
    }
    for b in bind {
        key += &format!("_{}{}", b.storage.tag(), if b.vec4 { "x4" } else { "" });
    }
    dev.kernel(&key, &[], false, || {
        assemble(&specialize(file.body, consts), bind)
    })
}

/// Packed f16 holds two elements per 32-bit word: with an odd row length a word straddles two
/// rows, which two workgroups (or invocations) would write at once. Those outputs go through f32:
/// the caller runs the kernel into an f32 temporary and casts it.
pub(crate) fn needs_f32_staging(dev: &Device, out: DType, c: usize) -> bool {
    Storage::of(dev, out) == Storage::F16Packed && !c.is_multiple_of(2)
}

/// What softmax_masked fuses into the row loads (include/softmax_mask.wgsl), checked by the
/// caller: `scale * x + mask` with causal columns at -inf. The input is viewed as
/// (d0, d1, tq, c).
pub(crate) struct Fused<'a, T> {
    /// > 0 and finite.
    pub scale: f32,
    pub causal: bool,
    /// The additive mask (x's dtype), contiguous along c, with its strides along d0, d1 and tq
    /// (0 where it is broadcast).
    pub mask: Option<(&'a T, [u32; 3])>,
    pub d1: u32,
    pub tq: u32,
}

/// out = softmax (or log-softmax) of x along rows of length `c`, or with `fused` the softmax of
/// `scale * x + mask` (an all -inf row then gives zeros); x and out are (rows, c) contiguous, of
/// any dtypes (a mask has x's), and `out` needs no f32 staging (see [`needs_f32_staging`]).
pub(crate) fn softmax<T: Operand>(
    x: &T,
    rows: usize,
    c: usize,
    log: bool,
    fused: Option<&Fused<T>>,
    out: &T,
) -> Result<()> {
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let dev = out.device();
    debug_assert!(!needs_f32_staging(dev, out.dtype(), c), "stage packed rows");
    let l = launch(rows, c, dev.info().subgroup_size);
    // Without a mask, x stands in for the mask binding (MASK = 0 never reads it).
    let mask = fused.and_then(|f| f.mask.map(|(m, _)| m)).unwrap_or(x);
    let storage = [x, out, mask].map(|t| Storage::of(dev, t.dtype()));
    // Plain softmax leaves MASKED, CAUSAL and MASK at 0: its kernels compile to what they were
    // before the fused mask existed.
    let mut consts = vec![("LOG", u32::from(log))];
    if let Some(f) = fused {
        consts.push(("MASKED", 1));
        consts.push(("CAUSAL", u32::from(f.causal)));
        consts.push(("MASK", u32::from(f.mask.is_some())));
    }
    let k = if l.mode == 2 {
        let bind = bindings(&SOFTMAX_SG, &storage, &[l.vec4; 3]);
        consts.extend([("SG", l.lanes), ("CHUNKS", l.chunks)]);
        kernel(dev, &SOFTMAX_SG, &bind, &consts)?
    } else {
        let bind = bindings(&SOFTMAX, &storage, &[l.vec4; 3]);
        consts.push(("MODE", l.mode));
        kernel(dev, &SOFTMAX, &bind, &consts)?
    };
    let params = params(rows, c, l.lanes, fused);
    dev.dispatch(
        &k,
        &params,
        &[x.block(), out.block(), mask.block()],
        l.groups,
    )
}

/// The uniform words of include/softmax_rows.wgsl's `Params`.
fn params<T>(rows: usize, c: usize, lanes: u32, fused: Option<&Fused<T>>) -> [u32; 12] {
    let (scale, tq, d1, ms) = match fused {
        Some(f) => (f.scale, f.tq, f.d1, f.mask.map_or([0; 3], |(_, s)| s)),
        None => (1.0, 1, 1, [0; 3]),
    };
    // Causal query i sees columns k < i + diag, diag = c - tq + 1 (may be negative).
    let diag = c as i64 - tq as i64 + 1;
    [
        rows as u32,
        c as u32,
        c.div_ceil(4) as u32,
        lanes.trailing_zeros(),
        scale.to_bits(),
        tq,
        diag.clamp(i32::MIN as i64, i32::MAX as i64) as i32 as u32,
        d1,
        ms[0],
        ms[1],
        ms[2],
        0,
    ]
}

/// Cross-entropy of logits x (rows, c) against `targets` (rows, f32 class indices, checked by
/// the caller to be < c): `loss` (rows, f32) gets each row's loss and, if given, `grad` (rows, c)
/// gets (softmax - onehot) * inv_b (a gradient that needs no f32 staging, see
/// [`needs_f32_staging`]).
pub(crate) fn cross_entropy<T: Operand>(
    x: &T,
    targets: &T,
    rows: usize,
    c: usize,
    inv_b: f32,
    grad: Option<&T>,
    loss: &T,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let dev = x.device();
    debug_assert!(
        grad.is_none_or(|g| !needs_f32_staging(dev, g.dtype(), c)),
        "stage packed rows"
    );
    // Cross-entropy keeps the workgroup kernel (modes 0 and 1) on every adapter.
    let l = launch(rows, c, None);
    // Without a gradient, x stands in for the grad binding (`out`; the kernel does not touch it).
    let g = grad.unwrap_or(x);
    let bind = bindings(
        &CROSS_ENTROPY,
        &[
            Storage::of(dev, x.dtype()),
            Storage::F32,
            Storage::of(dev, g.dtype()),
            Storage::F32,
        ],
        &[l.vec4, false, l.vec4, false],
    );
    let k = kernel(
        dev,
        &CROSS_ENTROPY,
        &bind,
        &[("MODE", l.mode), ("GRAD", u32::from(grad.is_some()))],
    )?;
    // The softmax parameters, with 1 / B as the scale.
    let mut params = params::<T>(rows, c, l.lanes, None);
    params[4] = inv_b.to_bits();
    dev.dispatch(
        &k,
        &params,
        &[x.block(), targets.block(), g.block(), loss.block()],
        l.groups,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{validate_wgsl, variants};

    /// The vec4 variants (which the registry's own test does not build) and every specialization
    /// parse and validate.
    #[test]
    fn vec4_and_specialized_variants_validate() {
        for file in [&SOFTMAX, &SOFTMAX_SG, &CROSS_ENTROPY] {
            for plain in variants(file) {
                for vec4 in [false, true] {
                    let bind: Vec<Binding> = plain
                        .iter()
                        .map(|b| Binding {
                            vec4: vec4 && b.name != "t" && b.name != "loss",
                            ..*b
                        })
                        .collect();
                    for mode in [0, 1] {
                        for flag in [0, 1] {
                            // Every mask specialization once per mode (the masks read the
                            // `mask` binding only with MASK = 1).
                            let consts = [
                                ("MODE", mode),
                                ("LOG", flag),
                                ("GRAD", flag),
                                ("CHUNKS", 1 << (5 * mode)),
                                ("MASKED", flag | mode),
                                ("CAUSAL", flag),
                                ("MASK", flag ^ mode),
                            ];
                            let src = assemble(&specialize(file.body, &consts), &bind);
                            if let Err(e) = validate_wgsl(&src) {
                                panic!("{} {bind:?} {consts:?}: {e}", file.name);
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn launch_shapes() {
        let l = launch(5, 10, None);
        assert_eq!((l.mode, l.groups, l.vec4), (1, 1, false));
        // 256 quads: 32 invocations of 8 quads, 8 rows per workgroup.
        let l = launch(4096, 1024, None);
        assert_eq!((l.mode, l.groups, l.lanes), (0, 512, 32));
        assert!(l.vec4);
        let l = launch(9, 64, None);
        assert_eq!((l.mode, l.groups, l.lanes), (0, 1, 16));
        // Past 8192 elements the rest of a row is streamed.
        let l = launch(3, 8193, None);
        assert_eq!((l.mode, l.groups, l.lanes), (0, 3, 256));
        assert!(!l.vec4);
        let l = launch(3, 1000, None);
        assert_eq!(l.lanes, 32);
        // With 8-lane subgroups: a row per subgroup, 32 rows per workgroup, 32 quads per lane
        // for 1024 elements; short rows keep one invocation per row.
        let l = launch(4096, 1024, Some(8));
        assert_eq!((l.mode, l.groups, l.lanes, l.chunks), (2, 128, 8, 32));
        let l = launch(33, 100, Some(8));
        assert_eq!((l.mode, l.groups, l.chunks), (2, 2, 4));
        assert!(l.vec4);
        let l = launch(3, 5000, Some(32));
        assert_eq!((l.mode, l.groups, l.chunks), (2, 1, 32));
        assert_eq!(launch(5, 10, Some(8)).mode, 1);
    }
}
