// conv2d forward as an implicit GEMM: per group g, y[n, g ocg + m, q] = sum_k W[g ocg + m, k] *
// X[k, (n, q)] + b, with k = (ci, ky, kx) over cg kh kw and X the column matrix that im2col would
// build; here each X value is gathered from x when it is needed, so no column buffer exists.
// Parameters: include/conv2d_params.wgsl.
//
// An invocation computes a TM x TN block: TM output channels of one group times TN consecutive
// output positions of the flattened (n, oh, ow) axis. The workgroup's lanes span positions and
// share the channels, so every weight load is the same address in every lane (one scalar load
// on a CPU adapter) and only the input is gathered per lane. Sums run ci, ky, kx in order in
// f32: bitwise the same every run. No barriers, so lanes past the end return at once.

const WG_X: u32 = 64u;
const TM: u32 = 4u;
const TN: u32 = 4u;

@compute @workgroup_size(WG_X)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(workgroup_id) wg: vec3<u32>) {
    let hw = p.h * p.w;
    let pq = p.oh * p.ow;
    let total = p.n * pq;
    let q0 = gid.x * TN;
    if (q0 >= total) {
        return;
    }
    let g = wg.y / p.m_blocks;
    let m0 = (wg.y % p.m_blocks) * TM;
    // Per position: the sample's first input element of this group, the window's top-left input
    // coordinate, and the output's sample and offset in its plane.
    var xbase: array<u32, TN>;
    var iy0: array<i32, TN>;
    var ix0: array<i32, TN>;
    var on: array<u32, TN>;
    var oq: array<u32, TN>;
    for (var j = 0u; j < TN; j++) {
        let q = min(q0 + j, total - 1u);
        let n = q / pq;
        let r = q % pq;
        on[j] = n;
        oq[j] = r;
        xbase[j] = (n * p.c + g * p.cg) * hw;
        iy0[j] = i32((r / p.ow) * p.sh) - i32(p.ph);
        ix0[j] = i32((r % p.ow) * p.sw) - i32(p.pw);
    }
    let khw = p.kh * p.kw;
    let kdim = p.cg * khw;
    // Rows past the group's channels repeat its last one and are not stored.
    var wrow: array<u32, TM>;
    for (var i = 0u; i < TM; i++) {
        wrow[i] = (g * p.ocg + min(m0 + i, p.ocg - 1u)) * kdim;
    }
    var acc: array<array<f32, TN>, TM>;
    for (var ky = 0u; ky < p.kh; ky++) {
        for (var kx = 0u; kx < p.kw; kx++) {
            // The input offset of this tap per position, or none where it falls in the padding.
            var off: array<u32, TN>;
            var inside: array<bool, TN>;
            for (var j = 0u; j < TN; j++) {
                let iy = iy0[j] + i32(ky * p.dh);
                let ix = ix0[j] + i32(kx * p.dw);
                inside[j] = iy >= 0 && iy < i32(p.h) && ix >= 0 && ix < i32(p.w);
                off[j] = xbase[j] + select(0u, u32(iy) * p.w + u32(ix), inside[j]);
            }
            let tap = ky * p.kw + kx;
            for (var ci = 0u; ci < p.cg; ci++) {
                var xv: array<f32, TN>;
                for (var j = 0u; j < TN; j++) {
                    xv[j] = select(0.0, ld_x(off[j] + ci * hw), inside[j]);
                }
                let k = ci * khw + tap;
                for (var i = 0u; i < TM; i++) {
                    let wv = ld_wt(wrow[i] + k);
                    for (var j = 0u; j < TN; j++) {
                        acc[i][j] = fma(wv, xv[j], acc[i][j]);
                    }
                }
            }
        }
    }
    let even = (pq & 1u) == 0u;
    for (var i = 0u; i < TM; i++) {
        if (m0 + i >= p.ocg) {
            break;
        }
        let o = g * p.ocg + m0 + i;
        var b = 0.0;
        if (p.has_bias != 0u) {
            b = ld_b(o);
        }
        for (var j = 0u; j < TN; j++) {
            acc[i][j] += b;
        }
        if (even) {
            // Planes of even size: q0 is even (TN is), so each pair (q, q + 1) is one sample's,
            // adjacent and word-aligned in y: one packed word, written whole.
            for (var j = 0u; j < TN; j += 2u) {
                if (q0 + j < total) {
                    let e = (on[j] * p.oc + o) * pq + oq[j];
                    st2_y(e >> 1u, acc[i][j], acc[i][j + 1u], e + 2u);
                }
            }
        } else {
            // Odd planes (never packed f16: the caller stages those in f32).
            for (var j = 0u; j < TN; j++) {
                if (q0 + j < total) {
                    st_y((on[j] * p.oc + o) * pq + oq[j], acc[i][j]);
                }
            }
        }
    }
}
