// Softmax or log-softmax along the last dim with subgroup operations: one row per subgroup, no
// workgroup memory and no barriers. Same results and special values as softmax.wgsl (a row of
// all -inf, or holding NaN or +inf, gives NaN everywhere; an all -inf row gives zeros under
// MASKED); parameters and row access come from include/softmax_rows.wgsl, the fused scale and
// masks of softmax_masked from include/softmax_mask.wgsl.
//
// Lane l of the row's subgroup takes the quads q = l + SG * c. The first CHUNKS of them stay in
// registers, so rows up to 4 * SG * CHUNKS elements are read once and written once; the rest of
// a longer row is read again for the sum and for the output. The row max M is subgroupMax of
// the lanes' maxima, S = subgroupAdd of their sums of exp(x - M): two shuffles instead of the
// two barriers and workgroup-memory merges of softmax.wgsl, which cost lavapipe more than the
// exponentials. A subgroup's reduction order is fixed, so results are bitwise reproducible.

const WG: u32 = 256u;
const SG: u32 = 8u;     // lanes per subgroup: the adapter's fixed subgroup size
const CHUNKS: u32 = 8u; // quads per lane held in registers, a power of two (specialized)
const LOG: u32 = 0u;    // 1: log_softmax, 0: softmax (specialized)

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(subgroup_invocation_id) lane: u32,
        @builtin(subgroup_id) sg: u32) {
    let ninf = neg_inf();
    let row = (wg.y * nwg.x + wg.x) * (WG / SG) + sg;
    // A subgroup past the last row keeps going without loads or stores: the subgroup operations
    // below need every lane of it, and returning early is not uniform control flow for naga.
    let quads = select(0u, p.quads, row < p.rows);
    let r = row_of(row);
    var v: array<vec4<f32>, CHUNKS>;
    var m = ninf;
    for (var c = 0u; c < CHUNKS; c++) {
        let q = lane + c * SG;
        v[c] = vec4<f32>(ninf);
        if (q < quads) {
            v[c] = row_in(r, q);
        }
        m = maxn(m, max4(v[c]));
    }
    for (var q = lane + CHUNKS * SG; q < quads; q += SG) {
        m = maxn(m, max4(row_in(r, q)));
    }
    // subgroupMax may drop a NaN as max does: a lane's NaN is counted on its own.
    let any_nan = subgroupMax(select(0u, 1u, is_nan(m)));
    let big_m = select(subgroupMax(m), nan(), any_nan != 0u);
    // exp(x - M): 0 for -inf entries and padding when M is finite; NaN everywhere for an all
    // -inf row (M = -inf) or one holding +inf, which is what the output must be.
    var s = 0.0;
    for (var c = 0u; c < CHUNKS; c++) {
        let e = exp(v[c] - big_m);
        s += sum4(e);
        if (LOG == 0u) {
            v[c] = e;
        }
    }
    for (var q = lane + CHUNKS * SG; q < quads; q += SG) {
        s += sum4(exp(row_in(r, q) - big_m));
    }
    let big_s = subgroupAdd(s);
    if (MASKED != 0u && is_neg_inf(big_m)) {
        // softmax_masked of a row masked entirely: zeros.
        for (var q = lane; q < quads; q += SG) {
            store4(r.base, q, vec4<f32>(0.0));
        }
        return;
    }
    if (not_finite(big_m)) {
        // A row holding NaN or +inf, or all -inf: NaN everywhere.
        for (var q = lane; q < quads; q += SG) {
            store4(r.base, q, vec4<f32>(nan()));
        }
        return;
    }
    if (LOG == 0u) {
        let inv = 1.0 / big_s;
        for (var c = 0u; c < CHUNKS; c++) {
            let q = lane + c * SG;
            if (q < quads) {
                store4(r.base, q, v[c] * inv);
            }
        }
        for (var q = lane + CHUNKS * SG; q < quads; q += SG) {
            store4(r.base, q, exp(row_in(r, q) - big_m) * inv);
        }
    } else {
        let ls = log(big_s);
        for (var c = 0u; c < CHUNKS; c++) {
            let q = lane + c * SG;
            if (q < quads) {
                store4(r.base, q, (v[c] - big_m) - ls);
            }
        }
        for (var q = lane + CHUNKS * SG; q < quads; q += SG) {
            store4(r.base, q, (row_in(r, q) - big_m) - ls);
        }
    }
}
