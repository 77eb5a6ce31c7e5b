// Fused softmax cross-entropy along the last dim, one pass per row: logits x are (B, C)
// contiguous, targets t (B) hold class indices as f32 (exact below 2^24; the host checks the
// range). For row r with max M, S = sum_j exp(x_j - M) and target k:
//   loss[r]   = (M + log S) - x[r, k]                       (f32)
//   out[r, i] = (exp(x_i - M) / S - [i == k]) * p.scale     (the gradient, p.scale = 1 / B;
//                                                            written only if GRAD != 0)
// The mean of the row losses is a second dispatch (the axis reduction). A row that is all -inf,
// or holds NaN or +inf, gives NaN, as in torch.
//
// The row statistics are those of shaders/softmax.wgsl (see there for the why), and so are the
// parameters, row access and merges (include/softmax_rows.wgsl): mode 0 gives a row
// 2^lane_shift invocations, each holding up to CHUNKS quads in registers, and merges their
// (max, sum) pairs in two stages with two barriers (`row_stats`); mode 1 gives a row one
// invocation.

const WG: u32 = 256u;
// 0: 2^lane_shift invocations per row, 1: one invocation per row. Specialized (see softmax.wgsl).
const MODE: u32 = 0u;
// 1: write the gradient to out; 0: the loss only (out is bound but untouched). Specialized.
const GRAD: u32 = 1u;
const CHUNKS: u32 = 8u;

// (softmax - onehot) * p.scale for quad q of a row whose target is `t`.
fn store_grad(base: u32, q: u32, sm: vec4<f32>, t: u32) {
    let i = 4u * q;
    let hot = select(vec4<f32>(0.0), vec4<f32>(1.0), vec4<u32>(i, i + 1u, i + 2u, i + 3u) == vec4<u32>(t));
    store4(base, q, (sm - hot) * p.scale);
}

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
        let base = row * p.c;
        var v: array<vec4<f32>, CHUNKS>;
        var mc = ninf;
        for (var c = 0u; c < CHUNKS; c++) {
            let q = lane + c * lanes;
            if (q < quads) {
                v[c] = load4(base, q);
            } else {
                v[c] = vec4<f32>(ninf);
            }
            mc = maxn(mc, max4(v[c]));
        }
        let shift = select(mc, 0.0, is_neg_inf(mc));
        var sc = 0.0;
        for (var c = 0u; c < CHUNKS; c++) {
            v[c] = exp(v[c] - shift);
            sc += sum4(v[c]);
        }
        var mt = ninf;
        var st = 0.0;
        for (var q = lane + CHUNKS * lanes; q < quads; q += lanes) {
            let x = load4(base, q);
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
        let t = u32(ld_t(row));
        // A row holding NaN or +inf, or all -inf: a NaN loss and gradient.
        let bad = not_finite(big_m);
        if (lane == 0u) {
            st_loss(row, select((big_m + log(big_s)) - ld_x(base + t), nan(), bad));
        }
        if (GRAD != 0u && bad) {
            for (var q = lane; q < quads; q += lanes) {
                store4(base, q, vec4<f32>(nan()));
            }
        } else if (GRAD != 0u) {
            let factor = exp(mc - big_m) / big_s;
            let inv = 1.0 / big_s;
            for (var c = 0u; c < CHUNKS; c++) {
                let q = lane + c * lanes;
                if (q < quads) {
                    store_grad(base, q, v[c] * factor, t);
                }
            }
            for (var q = lane + CHUNKS * lanes; q < quads; q += lanes) {
                store_grad(base, q, exp(load4(base, q) - big_m) * inv, t);
            }
        }
        return;
    }
    // mode 1: row `group * WG + lid`, three passes.
    let row = group * WG + lid;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.c;
    var m = ninf;
    for (var i = 0u; i < p.c; i++) {
        m = maxn(m, ld_x(base + i));
    }
    var s = 0.0;
    for (var i = 0u; i < p.c; i++) {
        s += exp(ld_x(base + i) - m);
    }
    let t = u32(ld_t(row));
    let bad = not_finite(m);
    st_loss(row, select((m + log(s)) - ld_x(base + t), nan(), bad));
    if (GRAD != 0u && bad) {
        for (var i = 0u; i < p.c; i++) {
            st_out(base + i, nan());
        }
    } else if (GRAD != 0u) {
        let inv = 1.0 / s;
        for (var i = 0u; i < p.c; i++) {
            let hot = select(0.0, 1.0, i == t);
            st_out(base + i, (exp(ld_x(base + i) - m) * inv - hot) * p.scale);
        }
    }
}
