// C = A · dequant(W)ᵀ (+ bias) (activation) with int8 weights dequantized in registers: the
// f32 weights never exist in memory. A is (M, K), f32 or f16; the int8 layout and the scales are
// described in include/qmatmul_common.wgsl; bias (N) f32; C is (M, N) in A's dtype (or f32
// staging). Parameters (binding 0, batch fields unused) and `store4` come from
// include/matmul_common.wgsl. This is the kernel for adapters without subgroups of a fixed
// size; qmatmul_sg.wgsl is the other.
//
// Each invocation computes a TM x 4 block of C straight from memory, as matmul_reg.wgsl does:
// per 16 k it loads one vec4<u32> of each of its four rows of W (a sixteenth of the loads of
// f32 weights) and four quads of each of its TM rows of A. The accumulators are variables, one
// line per row (CPU compilers keep an array indexed in a loop in memory); rows at or past TM
// are dead code once TM is specialized.

// Rows of C per invocation: 8, or 1 for one-row inputs. Specialized.
const TM: u32 = 8u;
// Invocations per workgroup, all along N, four columns each: 32, or 8 for outputs of at most
// 32 columns (a CPU adapter runs every invocation of a workgroup, in range or not).
// Specialized.
const WG: u32 = 32u;

@compute @workgroup_size(WG, 1, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let m0 = wg.y * TM;
    let n0 = (wg.x * WG + lid.x) * 4u;
    // Only a uniform exit: a lane-dependent one would make the loads of A divergent. Rows and
    // columns past the edge are clamped when read and never stored.
    if (m0 >= p.m) {
        return;
    }
    let last_m = p.m - 1u;
    let kv = (p.k + 15u) / 16u;
    let last_n = p.n - 1u;
    let w0 = min(n0 + 0u, last_n) * kv;
    let w1 = min(n0 + 1u, last_n) * kv;
    let w2 = min(n0 + 2u, last_n) * kv;
    let w3 = min(n0 + 3u, last_n) * kv;
    var c0 = vec4<f32>(0.0);
    var c1 = vec4<f32>(0.0);
    var c2 = vec4<f32>(0.0);
    var c3 = vec4<f32>(0.0);
    var c4 = vec4<f32>(0.0);
    var c5 = vec4<f32>(0.0);
    var c6 = vec4<f32>(0.0);
    var c7 = vec4<f32>(0.0);
    for (var j = 0u; j < kv; j++) {
        let v0 = w[w0 + j];
        let v1 = w[w1 + j];
        let v2 = w[w2 + j];
        let v3 = w[w3 + j];
        for (var t = 0u; t < 4u; t++) {
            let k = 16u * j + 4u * t;
            if (k >= p.k) {
                break;
            }
            let q0 = q4(v0[t]);
            let q1 = q4(v1[t]);
            let q2 = q4(v2[t]);
            let q3 = q4(v3[t]);
            { c0 = fma4x4(c0, a4(min(m0 + 0u, last_m) * p.k, k), q0, q1, q2, q3); }
            if (TM > 1u) { c1 = fma4x4(c1, a4(min(m0 + 1u, last_m) * p.k, k), q0, q1, q2, q3); }
            if (TM > 2u) { c2 = fma4x4(c2, a4(min(m0 + 2u, last_m) * p.k, k), q0, q1, q2, q3); }
            if (TM > 3u) { c3 = fma4x4(c3, a4(min(m0 + 3u, last_m) * p.k, k), q0, q1, q2, q3); }
            if (TM > 4u) { c4 = fma4x4(c4, a4(min(m0 + 4u, last_m) * p.k, k), q0, q1, q2, q3); }
            if (TM > 5u) { c5 = fma4x4(c5, a4(min(m0 + 5u, last_m) * p.k, k), q0, q1, q2, q3); }
            if (TM > 6u) { c6 = fma4x4(c6, a4(min(m0 + 6u, last_m) * p.k, k), q0, q1, q2, q3); }
            if (TM > 7u) { c7 = fma4x4(c7, a4(min(m0 + 7u, last_m) * p.k, k), q0, q1, q2, q3); }
        }
    }
    let s = scales4(n0);
    { store4(0u, m0 + 0u, n0, c0 * s); }
    if (TM > 1u) { store4(0u, m0 + 1u, n0, c1 * s); }
    if (TM > 2u) { store4(0u, m0 + 2u, n0, c2 * s); }
    if (TM > 3u) { store4(0u, m0 + 3u, n0, c3 * s); }
    if (TM > 4u) { store4(0u, m0 + 4u, n0, c4 * s); }
    if (TM > 5u) { store4(0u, m0 + 5u, n0, c5 * s); }
    if (TM > 6u) { store4(0u, m0 + 6u, n0, c6 * s); }
    if (TM > 7u) { store4(0u, m0 + 7u, n0, c7 * s); }
}
