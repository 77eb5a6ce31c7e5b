// conv2d's weight gradient: dW[g ocg + m, kk] = sum over positions (n, oy, ox) of
// dy[n, g ocg + m, oy, ox] * X[kk, (n, oy, ox)], kk = (ci, ky, kx) over cg kh kw, X gathered
// from x as in conv2d_fwd.wgsl. The positions are cut into `chunks` fixed ranges of `chunk`
// (the z of the grid); each writes its partial sums, f32, to part (chunks, oc, cg kh kw), which
// the reduce kernel then adds in chunk order, so the result depends only on the shape: bitwise
// repeatable, no atomics. With one chunk part is the gradient itself. Parameters:
// include/conv2d_params.wgsl.
//
// An invocation computes TM output channels of one group times TN consecutive kk; lanes span
// kk, so the dy loads are the same address in every lane and only x is gathered per lane.

const WG_X: u32 = 64u;
const TM: u32 = 4u;
const TN: u32 = 4u;

@compute @workgroup_size(WG_X)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        @builtin(workgroup_id) wg: vec3<u32>) {
    let hw = p.h * p.w;
    let pq = p.oh * p.ow;
    let khw = p.kh * p.kw;
    let kdim = p.cg * khw;
    let k0 = gid.x * TN;
    if (k0 >= kdim) {
        return;
    }
    let g = wg.y / p.m_blocks;
    let m0 = (wg.y % p.m_blocks) * TM;
    let chunk = wg.z;
    // Per kk: its channel's offset in a sample's plane stack and its tap's displacement.
    var xoff: array<u32, TN>;
    var tapy: array<i32, TN>;
    var tapx: array<i32, TN>;
    for (var j = 0u; j < TN; j++) {
        let kk = min(k0 + j, kdim - 1u);
        let ci = kk / khw;
        let tap = kk % khw;
        xoff[j] = (g * p.cg + ci) * hw;
        tapy[j] = i32((tap / p.kw) * p.dh) - i32(p.ph);
        tapx[j] = i32((tap % p.kw) * p.dw) - i32(p.pw);
    }
    var grow: array<u32, TM>;
    for (var i = 0u; i < TM; i++) {
        grow[i] = (g * p.ocg + min(m0 + i, p.ocg - 1u)) * pq;
    }
    let total = p.n * pq;
    let start = chunk * p.chunk;
    let end = min(start + p.chunk, total);
    var acc: array<array<f32, TN>, TM>;
    // The position (n, oy, ox) of r, advanced by one each step.
    var n = start / pq;
    var oy = (start % pq) / p.ow;
    var ox = start % p.ow;
    for (var r = start; r < end; r++) {
        let gbase = n * p.oc * pq + oy * p.ow + ox;
        var gv: array<f32, TM>;
        for (var i = 0u; i < TM; i++) {
            gv[i] = ld_dy(gbase + grow[i]);
        }
        let xs = n * p.c * hw;
        let iy0 = i32(oy * p.sh);
        let ix0 = i32(ox * p.sw);
        var xv: array<f32, TN>;
        for (var j = 0u; j < TN; j++) {
            let iy = iy0 + tapy[j];
            let ix = ix0 + tapx[j];
            let inside = iy >= 0 && iy < i32(p.h) && ix >= 0 && ix < i32(p.w);
            let e = xs + xoff[j] + select(0u, u32(iy) * p.w + u32(ix), inside);
            xv[j] = select(0.0, ld_x(e), inside);
        }
        for (var i = 0u; i < TM; i++) {
            for (var j = 0u; j < TN; j++) {
                acc[i][j] = fma(gv[i], xv[j], acc[i][j]);
            }
        }
        ox += 1u;
        if (ox == p.ow) {
            ox = 0u;
            oy += 1u;
            if (oy == p.oh) {
                oy = 0u;
                n += 1u;
            }
        }
    }
    for (var i = 0u; i < TM; i++) {
        if (m0 + i >= p.ocg) {
            break;
        }
        let row = (chunk * p.oc + g * p.ocg + m0 + i) * kdim;
        for (var j = 0u; j < TN; j++) {
            if (k0 + j < kdim) {
                st_part(row + k0 + j, acc[i][j]);
            }
        }
    }
}
