// Unary elementwise op with an optional scalar `s`; with op 0 it is a copy or a cast (x and out
// may have different storage). Two outputs per invocation (see kernels/mod.rs).

struct Params {
    n: u32,   // elements
    op: u32,  // see UnaryOp in kernels/elementwise.rs
    s: f32,   // the scalar operand
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

// max(x, 0) that keeps NaN, as torch.relu does. Compared on the bits: GL drivers turn
// `x < 0.0 ? 0.0 : x` into max(x, 0.0), which may drop NaN. Negative non-NaN floats are the
// bit patterns in (0x80000000, 0xff800000]; -0.0 passes through.
fn relu(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    return select(x, 0.0, b > 0x80000000u && b <= 0xff800000u);
}

fn apply(x: f32) -> f32 {
    switch p.op {
        case 0u: { return x; }
        case 1u: { return relu(x); }
        case 2u: { return -x; }
        case 3u: { return x + p.s; }
        case 4u: { return x - p.s; }
        case 5u: { return x * p.s; }
        case 6u: { return x / p.s; }
        case 7u: { return p.s - x; }
        default: { return p.s / x; }
    }
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
        v1 = apply(ld_x(i + 1u));
    }
    st2_out(w, apply(ld_x(i)), v1, p.n);
}
