// f16 <-> f32 by the bits, for the packed-f16 storage (two f16 in a u32): prepended by
// kernels/mod.rs to every module with a packed binding; its accessors call nothing else.
//
// Why not pack2x16float alone: the WGSL spec leaves its result indeterminate for a value outside
// f16's finite range (SwiftShader turns inf into NaN) and lets an inexact conversion round either
// way. Integer arithmetic is exact on every adapter, so these give the same bits everywhere: the
// bits the `half` crate gives (round to nearest even; inf, NaN and subnormals kept; a NaN keeps
// the top of its payload and is made quiet).

// f32 -> f16 bits (in the low 16 bits).
fn fg16_from_f32(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let s = (b >> 16u) & 0x8000u;
    let e = (b >> 23u) & 0xffu;
    let m = b & 0x7fffffu;
    if (e == 0xffu) {
        // inf, or NaN: quiet, with the payload's top 10 bits.
        return s | 0x7c00u | select(0u, 0x200u | (m >> 13u), m != 0u);
    }
    // f16's biased exponent is e - 112: 31 and above overflow to inf.
    if (e >= 143u) {
        return s | 0x7c00u;
    }
    if (e <= 112u) {
        // A subnormal f16 (or zero): below 2^-25 nothing is left (f32 subnormals included).
        if (e < 102u) {
            return s;
        }
        let mm = m | 0x800000u;
        let shift = 126u - e; // 14 to 24
        let rb = 1u << (shift - 1u);
        // Round to nearest even: the round bit, and a sticky bit or the kept bit's lowest.
        let up = (mm & rb) != 0u && (mm & (3u * rb - 1u)) != 0u;
        return s | ((mm >> shift) + select(0u, 1u, up));
    }
    let h = s | ((e - 112u) << 10u) | (m >> 13u);
    // A carry out of the mantissa goes into the exponent (to inf past the largest finite f16).
    let up = (m & 0x1000u) != 0u && (m & 0x2fffu) != 0u;
    return h + select(0u, 1u, up);
}

// f16 bits (the low 16 bits of h) -> f32, exact.
fn fg16_to_f32(h: u32) -> f32 {
    let s = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let m = h & 0x3ffu;
    if (e == 0x1fu) {
        return bitcast<f32>(s | 0x7f800000u | select(0u, 0x400000u | (m << 13u), m != 0u));
    }
    if (e == 0u) {
        if (m == 0u) {
            return bitcast<f32>(s);
        }
        // m 2^-24 = 2^(p - 24) (m / 2^p), normal in f32, with p the top set bit of m.
        let p = firstLeadingBit(m);
        return bitcast<f32>(s | ((p + 103u) << 23u) | ((m << (23u - p)) & 0x7fffffu));
    }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}

// Two f32 -> one word (v.x in the low half).
fn fg16_pack2(v: vec2<f32>) -> u32 {
    return fg16_from_f32(v.x) | (fg16_from_f32(v.y) << 16u);
}

// One word -> two f32. unpack2x16float is exact for normal f16 (every finite f16 is an f32), so
// words of two normal halves take it; zeros, subnormals (which an adapter may flush), inf and
// NaN (which an adapter may assume absent) are decoded on the bits.
fn fg16_unpack2(w: u32) -> vec2<f32> {
    let e0 = (w >> 10u) & 0x1fu;
    let e1 = (w >> 26u) & 0x1fu;
    if (e0 != 0u && e0 != 0x1fu && e1 != 0u && e1 != 0x1fu) {
        return unpack2x16float(w);
    }
    return vec2<f32>(fg16_to_f32(w & 0xffffu), fg16_to_f32(w >> 16u));
}

// Word w with half `k` (0 low, 1 high) replaced by the f16 of v; the other half's bits kept.
fn fg16_set_half(w: u32, k: u32, v: f32) -> u32 {
    let sh = 16u * k;
    return (w & ~(0xffffu << sh)) | (fg16_from_f32(v) << sh);
}
