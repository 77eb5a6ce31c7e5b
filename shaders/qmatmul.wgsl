// C = A · dequant(W)ᵀ (+ bias) (activation) with int8 weights dequantized in registers: the
// f32 weights never exist in memory.
// A is (M, K), f32 or f16. W is (N, K) int8, four k per u32 word of `w` (k = 4j + b in byte b,
// two's complement), each row padded with zero bytes to KW = ceil(K / 4) words. `scale` (N,
// f32) is per output channel: W[n, k] = scale[n] * q[n, k]. bias (N) f32. C is (M, N) in A's
// dtype (or f32 staging). Since the scale is per output, C[m, n] = scale[n] * sum_k A[m, k]
// q[n, k]: the sum runs over the integers (exact in f32), k in order, and the scale multiplies
// once. Parameters (binding 0, the batch fields unused) and `store4` (bias, fused relu / gelu)
// come from include/matmul_common.wgsl.
//
// Each invocation computes a 4 x 4 block of C, straight from memory as matmul_reg.wgsl does:
// per word it loads one word of each of its four rows of W (a quarter of the f32 kernel's
// bytes and loads) and a quad of each of its four rows of A. A workgroup lies along N only,
// so the rows of A depend on the workgroup alone and a CPU adapter issues their loads once for
// all its SIMD lanes.

const TM: u32 = 4u;  // rows of C per invocation (four accumulators below)
const WG: u32 = 64u; // invocations per workgroup, all along N

// The four int8 of a word, sign-extended: each byte shifted to the top of an i32 and back.
fn q4(word: u32) -> vec4<f32> {
    let hi = vec4<u32>(word) << vec4<u32>(24u, 16u, 8u, 0u);
    return vec4<f32>(bitcast<vec4<i32>>(hi) >> vec4<u32>(24u));
}

// A[row, k .. k + 4] from element offset `r` of the row, zeros past K (padding bytes of W are
// 0, but the next row's values must not be read: they may be anything).
fn a_tail(r: u32, k: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    for (var i = 0u; k + i < p.k; i++) {
        v[i] = ld_a(r + k + i);
    }
    return v;
}

// acc + a[t] * W[n0 + c, k + t] over t, with the four columns' quads qc: k in order.
fn fma4x4(acc: vec4<f32>, a: vec4<f32>, q0: vec4<f32>, q1: vec4<f32>, q2: vec4<f32>, q3: vec4<f32>) -> vec4<f32> {
    var s = fma(vec4<f32>(a.x), vec4<f32>(q0.x, q1.x, q2.x, q3.x), acc);
    s = fma(vec4<f32>(a.y), vec4<f32>(q0.y, q1.y, q2.y, q3.y), s);
    s = fma(vec4<f32>(a.z), vec4<f32>(q0.z, q1.z, q2.z, q3.z), s);
    return fma(vec4<f32>(a.w), vec4<f32>(q0.w, q1.w, q2.w, q3.w), s);
}

@compute @workgroup_size(WG, 1, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let m0 = wg.y * TM;
    let n0 = (wg.x * WG + lid.x) * 4u;
    if (m0 >= p.m || n0 >= p.n) {
        return;
    }
    let kw = (p.k + 3u) / 4u;
    // Rows and columns past the edge are clamped when read; their results are never stored.
    let r0 = m0 * p.k;
    let r1 = min(m0 + 1u, p.m - 1u) * p.k;
    let r2 = min(m0 + 2u, p.m - 1u) * p.k;
    let r3 = min(m0 + 3u, p.m - 1u) * p.k;
    let w0 = n0 * kw;
    let w1 = min(n0 + 1u, p.n - 1u) * kw;
    let w2 = min(n0 + 2u, p.n - 1u) * kw;
    let w3 = min(n0 + 3u, p.n - 1u) * kw;
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    let full = p.k / 4u;
    for (var j = 0u; j < full; j++) {
        let q0 = q4(w[w0 + j]);
        let q1 = q4(w[w1 + j]);
        let q2 = q4(w[w2 + j]);
        let q3 = q4(w[w3 + j]);
        let k = 4u * j;
        c0 = fma4x4(c0, ld4_a(r0 + k), q0, q1, q2, q3);
        c1 = fma4x4(c1, ld4_a(r1 + k), q0, q1, q2, q3);
        c2 = fma4x4(c2, ld4_a(r2 + k), q0, q1, q2, q3);
        c3 = fma4x4(c3, ld4_a(r3 + k), q0, q1, q2, q3);
    }
    if (full < kw) {
        let q0 = q4(w[w0 + full]);
        let q1 = q4(w[w1 + full]);
        let q2 = q4(w[w2 + full]);
        let q3 = q4(w[w3 + full]);
        let k = 4u * full;
        c0 = fma4x4(c0, a_tail(r0, k), q0, q1, q2, q3);
        c1 = fma4x4(c1, a_tail(r1, k), q0, q1, q2, q3);
        c2 = fma4x4(c2, a_tail(r2, k), q0, q1, q2, q3);
        c3 = fma4x4(c3, a_tail(r3, k), q0, q1, q2, q3);
    }
    let last = p.n - 1u;
    let s = vec4<f32>(ld_scale(n0), ld_scale(min(n0 + 1u, last)),
                      ld_scale(min(n0 + 2u, last)), ld_scale(min(n0 + 3u, last)));
    store4(0u, m0, n0, c0 * s);
    store4(0u, m0 + 1u, n0, c1 * s);
    store4(0u, m0 + 2u, n0, c2 * s);
    store4(0u, m0 + 3u, n0, c3 * s);
}
