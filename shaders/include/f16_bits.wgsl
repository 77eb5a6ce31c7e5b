// f16 <-> f32 by the bits, for f16 storage: prepended by kernels/mod.rs to every module with an
// f16 binding; the packed accessors use nothing else.
//
// Why not pack2x16float / unpack2x16float: the WGSL spec leaves a packed value outside f16's
// finite range indeterminate (SwiftShader turns inf into NaN), lets an inexact conversion round
// either way, and lets an adapter assume no inf or NaN occurs. Integer arithmetic is exact on
// every adapter, so these give the same bits everywhere: the bits of the `half` crate (round to
// nearest even; inf, NaN and subnormals kept; a NaN keeps the top of its payload, made quiet).
//
// Branch-free (every case computed, one picked by `select`), two values at a time: the
// accessors are inlined into unrolled kernels (the subgroup matmul), where branches multiplied
// SwiftShader's compile time and memory (minutes and gigabytes for one kernel).

// f32 -> f16 bits (in the low 16 bits of each component).
fn fg16_from_f32x2(x: vec2<f32>) -> vec2<u32> {
    let b = bitcast<vec2<u32>>(x);
    let s = (b >> vec2<u32>(16u)) & vec2<u32>(0x8000u);
    let e = (b >> vec2<u32>(23u)) & vec2<u32>(0xffu);
    let m = b & vec2<u32>(0x7fffffu);
    let zero = vec2<u32>(0u);
    let one = vec2<u32>(1u);
    // A normal f16 (f16's biased exponent is e - 112): the top 10 mantissa bits, rounded to
    // nearest even (the round bit, and a sticky bit or the kept bit's lowest); a carry goes into
    // the exponent, and past the largest finite f16 to inf.
    let up_n = ((m & vec2<u32>(0x1000u)) != zero) & ((m & vec2<u32>(0x2fffu)) != zero);
    let normal = (s | ((e - vec2<u32>(112u)) << vec2<u32>(10u)) | (m >> vec2<u32>(13u)))
        + select(zero, one, up_n);
    // A subnormal f16 (e from 102 to 112): the mantissa with its leading 1, shifted right by
    // 14 to 24 and rounded the same way (the clamp only keeps the unused shifts in range).
    let mm = m | vec2<u32>(0x800000u);
    let sh = vec2<u32>(126u) - clamp(e, vec2<u32>(102u), vec2<u32>(112u));
    let rb = one << (sh - one);
    let up_s = ((mm & rb) != zero) & ((mm & (vec2<u32>(3u) * rb - one)) != zero);
    let sub = s | ((mm >> sh) + select(zero, one, up_s));
    // inf, or a quiet NaN with the payload's top 10 bits.
    let nan_bits = select(zero, vec2<u32>(0x200u) | (m >> vec2<u32>(13u)), m != zero);
    var h = select(normal, sub, e <= vec2<u32>(112u));
    h = select(h, s, e < vec2<u32>(102u)); // below 2^-25 (f32 subnormals too): a signed zero
    h = select(h, s | vec2<u32>(0x7c00u), e >= vec2<u32>(143u)); // overflow: inf
    return select(h, s | vec2<u32>(0x7c00u) | nan_bits, e == vec2<u32>(0xffu));
}

// f16 bits (the low 16 bits of each component) -> f32, exact.
fn fg16_to_f32x2(hb: vec2<u32>) -> vec2<f32> {
    let h = hb & vec2<u32>(0xffffu);
    let s = (h & vec2<u32>(0x8000u)) << vec2<u32>(16u);
    let e = (h >> vec2<u32>(10u)) & vec2<u32>(0x1fu);
    let m = h & vec2<u32>(0x3ffu);
    let zero = vec2<u32>(0u);
    let normal = s | ((e + vec2<u32>(112u)) << vec2<u32>(23u)) | (m << vec2<u32>(13u));
    // A subnormal: m 2^-24 = 2^(p - 24) (m / 2^p), normal in f32, p the top set bit of m (the
    // min only keeps m = 0's unused shift in range).
    let p = min(firstLeadingBit(m), vec2<u32>(9u));
    let sub = select(s,
        s | ((p + vec2<u32>(103u)) << vec2<u32>(23u)) | ((m << (vec2<u32>(23u) - p)) & vec2<u32>(0x7fffffu)),
        m != zero);
    let special = s | vec2<u32>(0x7f800000u)
        | select(zero, vec2<u32>(0x400000u) | (m << vec2<u32>(13u)), m != zero);
    var r = select(normal, sub, e == zero);
    r = select(r, special, e == vec2<u32>(0x1fu));
    return bitcast<vec2<f32>>(r);
}

fn fg16_from_f32(x: f32) -> u32 {
    return fg16_from_f32x2(vec2<f32>(x)).x;
}

fn fg16_to_f32(h: u32) -> f32 {
    return fg16_to_f32x2(vec2<u32>(h)).x;
}

// Two f32 -> one word (v.x in the low half).
fn fg16_pack2(v: vec2<f32>) -> u32 {
    let h = fg16_from_f32x2(v);
    return h.x | (h.y << 16u);
}

// One word -> two f32 (the low half first).
fn fg16_unpack2(w: u32) -> vec2<f32> {
    return fg16_to_f32x2(vec2<u32>(w, w >> 16u));
}

// Word w with half `k` (0 low, 1 high) replaced by the f16 of v; the other half's bits kept.
fn fg16_set_half(w: u32, k: u32, v: f32) -> u32 {
    let sh = 16u * k;
    return (w & ~(0xffffu << sh)) | (fg16_from_f32(v) << sh);
}
