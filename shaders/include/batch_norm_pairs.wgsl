// The entry point of batch norm's elementwise kernels, whose output element i of channel c is
// `value(i, c)` (the file defines it): one invocation per 32-bit word of `out`, both of its
// elements, so a packed f16 output is written whole by one invocation (as include/pairs.wgsl).
// The channel is found by one division per word, not per element: element i + 1 is in the
// next plane only when i ends its plane. A 2-D grid of workgroups covers large outputs.
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = (wg.y * nwg.x + wg.x) * WG + lid;
    let i = 2u * w;
    if (i >= p.n) {
        return;
    }
    let plane = i / p.hw;
    let c = plane % p.c;
    var v1 = 0.0;
    if (i + 1u < p.n) {
        var c1 = c;
        if (i + 1u - plane * p.hw == p.hw) {
            c1 = select(c + 1u, 0u, c + 1u == p.c);
        }
        v1 = value(i + 1u, c1);
    }
    st2_out(w, value(i, c), v1, p.n);
}
