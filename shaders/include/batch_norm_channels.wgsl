// Shared by the batch norm kernels (prepended at build time): the parameters at binding 0 and,
// for the per-channel kernels, the fixed-order channel sum. x is (N, C, HW) contiguous; channel
// c's elements are e = 0 .. N HW, at (e / HW) C HW + c HW + e % HW. stats is f32 (2, C): each
// channel's mean, then its rstd = 1 / sqrt(biased variance + eps).
//
// A per-channel kernel runs one workgroup per channel; lane l takes e = l, l + WG, ... in
// order, and the WG partial sums are added in lane order by every lane: the result depends on
// the shape alone, bitwise repeatable, no atomics.

struct Params {
    n: u32,        // elements of x (pairs.wgsl)
    c: u32,
    hw: u32,
    count: u32,    // N HW, the elements per channel
    eps: f32,
    momentum: f32, // batch_norm_stats: the running statistics' update
    update: u32,   // batch_norm_stats: 1 to update them
    _pad0: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

var<workgroup> part: array<vec2<f32>, WG>;

// The element offset of channel c's e-th element.
fn channel_elem(c: u32, e: u32) -> u32 {
    return (e / p.hw) * p.c * p.hw + c * p.hw + e % p.hw;
}

// The sum of `v` over the workgroup's lanes, the same in each of them.
fn channel_sum(lid: u32, v: vec2<f32>) -> vec2<f32> {
    part[lid] = v;
    workgroupBarrier();
    var s = vec2<f32>(0.0);
    for (var k = 0u; k < WG; k++) {
        s += part[k];
    }
    workgroupBarrier();
    return s;
}
