//! Dispatch for shaders/index_select.wgsl: the row gather of an embedding lookup and the
//! deterministic scatter-add of its gradient.

use super::Operand;
use super::{pair_groups, Storage, INDEX_SELECT};
use crate::Result;

/// Which half of shaders/index_select.wgsl runs (its MODE).
#[derive(Clone, Copy)]
enum Mode {
    Gather = 0,
    ScatterAdd = 1,
}

fn run<T: Operand>(mode: Mode, idx: &T, x: &T, rows: usize, d: usize, out: &T) -> Result<()> {
    let n = out.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = out.device();
    let s = Storage::of(dev, out.dtype());
    let blocks = [idx.block(), x.block(), out.block()];
    let k = INDEX_SELECT.kernel_for(
        dev,
        &[Storage::U32, s, s],
        &[("MODE", mode as u32)],
        &blocks,
    )?;
    dev.dispatch(
        &k,
        &[n as u32, d as u32, rows as u32, 0],
        &blocks,
        pair_groups(n),
    )
}

/// out (n, d) = rows `ids` of `table` (V, d); `ids` holds n raw u32 words, each < V (checked by
/// the caller).
pub(crate) fn gather<T: Operand>(ids: &T, table: &T, d: usize, out: &T) -> Result<()> {
    run(Mode::Gather, ids, table, 0, d, out)
}

/// out (v, d) = the scatter-add of `g` (n, d) by the CSR lists in `csr` (raw u32 words: v + 1
/// offsets, then the positions of each row in increasing order; see the shader).
pub(crate) fn scatter_add<T: Operand>(csr: &T, g: &T, v: usize, d: usize, out: &T) -> Result<()> {
    run(Mode::ScatterAdd, csr, g, v, d, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{assemble, specialize, validate_wgsl, variants};

    /// The scatter-add specialization (the registry validates the gather) in every storage.
    #[test]
    fn both_modes_validate() {
        for bind in variants(&INDEX_SELECT) {
            for mode in [Mode::Gather, Mode::ScatterAdd] {
                let body = specialize(INDEX_SELECT.body, &[("MODE", mode as u32)]);
                if let Err(e) = validate_wgsl(&assemble(&body, &bind)) {
                    panic!("index_select MODE {} {bind:?}: {e}", mode as u32);
                }
            }
        }
    }
}
