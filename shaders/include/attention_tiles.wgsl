// Shared by attention_fwd.wgsl, attention_bwd_dq.wgsl and attention_bwd_dkv.wgsl (prepended at
// build time, after include/attention_params.wgsl): the tile sizes, which rows a workgroup takes
// and the rows of a staged tile.
//
// Each invocation owns RB rows (queries in the forward and dQ, keys in dK / dV): it holds them
// and their accumulators in registers and walks the other side in tiles of C rows, which the
// workgroup stages in workgroup memory as f32 quads, zero past T and past D. Every invocation
// reads the same staged quad at the same time (the tile row and quad are loop counters), a
// broadcast on GPUs (RB = 1 there); CPU adapters load it once per lane whatever the address,
// so there RB > 1 lets each load serve several rows. An invocation adds in a fixed order and
// writes only its own rows: no atomics, bitwise reproducible.

const R: u32 = 32u; // invocations per workgroup
const RB: u32 = 1u; // rows per invocation: R * RB rows per workgroup, row li + R b for b < RB
const C: u32 = 32u; // rows of the other side per staged tile
const S: u32 = 16u; // quads per row held: the head-dim bucket / 4

// The workgroup's matrix m (of BH), its first row, the element offset of its (T, D) matrices,
// and whether it has work (the spare workgroups of a 2-D grid have none).
struct Tile {
    m: u32,
    row0: u32,
    base: u32,
    live: bool,
}

fn tile_of(wg: vec3<u32>, nwg: vec3<u32>) -> Tile {
    let lin = wg.y * nwg.x + wg.x;
    let m = lin / p.tiles;
    return Tile(m, (lin % p.tiles) * R * RB, m * p.t * p.d, lin < p.groups);
}

// Rows of the tile at `first` that exist (the last tile may be partial).
fn tile_rows(first: u32) -> u32 {
    return min(C, p.t - first);
}

