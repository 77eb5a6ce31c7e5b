// Swaps the last two dims: x is (B, R, C) contiguous, out is (B, C, R).
// Two outputs per invocation (see kernels/mod.rs).

struct Params {
    n: u32,  // B * R * C
    r: u32,
    c: u32,
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

// The element of x that lands at out's linear index i.
fn value(i: u32) -> f32 {
    let plane = p.r * p.c;
    let b = i / plane;
    let rem = i % plane;
    let c = rem / p.r;
    let r = rem % p.r;
    return ld_x(b * plane + r * p.c + c);
}
