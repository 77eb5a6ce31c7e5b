// C = op(A) · op(B) (+ bias) (activation), batched over workgroup_id.z.
// op(A) is (M, K): A is stored (M, K), or (K, M) with TRANS_A. op(B) is (K, N): B is stored
// (K, N), or (N, K) with TRANS_B. bias is (N). C is (M, N). All f32 accumulation, k in order, in
// blocks (K_MASK, include/matmul_common.wgsl).
// Parameters (binding 0) and `store4` (the fused epilogue) come from include/matmul_common.wgsl,
// TRANS_A / TRANS_B / VEC_B and the loads a4, a1, b4 from include/matmul_loads.wgsl.
//
// Register-blocked and barrier-free: each invocation computes a TM x TN block of C straight from
// memory, four k at a time, with no workgroup memory and no barriers. CPU adapters (lavapipe)
// run this fastest: their caches do the tiling, and barriers cost them a thread switch.

const TM: u32 = 4u;   // rows of C per invocation
const TN: u32 = 4u;   // columns of C per invocation, a multiple of 4
const TN4: u32 = 1u;  // TN / 4
const WG_X: u32 = 16u;
const WG_Y: u32 = 4u;
@compute @workgroup_size(WG_X, WG_Y, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    // With WG_Y = 1 the rows depend on the workgroup only, so a CPU adapter proves A's loads
    // uniform across its SIMD lanes and issues one load instead of one per lane.
    let ly = select(lid.y, 0u, WG_Y == 1u);
    let m0 = (wg.y * WG_Y + ly) * TM;
    let n0 = (wg.x * WG_X + lid.x) * TN;
    if (m0 >= p.m || n0 >= p.n) {
        return;
    }
    let a_base = wg.z * p.a_batch;
    let b_base = wg.z * p.b_batch;
    // Edge blocks read clamped rows; their extra results are never stored.
    var rows: array<u32, TM>;
    for (var r = 0u; r < TM; r++) {
        rows[r] = min(m0 + r, p.m - 1u);
    }
    // acc[r * TN4 + j] = C[m0 + r, n0 + 4j .. n0 + 4j + 4]
    var acc: array<vec4<f32>, TM * TN4>;
    var sum: array<vec4<f32>, TM * TN4>; // the blocks before k's
    let c_base = wg.z * p.c_batch;
    if (ONTO) {
        for (var r = 0u; r < TM; r++) {
            for (var j = 0u; j < TN4; j++) {
                acc[r * TN4 + j] = start4(c_base, rows[r], n0 + 4u * j);
            }
        }
    }
    let k4 = p.k & ~3u;
    for (var k = 0u; k < k4; k += 4u) {
        if (block_starts(k)) { // blocks are whole quads of k
            for (var i = 0u; i < TM * TN4; i++) {
                sum[i] += acc[i];
                acc[i] = vec4<f32>(0.0);
            }
        }
        var bv: array<vec4<f32>, 4 * TN4>; // bv[kk * TN4 + j]
        for (var kk = 0u; kk < 4u; kk++) {
            for (var j = 0u; j < TN4; j++) {
                bv[kk * TN4 + j] = b4(b_base, k + kk, n0 + 4u * j);
            }
        }
        for (var r = 0u; r < TM; r++) {
            let a = a4(a_base, rows[r], k);
            for (var j = 0u; j < TN4; j++) {
                var s = acc[r * TN4 + j];
                s = fma(vec4<f32>(a.x), bv[j], s);
                s = fma(vec4<f32>(a.y), bv[TN4 + j], s);
                s = fma(vec4<f32>(a.z), bv[2u * TN4 + j], s);
                s = fma(vec4<f32>(a.w), bv[3u * TN4 + j], s);
                acc[r * TN4 + j] = s;
            }
        }
    }
    for (var k = k4; k < p.k; k++) {
        if (block_starts(k)) {
            for (var i = 0u; i < TM * TN4; i++) {
                sum[i] += acc[i];
                acc[i] = vec4<f32>(0.0);
            }
        }
        for (var r = 0u; r < TM; r++) {
            let a = vec4<f32>(a1(a_base, rows[r], k));
            for (var j = 0u; j < TN4; j++) {
                acc[r * TN4 + j] = fma(a, b4(b_base, k, n0 + 4u * j), acc[r * TN4 + j]);
            }
        }
    }
    for (var r = 0u; r < TM; r++) {
        let m = m0 + r;
        if (m >= p.m) {
            break;
        }
        for (var j = 0u; j < TN4; j++) {
            store4(c_base, m, n0 + 4u * j, sum[r * TN4 + j] + acc[r * TN4 + j]);
        }
    }
}
