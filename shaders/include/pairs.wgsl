
// The entry point of the kernels whose output element i is `value(i)` (the file defines it):
// one invocation per 32-bit word of `out`, both of its elements, so a packed f16 output is
// written whole by one invocation. A 2-D grid of workgroups covers large outputs; `p.n` is the
// output's element count.
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
        v1 = value(i + 1u);
    }
    st2_out(w, value(i), v1, p.n);
}
