// Fused self-attention backward pass 1 on subgroups (CPU adapters): the queries' gradient and
// each row's delta, the math of attention_bwd_dq.wgsl in the subgroup form of
// attention_sg_fwd.wgsl. A subgroup owns BR queries (rows r0 + r) and walks the key tiles the
// forward walked, rebuilding the probabilities from the saved lse:
//   delta_r = dO_r . O_r (one subgroupAdd of the lanes' column quads; written for pass 2),
//   S = Q Kᵀ and dP = dO Vᵀ (lanes hold keys, query quads and dO quads are broadcast),
//   dS = P (dP - delta) scale with P = exp(scale S - lse),
//   dQ += dS K (lanes own column quads, dS broadcast from the lane holding the key).
// Every sum has a fixed order and the subgroup writes only its own rows: bitwise reproducible.
// `//@` lines: src/kernels/attention_sg.rs; parameters and edges: include/attention_params.wgsl.

const SG: u32 = 8u;  // lanes per subgroup
const BR: u32 = 16u; // queries per subgroup, a multiple of SG
const TC: u32 = 4u;  // keys per lane and tile
const CQ: u32 = 2u;  // column quads per lane: the head-dim bucket / (4 SG)
const VEC: u32 = 0u; // 1: D % 4 == 0, and q, k, v, o, dy and dq are bound as quads

//@ rows: q k v o dy
//@ puts: dq

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
    let base = m * p.t * p.d;
    let kvb = (m / p.group) * p.t * p.d; // kv matrix m / G
    let stats = m * p.t; // where the matrix's lse and delta start
    let d4 = (p.d + 3u) / 4u;
    //@ cols
    //@ zero: dq
    //@ dq_init
    var kend = p.t;
    if (p.causal != 0u) {
        kend = min(p.t, r0 + BR);
    }
    for (var c0 = 0u; c0 < kend; c0 += SG * TC) {
        //@ s_init: s dp
        for (var qd = 0u; qd < d4; qd++) {
            //@ s_quad: q k s
            //@ s_quad: dy v dp
        }
        //@ dq_ds
        for (var t = 0u; t < TC; t++) {
            let ct = c0 + SG * t;
            //@ acc: k ds dq
            //@ rotate: ds
        }
    }
    //@ store: dq
}
