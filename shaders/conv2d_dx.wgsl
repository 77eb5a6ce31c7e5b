// conv2d's input gradient as an implicit-GEMM transposed convolution: per group g,
// dx[n, g cg + m, (iy, ix)] = sum over (o, ky, kx) of W[g ocg + o, m, ky, kx] * dy[n, g ocg + o,
// oy, ox] where iy = oy sh - ph + ky dh (and so for x): the taps whose output coordinate is
// whole and inside (n, oc, oh, ow) contribute. dy is gathered in place, nothing is
// materialized. Parameters: include/conv2d_params.wgsl.
//
// As in conv2d_fwd.wgsl an invocation computes TM input channels of one group times 4
// consecutive positions of the flattened (n, h, w) axis, lanes spanning positions so the weight
// loads are uniform, the positions as vector components and the rows as named variables (kept
// in registers); sums run ky, kx, o in order in f32 (bitwise repeatable), no barriers.

const WG_X: u32 = 64u;
const TM: u32 = 4u;
const TN: u32 = 4u;

// The flattened position q's sample and offset in its plane, clamped into range (positions
// past the end compute the last one's values and are not stored).
fn split_q(q: u32, total: u32, hw: u32) -> vec2<u32> {
    let qc = min(q, total - 1u);
    return vec2<u32>(qc / hw, qc % hw);
}

@compute @workgroup_size(WG_X)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(workgroup_id) wg: vec3<u32>) {
    let hw = p.h * p.w;
    let pq = p.oh * p.ow;
    let total = p.n * hw;
    let q0 = gid.x * TN;
    if (q0 >= total) {
        return;
    }
    let g = wg.y / p.m_blocks;
    let m0 = (wg.y % p.m_blocks) * TM;
    // Per position: dy's first element of this group in the sample, and the input coordinate
    // shifted by the padding (iy + ph), from which each tap's output coordinate follows.
    let s0 = split_q(q0, total, hw);
    let s1 = split_q(q0 + 1u, total, hw);
    let s2 = split_q(q0 + 2u, total, hw);
    let s3 = split_q(q0 + 3u, total, hw);
    let on = vec4<u32>(s0.x, s1.x, s2.x, s3.x);
    let oq = vec4<u32>(s0.y, s1.y, s2.y, s3.y);
    let dybase = (on * p.oc + g * p.ocg) * pq;
    let ty0 = vec4<i32>(oq / p.w + p.ph);
    let tx0 = vec4<i32>(oq % p.w + p.pw);
    let khw = p.kh * p.kw;
    // W is (oc, cg, kh, kw): row i's element (o, ky, kx) is at w{i} + o cg khw + tap.
    let last = p.cg - 1u;
    let wg0 = g * p.ocg * p.cg * khw;
    let w0 = wg0 + min(m0, last) * khw;
    let w1 = wg0 + min(m0 + 1u, last) * khw;
    let w2 = wg0 + min(m0 + 2u, last) * khw;
    let w3 = wg0 + min(m0 + 3u, last) * khw;
    let ostride = p.cg * khw;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    let zero = vec4<i32>(0);
    for (var ky = 0u; ky < p.kh; ky++) {
        let ty = ty0 - vec4<i32>(i32(ky * p.dh));
        let oy = vec4<u32>(max(ty, zero)) / p.sh;
        let in_y = (ty >= zero) & (vec4<u32>(ty) == oy * p.sh) & (oy < vec4<u32>(p.oh));
        if (!any(in_y)) {
            // No position of this invocation takes the row tap (a stride's other phase, or
            // past the edge): every term would be 0.
            continue;
        }
        for (var kx = 0u; kx < p.kw; kx++) {
            let tx = tx0 - vec4<i32>(i32(kx * p.dw));
            let ox = vec4<u32>(max(tx, zero)) / p.sw;
            let inside = in_y & (tx >= zero) & (vec4<u32>(tx) == ox * p.sw)
                & (ox < vec4<u32>(p.ow));
            if (!any(inside)) {
                continue;
            }
            let off = dybase + select(vec4<u32>(0u), oy * p.ow + ox, inside);
            let tap = ky * p.kw + kx;
            for (var o = 0u; o < p.ocg; o++) {
                let e = off + o * pq;
                let gv = select(vec4<f32>(0.0),
                                vec4<f32>(ld_dy(e.x), ld_dy(e.y), ld_dy(e.z), ld_dy(e.w)), inside);
                let k = o * ostride + tap;
                acc0 = fma(vec4<f32>(ld_wt(w0 + k)), gv, acc0);
                if (TM > 1u) {
                    acc1 = fma(vec4<f32>(ld_wt(w1 + k)), gv, acc1);
                    acc2 = fma(vec4<f32>(ld_wt(w2 + k)), gv, acc2);
                    acc3 = fma(vec4<f32>(ld_wt(w3 + k)), gv, acc3);
                }
            }
        }
    }
    store_row(m0, g, q0, total, hw, on, oq, acc0);
    if (TM > 1u) {
        store_row(m0 + 1u, g, q0, total, hw, on, oq, acc1);
        store_row(m0 + 2u, g, q0, total, hw, on, oq, acc2);
        store_row(m0 + 3u, g, q0, total, hw, on, oq, acc3);
    }
}

// Row m of the group's input channels at the four positions; rows past the group and
// positions past the end are not stored.
fn store_row(m: u32, g: u32, q0: u32, total: u32, hw: u32, on: vec4<u32>, oq: vec4<u32>,
             acc: vec4<f32>) {
    if (m >= p.cg) {
        return;
    }
    let e = (on * p.c + g * p.cg + m) * hw + oq;
    if ((hw & 1u) == 0u) {
        // As in the forward: pairs of an even plane are one packed word.
        if (q0 < total) {
            st2_dx(e.x >> 1u, acc.x, acc.y, e.x + 2u);
        }
        if (q0 + 2u < total) {
            st2_dx(e.z >> 1u, acc.z, acc.w, e.z + 2u);
        }
    } else {
        if (q0 < total) {
            st_dx(e.x, acc.x);
        }
        if (q0 + 1u < total) {
            st_dx(e.y, acc.y);
        }
        if (q0 + 2u < total) {
            st_dx(e.z, acc.z);
        }
        if (q0 + 3u < total) {
            st_dx(e.w, acc.w);
        }
    }
}
