// Shared by the batch norm kernels (prepended at build time): the parameters at binding 0 and,
// for the per-channel kernels, the fixed-order channel sum. x is (N, C, HW) contiguous; channel
// c's elements are e = 0 .. N HW, at (e / HW) C HW + c HW + e % HW. stats is f32 (2, C): each
// channel's mean, then its rstd = 1 / sqrt(biased variance + eps).
//
// A per-channel kernel runs one workgroup per channel; lane l takes e = l, l + CH_WG, ... in
// order (walked with `first` and `next`, which divide once per lane, not once per element),
// and the CH_WG partial sums are added as a fixed tree: the result depends on the shape alone,
// bitwise repeatable, no atomics.

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

// Lanes of the elementwise kernels' workgroups (include/batch_norm_pairs.wgsl).
const WG: u32 = 256u;
// Lanes of a per-channel kernel's workgroup: few, so a small channel keeps them busy and the
// tree sum takes few barriers.
const CH_WG: u32 = 64u;

var<workgroup> part: array<vec2<f32>, CH_WG>;

// Lane `lid`'s first element of a channel: (sample, offset in the plane) of e = lid.
fn first(lid: u32) -> vec2<u32> {
    return vec2<u32>(lid / p.hw, lid % p.hw);
}

// The (sample, offset) CH_WG elements past `at` within a channel.
fn next(at: vec2<u32>) -> vec2<u32> {
    var r = at.y + CH_WG % p.hw;
    var n = at.x + CH_WG / p.hw;
    if (r >= p.hw) {
        r -= p.hw;
        n += 1u;
    }
    return vec2<u32>(n, r);
}

// The offset in x of channel c's element at (sample, offset in the plane).
fn channel_elem(c: u32, at: vec2<u32>) -> u32 {
    return (at.x * p.c + c) * p.hw + at.y;
}

// The sum of `v` over the workgroup's lanes, the same in each of them: halves added pairwise,
// lane l + s into lane l for s = CH_WG / 2, CH_WG / 4, ..., 1.
fn channel_sum(lid: u32, v: vec2<f32>) -> vec2<f32> {
    part[lid] = v;
    workgroupBarrier();
    for (var s = CH_WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            part[lid] += part[lid + s];
        }
        workgroupBarrier();
    }
    let total = part[0];
    workgroupBarrier();
    return total;
}
