// Shared by shaders/qmatmul.wgsl and shaders/qmatmul_sg.wgsl (prepended after
// include/matmul_common.wgsl): the layout of the int8 weights and the arithmetic of a step.
//
// W is (N, K) int8, four k per u32 (k = 4j + b in byte b of word j of a row, two's
// complement), each row padded with zero bytes to a whole number of vec4<u32> (16 k): `w` is
// read as vec4<u32>, row n starting at vec4 n * KV, KV = ceil(K / 16). `scale` (N, f32) is per
// output channel: W[n, k] = scale[n] * q[n, k]. Since the scale is per output, C[m, n] =
// scale[n] * sum_k A[m, k] q[n, k]: the sum runs over the integers (exact as f32), k in order,
// and the scale multiplies once, before `store4` adds the bias and applies the activation.

// The four int8 of a word, sign-extended: each byte shifted to the top of an i32 and back.
fn q4(word: u32) -> vec4<f32> {
    let hi = vec4<u32>(word) << vec4<u32>(24u, 16u, 8u, 0u);
    return vec4<f32>(bitcast<vec4<i32>>(hi) >> vec4<u32>(24u));
}

// A[row, k .. k + 4] (`r` = row * K), zeros past K: the padding bytes of W are 0, but the next
// row's values must not be read (they may be anything).
fn a4(r: u32, k: u32) -> vec4<f32> {
    if (k + 3u < p.k) {
        return ld4_a(r + k);
    }
    var v = vec4<f32>(0.0);
    for (var i = 0u; k + i < p.k; i++) {
        v[i] = ld_a(r + k + i);
    }
    return v;
}

// acc + a[t] * W[n0 .. n0 + 4, k + t] over t in order; q0 .. q3 are the four columns' k quads.
fn fma4x4(acc: vec4<f32>, a: vec4<f32>, q0: vec4<f32>, q1: vec4<f32>, q2: vec4<f32>, q3: vec4<f32>) -> vec4<f32> {
    var s = fma(vec4<f32>(a.x), vec4<f32>(q0.x, q1.x, q2.x, q3.x), acc);
    s = fma(vec4<f32>(a.y), vec4<f32>(q0.y, q1.y, q2.y, q3.y), s);
    s = fma(vec4<f32>(a.z), vec4<f32>(q0.z, q1.z, q2.z, q3.z), s);
    return fma(vec4<f32>(a.w), vec4<f32>(q0.w, q1.w, q2.w, q3.w), s);
}

// The scales of columns n0 .. n0 + 4 (clamped: columns past N are never stored).
fn scales4(n0: u32) -> vec4<f32> {
    let last_n = p.n - 1u;
    return vec4<f32>(ld_scale(min(n0, last_n)), ld_scale(min(n0 + 1u, last_n)),
                     ld_scale(min(n0 + 2u, last_n)), ld_scale(min(n0 + 3u, last_n)));
}
