// out = x with its axes permuted. out has shape `shape` (rank 4, left-padded with 1); `s` holds,
// for each axis of out, x's stride along the axis that lands there, so out's element at
// (i0, i1, i2, i3) is x's at i0 s.x + i1 s.y + i2 s.z + i3 s.w (`offset` comes from
// include/broadcast.wgsl). Two consecutive outputs per invocation: on packed f16 one invocation
// writes both halves of each word of out (see kernels/mod.rs), while its reads may land anywhere.

struct Params {
    n: u32, // elements
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    shape: vec4<u32>,
    s: vec4<u32>,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

fn value(i: u32) -> f32 {
    return ld_x(offset(i, p.s));
}
