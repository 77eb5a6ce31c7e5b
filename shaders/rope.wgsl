// Rotary position embedding, rotate-half form (Hugging Face Llama): x and y are (M, T, D)
// contiguous (M = batch * heads), D even, half = D / 2; cs (f32) is (2, T, half): the cosines,
// then the sines, of position t's angles (offset + t) * theta^(-2i / D), made on the host. For
// each row and i < half:
//   y[i]        = x[i] c - x[i + half] s,
//   y[i + half] = x[i + half] c + x[i] s,
// with s = dir * sin: dir = -1 rotates back, which is the backward (the rotation's transpose).
// One invocation per two adjacent i, so it writes whole words of a packed f16 y when half is
// even (rows start on even elements since D is even); packed f16 with half odd is written to
// f32 first (the host stages it). In f32 whatever the storage.

struct Params {
    n: u32,    // invocations with work: M * T * ceil(half / 2)
    t: u32,    // positions
    half: u32, // D / 2
    dir: f32,  // 1: forward, -1: backward
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = (wg.y * nwg.x + wg.x) * WG + lid;
    if (w >= p.n) {
        return;
    }
    let per_row = (p.half + 1u) / 2u;
    let row = w / per_row;        // (m, t) flattened
    let i = 2u * (w % per_row);   // the first of this invocation's two i
    let t = row % p.t;
    let base = row * 2u * p.half; // the row's first element
    let cb = t * p.half;          // position t's cosines; its sines are p.t * p.half further
    var lo = vec2<f32>(0.0);
    var hi = vec2<f32>(0.0);
    for (var k = 0u; k < 2u; k++) {
        let j = i + k;
        if (j < p.half) {
            let c = ld_cs(cb + j);
            let s = p.dir * ld_cs(p.t * p.half + cb + j);
            let x1 = ld_x(base + j);
            let x2 = ld_x(base + j + p.half);
            lo[k] = x1 * c - x2 * s;
            hi[k] = x2 * c + x1 * s;
        }
    }
    // The first half's pair starts on an even element; the second's only when half is even.
    st2_y((base + i) >> 1u, lo.x, lo.y, base + p.half);
    if ((p.half & 1u) == 0u) {
        st2_y((base + p.half + i) >> 1u, hi.x, hi.y, base + 2u * p.half);
    } else {
        st_y(base + p.half + i, hi.x);
        if (i + 1u < p.half) {
            st_y(base + p.half + i + 1u, hi.y);
        }
    }
}
