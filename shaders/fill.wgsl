// out[i] = value for every element. Two outputs per invocation (see kernels/mod.rs).

struct Params {
    n: u32,
    value: f32,
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = (wg.y * nwg.x + wg.x) * WG + lid;
    if (2u * w >= p.n) {
        return;
    }
    st2_out(w, p.value, p.value, p.n);
}
