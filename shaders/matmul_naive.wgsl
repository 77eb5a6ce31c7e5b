// C = op(A) · op(B) (+ bias) (activation), one invocation per output: the plain reference kernel
// the benchmark reports ratios against. Shapes and flags as in matmul_reg.wgsl.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    epilogue: u32,
    a_batch: u32,
    b_batch: u32,
    c_batch: u32,
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

override TRANS_A: bool = false;
override TRANS_B: bool = false;

fn gelu(x: f32) -> f32 {
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    let e = exp(-2.0 * abs(u));
    return 0.5 * x * (1.0 + sign(u) * (1.0 - e) / (1.0 + e));
}

@compute @workgroup_size(16, 16, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let row = gid.y;
    if (row >= p.m || col >= p.n) {
        return;
    }
    let a_base = gid.z * p.a_batch;
    let b_base = gid.z * p.b_batch;
    var acc = 0.0;
    for (var k = 0u; k < p.k; k++) {
        var a = 0.0;
        var b = 0.0;
        if (TRANS_A) { a = ld_a(a_base + k * p.m + row); } else { a = ld_a(a_base + row * p.k + k); }
        if (TRANS_B) { b = ld_b(b_base + col * p.k + k); } else { b = ld_b(b_base + k * p.n + col); }
        acc = fma(a, b, acc);
    }
    if ((p.epilogue & 1u) != 0u) {
        acc += ld_bias(col);
    }
    let act = p.epilogue >> 1u;
    if (act == 1u) {
        acc = select(acc, 0.0, bitcast<u32>(acc) > 0x80000000u && bitcast<u32>(acc) <= 0xff800000u); // relu keeping NaN (see unary.wgsl)
    } else if (act == 2u) {
        acc = gelu(acc);
    }
    st_c(gid.z * p.c_batch + row * p.n + col, acc);
}
