// conv2d's input gradient as an implicit-GEMM transposed convolution: per group g,
// dx[n, g cg + m, (iy, ix)] = sum over (o, ky, kx) of W[g ocg + o, m, ky, kx] * dy[n, g ocg + o,
// oy, ox] where iy = oy sh - ph + ky dh (and so for x): the taps whose output coordinate is
// whole and inside (n, oc, oh, ow) contribute. dy is gathered in place, nothing is
// materialized. Parameters: include/conv2d_params.wgsl.
//
// Decomposed by stride phase: the grid's z is the phase (py, px) = (z / sw, z % sw) (with sw
// at most w), and the invocations of a phase cover only the inputs iy = py + sh iyq, ix = px + sw ixq. Whether a
// tap's output coordinate is whole, (iy + ph - ky dh) % sh == 0, depends on the phase alone,
// so a phase visits only its own taps (about 1 / (sh sw) of them), uniformly across lanes, and
// consecutive positions of a phase read consecutive dy columns. With unit stride there is one
// phase, the whole plane. No skip depends on the invocation's own positions: control flow that
// differs between lanes would make the loop counters, and so every weight load, per-lane on a
// CPU adapter (which loads a uniform address once for all its SIMD lanes).
//
// As in conv2d_fwd.wgsl an invocation computes TM input channels of one group times 4
// consecutive positions of the phase's flattened (n, iyq, ixq) axis, lanes spanning positions so
// the weight loads are uniform, the positions as vector components and the rows as named
// variables (the `//@row` lines, expanded by src/kernels/conv2d.rs; unexpanded the kernel
// computes nothing); sums run ky, kx, o in order in f32 (bitwise repeatable), no barriers.

const WG_X: u32 = 64u;
const TM: u32 = 4u;
const TN: u32 = 4u;
// True where the `//@uni` rows are loaded one per lane and handed out with subgroupBroadcast
// (src/kernels/conv2d.rs sets it); then no invocation returns early, since a broadcast needs
// its whole subgroup, and lanes past the end compute clamped values they do not store.
const SUBGROUPS: bool = false;

// The flattened position q's sample and offset in its phase's plane, clamped into range
// (positions past the end compute the last one's values and are not stored).
fn split_q(q: u32, total: u32, hw: u32) -> vec2<u32> {
    let qc = min(q, total - 1u);
    return vec2<u32>(qc / hw, qc % hw);
}

// Whether tap offset t (= phase + padding - tap dilation) is a whole multiple of the stride s.
fn whole(t: i32, s: u32) -> bool {
    return ((t % i32(s)) + i32(s)) % i32(s) == 0;
}

@compute @workgroup_size(WG_X)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        //@lane
        @builtin(workgroup_id) wg: vec3<u32>) {
    let hw = p.h * p.w;
    let pq = p.oh * p.ow;
    // Phases past the plane are empty, so the grid has min(sh, h) min(sw, w) of them.
    let swq = min(p.sw, p.w);
    let py = wg.z / swq;
    let px = wg.z % swq;
    // The phase's plane: rows py, py + sh, ... below h, and so for columns.
    let hq = (p.h - min(py, p.h) + p.sh - 1u) / p.sh;
    let wq = (p.w - min(px, p.w) + p.sw - 1u) / p.sw;
    let hwq = hq * wq;
    let total = p.n * hwq;
    if (total == 0u) {
        // An empty phase (the same for the whole grid slice).
        return;
    }
    let q0 = gid.x * TN;
    if (q0 >= total && !SUBGROUPS) {
        return;
    }
    let g = wg.y / p.m_blocks;
    let m0 = (wg.y % p.m_blocks) * TM;
    // Per position: its sample, its coordinate in the phase's plane (iyq, ixq) and dy's first
    // element of this group in the sample.
    let s0 = split_q(q0, total, hwq);
    let s1 = split_q(q0 + 1u, total, hwq);
    let s2 = split_q(q0 + 2u, total, hwq);
    let s3 = split_q(q0 + 3u, total, hwq);
    let on = vec4<u32>(s0.x, s1.x, s2.x, s3.x);
    let oqq = vec4<u32>(s0.y, s1.y, s2.y, s3.y);
    let iyq = vec4<i32>(oqq / wq);
    let ixq = vec4<i32>(oqq % wq);
    // The offset of each position in the input plane, for the stores.
    let oq = (vec4<u32>(iyq) * p.sh + py) * p.w + vec4<u32>(ixq) * p.sw + px;
    let dybase = (on * p.oc + g * p.ocg) * pq;
    let khw = p.kh * p.kw;
    // W is (oc, cg, kh, kw): row i's element (o, ky, kx) is at w{i} + o cg khw + tap.
    let last = p.cg - 1u;
    let wg0 = g * p.ocg * p.cg * khw;
    //@uni w wg0 + min(m0 + {r}, last) * khw
    let ostride = p.cg * khw;
    //@row var acc{r} = vec4<f32>(0.0);
    let zero = vec4<i32>(0);
    let ohi = vec4<i32>(i32(p.oh));
    let owi = vec4<i32>(i32(p.ow));
    for (var ky = 0u; ky < p.kh; ky++) {
        // iy + ph - ky dh = sh (iyq + ty / sh) with ty = py + ph - ky dh, whole in this phase.
        let ty = i32(py + p.ph) - i32(ky * p.dh);
        if (!whole(ty, p.sh)) {
            continue;
        }
        let oy = iyq + vec4<i32>(ty / i32(p.sh));
        let in_y = (oy >= zero) & (oy < ohi);
        for (var kx = 0u; kx < p.kw; kx++) {
            let tx = i32(px + p.pw) - i32(kx * p.dw);
            if (!whole(tx, p.sw)) {
                continue;
            }
            let ox = ixq + vec4<i32>(tx / i32(p.sw));
            let inside = in_y & (ox >= zero) & (ox < owi);
            let off = dybase + select(vec4<u32>(0u), vec4<u32>(oy) * p.ow + vec4<u32>(ox), inside);
            let tap = ky * p.kw + kx;
            for (var o = 0u; o < p.ocg; o++) {
                let e = off + o * pq;
                let gv = select(vec4<f32>(0.0),
                                vec4<f32>(ld_dy(e.x), ld_dy(e.y), ld_dy(e.z), ld_dy(e.w)), inside);
                let k = o * ostride + tap;
                //@get w wv ld_wt k
                //@row acc{r} = fma(vec4<f32>(wv{r}), gv, acc{r});
            }
        }
    }
    //@row store_row(m0 + {r}u, g, q0, total, hw, on, oq, acc{r});
}

// Row m of the group's input channels at the four positions; rows past the group and
// positions past the end are not stored.
fn store_row(m: u32, g: u32, q0: u32, total: u32, hw: u32, on: vec4<u32>, oq: vec4<u32>,
             acc: vec4<f32>) {
    if (m >= p.cg) {
        return;
    }
    let e = (on * p.c + g * p.cg + m) * hw + oq;
    if ((hw & 1u) == 0u && p.sh == 1u && p.sw == 1u) {
        // Unit stride (one phase, the whole plane), as in the forward: pairs of an even plane
        // are one packed word.
        if (q0 < total) {
            st2_dx(e.x >> 1u, acc.x, acc.y, e.x + 2u);
        }
        if (q0 + 2u < total) {
            st2_dx(e.z >> 1u, acc.z, acc.w, e.z + 2u);
        }
    } else {
        // Odd planes and strided phases (never packed f16: the caller stages those in f32).
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
