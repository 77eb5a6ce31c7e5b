// Shared by softmax.wgsl, softmax_sg.wgsl and cross_entropy.wgsl (prepended at build time): the
// parameters at binding 0, row access, and the merge of a row's statistics across invocations.
// x and out are (rows, C), contiguous, and may be vec4 bindings (C a multiple of 4); loads and
// stores go through ld4_ / st4_ either way, with per-element guards for a row's last, partial
// quad.

struct Params {
    rows: u32,
    c: u32,          // row length (T_k)
    quads: u32,      // ceil(c / 4)
    lane_shift: u32, // log2 of the invocations per row (mode 0)
    // The rest is read only by the fused mask (include/softmax_mask.wgsl) and cross-entropy.
    scale: f32,      // y = softmax(scale * x + mask); cross-entropy: 1 / B, the mean's gradient
    tq: u32,         // rows of each (T_q, T_k) matrix: a row's query index is row % tq
    diag: i32,       // T_k - T_q + 1: causal query i sees columns k < i + diag
    d1: u32,         // the input's second dim of four (leading dims padded with 1)
    ms0: u32,        // the mask's strides along the input's first three of four dims, 0 where
    ms1: u32,        // the mask is broadcast
    msq: u32,
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

// -inf and NaN, built at run time: WGSL has no literal for them and naga rejects constant ones.
fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u | (p.c & 0u));
}

fn nan() -> f32 {
    return bitcast<f32>(0x7fc00000u | (p.c & 0u));
}

// Special values on the bits: the WGSL spec lets an adapter assume no NaN or infinity (fold
// `x != x`, compare infinities as anything) and lets `max(NaN, x)` return x (SwiftShader does).
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn is_neg_inf(x: f32) -> bool {
    return bitcast<u32>(x) == 0xff800000u;
}

// NaN, +inf or -inf.
fn not_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) == 0x7f800000u;
}

// max that keeps NaN (torch): a row's max is NaN when the row holds one, on every adapter.
fn maxn(a: f32, b: f32) -> f32 {
    return select(max(a, b), nan(), is_nan(a) || is_nan(b));
}

fn max4(v: vec4<f32>) -> f32 {
    return maxn(maxn(v.x, v.y), maxn(v.z, v.w));
}

fn sum4(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

// Elements 4q..4q+4 of the row at `base`; past the row end -inf (exp gives 0).
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

fn store4(base: u32, q: u32, y: vec4<f32>) {
    let i = 4u * q;
    if (i + 4u <= p.c) {
        st4_out(base + i, y);
        return;
    }
    for (var k = 0u; i + k < p.c; k++) {
        st_out(base + i + k, y[k]);
    }
}

// Mode 0 of softmax.wgsl and cross_entropy.wgsl gives a row 2^lane_shift invocations (16 to WG),
// WG >> lane_shift rows per workgroup, each invocation holding a (max, sum of exp(x - max)) pair.

// Invocations per row in the first merge stage.
const PARTS: u32 = 4u;
// Rows per workgroup are at most WG / MIN_LANES (include/lanes.wgsl).

var<workgroup> wm: array<f32, WG>;
var<workgroup> ws: array<f32, WG>;
var<workgroup> pm: array<f32, WG / MIN_LANES * PARTS>;
var<workgroup> ps: array<f32, WG / MIN_LANES * PARTS>;

// Merges two (max, sum of exp(x - max)) pairs. A pair with max -inf is empty (sum 0), and two
// empty pairs stay empty rather than giving exp(-inf + inf) = NaN.
fn merge(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let m = maxn(a.x, b.x);
    if (is_neg_inf(m)) {
        return vec2<f32>(m, 0.0);
    }
    return vec2<f32>(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

// The (max M, sum S of exp(x - M)) of invocation `lid`'s row from every invocation's pair
// `mine`, in two stages: PARTS invocations of the row merge lanes / PARTS pairs each (max first,
// then one exp per pair), then every invocation merges the PARTS results. Two barriers, so every
// invocation of the workgroup calls it; the order is fixed, so results are bitwise reproducible.
// A row of all -inf gives M = -inf; a row holding NaN gives M = NaN; one holding +inf, +inf.
// The callers write NaN for every row whose M is not finite (torch's answer) on the bits,
// rather than trusting NaN and infinity arithmetic to get there.
fn row_stats(lid: u32, mine: vec2<f32>) -> vec2<f32> {
    let lanes = 1u << p.lane_shift;
    let slot = lid >> p.lane_shift;
    let lane = lid & (lanes - 1u);
    wm[lid] = mine.x;
    ws[lid] = mine.y;
    workgroupBarrier();
    if (lane < PARTS) {
        let per_part = lanes / PARTS;
        let j0 = slot * lanes + lane * per_part;
        var m = wm[j0];
        for (var j = 1u; j < per_part; j++) {
            m = maxn(m, wm[j0 + j]);
        }
        var s = 0.0;
        if (!is_neg_inf(m)) {
            for (var j = 0u; j < per_part; j++) {
                s += ws[j0 + j] * exp(wm[j0 + j] - m);
            }
        }
        pm[slot * PARTS + lane] = m;
        ps[slot * PARTS + lane] = s;
    }
    workgroupBarrier();
    let p0 = slot * PARTS;
    var big_m = pm[p0];
    for (var j = 1u; j < PARTS; j++) {
        big_m = maxn(big_m, pm[p0 + j]);
    }
    var big_s = 0.0;
    for (var j = 0u; j < PARTS; j++) {
        big_s += ps[p0 + j] * exp(pm[p0 + j] - big_m);
    }
    return vec2<f32>(big_m, big_s);
}
