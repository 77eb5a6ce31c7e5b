// Sum (or mean) along one axis. x is viewed as (outer, len, inner) and out, always f32, as
// (outer, inner): out[o * inner + i] = sum_k x[(o * len + k) * inner + i] / div.
// The order of additions is fixed by the shape, so results are bitwise reproducible.
//
// mode 0, long rows: one workgroup per output; invocation t sums k = t, t + WG, ... and the
//         workgroup adds the WG partial sums as a tree.
// mode 1, short rows: one invocation per output, summing k in order.
// mode 2, a fold: as mode 1, continuing from the value out already holds (div is 1), so any
//         split of len into consecutive runs folded one after another gives the same bits.

struct Params {
    outputs: u32, // outer * inner
    len: u32,
    inner: u32,
    mode: u32,
    div: f32,     // len for a mean, 1 for a sum
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;
var<workgroup> partial: array<f32, WG>;

fn base(o: u32) -> u32 {
    return (o / p.inner) * p.len * p.inner + o % p.inner;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let group = wg.y * nwg.x + wg.x;
    if (p.mode == 0u) {
        // `group` is the same for the whole workgroup, so this exit keeps the barriers uniform.
        if (group >= p.outputs) {
            return;
        }
        let b = base(group);
        var acc = 0.0;
        for (var k = lid; k < p.len; k += WG) {
            acc += ld_x(b + k * p.inner);
        }
        partial[lid] = acc;
        workgroupBarrier();
        for (var half = WG / 2u; half > 0u; half /= 2u) {
            if (lid < half) {
                partial[lid] += partial[lid + half];
            }
            workgroupBarrier();
        }
        if (lid == 0u) {
            out[group] = partial[0] / p.div;
        }
        return;
    }
    let o = group * WG + lid;
    if (o >= p.outputs) {
        return;
    }
    let b = base(o);
    var acc = 0.0;
    if (p.mode == 2u) {
        acc = out[o];
    }
    for (var k = 0u; k < p.len; k++) {
        acc += ld_x(b + k * p.inner);
    }
    out[o] = acc / p.div;
}
