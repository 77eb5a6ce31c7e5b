//! Dispatch of shaders/qmatmul.wgsl: C = A · dequant(W)ᵀ (+ bias) (activation) with int8
//! weights packed four per u32 and one f32 scale per output channel, dequantized in registers.

use super::matmul::{act_code, Epilogue};
use super::{assemble, Binding, Operand, Storage, QMATMUL};
use crate::device::Kernel;
use crate::{DType, Device, Result};
use std::sync::Arc;

/// Rows of C per invocation and invocations per workgroup (TM, WG in the shader): a
/// workgroup covers TM rows and 4 * WG columns.
const TM: usize = 4;
const WG: usize = 64;

/// u32 words per row of W for `k` inputs: four int8 each, the last padded with zero bytes.
pub(crate) fn words_per_row(k: usize) -> usize {
    k.div_ceil(4)
}

/// Packed f16 holds two elements per word, and an invocation stores four columns of a row:
/// with N % 4 != 0 a word can straddle two invocations' columns, so such outputs are written
/// to an f32 temporary the caller casts (the rule of the f32 matmul's stores).
pub(crate) fn needs_f32_staging(dev: &Device, n: usize, out: DType) -> bool {
    Storage::of(dev, out) == Storage::F16Packed && !n.is_multiple_of(4)
}

/// The bindings for A and C of these storages; A is read in quads when rows start on
/// 16-byte boundaries (K % 4 == 0), C written in quads when N % 4 == 0 (VEC_C).
pub(crate) fn bindings(a: Storage, c: Storage, vec_a: bool, vec_c: bool) -> Vec<Binding> {
    QMATMUL
        .with_storage(&[a, Storage::U32, Storage::F32, Storage::F32, c])
        .into_iter()
        .map(|b| Binding {
            vec4: (b.name == "a" && vec_a) || (b.name == "c" && vec_c),
            ..b
        })
        .collect()
}

fn kernel(dev: &Device, a: Storage, c: Storage, vec_a: bool, vec_c: bool) -> Result<Arc<Kernel>> {
    let key = format!(
        "qmatmul_{}_{}{}{}",
        a.tag(),
        c.tag(),
        if vec_a { "_a4" } else { "" },
        if vec_c { "_c4" } else { "" }
    );
    let flag = |b: bool| if b { 1.0 } else { 0.0 };
    // Every index is clamped or guarded against the dispatched shapes (tests cover the edges).
    dev.kernel(&key, &[("VEC_C", flag(vec_c))], true, || {
        assemble(QMATMUL.body, &bindings(a, c, vec_a, vec_c))
    })
}

/// `c` (M, N) = `a` (M, K) · dequant(W)ᵀ (+ `bias`) (`act`), W held as `words` (N rows of
/// `words_per_row(K)` raw u32, see the shader) and `scale` (N, f32); `bias` is (N) f32. `c`
/// has a's dtype, or f32 where [`needs_f32_staging`] says so. Shapes are checked by the caller.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qmatmul<T: Operand>(
    a: &T,
    words: &T,
    scale: &T,
    bias: Option<&T>,
    act: Epilogue,
    (m, n, k): (usize, usize, usize),
    c: &T,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let dev = c.device();
    let (sa, sc) = (Storage::of(dev, a.dtype()), Storage::of(dev, c.dtype()));
    debug_assert!(
        sc != Storage::F16Packed || n.is_multiple_of(4),
        "stage packed rows"
    );
    let vec_c = n.is_multiple_of(4);
    let kern = kernel(dev, sa, sc, k.is_multiple_of(4), vec_c)?;
    let epilogue = u32::from(bias.is_some()) | (act_code(act) << 1);
    let params = [m as u32, n as u32, k as u32, epilogue, 0, 0, 0, 0];
    // bias is bound even when unused (bindings are fixed); the scales stand in for it.
    let bias = bias.unwrap_or(scale);
    let groups = [n.div_ceil(4 * WG) as u32, m.div_ceil(TM) as u32, 1];
    dev.dispatch3(
        &kern,
        &params,
        &[
            a.block(),
            words.block(),
            scale.block(),
            bias.block(),
            c.block(),
        ],
        groups,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::validate_wgsl;
    use Storage::*;

    /// Every storage of A and C, with and without quad loads and stores, validates.
    #[test]
    fn every_form_validates() {
        for (a, c) in [
            (F32, F32),
            (F16, F16),
            (F16Packed, F16Packed),
            (F16Packed, F32),
        ] {
            for (vec_a, vec_c) in [(false, false), (true, false), (false, true), (true, true)] {
                let src = assemble(QMATMUL.body, &bindings(a, c, vec_a, vec_c));
                if let Err(e) = validate_wgsl(&src) {
                    panic!("qmatmul {a:?} {c:?} vec_a {vec_a} vec_c {vec_c}: {e}");
                }
            }
        }
    }

    #[test]
    fn rows_pad_to_whole_words() {
        assert_eq!(words_per_row(0), 0);
        assert_eq!(words_per_row(1), 1);
        assert_eq!(words_per_row(4), 1);
        assert_eq!(words_per_row(5), 2);
    }
}
