// Fused self-attention forward on subgroups, for CPU adapters (lavapipe runs a subgroup as one
// SIMD thread: a per-lane load is a scalar loop there, a broadcast one register shuffle). The
// same math as attention_fwd.wgsl: o = softmax(scale * q kᵀ, causal) v with an online softmax
// over tiles of keys, saving o and lse = m + log(l) per query; the (T, T) scores are never
// stored.
//
// A subgroup owns BR queries (rows r0 + r) of one (batch, head) matrix and walks the keys in
// tiles of SG TC, two matmuls per tile in the form of shaders/matmul_sg.wgsl:
// - S = Q Kᵀ: lane l holds keys c0 + l + SG t (t < TC) and loads them a quad of D at a time;
//   each lane loads BR / SG query quads, and query r's quad reaches every lane by
//   subgroupBroadcast. s{r}_{t} is query r's score against the lane's t-th key.
// - O += P V: lane l owns the column quads l + SG c (c < CQ) of every query's output; for each
//   key of the tile, P[r, key] is broadcast from the lane holding it and the lane loads its
//   columns of that key's value row.
// The row max is a subgroupMax per query and tile; each lane keeps its own partial sum l{r},
// added by one subgroupAdd at the end (a fixed order: bitwise reproducible; no atomics, and the
// subgroup writes only its own rows). No workgroup memory, no barriers.
//
// The lines marked `//@` are expanded by src/kernels/attention_sg.rs into one statement per
// query, key slot and column quad (plain variables: CPU compilers keep arrays indexed in loops
// in memory). The key slots are walked by a loop over t that rotates slot t's probabilities
// into p{r}_0, so its body is unrolled over the SG source lanes only. Parameters, the causal
// rule and the edges of a row: include/attention_params.wgsl.

const SG: u32 = 8u;  // lanes per subgroup: the adapter's fixed subgroup size
const BR: u32 = 16u; // queries per subgroup, a multiple of SG
const TC: u32 = 4u;  // keys per lane and tile: tiles of SG TC keys
const CQ: u32 = 2u;  // column quads per lane: the head-dim bucket / (4 SG)
const VEC: u32 = 0u; // 1: D % 4 == 0, and q, k, v and o are bound as quads

//@ rows: q k v
//@ puts: o

@compute @workgroup_size(SG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(subgroup_invocation_id) lane: u32) {
    // The spare workgroups of a 2-D grid leave whole: a workgroup is one subgroup.
    let lin = wg.y * nwg.x + wg.x;
    if (lin >= p.groups) {
        return;
    }
    let m = lin / p.tiles;
    let r0 = (lin % p.tiles) * BR;
    let base = m * p.t * p.d;
    let kvb = (m / p.group) * p.t * p.d; // kv matrix m / G
    let d4 = (p.d + 3u) / 4u;
    let ninf = neg_inf();
    //@ cols
    //@ zero: o
    //@ fwd_init
    // Keys any of the subgroup's queries sees.
    var kend = p.t;
    if (p.causal != 0u) {
        kend = min(p.t, r0 + BR);
    }
    for (var c0 = 0u; c0 < kend; c0 += SG * TC) {
        //@ s_init: s
        for (var qd = 0u; qd < d4; qd++) {
            //@ s_quad: q k s
        }
        //@ fwd_softmax
        for (var t = 0u; t < TC; t++) {
            let ct = c0 + SG * t;
            //@ acc: v p o
            //@ rotate: p
        }
    }
    //@ fwd_store
}
