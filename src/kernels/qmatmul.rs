//! Dispatch of the quantized matmul: C = A · dequant(W)ᵀ (+ bias) (activation) with int8
//! weights packed four per u32 and one f32 scale per output channel, dequantized in registers.
//! Two kernels: shaders/qmatmul_sg.wgsl where the adapter has subgroups of a fixed size of at
//! least TM lanes (rows of A shared by broadcast), shaders/qmatmul.wgsl elsewhere.

use super::matmul::{act_code, Epilogue};
use super::{assemble, specialize, Binding, Operand, Storage, QMATMUL, QMATMUL_SG};
use crate::device::Kernel;
use crate::{DType, Device, Result};
use std::sync::Arc;

/// Rows of C per workgroup of the plain kernel (TM in shaders/qmatmul.wgsl; 1 for one-row
/// inputs) and its invocations (WG there; 8 for outputs of at most 32 columns), each four
/// columns.
const TM: usize = 8;
const WG: usize = 32;
const NARROW_WG: usize = 8;
/// Rows of C per workgroup (one subgroup) of the subgroup kernel (TM in
/// shaders/qmatmul_sg.wgsl; 8 for inputs of at most 8 rows), and columns per lane (TN there;
/// 4 for outputs of at most 4 SG columns).
const SG_TM: usize = 32;
const SG_TN: usize = 8;
/// Lanes of A's rows the subgroup kernel broadcasts from: the fewest lanes it runs on.
const MIN_SG: u32 = 8;

/// u32 words per row of W for `k` inputs: four int8 each, padded with zero bytes to a whole
/// number of vec4<u32> (16 int8), which the shader loads at once.
pub(crate) fn words_per_row(k: usize) -> usize {
    4 * k.div_ceil(16)
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
            vec4: b.name == "w" || (b.name == "a" && vec_a) || (b.name == "c" && vec_c),
            ..b
        })
        .collect()
}

/// The subgroup size the subgroup kernel runs with on `dev`, if it runs there.
fn subgroup(dev: &Device) -> Option<u32> {
    dev.info().subgroup_size.filter(|&sg| sg >= MIN_SG)
}

/// The kernel for these storages and an (m, n) output on `dev`, and the columns and rows one
/// workgroup covers.
fn kernel(
    dev: &Device,
    m: usize,
    n: usize,
    a: Storage,
    c: Storage,
    vec_a: bool,
    vec_c: bool,
) -> Result<(Arc<Kernel>, usize, usize)> {
    let sg = subgroup(dev);
    // Short inputs get fewer rows per workgroup and narrow outputs fewer columns per lane (an
    // inference batch of one row, or a classifier's 10 outputs, would otherwise compute the
    // block's other rows or columns for nothing).
    let (file, tn, rows) = match sg {
        Some(sg) => {
            let tn = if n <= 4 * sg as usize { 4 } else { SG_TN };
            (&QMATMUL_SG, tn, if m <= 8 { 8 } else { SG_TM })
        }
        None => (&QMATMUL, 4, if m <= 1 { 1 } else { TM }),
    };
    let wg = if n <= 4 * NARROW_WG { NARROW_WG } else { WG };
    let lanes = sg.map_or(wg, |s| s as usize);
    let cols = tn * lanes;
    let key = format!(
        "{}{}_tm{rows}_tn{tn}_wg{lanes}_{}_{}{}{}",
        file.name,
        sg.map_or(String::new(), |s| s.to_string()),
        a.tag(),
        c.tag(),
        if vec_a { "_a4" } else { "" },
        if vec_c { "_c4" } else { "" }
    );
    let flag = |b: bool| if b { 1.0 } else { 0.0 };
    // Every index is clamped or guarded against the dispatched shapes (tests cover the edges).
    let k = dev.kernel(&key, &[("VEC_C", flag(vec_c))], true, || {
        let mut consts = vec![("TM", rows as u32)];
        match sg {
            Some(sg) => consts.extend([("SG", sg), ("TN", tn as u32)]),
            None => consts.push(("WG", wg as u32)),
        }
        assemble(
            &specialize(file.body, &consts),
            &bindings(a, c, vec_a, vec_c),
        )
    })?;
    Ok((k, cols, rows))
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
    let (kern, cols, rows) = kernel(dev, m, n, sa, sc, k.is_multiple_of(4), vec_c)?;
    let epilogue = u32::from(bias.is_some()) | (act_code(act) << 1);
    let params = [m as u32, n as u32, k as u32, epilogue, 0, 0, 0, 0];
    // bias is bound even when unused (bindings are fixed); the scales stand in for it.
    let bias = bias.unwrap_or(scale);
    let groups = [n.div_ceil(cols) as u32, m.div_ceil(rows) as u32, 1];
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
                let sg32 = specialize(QMATMUL_SG.body, &[("SG", 32)]);
                for (name, body) in [
                    ("plain", QMATMUL.body),
                    ("sg", QMATMUL_SG.body),
                    ("sg32", &sg32),
                ] {
                    let src = assemble(body, &bindings(a, c, vec_a, vec_c));
                    if let Err(e) = validate_wgsl(&src) {
                        panic!("qmatmul {name} {a:?} {c:?} vec_a {vec_a} vec_c {vec_c}: {e}");
                    }
                }
            }
        }
    }

    #[test]
    fn rows_pad_to_whole_words() {
        assert_eq!(words_per_row(0), 0);
        assert_eq!(words_per_row(1), 4);
        assert_eq!(words_per_row(16), 4);
        assert_eq!(words_per_row(17), 8);
    }
}
