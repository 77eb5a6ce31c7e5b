// conv2d's input gradient as an implicit-GEMM transposed convolution: per group g,
// dx[n, g cg + m, (iy, ix)] = sum over (o, ky, kx) of W[g ocg + o, m, ky, kx] * dy[n, g ocg + o,
// oy, ox] where iy = oy sh - ph + ky dh (and so for x): the taps whose output coordinate is
// whole and inside (n, oc, oh, ow) contribute. dy is gathered in place, nothing is
// materialized. Parameters: include/conv2d_params.wgsl.
//
// As in conv2d_fwd.wgsl an invocation computes TM input channels of one group times TN
// consecutive positions of the flattened (n, h, w) axis, lanes spanning positions so the weight
// loads are uniform; sums run ky, kx, o in order in f32 (bitwise repeatable), no barriers.

const WG_X: u32 = 64u;
const TM: u32 = 4u;
const TN: u32 = 4u;

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
    var dybase: array<u32, TN>;
    var ty0: array<i32, TN>;
    var tx0: array<i32, TN>;
    var on: array<u32, TN>;
    var oq: array<u32, TN>;
    for (var j = 0u; j < TN; j++) {
        let q = min(q0 + j, total - 1u);
        let n = q / hw;
        let r = q % hw;
        on[j] = n;
        oq[j] = r;
        dybase[j] = (n * p.oc + g * p.ocg) * pq;
        ty0[j] = i32(r / p.w + p.ph);
        tx0[j] = i32(r % p.w + p.pw);
    }
    let khw = p.kh * p.kw;
    // W is (oc, cg, kh, kw): row i's element (o, ky, kx) is at wrow[i] + o cg khw + tap.
    var wrow: array<u32, TM>;
    for (var i = 0u; i < TM; i++) {
        wrow[i] = g * p.ocg * p.cg * khw + min(m0 + i, p.cg - 1u) * khw;
    }
    let ostride = p.cg * khw;
    var acc: array<array<f32, TN>, TM>;
    for (var ky = 0u; ky < p.kh; ky++) {
        for (var kx = 0u; kx < p.kw; kx++) {
            var off: array<u32, TN>;
            var inside: array<bool, TN>;
            for (var j = 0u; j < TN; j++) {
                let ty = ty0[j] - i32(ky * p.dh);
                let tx = tx0[j] - i32(kx * p.dw);
                let oy = u32(max(ty, 0)) / p.sh;
                let ox = u32(max(tx, 0)) / p.sw;
                inside[j] = ty >= 0 && tx >= 0 && u32(ty) == oy * p.sh && u32(tx) == ox * p.sw
                    && oy < p.oh && ox < p.ow;
                off[j] = dybase[j] + select(0u, oy * p.ow + ox, inside[j]);
            }
            let tap = ky * p.kw + kx;
            for (var o = 0u; o < p.ocg; o++) {
                var gv: array<f32, TN>;
                for (var j = 0u; j < TN; j++) {
                    gv[j] = select(0.0, ld_dy(off[j] + o * pq), inside[j]);
                }
                let k = o * ostride + tap;
                for (var i = 0u; i < TM; i++) {
                    let wv = ld_wt(wrow[i] + k);
                    for (var j = 0u; j < TN; j++) {
                        acc[i][j] = fma(wv, gv[j], acc[i][j]);
                    }
                }
            }
        }
    }
    let even = (hw & 1u) == 0u;
    for (var i = 0u; i < TM; i++) {
        if (m0 + i >= p.cg) {
            break;
        }
        let ch = g * p.cg + m0 + i;
        if (even) {
            // As in the forward: pairs of an even plane are one packed word.
            for (var j = 0u; j < TN; j += 2u) {
                if (q0 + j < total) {
                    let e = (on[j] * p.c + ch) * hw + oq[j];
                    st2_dx(e >> 1u, acc[i][j], acc[i][j + 1u], e + 2u);
                }
            }
        } else {
            for (var j = 0u; j < TN; j++) {
                if (q0 + j < total) {
                    st_dx((on[j] * p.c + ch) * hw + oq[j], acc[i][j]);
                }
            }
        }
    }
}
