// Shared by attention_fwd.wgsl, attention_bwd_dq.wgsl and attention_bwd_dkv.wgsl (prepended at
// build time): the parameters at binding 0, the tile sizes, which rows a workgroup takes, the
// causal rule and the edges of a row. q, k, v, o and their gradients are (BH, T, D) contiguous
// (BH = batch * heads); lse and delta are (BH, T) f32.
//
// Each invocation owns RB rows (queries in the forward and dQ, keys in dK / dV): it holds them
// and their accumulators in registers and walks the other side in tiles of C rows, which the
// workgroup stages in workgroup memory as f32 quads, zero past T and past D. Every invocation
// reads the same staged quad at the same time (the tile row and quad are loop counters), a
// broadcast on GPUs (RB = 1 there); CPU adapters load it once per lane whatever the address,
// so there RB > 1 lets each load serve several rows. An invocation adds in a fixed order and
// writes only its own rows: no atomics, bitwise reproducible.

struct Params {
    groups: u32,   // workgroups with work: tiles * BH (a 2-D grid may have spare ones)
    tiles: u32,    // row tiles per matrix: ceil(T / (R RB))
    t: u32,        // sequence length (T_q = T_k)
    d: u32,        // head dim
    causal: u32,   // 1: query i sees keys j <= i only
    scale: f32,    // 1 / sqrt(D)
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const R: u32 = 32u; // invocations per workgroup
const RB: u32 = 1u; // rows per invocation: R * RB rows per workgroup, row li + R b for b < RB
const C: u32 = 32u; // rows of the other side per staged tile
const S: u32 = 16u; // quads per row held: the head-dim bucket / 4

// -inf, built at run time: naga rejects a constant one.
fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u | (p.t & 0u));
}

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

// Query i sees key j (both < T): j <= i when causal (softmax_masked's rule `k <= i + T_k - T_q`
// with T_q = T_k).
fn visible(i: u32, j: u32) -> bool {
    return p.causal == 0u || j <= i;
}

// Rows of the tile at `first` that exist (the last tile may be partial).
fn tile_rows(first: u32) -> u32 {
    return min(C, p.t - first);
}

// Elements of quad qd of a row that exist: none past T, fewer than 4 at the end of a row whose D
// is not a multiple of 4.
fn quad_len(row: u32, qd: u32) -> u32 {
    if (row >= p.t) {
        return 0u;
    }
    return min(4u, p.d - min(p.d, 4u * qd));
}
