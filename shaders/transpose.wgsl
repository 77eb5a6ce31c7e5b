// Swaps the last two dims: x is (B, R, C) contiguous, out is (B, C, R).
// Two outputs per invocation (see kernels/mod.rs).

struct Params {
    n: u32,  // B * R * C
    r: u32,
    c: u32,
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

// The element of x that lands at out's linear index i.
fn src(i: u32) -> f32 {
    let plane = p.r * p.c;
    let b = i / plane;
    let rem = i % plane;
    let c = rem / p.r;
    let r = rem % p.r;
    return ld_x(b * plane + r * p.c + c);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = (wg.y * nwg.x + wg.x) * WG + lid;
    let i = 2u * w;
    if (i >= p.n) {
        return;
    }
    var v1 = 0.0;
    if (i + 1u < p.n) {
        v1 = src(i + 1u);
    }
    st2_out(w, src(i), v1, p.n);
}
