// Broadcasted binary elementwise op: out = a (op) b, out has shape `shape` (rank 4, left-padded
// with 1). `sa` / `sb` are the strides of a and b in elements, 0 along broadcast dims.
// Two outputs per invocation (see kernels/mod.rs), or four with VEC.
//
// Ops 0-3 (arithmetic) share one pipeline and switch on p.op. The others, the backward rules of
// activations, get a pipeline each with OP specialized (lavapipe runs every case of a switch):
//   4 expand:  out = a (b ignored; a broadcast to out's shape)
//   5 relu':   out = a where b > 0, else 0   (a = grad, b = relu output)
//   6 gelu':   out = a * gelu'(b)            (b = gelu input)
//   7 tanh':   out = a * (1 - b^2)           (b = tanh output)
//   8 sigmoid': out = a * b * (1 - b)        (b = sigmoid output)
//   9 abs':    out = a * sign(b)             (b = abs input; 0 at 0, NaN at NaN)
//  10 maximum: out = max(a, b), NaN if either is NaN (torch.maximum)
//  11 minimum: out = min(a, b), NaN if either is NaN (torch.minimum)
//  12 share:   out = 0 where a < b, 0.5 where a == b, else 1 (NaN included): the share of a
//              maximum's gradient that goes to a, as torch splits it (minimum: a and b swapped)
//  13 silu':   out = a * silu'(b)            (b = silu input)
//  14 swiglu:  out = silu(a) * b             (a = gate, b = up: Llama's MLP product)
//
// The strided `offset` comes from include/broadcast.wgsl.

struct Params {
    n: u32,        // elements of out
    op: u32,       // 0 add, 1 sub, 2 mul, 3 div
    _pad0: u32,
    _pad1: u32,
    shape: vec4<u32>,
    sa: vec4<u32>,
    sb: vec4<u32>,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;
const OP: u32 = 0xffffffffu;
// 1: no broadcast (a, b and out have one shape), all vec4 bindings, n % 4 == 0: four elements
// per invocation in whole quads, no index arithmetic. Specialized.
const VEC: u32 = 0u;

fn apply(x: f32, y: f32) -> f32 {
    // Constant conditions: the compiler keeps one of these, or none.
    if (OP == 4u) { return x; }
    if (OP == 5u) { return select(0.0, x, y > 0.0); }
    if (OP == 6u) { return x * gelu_grad(y); }
    if (OP == 7u) { return x * (1.0 - y * y); }
    if (OP == 8u) { return x * y * (1.0 - y); }
    if (OP == 9u) { return x * select(sign(y), y, is_nan(y)); }
    // x + y is NaN when either is: WGSL's max and min may return the other operand.
    if (OP == 10u) { return select(max(x, y), x + y, is_nan(x) || is_nan(y)); }
    if (OP == 11u) { return select(min(x, y), x + y, is_nan(x) || is_nan(y)); }
    if (OP == 12u) { return select(select(1.0, 0.5, x == y), 0.0, x < y); }
    if (OP == 13u) { return x * silu_grad(y); }
    if (OP == 14u) { return silu(x) * y; }
    switch p.op {
        case 0u: { return x + y; }
        case 1u: { return x - y; }
        case 2u: { return x * y; }
        default: { return x / y; }
    }
}

fn at(i: u32) -> f32 {
    return apply(ld_a(offset(i, p.sa)), ld_b(offset(i, p.sb)));
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = (wg.y * nwg.x + wg.x) * WG + lid;
    if (VEC == 1u) {
        let q = 4u * w;
        if (q < p.n) {
            let x = ld4_a(q);
            let y = ld4_b(q);
            st4_out(q, vec4<f32>(apply(x.x, y.x), apply(x.y, y.y), apply(x.z, y.z), apply(x.w, y.w)));
        }
        return;
    }
    let i = 2u * w;
    if (i >= p.n) {
        return;
    }
    var v1 = 0.0;
    if (i + 1u < p.n) {
        v1 = at(i + 1u);
    }
    st2_out(w, at(i), v1, p.n);
}
