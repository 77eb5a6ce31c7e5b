// Softmax or log-softmax along the last dim: x and out are (rows, C), contiguous. Statistics and
// exponentials in f32 whatever the storage.
//
// For a row with max M and S = sum_j exp(x_j - M):
//   softmax     y_i = exp(x_i - M) / S
//   log_softmax y_i = (x_i - M) - log(S)
// Subtracting M keeps every exponential in [0, 1], so 1e30 works. A -inf entry gives 0 (or -inf);
// a row that is all -inf gives NaN, and a row holding NaN or +inf gives NaN everywhere (torch).
//
// mode 0: `lanes` invocations per row (a power of two, 16 to WG), WG / lanes rows per
// workgroup. `lanes` is chosen so each invocation has up to CHUNKS quads: the per-invocation
// overhead and the barriers are then shared by enough elements. Each invocation takes the vec4
// quads q = lane + lanes * c of its row and keeps the first CHUNKS of them in registers: it finds
// their max m and sum s of exp(x - m) (the row is read once), then streams any further quads
// with an online (m, s) update. The (m, s) pairs of a row merge in two stages (`row_stats` in
// include/softmax_rows.wgsl: two barriers per workgroup). The order is fixed, so results are
// bitwise reproducible. Quads in registers are written without reading x again; streamed ones
// are read a second time.
// mode 1, short rows: one invocation per row, three passes over the row.
// Where the adapter has subgroups of a fixed size, softmax_sg.wgsl replaces mode 0.
// Parameters and row access: include/softmax_rows.wgsl; the fused scale and masks of
// softmax_masked (MASKED, a specialization, which also turns an all -inf row into zeros):
// include/softmax_mask.wgsl.

const WG: u32 = 256u;
// Quads per invocation held in registers; rows up to 4 * lanes * CHUNKS elements are read once.
const CHUNKS: u32 = 8u;
// 1: log_softmax, 0: softmax. Specialized.
const LOG: u32 = 0u;
// 0: 2^lane_shift invocations per row, 1: one invocation per row. Specialized, not a uniform:
// lavapipe recompiles a shader at every dispatch when inlining a uniform would remove half of it.
const MODE: u32 = 0u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let group = wg.y * nwg.x + wg.x;
    let ninf = neg_inf();
    if (MODE == 0u) {
        // Every invocation reaches both barriers; those of a row past the end only skip the
        // loads and stores (`live`).
        let lanes = 1u << p.lane_shift;
        let slot = lid >> p.lane_shift;
        let lane = lid & (lanes - 1u);
        let row = group * (WG >> p.lane_shift) + slot;
        let live = row < p.rows;
        let quads = select(0u, p.quads, live);
        let r = row_of(row);
        // Quads in registers: their max, then exp(x - max) (kept for softmax) and its sum.
        var v: array<vec4<f32>, CHUNKS>;
        var mc = ninf;
        for (var c = 0u; c < CHUNKS; c++) {
            let q = lane + c * lanes;
            if (q < quads) {
                v[c] = row_in(r, q);
            } else {
                v[c] = vec4<f32>(ninf);
            }
            mc = maxn(mc, max4(v[c]));
        }
        // A lane that holds only -inf subtracts 0: its exponentials are 0, not NaN.
        let shift = select(mc, 0.0, is_neg_inf(mc));
        var sc = 0.0;
        for (var c = 0u; c < CHUNKS; c++) {
            let e = exp(v[c] - shift);
            sc += sum4(e);
            if (LOG == 0u) {
                v[c] = e;
            }
        }
        // Quads past the registers: online update.
        var mt = ninf;
        var st = 0.0;
        for (var q = lane + CHUNKS * lanes; q < quads; q += lanes) {
            let x = row_in(r, q);
            let mn = maxn(mt, max4(x));
            if (!is_neg_inf(mn)) {
                st = st * exp(mt - mn) + sum4(exp(x - mn));
                mt = mn;
            }
        }
        let stats = row_stats(lid, merge(vec2<f32>(mc, sc), vec2<f32>(mt, st)));
        if (!live) {
            return;
        }
        let big_m = stats.x;
        let big_s = stats.y;
        if (MASKED != 0u && is_neg_inf(big_m)) {
            // softmax_masked of a row masked entirely: zeros.
            for (var q = lane; q < quads; q += lanes) {
                store4(r.base, q, vec4<f32>(0.0));
            }
            return;
        }
        if (not_finite(big_m)) {
            // A row holding NaN or +inf, or all -inf: NaN everywhere.
            for (var q = lane; q < quads; q += lanes) {
                store4(r.base, q, vec4<f32>(nan()));
            }
            return;
        }
        // An all -inf row: big_m = -inf and every output NaN (the expressions below give it).
        if (LOG == 0u) {
            // exp(mc - M) is 0 for a lane of -inf (M finite) and NaN for an all -inf row.
            let factor = exp(mc - big_m) / big_s;
            let inv = 1.0 / big_s;
            for (var c = 0u; c < CHUNKS; c++) {
                let q = lane + c * lanes;
                if (q < quads) {
                    store4(r.base, q, v[c] * factor);
                }
            }
            for (var q = lane + CHUNKS * lanes; q < quads; q += lanes) {
                store4(r.base, q, exp(row_in(r, q) - big_m) * inv);
            }
        } else {
            let ls = select(log(big_s), nan(), big_m == ninf);
            for (var c = 0u; c < CHUNKS; c++) {
                let q = lane + c * lanes;
                if (q < quads) {
                    store4(r.base, q, (v[c] - big_m) - ls);
                }
            }
            for (var q = lane + CHUNKS * lanes; q < quads; q += lanes) {
                store4(r.base, q, (row_in(r, q) - big_m) - ls);
            }
        }
        return;
    }
    // mode 1: row `group * WG + lid`, three passes.
    let row = group * WG + lid;
    if (row >= p.rows) {
        return;
    }
    let r = row_of(row);
    let base = r.base;
    var m = ninf;
    for (var i = 0u; i < p.c; i++) {
        m = maxn(m, row_at(r, i));
    }
    if (MASKED != 0u && is_neg_inf(m)) {
        for (var i = 0u; i < p.c; i++) {
            st_out(base + i, 0.0);
        }
        return;
    }
    if (not_finite(m)) {
        // A row holding NaN or +inf, or all -inf: NaN everywhere.
        for (var i = 0u; i < p.c; i++) {
            st_out(base + i, nan());
        }
        return;
    }
    var s = 0.0;
    for (var i = 0u; i < p.c; i++) {
        s += exp(row_at(r, i) - m);
    }
    // All -inf: m = -inf, x - m = NaN, s NaN, every output NaN.
    if (LOG == 0u) {
        let inv = 1.0 / s;
        for (var i = 0u; i < p.c; i++) {
            st_out(base + i, exp(row_at(r, i) - m) * inv);
        }
    } else {
        let ls = log(s);
        for (var i = 0u; i < p.c; i++) {
            st_out(base + i, (row_at(r, i) - m) - ls);
        }
    }
}
