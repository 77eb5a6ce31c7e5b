// conv2d's weight gradient: dW[g ocg + m, kk] = sum over positions (n, oy, ox) of
// dy[n, g ocg + m, oy, ox] * X[kk, (n, oy, ox)], kk = (ci, ky, kx) over cg kh kw, X gathered
// from x as in conv2d_fwd.wgsl. The positions are cut into `chunks` fixed ranges of `chunk`
// (the z of the grid); each writes its partial sums, f32, to part (chunks, oc, cg kh kw), which
// the reduce kernel then adds in chunk order, so the result depends only on the shape: bitwise
// repeatable, no atomics. With one chunk part is the gradient itself, and with p.onto each sum
// continues from the value part holds: every position is then added in order (n, oy, ox), so
// a batch split into consecutive runs of samples folded one after another gives the bits of the
// whole batch (batch-invariant mode). Parameters: include/conv2d_params.wgsl.
//
// An invocation computes TM output channels of one group times 4 consecutive kk of one chunk.
// A workgroup's lanes are k_lanes runs of kk times WG_X / k_lanes chunks (lane l: kk block
// l % k_lanes, chunk l / k_lanes), k_lanes chosen in src/kernels/conv2d.rs so that few lanes
// fall past kdim: a small kdim (a 1x1 conv, or one input channel) fills the workgroup with
// chunks instead. Lanes of one chunk load dy at the same address, and only x is gathered per
// lane, each gathered value feeding TM rows. The four kk are vector components and the rows named
// variables, kept in registers: the `//@row` lines, expanded by src/kernels/conv2d.rs
// (unexpanded the kernel computes nothing).

const WG_X: u32 = 64u;
const TM: u32 = 4u;
const TN: u32 = 4u;
// True where the `//@uni` rows are loaded one per lane and handed out with subgroupBroadcast
// (src/kernels/conv2d.rs sets it, only where a subgroup lies within one chunk: k_lanes a
// multiple of its size); then no invocation returns early, since a broadcast needs its whole
// subgroup, and lanes past the end compute clamped values they do not store.
const SUBGROUPS: bool = false;

@compute @workgroup_size(WG_X)
fn main(
        //@lane
        @builtin(workgroup_id) wg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let hw = p.h * p.w;
    let pq = p.oh * p.ow;
    let khw = p.kh * p.kw;
    let kdim = p.cg * khw;
    let k0 = (wg.x * p.k_lanes + lid % p.k_lanes) * TN;
    let chunk = wg.z * (WG_X / p.k_lanes) + lid / p.k_lanes;
    if ((k0 >= kdim || chunk >= p.chunks) && !SUBGROUPS) {
        return;
    }
    let g = wg.y / p.m_blocks;
    let m0 = (wg.y % p.m_blocks) * TM;
    // Per kk: its channel's offset in a sample's plane stack and its tap's displacement.
    let kk = min(vec4<u32>(k0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(kdim - 1u));
    let ci = kk / khw;
    let tap = kk % khw;
    let xoff = (g * p.cg + ci) * hw;
    let tapy = vec4<i32>((tap / p.kw) * p.dh) - i32(p.ph);
    let tapx = vec4<i32>((tap % p.kw) * p.dw) - i32(p.pw);
    let last = p.ocg - 1u;
    //@uni g (g * p.ocg + min(m0 + {r}, last)) * pq
    let total = p.n * pq;
    let start = min(chunk * p.chunk, total);
    let end = min(start + p.chunk, total);
    //@row var acc{r} = start_row(m0 + {r}u, g, k0, kdim);
    let hi = vec4<i32>(i32(p.h));
    let wi = vec4<i32>(i32(p.w));
    let zero = vec4<i32>(0);
    // The position (n, oy, ox) of r, advanced by one each step.
    var n = start / pq;
    var oy = (start % pq) / p.ow;
    var ox = start % p.ow;
    for (var r = start; r < end; r++) {
        let gbase = n * p.oc * pq + oy * p.ow + ox;
        let xs = n * p.c * hw;
        let iy = vec4<i32>(i32(oy * p.sh)) + tapy;
        let ix = vec4<i32>(i32(ox * p.sw)) + tapx;
        let inside = (iy >= zero) & (iy < hi) & (ix >= zero) & (ix < wi);
        let e = xs + xoff + select(vec4<u32>(0u), vec4<u32>(iy) * p.w + vec4<u32>(ix), inside);
        let xv = select(vec4<f32>(0.0),
                        vec4<f32>(ld_x(e.x), ld_x(e.y), ld_x(e.z), ld_x(e.w)), inside);
        //@get g gv ld_dy gbase
        //@row acc{r} = fma(vec4<f32>(gv{r}), xv, acc{r});
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
    //@row store_row(m0 + {r}u, g, chunk, k0, kdim, acc{r});
}

// The sums row m starts from: zero, or with p.onto what part holds (one chunk).
fn start_row(m: u32, g: u32, k0: u32, kdim: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    if (p.onto == 0u || m >= p.ocg) {
        return v;
    }
    let row = (g * p.ocg + m) * kdim + k0;
    for (var i = 0u; i < 4u; i++) {
        if (k0 + i < kdim) {
            v[i] = ld_part(row + i);
        }
    }
    return v;
}

// Row m of the group's output channels at the four kk of this chunk's partial; rows past the
// group and kk past the end are not stored.
fn store_row(m: u32, g: u32, chunk: u32, k0: u32, kdim: u32, acc: vec4<f32>) {
    if (m >= p.ocg || chunk >= p.chunks) {
        return;
    }
    let row = (chunk * p.oc + g * p.ocg + m) * kdim + k0;
    if (k0 < kdim) {
        st_part(row, acc.x);
    }
    if (k0 + 1u < kdim) {
        st_part(row + 1u, acc.y);
    }
    if (k0 + 2u < kdim) {
        st_part(row + 2u, acc.z);
    }
    if (k0 + 3u < kdim) {
        st_part(row + 3u, acc.w);
    }
}
