// Shared by softmax.wgsl and softmax_sg.wgsl (prepended at build time): the parameters at
// binding 0 and row access. x and out are (rows, C), contiguous, and may be vec4 bindings (C a
// multiple of 4); loads and stores go through ld4_ / st4_ either way, with per-element guards
// for a row's last, partial quad.

struct Params {
    rows: u32,
    c: u32,          // row length (T_k)
    quads: u32,      // ceil(c / 4)
    lane_shift: u32, // log2 of the invocations per row (mode 0)
    // The rest is read only by the fused mask (include/softmax_mask.wgsl); the plain kernels
    // leave it zero.
    scale: f32,      // y = softmax(scale * x + mask)
    tq: u32,         // rows of each (T_q, T_k) matrix: a row's query index is row % tq
    diag: i32,       // T_k - T_q + 1: causal query i sees columns k < i + diag
    d1: u32,         // the input's second dim of four (leading dims padded with 1)
    ms0: u32,        // the mask's strides along the input's first three of four dims, 0 where
    ms1: u32,        // the mask is broadcast
    msq: u32,
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

// -inf and NaN, built at run time: WGSL has no literal for them and naga rejects constant ones.
fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u | (p.c & 0u));
}

fn nan() -> f32 {
    return bitcast<f32>(0x7fc00000u | (p.c & 0u));
}

fn max4(v: vec4<f32>) -> f32 {
    return max(max(v.x, v.y), max(v.z, v.w));
}

fn sum4(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
}

// Elements 4q..4q+4 of the row at `base`; past the row end -inf (exp gives 0).
fn load4(base: u32, q: u32) -> vec4<f32> {
    let i = 4u * q;
    if (i + 4u <= p.c) {
        return ld4_x(base + i);
    }
    var v = vec4<f32>(neg_inf());
    for (var k = 0u; i + k < p.c; k++) {
        v[k] = ld_x(base + i + k);
    }
    return v;
}

fn store4(base: u32, q: u32, y: vec4<f32>) {
    let i = 4u * q;
    if (i + 4u <= p.c) {
        st4_out(base + i, y);
        return;
    }
    for (var k = 0u; i + k < p.c; k++) {
        st_out(base + i + k, y[k]);
    }
}
