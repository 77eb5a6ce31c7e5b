// Three-input select with broadcasting: out = a where c is nonzero, else b. out has shape
// `shape` (rank 4, left-padded with 1); sc, sa, sb are the strides of c, a, b in elements, 0 along
// broadcast dims (`offset` comes from include/broadcast.wgsl). c may be stored in another dtype
// than a, b and out. Two outputs per invocation (see kernels/mod.rs).

struct Params {
    n: u32, // elements of out
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    shape: vec4<u32>,
    sc: vec4<u32>,
    sa: vec4<u32>,
    sb: vec4<u32>,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

// Nonzero on the bits: NaN selects a (as torch's bool(nan) is true), -0 selects b. GL drivers
// may fold float comparisons with NaN.
fn nonzero(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) != 0u;
}

fn value(i: u32) -> f32 {
    if (nonzero(ld_c(offset(i, p.sc)))) {
        return ld_a(offset(i, p.sa));
    }
    return ld_b(offset(i, p.sb));
}
