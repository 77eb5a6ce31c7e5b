// Unary elementwise op with up to two scalars `s`, `s2`; with op 0 it is a copy or a cast (x and
// out may have different storage). Two outputs per invocation (see kernels/mod.rs), or four with
// VEC. Every op computes in f32 whatever the storage.
//
// NaN in, NaN out, as in torch, for every op but pow with exponent 0 (which gives 1). Ops that
// must keep NaN through a comparison test the bits: GL drivers turn `x < a ? a : x` into
// max(x, a), which may drop NaN.

struct Params {
    n: u32,   // elements
    op: u32,  // see UnaryOp in kernels/elementwise.rs (ops 0-8; OP selects the others)
    s: f32,   // the scalar operand (clamp: the lower bound; pow: the exponent)
    s2: f32,  // a second scalar (clamp: the upper bound)
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;
// Ops 9-18 each get a pipeline of their own, with OP specialized to their code; the arithmetic
// ops 0-8 share one, with OP = 0xffffffff, and switch on p.op. CPU drivers such as lavapipe run
// every case of a switch for every element (masked SIMD), so one shader holding every op made a
// copy pay for gelu, pow and the rest: 4x the time on lavapipe.
const OP: u32 = 0xffffffffu;
// 1: x and out are vec4 bindings and n % 4 == 0, four elements per invocation in whole quads.
// Specialized. lavapipe loads a storage value one lane at a time, so quads halve the loop trips.
const VEC: u32 = 0u;

// A NaN built at run time: WGSL has no NaN literal and naga rejects a constant one.
fn nan_like(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) | 0x7fc00000u);
}

// +inf, built at run time for the same reason.
fn inf_like(x: f32) -> f32 {
    return bitcast<f32>((bitcast<u32>(x) | 0x7fffffffu) & 0x7f800000u);
}

// The edges of exp, log and sqrt, which the builtins leave undefined (SwiftShader's log(0) is
// -88.03, its exp(NaN) inf), pinned to torch's answers on the bits: exp(+-inf) = inf, 0;
// log(+-0) = -inf, log(inf) = inf; sqrt(+-0) = +-0, sqrt(inf) = inf; log and sqrt of a negative
// number (-inf too) NaN. NaN itself is kept by `keep_nan`.
fn neg_inf_like(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(inf_like(x)) | 0x80000000u);
}

fn exp_edges(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    let r = select(exp(x), inf_like(x), b == 0x7f800000u);
    return select(r, 0.0, b == 0xff800000u);
}

fn log_nan(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    var r = select(log(x), inf_like(x), b == 0x7f800000u);
    r = select(r, neg_inf_like(x), (b & 0x7fffffffu) == 0u);
    return select(r, nan_like(x), b > 0x80000000u);
}

fn sqrt_nan(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    let r = select(sqrt(x), x, (b & 0x7fffffffu) == 0u || b == 0x7f800000u);
    return select(r, nan_like(x), b > 0x80000000u);
}

// x^e with torch (C pow) semantics: x^0 = 1 even for NaN; a negative base with an integer
// exponent takes the sign of its parity; a finite negative base with a fractional exponent is NaN;
// 0^-e = inf (signed for -0 and an odd exponent). `e` is finite (the host checks).
fn pow_scalar(x: f32, e: f32) -> f32 {
    if (e == 0.0) {
        return 1.0;
    }
    if (e == 1.0) {
        return x;
    }
    if (e == 2.0) {
        return x * x;
    }
    let a = abs(x);
    var r = exp2(e * log2(a));
    // The edges the builtins may leave undefined: zero and infinity.
    if (a == 0.0) {
        r = select(0.0, inf_like(x), e < 0.0);
    }
    if (a == inf_like(x)) {
        r = select(a, 0.0, e < 0.0);
    }
    let integer = e == floor(e);
    let odd = integer && fract(0.5 * e) != 0.0;
    let negative = (bitcast<u32>(x) >> 31u) == 1u;
    if (negative && odd) {
        r = -r;
    }
    // -inf^e for a fractional e is +inf or +0 (C), not NaN.
    if (negative && !integer && a != 0.0 && a != inf_like(x)) {
        r = nan_like(x);
    }
    return select(r, x, is_nan(x));
}

// min(max(x, lo), hi) keeping NaN (the bounds are never NaN: the host checks). lo > hi gives hi
// everywhere, as in torch.
fn clamp_nan(x: f32, lo: f32, hi: f32) -> f32 {
    return select(min(max(x, lo), hi), x, is_nan(x));
}

// NaN in, NaN out, decided on the bits: the spec lets the builtins (exp, log, sqrt, ...) assume
// no NaN, and SwiftShader's exp(NaN) is inf.
fn keep_nan(r: f32, x: f32) -> f32 {
    return select(r, x, is_nan(x));
}

fn apply(x: f32) -> f32 {
    // Constant conditions: the compiler keeps one of these, or none.
    if (OP == 9u) { return keep_nan(gelu(x), x); }
    if (OP == 10u) { return keep_nan(tanh_stable(x), x); }
    if (OP == 11u) { return keep_nan(sigmoid(x), x); }
    if (OP == 12u) { return keep_nan(exp_edges(x), x); }
    if (OP == 13u) { return keep_nan(log_nan(x), x); }
    if (OP == 14u) { return keep_nan(sqrt_nan(x), x); }
    if (OP == 15u) { return pow_scalar(x, p.s); }
    if (OP == 16u) { return clamp_nan(x, p.s, p.s2); }
    // |x| by clearing the sign bit: NaN stays NaN, -0 becomes 0.
    if (OP == 17u) { return bitcast<f32>(bitcast<u32>(x) & 0x7fffffffu); }
    if (OP == 18u) { return keep_nan(silu(x), x); }
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
    if (VEC == 1u) {
        let q = 4u * w;
        if (q < p.n) {
            let v = ld4_x(q);
            st4_out(q, vec4<f32>(apply(v.x), apply(v.y), apply(v.z), apply(v.w)));
        }
        return;
    }
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
