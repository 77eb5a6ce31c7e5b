// Shared by the matmul shaders (prepended at build time): the parameters at binding 0 and the
// fused epilogue applied to each output before it is stored.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    epilogue: u32, // bit 0: add bias; bits 1..: 0 none, 1 relu, 2 gelu
    a_batch: u32,  // elements between batches of A (0: shared)
    b_batch: u32,
    c_batch: u32,
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

// tanh-form GELU; tanh through exp(-2|u|) so large |x| gives x or 0, never NaN.
fn gelu(x: f32) -> f32 {
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    let e = exp(-2.0 * abs(u));
    let t = sign(u) * (1.0 - e) / (1.0 + e);
    return 0.5 * x * (1.0 + t);
}

fn finish(v: f32, col: u32) -> f32 {
    var r = v;
    if ((p.epilogue & 1u) != 0u) {
        r += ld_bias(col);
    }
    let act = p.epilogue >> 1u;
    if (act == 1u) {
        r = select(r, 0.0, bitcast<u32>(r) > 0x80000000u && bitcast<u32>(r) <= 0xff800000u); // relu keeping NaN (see unary.wgsl)
    } else if (act == 2u) {
        r = gelu(r);
    }
    return r;
}

