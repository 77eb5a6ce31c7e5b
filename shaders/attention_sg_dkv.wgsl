// Fused self-attention backward pass 2 on subgroups (CPU adapters): the keys' and values'
// gradients, the math of attention_bwd_dkv.wgsl in the subgroup form of attention_sg_fwd.wgsl
// with the roles swapped. A subgroup owns BR keys (rows r0 + r) and walks the queries that see
// them (causal: from r0 on) in tiles of SG TC, lane l holding queries c0 + l + SG t:
//   S = K Qᵀ and dP = V dOᵀ (key and value quads broadcast, query and dO quads per lane),
//   P = exp(scale S - lse) (each lane loads its queries' lse and delta),
//   dS = P (dP - delta) scale,
//   dV += P dO and dK += dS Q (lanes own column quads, P and dS broadcast from the lane
//   holding the query).
// Every sum has a fixed order and the subgroup writes only its own rows: bitwise reproducible.
// `//@` lines: src/kernels/attention_sg.rs; parameters and edges: include/attention_params.wgsl.

const SG: u32 = 8u;  // lanes per subgroup
const BR: u32 = 16u; // keys per subgroup, a multiple of SG
const TC: u32 = 4u;  // queries per lane and tile
const CQ: u32 = 2u;  // column quads per lane: the head-dim bucket / (4 SG)
const VEC: u32 = 0u; // 1: D % 4 == 0, and q, k, v, dy, dk and dv are bound as quads

//@ rows: q k v dy
//@ puts: dk dv

@compute @workgroup_size(SG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(subgroup_invocation_id) lane: u32) {
    let lin = wg.y * nwg.x + wg.x;
    if (lin >= p.groups) {
        return;
    }
    let m = lin / p.tiles;
    let r0 = (lin % p.tiles) * BR;
    let kvb = m * p.t * p.d; // m is a kv matrix, read by query matrices m G .. m G + G - 1
    let d4 = (p.d + 3u) / 4u;
    //@ cols
    //@ zero: dk dv
    // Causal: queries before the first key see none of these keys.
    var istart = 0u;
    if (p.causal != 0u) {
        istart = r0;
    }
    // Grouped-query heads: the group's query matrices in order (a fixed order, no atomics).
    for (var h = 0u; h < p.group; h++) {
        let base = (m * p.group + h) * p.t * p.d;
        let stats = (m * p.group + h) * p.t;
        for (var c0 = istart; c0 < p.t; c0 += SG * TC) {
            //@ kv_stats
            //@ s_init: s dp
            for (var qd = 0u; qd < d4; qd++) {
                //@ s_quad: k q s
                //@ s_quad: v dy dp
            }
            //@ kv_p
            for (var t = 0u; t < TC; t++) {
                let ct = c0 + SG * t;
                //@ acc: dy p dv
                //@ acc: q ds dk
                //@ rotate: p ds
            }
        }
    }
    //@ store: dk dv
}
