// Shared by every attention shader, the workgroup-tiled ones (attention_*.wgsl, with
// include/attention_tiles.wgsl) and the subgroup ones (attention_sg_*.wgsl): the parameters at
// binding 0, the causal rule and the edges of a row. q, o and their gradients are (BH, T, D)
// contiguous (BH = batch * heads); k, v and theirs (BH / G, T, D) with G query heads per kv
// head (grouped-query attention; G = 1 is plain multi-head): query matrix m reads kv matrix
// m / G, never a copy. lse and delta are (BH, T) f32.

struct Params {
    groups: u32,   // workgroups with work: tiles * BH (a 2-D grid may have spare ones)
    tiles: u32,    // row blocks per matrix: ceil(T / rows per workgroup)
    t: u32,        // sequence length (T_q = T_k)
    d: u32,        // head dim
    causal: u32,   // 1: query i sees keys j <= i only
    scale: f32,    // 1 / sqrt(D)
    group: u32,    // G: query heads per kv head
    _pad1: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

// -inf, built at run time: naga rejects a constant one.
fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u | (p.t & 0u));
}

// Query i sees key j (both < T): j <= i when causal (softmax_masked's rule `k <= i + T_k - T_q`
// with T_q = T_k).
fn visible(i: u32, j: u32) -> bool {
    return p.causal == 0u || j <= i;
}

// Elements of quad qd of a row that exist: none past T, fewer than 4 at the end of a row whose D
// is not a multiple of 4.
fn quad_len(row: u32, qd: u32) -> u32 {
    if (row >= p.t) {
        return 0u;
    }
    return min(4u, p.d - min(p.d, 4u * qd));
}
