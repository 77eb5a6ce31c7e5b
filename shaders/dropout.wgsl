// Dropout with a mask that is a pure function of (seed, element index), computed with integer
// operations only, so a seed gives the same mask on every adapter and the backward regenerates
// it instead of storing it. x and out have n elements (out may be the gradient):
//   key  = mix(seed_lo ^ mix(seed_hi ^ 0x9e3779b9))
//   bits = mix(mix(i ^ key) + key)
//   out[i] = x[i] * (bits >= threshold ? scale : 0)
// with mix = lowbias32 (two xor-shift-multiply rounds), threshold = p * 2^32 (element i is
// dropped with probability p) and scale = 1 / (1 - p). x * 0 keeps NaN, as torch does.
// Two outputs per invocation (see kernels/mod.rs).

struct Params {
    n: u32,
    threshold: u32,
    seed_lo: u32,
    seed_hi: u32,
    scale: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

fn mix(v: u32) -> u32 {
    var x = v;
    x ^= x >> 16u;
    x *= 0x7feb352du;
    x ^= x >> 15u;
    x *= 0x846ca68bu;
    x ^= x >> 16u;
    return x;
}

fn factor(i: u32, key: u32) -> f32 {
    let bits = mix(mix(i ^ key) + key);
    return select(0.0, p.scale, bits >= p.threshold);
}

fn value(i: u32) -> f32 {
    return ld_x(i) * factor(i, mix(p.seed_lo ^ mix(p.seed_hi ^ 0x9e3779b9u)));
}
