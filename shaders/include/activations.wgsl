// Activations and their derivatives (and a NaN test), shared by unary.wgsl (forward) and
// binary.wgsl (backward); prepended at build time.

// Whether x is NaN, on the bits (GL drivers may fold `x != x` to false).
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// max(x, 0) that keeps NaN, as torch.relu does. Compared on the bits: GL drivers turn
// `x < 0.0 ? 0.0 : x` into max(x, 0.0), which may drop NaN. Negative non-NaN floats are the
// bit patterns in (0x80000000, 0xff800000]; -0.0 passes through.
fn relu(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    return select(x, 0.0, b > 0x80000000u && b <= 0xff800000u);
}

// tanh without overflow: sign(u) (1 - e) / (1 + e) with e = exp(-2|u|) <= 1, so |u| = 1e4 or inf
// gives +-1, never inf / inf. Near 0, where 1 - e cancels, an odd Taylor polynomial (its first
// omitted term is below 1e-9 relative for |u| < 0.125).
fn tanh_stable(u: f32) -> f32 {
    let a = abs(u);
    let e = exp(-2.0 * a);
    let far = sign(u) * (1.0 - e) / (1.0 + e);
    let u2 = u * u;
    let near = u * (1.0 + u2 * (-1.0 / 3.0 + u2 * (2.0 / 15.0 + u2 * (-17.0 / 315.0))));
    return select(far, near, a < 0.125);
}

// gelu, tanh form: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
fn gelu(x: f32) -> f32 {
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    return 0.5 * x * (1.0 + tanh_stable(u));
}

// 1 / (1 + exp(-x)), computed from e = exp(-|x|) <= 1 so neither sign overflows: 1 / (1 + e)
// for x >= 0, e / (1 + e) below.
fn sigmoid(x: f32) -> f32 {
    let e = exp(-abs(x));
    return select(e, 1.0, x >= 0.0) / (1.0 + e);
}

// x sigmoid(x) (SiLU); 0 * sigmoid at -inf is taken as 0 by sigmoid's e / (1 + e) = 0.
fn silu(x: f32) -> f32 {
    return x * sigmoid(x);
}

// d silu / dx = s (1 + x (1 - s)) with s = sigmoid(x).
fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    return s * (1.0 + x * (1.0 - s));
}

// d gelu / dx for the tanh form: 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2),
// with t = tanh(u). Past |x| = 10 it is 1 or 0 to f32 precision; the cut also keeps x^3 from
// overflowing into 0 * inf = NaN.
fn gelu_grad(x: f32) -> f32 {
    if (abs(x) > 10.0) {
        return select(0.0, 1.0, x > 0.0);
    }
    let c = 0.7978845608028654;
    let t = tanh_stable(c * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 0.134145 * x * x);
}
