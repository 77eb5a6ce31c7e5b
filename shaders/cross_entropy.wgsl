// Fused softmax cross-entropy along the last dim, one pass per row: logits x are (B, C)
// contiguous, targets t (B) hold class indices as f32 (exact below 2^24; the host checks the
// range). For row r with max M, S = sum_j exp(x_j - M) and target k:
//   loss[r]    = (M + log S) - x[r, k]                     (f32)
//   grad[r, i] = (exp(x_i - M) / S - [i == k]) * inv_b     (written only if GRAD != 0)
// The mean of the row losses is a second dispatch (the axis reduction). A row that is all -inf,
// or holds NaN or +inf, gives NaN, as in torch.
//
// The row statistics are those of shaders/softmax.wgsl (see there for the why): mode 0 gives a
// row 2^lane_shift invocations, each holding up to CHUNKS quads in registers, and merges their
// (max, sum) pairs in two stages with two barriers; mode 1 gives a row one invocation.

struct Params {
    rows: u32,
    c: u32,          // classes
    quads: u32,      // ceil(c / 4)
    lane_shift: u32, // log2 of the invocations per row (mode 0)
    inv_b: f32,      // 1 / B: the gradient of the mean
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;
// 0: 2^lane_shift invocations per row, 1: one invocation per row. Specialized (see softmax.wgsl).
const MODE: u32 = 0u;
// 1: write grad; 0: the loss only (grad is bound but untouched). Specialized.
const GRAD: u32 = 1u;
const CHUNKS: u32 = 8u;
const PARTS: u32 = 4u;
// Rows per workgroup are at most WG / MIN_LANES.
const MIN_LANES: u32 = 16u;

var<workgroup> wm: array<f32, WG>;
var<workgroup> ws: array<f32, WG>;
var<workgroup> pm: array<f32, WG / MIN_LANES * PARTS>;
var<workgroup> ps: array<f32, WG / MIN_LANES * PARTS>;

fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u | (p.c & 0u));
}

fn max4(v: vec4<f32>) -> f32 {
    return max(max(v.x, v.y), max(v.z, v.w));
}

fn sum4(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

fn load4(base: u32, q: u32) -> vec4<f32> {
    let i = 4u * q;
    if (i + 4u <= p.c) {
        return ld4_x(base + i);
    }
    var v = vec4<f32>(neg_inf());
    for (var k = 0u; i + k < p.c; k++) {
        v[k] = ld_x(base + i + k);
    }
    return v;
}

// (softmax - onehot) * inv_b for quad q of a row whose target is `t`.
fn store_grad(base: u32, q: u32, sm: vec4<f32>, t: u32) {
    let i = 4u * q;
    let hot = select(vec4<f32>(0.0), vec4<f32>(1.0), vec4<u32>(i, i + 1u, i + 2u, i + 3u) == vec4<u32>(t));
    let y = (sm - hot) * p.inv_b;
    if (i + 4u <= p.c) {
        st4_grad(base + i, y);
        return;
    }
    for (var k = 0u; i + k < p.c; k++) {
        st_grad(base + i + k, y[k]);
    }
}

fn merge(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let m = max(a.x, b.x);
    if (m == neg_inf()) {
        return vec2<f32>(m, 0.0);
    }
    return vec2<f32>(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
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
            mc = max(mc, max4(v[c]));
        }
        let shift = select(mc, 0.0, mc == ninf);
        var sc = 0.0;
        for (var c = 0u; c < CHUNKS; c++) {
            v[c] = exp(v[c] - shift);
            sc += sum4(v[c]);
        }
        var mt = ninf;
        var st = 0.0;
        for (var q = lane + CHUNKS * lanes; q < quads; q += lanes) {
            let x = load4(base, q);
            let mn = max(mt, max4(x));
            if (mn != ninf) {
                st = st * exp(mt - mn) + sum4(exp(x - mn));
                mt = mn;
            }
        }
        let mine = merge(vec2<f32>(mc, sc), vec2<f32>(mt, st));
        wm[lid] = mine.x;
        ws[lid] = mine.y;
        workgroupBarrier();
        if (lane < PARTS) {
            let per_part = lanes / PARTS;
            let j0 = slot * lanes + lane * per_part;
            var m = wm[j0];
            for (var j = 1u; j < per_part; j++) {
                m = max(m, wm[j0 + j]);
            }
            var s = 0.0;
            if (m != ninf) {
                for (var j = 0u; j < per_part; j++) {
                    s += ws[j0 + j] * exp(wm[j0 + j] - m);
                }
            }
            pm[slot * PARTS + lane] = m;
            ps[slot * PARTS + lane] = s;
        }
        workgroupBarrier();
        if (!live) {
            return;
        }
        let p0 = slot * PARTS;
        var big_m = pm[p0];
        for (var j = 1u; j < PARTS; j++) {
            big_m = max(big_m, pm[p0 + j]);
        }
        var big_s = 0.0;
        for (var j = 0u; j < PARTS; j++) {
            big_s += ps[p0 + j] * exp(pm[p0 + j] - big_m);
        }
        let t = u32(ld_t(row));
        if (lane == 0u) {
            // All -inf: big_s is NaN, and so is the loss.
            st_loss(row, (big_m + log(big_s)) - ld_x(base + t));
        }
        if (GRAD != 0u) {
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
        m = max(m, ld_x(base + i));
    }
    var s = 0.0;
    for (var i = 0u; i < p.c; i++) {
        s += exp(ld_x(base + i) - m);
    }
    let t = u32(ld_t(row));
    st_loss(row, (m + log(s)) - ld_x(base + t));
    if (GRAD != 0u) {
        let inv = 1.0 / s;
        for (var i = 0u; i < p.c; i++) {
            let hot = select(0.0, 1.0, i == t);
            st_grad(base + i, (exp(ld_x(base + i) - m) * inv - hot) * p.inv_b);
        }
    }
}
