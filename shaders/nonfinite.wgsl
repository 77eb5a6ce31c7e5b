// Sets flag[0] = 1 if any of the n elements of x is NaN or +-inf; leaves it alone otherwise (the
// host zeroes it first and may run this over several tensors before one readback). Invocations
// that find one all write the same value, so the race is benign and the result deterministic.
// Each invocation checks one quad (4 elements); x may be a vec4 binding when n is a multiple of 4.

struct Params {
    n: u32,
    quads: u32,  // ceil(n / 4)
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let q = (wg.y * nwg.x + wg.x) * WG + lid;
    if (q >= p.quads) {
        return;
    }
    let i = 4u * q;
    var v = vec4<f32>(0.0);
    if (i + 4u <= p.n) {
        v = ld4_x(i);
    } else {
        for (var k = 0u; i + k < p.n; k++) {
            v[k] = ld_x(i + k);
        }
    }
    // Exponent all ones: inf or NaN. On the bits, which no compiler assumes away.
    let e = bitcast<vec4<u32>>(v) & vec4<u32>(0x7f800000u);
    if (any(e == vec4<u32>(0x7f800000u))) {
        st_flag(0u, 1.0);
    }
}
