// conv2d forward as an implicit GEMM: per group g, y[n, g ocg + m, q] = sum_k W[g ocg + m, k] *
// X[k, (n, q)] + b, with k = (ci, ky, kx) over cg kh kw and X the column matrix that im2col would
// build; here each X value is gathered from x when it is needed, so no column buffer exists.
// Parameters: include/conv2d_params.wgsl.
//
// An invocation computes a TM x 4 block: TM (16, 8, 4, or 1 for small groups; the tile choice
// in src/kernels/conv2d.rs) output channels of one group times 4 consecutive output positions
// of the flattened (n, oh, ow) axis: each gathered input value feeds TM rows. The workgroup's
// lanes span positions and share the channels, so the TM weights of a step are the same in
// every lane and only the input is gathered per lane. A CPU adapter (lavapipe) loads a buffer
// element per SIMD lane in a scalar loop inside loops, even at one address, so where the
// adapter has subgroups lane l loads rows l, l + SG, ... and subgroupBroadcast hands each row's
// weight to every lane (a register shuffle), as the subgroup matmul does with A. The four
// positions are the components of vectors and the TM rows are named variables, never arrays
// indexed in loops: CPU compilers keep those in registers (an indexed array lands in memory).
// So the `//@` lines are expanded by src/kernels/conv2d.rs: `//@row` into one statement per
// row with `{r}` its index, `//@uni NAME EXPR` into each row's base offset EXPR (with `{r}` the
// row, or the lane's rows), `//@get NAME VAR LOAD OFFSET` into VAR{r} = LOAD(NAME{r} + OFFSET)
// (or the lanes' loads and the broadcasts), `//@lane` into the lane id builtin; unexpanded,
// the file is a valid kernel that computes nothing (the naga test validates both forms). Sums
// run ky, kx, ci in order in f32: bitwise the same every run. No barriers.

const WG_X: u32 = 64u;
const TM: u32 = 4u;
const TN: u32 = 4u;
// True where the `//@uni` rows are loaded one per lane and handed out with subgroupBroadcast
// (src/kernels/conv2d.rs sets it); then no invocation returns early, since a broadcast needs
// its whole subgroup, and lanes past the end compute clamped values they do not store.
const SUBGROUPS: bool = false;

// The flattened position q's sample and offset in its plane, clamped into range (positions
// past the end compute the last one's values and are not stored).
fn split_q(q: u32, total: u32, pq: u32) -> vec2<u32> {
    let qc = min(q, total - 1u);
    return vec2<u32>(qc / pq, qc % pq);
}

@compute @workgroup_size(WG_X)
fn main(@builtin(global_invocation_id) gid: vec3<u32>,
        //@lane
        @builtin(workgroup_id) wg: vec3<u32>) {
    let hw = p.h * p.w;
    let pq = p.oh * p.ow;
    let total = p.n * pq;
    let q0 = gid.x * TN;
    if (q0 >= total && !SUBGROUPS) {
        return;
    }
    let g = wg.y / p.m_blocks;
    let m0 = (wg.y % p.m_blocks) * TM;
    // Per position (the vectors' components): sample and plane offset of the output, the
    // sample's first input element of this group, the window's top-left input coordinate.
    let s0 = split_q(q0, total, pq);
    let s1 = split_q(q0 + 1u, total, pq);
    let s2 = split_q(q0 + 2u, total, pq);
    let s3 = split_q(q0 + 3u, total, pq);
    let on = vec4<u32>(s0.x, s1.x, s2.x, s3.x);
    let oq = vec4<u32>(s0.y, s1.y, s2.y, s3.y);
    let xbase = (on * p.c + g * p.cg) * hw;
    let iy0 = vec4<i32>((oq / p.ow) * p.sh) - i32(p.ph);
    let ix0 = vec4<i32>((oq % p.ow) * p.sw) - i32(p.pw);
    let khw = p.kh * p.kw;
    let kdim = p.cg * khw;
    // Rows past the group's channels repeat its last one and are not stored.
    let last = p.ocg - 1u;
    //@uni w (g * p.ocg + min(m0 + {r}, last)) * kdim
    //@row var acc{r} = vec4<f32>(0.0);
    let hi = vec4<i32>(i32(p.h));
    let wi = vec4<i32>(i32(p.w));
    for (var ky = 0u; ky < p.kh; ky++) {
        let iy = iy0 + vec4<i32>(i32(ky * p.dh));
        let in_y = (iy >= vec4<i32>(0)) & (iy < hi);
        for (var kx = 0u; kx < p.kw; kx++) {
            // The input offset of this tap per position, or the sample's first where it falls
            // in the padding (read, then replaced by 0).
            let ix = ix0 + vec4<i32>(i32(kx * p.dw));
            let inside = in_y & (ix >= vec4<i32>(0)) & (ix < wi);
            let off = xbase + select(vec4<u32>(0u), vec4<u32>(iy) * p.w + vec4<u32>(ix), inside);
            let tap = ky * p.kw + kx;
            for (var ci = 0u; ci < p.cg; ci++) {
                let o = off + ci * hw;
                let xv = select(vec4<f32>(0.0),
                                vec4<f32>(ld_x(o.x), ld_x(o.y), ld_x(o.z), ld_x(o.w)), inside);
                let k = ci * khw + tap;
                //@get w wv ld_wt k
                //@row acc{r} = fma(vec4<f32>(wv{r}), xv, acc{r});
            }
        }
    }
    //@row store_row(m0 + {r}u, g, q0, total, pq, on, oq, acc{r});
}

// Row m of the group's output channels at the four positions, plus the bias; rows past the
// group and positions past the end are not stored.
fn store_row(m: u32, g: u32, q0: u32, total: u32, pq: u32, on: vec4<u32>, oq: vec4<u32>,
             acc: vec4<f32>) {
    if (m >= p.ocg) {
        return;
    }
    let o = g * p.ocg + m;
    var b = 0.0;
    if (p.has_bias != 0u) {
        b = ld_b(o);
    }
    let v = acc + vec4<f32>(b);
    let e = (on * p.oc + o) * pq + oq;
    if ((pq & 1u) == 0u) {
        // Planes of even size: q0 is even, so each pair (q, q + 1) is one sample's, adjacent
        // and word-aligned in y: one packed word, written whole.
        if (q0 < total) {
            st2_y(e.x >> 1u, v.x, v.y, e.x + 2u);
        }
        if (q0 + 2u < total) {
            st2_y(e.z >> 1u, v.z, v.w, e.z + 2u);
        }
    } else {
        // Odd planes (never packed f16: the caller stages those in f32).
        if (q0 < total) {
            st_y(e.x, v.x);
        }
        if (q0 + 1u < total) {
            st_y(e.y, v.y);
        }
        if (q0 + 2u < total) {
            st_y(e.z, v.z);
        }
        if (q0 + 3u < total) {
            st_y(e.w, v.w);
        }
    }
}
