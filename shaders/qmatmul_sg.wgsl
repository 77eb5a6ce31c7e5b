// C = A · dequant(W)ᵀ (+ bias) (activation) with int8 weights dequantized in registers, for
// adapters with subgroups of a fixed size SG >= 8: the fast kernel on CPU adapters. A is (M, K),
// f32 or f16; the int8 layout and the scales are described in include/qmatmul_common.wgsl;
// bias (N) f32; C is (M, N) in A's dtype (or f32 staging). Parameters (binding 0, batch fields
// unused) and `store4` come from include/matmul_common.wgsl.
//
// A workgroup is one subgroup of SG lanes computing TM rows x TN SG columns, each lane TN
// adjacent columns (one or two quads) and all TM rows. Per four k, lane l loads the quads of A's rows
// m0 + l % 8, m0 + 8 + l % 8, ... (TM / 8 loads per lane where every lane would otherwise load
// all TM rows: on lavapipe a buffer load is a loop over the lanes), and row 8i + r's quad
// reaches every lane with subgroupBroadcast(quad i, r), a register shuffle; each lane loads its
// own columns of W, a vec4<u32> (16 k) per column. No workgroup memory, no barriers, and no
// lane returns early (a broadcast needs every lane). The accumulators c{row}_{quad} are
// variables, one line per row (CPU compilers keep an array indexed in a loop in memory); rows
// at or past TM are dead code once TM is specialized. 32 x 8 measured fastest on lavapipe
// (ARCHITECTURE.md).

// Rows of C per subgroup: 32, or 8 for inputs of at most 8 rows. Specialized.
const TM: u32 = 32u;
// Columns per lane: 8, or 4 for outputs of at most 4 SG columns. Specialized.
const TN: u32 = 8u;
// Lanes per subgroup: the adapter's fixed subgroup size, at least 8. Specialized.
const SG: u32 = 8u;

@compute @workgroup_size(SG, 1, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(subgroup_invocation_id) lane: u32) {
    let m0 = wg.y * TM;
    let n0 = (wg.x * SG + lane) * TN;
    // Uniform: the whole subgroup leaves or stays. Rows and columns past the edge are clamped
    // when read and never stored.
    if (m0 >= p.m) {
        return;
    }
    let last_m = p.m - 1u;
    let kv = (p.k + 15u) / 16u;
    let last_n = p.n - 1u;
    let w00 = min(n0 + 0u, last_n) * kv;
    let w01 = min(n0 + 1u, last_n) * kv;
    let w02 = min(n0 + 2u, last_n) * kv;
    let w03 = min(n0 + 3u, last_n) * kv;
    let w10 = min(n0 + 4u, last_n) * kv;
    let w11 = min(n0 + 5u, last_n) * kv;
    let w12 = min(n0 + 6u, last_n) * kv;
    let w13 = min(n0 + 7u, last_n) * kv;
    var c0_0 = vec4<f32>(0.0); var c0_1 = vec4<f32>(0.0);
    var c1_0 = vec4<f32>(0.0); var c1_1 = vec4<f32>(0.0);
    var c2_0 = vec4<f32>(0.0); var c2_1 = vec4<f32>(0.0);
    var c3_0 = vec4<f32>(0.0); var c3_1 = vec4<f32>(0.0);
    var c4_0 = vec4<f32>(0.0); var c4_1 = vec4<f32>(0.0);
    var c5_0 = vec4<f32>(0.0); var c5_1 = vec4<f32>(0.0);
    var c6_0 = vec4<f32>(0.0); var c6_1 = vec4<f32>(0.0);
    var c7_0 = vec4<f32>(0.0); var c7_1 = vec4<f32>(0.0);
    var c8_0 = vec4<f32>(0.0); var c8_1 = vec4<f32>(0.0);
    var c9_0 = vec4<f32>(0.0); var c9_1 = vec4<f32>(0.0);
    var c10_0 = vec4<f32>(0.0); var c10_1 = vec4<f32>(0.0);
    var c11_0 = vec4<f32>(0.0); var c11_1 = vec4<f32>(0.0);
    var c12_0 = vec4<f32>(0.0); var c12_1 = vec4<f32>(0.0);
    var c13_0 = vec4<f32>(0.0); var c13_1 = vec4<f32>(0.0);
    var c14_0 = vec4<f32>(0.0); var c14_1 = vec4<f32>(0.0);
    var c15_0 = vec4<f32>(0.0); var c15_1 = vec4<f32>(0.0);
    var c16_0 = vec4<f32>(0.0); var c16_1 = vec4<f32>(0.0);
    var c17_0 = vec4<f32>(0.0); var c17_1 = vec4<f32>(0.0);
    var c18_0 = vec4<f32>(0.0); var c18_1 = vec4<f32>(0.0);
    var c19_0 = vec4<f32>(0.0); var c19_1 = vec4<f32>(0.0);
    var c20_0 = vec4<f32>(0.0); var c20_1 = vec4<f32>(0.0);
    var c21_0 = vec4<f32>(0.0); var c21_1 = vec4<f32>(0.0);
    var c22_0 = vec4<f32>(0.0); var c22_1 = vec4<f32>(0.0);
    var c23_0 = vec4<f32>(0.0); var c23_1 = vec4<f32>(0.0);
    var c24_0 = vec4<f32>(0.0); var c24_1 = vec4<f32>(0.0);
    var c25_0 = vec4<f32>(0.0); var c25_1 = vec4<f32>(0.0);
    var c26_0 = vec4<f32>(0.0); var c26_1 = vec4<f32>(0.0);
    var c27_0 = vec4<f32>(0.0); var c27_1 = vec4<f32>(0.0);
    var c28_0 = vec4<f32>(0.0); var c28_1 = vec4<f32>(0.0);
    var c29_0 = vec4<f32>(0.0); var c29_1 = vec4<f32>(0.0);
    var c30_0 = vec4<f32>(0.0); var c30_1 = vec4<f32>(0.0);
    var c31_0 = vec4<f32>(0.0); var c31_1 = vec4<f32>(0.0);
    for (var j = 0u; j < kv; j++) {
        let v00 = w[w00 + j];
        let v01 = w[w01 + j];
        let v02 = w[w02 + j];
        let v03 = w[w03 + j];
        // The second quad of columns, where TN has one.
        var v1 = array<vec4<u32>, 4>();
        if (TN > 4u) {
            v1 = array<vec4<u32>, 4>(w[w10 + j], w[w11 + j], w[w12 + j], w[w13 + j]);
        }
        for (var t = 0u; t < 4u; t++) {
            let k = 16u * j + 4u * t;
            if (k >= p.k) {
                break;
            }
            let q0 = array<vec4<f32>, 4>(q4(v00[t]), q4(v01[t]), q4(v02[t]), q4(v03[t]));
            var q1 = array<vec4<f32>, 4>();
            if (TN > 4u) {
                q1 = array<vec4<f32>, 4>(q4(v1[0][t]), q4(v1[1][t]), q4(v1[2][t]), q4(v1[3][t]));
            }
            {
                // Rows 0 .. 8: this lane's quad of row m0 + 0 + lane % 8, broadcast.
                let a = a4(min(m0 + 0u + lane % 8u, last_m) * p.k, k);
                let x0 = subgroupBroadcast(a, 0u);
                c0_0 = fma4x4(c0_0, x0, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c0_1 = fma4x4(c0_1, x0, q1[0], q1[1], q1[2], q1[3]); }
                let x1 = subgroupBroadcast(a, 1u);
                c1_0 = fma4x4(c1_0, x1, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c1_1 = fma4x4(c1_1, x1, q1[0], q1[1], q1[2], q1[3]); }
                let x2 = subgroupBroadcast(a, 2u);
                c2_0 = fma4x4(c2_0, x2, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c2_1 = fma4x4(c2_1, x2, q1[0], q1[1], q1[2], q1[3]); }
                let x3 = subgroupBroadcast(a, 3u);
                c3_0 = fma4x4(c3_0, x3, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c3_1 = fma4x4(c3_1, x3, q1[0], q1[1], q1[2], q1[3]); }
                let x4 = subgroupBroadcast(a, 4u);
                c4_0 = fma4x4(c4_0, x4, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c4_1 = fma4x4(c4_1, x4, q1[0], q1[1], q1[2], q1[3]); }
                let x5 = subgroupBroadcast(a, 5u);
                c5_0 = fma4x4(c5_0, x5, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c5_1 = fma4x4(c5_1, x5, q1[0], q1[1], q1[2], q1[3]); }
                let x6 = subgroupBroadcast(a, 6u);
                c6_0 = fma4x4(c6_0, x6, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c6_1 = fma4x4(c6_1, x6, q1[0], q1[1], q1[2], q1[3]); }
                let x7 = subgroupBroadcast(a, 7u);
                c7_0 = fma4x4(c7_0, x7, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c7_1 = fma4x4(c7_1, x7, q1[0], q1[1], q1[2], q1[3]); }
            }
            if (TM > 8u) {
                // Rows 8 .. 16: this lane's quad of row m0 + 8 + lane % 8, broadcast.
                let a = a4(min(m0 + 8u + lane % 8u, last_m) * p.k, k);
                let x8 = subgroupBroadcast(a, 0u);
                c8_0 = fma4x4(c8_0, x8, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c8_1 = fma4x4(c8_1, x8, q1[0], q1[1], q1[2], q1[3]); }
                let x9 = subgroupBroadcast(a, 1u);
                c9_0 = fma4x4(c9_0, x9, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c9_1 = fma4x4(c9_1, x9, q1[0], q1[1], q1[2], q1[3]); }
                let x10 = subgroupBroadcast(a, 2u);
                c10_0 = fma4x4(c10_0, x10, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c10_1 = fma4x4(c10_1, x10, q1[0], q1[1], q1[2], q1[3]); }
                let x11 = subgroupBroadcast(a, 3u);
                c11_0 = fma4x4(c11_0, x11, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c11_1 = fma4x4(c11_1, x11, q1[0], q1[1], q1[2], q1[3]); }
                let x12 = subgroupBroadcast(a, 4u);
                c12_0 = fma4x4(c12_0, x12, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c12_1 = fma4x4(c12_1, x12, q1[0], q1[1], q1[2], q1[3]); }
                let x13 = subgroupBroadcast(a, 5u);
                c13_0 = fma4x4(c13_0, x13, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c13_1 = fma4x4(c13_1, x13, q1[0], q1[1], q1[2], q1[3]); }
                let x14 = subgroupBroadcast(a, 6u);
                c14_0 = fma4x4(c14_0, x14, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c14_1 = fma4x4(c14_1, x14, q1[0], q1[1], q1[2], q1[3]); }
                let x15 = subgroupBroadcast(a, 7u);
                c15_0 = fma4x4(c15_0, x15, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c15_1 = fma4x4(c15_1, x15, q1[0], q1[1], q1[2], q1[3]); }
            }
            if (TM > 16u) {
                // Rows 16 .. 24: this lane's quad of row m0 + 16 + lane % 8, broadcast.
                let a = a4(min(m0 + 16u + lane % 8u, last_m) * p.k, k);
                let x16 = subgroupBroadcast(a, 0u);
                c16_0 = fma4x4(c16_0, x16, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c16_1 = fma4x4(c16_1, x16, q1[0], q1[1], q1[2], q1[3]); }
                let x17 = subgroupBroadcast(a, 1u);
                c17_0 = fma4x4(c17_0, x17, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c17_1 = fma4x4(c17_1, x17, q1[0], q1[1], q1[2], q1[3]); }
                let x18 = subgroupBroadcast(a, 2u);
                c18_0 = fma4x4(c18_0, x18, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c18_1 = fma4x4(c18_1, x18, q1[0], q1[1], q1[2], q1[3]); }
                let x19 = subgroupBroadcast(a, 3u);
                c19_0 = fma4x4(c19_0, x19, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c19_1 = fma4x4(c19_1, x19, q1[0], q1[1], q1[2], q1[3]); }
                let x20 = subgroupBroadcast(a, 4u);
                c20_0 = fma4x4(c20_0, x20, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c20_1 = fma4x4(c20_1, x20, q1[0], q1[1], q1[2], q1[3]); }
                let x21 = subgroupBroadcast(a, 5u);
                c21_0 = fma4x4(c21_0, x21, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c21_1 = fma4x4(c21_1, x21, q1[0], q1[1], q1[2], q1[3]); }
                let x22 = subgroupBroadcast(a, 6u);
                c22_0 = fma4x4(c22_0, x22, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c22_1 = fma4x4(c22_1, x22, q1[0], q1[1], q1[2], q1[3]); }
                let x23 = subgroupBroadcast(a, 7u);
                c23_0 = fma4x4(c23_0, x23, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c23_1 = fma4x4(c23_1, x23, q1[0], q1[1], q1[2], q1[3]); }
            }
            if (TM > 24u) {
                // Rows 24 .. 32: this lane's quad of row m0 + 24 + lane % 8, broadcast.
                let a = a4(min(m0 + 24u + lane % 8u, last_m) * p.k, k);
                let x24 = subgroupBroadcast(a, 0u);
                c24_0 = fma4x4(c24_0, x24, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c24_1 = fma4x4(c24_1, x24, q1[0], q1[1], q1[2], q1[3]); }
                let x25 = subgroupBroadcast(a, 1u);
                c25_0 = fma4x4(c25_0, x25, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c25_1 = fma4x4(c25_1, x25, q1[0], q1[1], q1[2], q1[3]); }
                let x26 = subgroupBroadcast(a, 2u);
                c26_0 = fma4x4(c26_0, x26, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c26_1 = fma4x4(c26_1, x26, q1[0], q1[1], q1[2], q1[3]); }
                let x27 = subgroupBroadcast(a, 3u);
                c27_0 = fma4x4(c27_0, x27, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c27_1 = fma4x4(c27_1, x27, q1[0], q1[1], q1[2], q1[3]); }
                let x28 = subgroupBroadcast(a, 4u);
                c28_0 = fma4x4(c28_0, x28, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c28_1 = fma4x4(c28_1, x28, q1[0], q1[1], q1[2], q1[3]); }
                let x29 = subgroupBroadcast(a, 5u);
                c29_0 = fma4x4(c29_0, x29, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c29_1 = fma4x4(c29_1, x29, q1[0], q1[1], q1[2], q1[3]); }
                let x30 = subgroupBroadcast(a, 6u);
                c30_0 = fma4x4(c30_0, x30, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c30_1 = fma4x4(c30_1, x30, q1[0], q1[1], q1[2], q1[3]); }
                let x31 = subgroupBroadcast(a, 7u);
                c31_0 = fma4x4(c31_0, x31, q0[0], q0[1], q0[2], q0[3]);
                if (TN > 4u) { c31_1 = fma4x4(c31_1, x31, q1[0], q1[1], q1[2], q1[3]); }
            }
        }
    }
    let s0 = scales4(n0 + 0u);
    let s1 = scales4(n0 + 4u);
    {
        store4(0u, m0 + 0u, n0, c0_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 0u, n0 + 4u, c0_1 * s1); }
        store4(0u, m0 + 1u, n0, c1_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 1u, n0 + 4u, c1_1 * s1); }
        store4(0u, m0 + 2u, n0, c2_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 2u, n0 + 4u, c2_1 * s1); }
        store4(0u, m0 + 3u, n0, c3_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 3u, n0 + 4u, c3_1 * s1); }
        store4(0u, m0 + 4u, n0, c4_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 4u, n0 + 4u, c4_1 * s1); }
        store4(0u, m0 + 5u, n0, c5_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 5u, n0 + 4u, c5_1 * s1); }
        store4(0u, m0 + 6u, n0, c6_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 6u, n0 + 4u, c6_1 * s1); }
        store4(0u, m0 + 7u, n0, c7_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 7u, n0 + 4u, c7_1 * s1); }
    }
    if (TM > 8u) {
        store4(0u, m0 + 8u, n0, c8_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 8u, n0 + 4u, c8_1 * s1); }
        store4(0u, m0 + 9u, n0, c9_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 9u, n0 + 4u, c9_1 * s1); }
        store4(0u, m0 + 10u, n0, c10_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 10u, n0 + 4u, c10_1 * s1); }
        store4(0u, m0 + 11u, n0, c11_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 11u, n0 + 4u, c11_1 * s1); }
        store4(0u, m0 + 12u, n0, c12_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 12u, n0 + 4u, c12_1 * s1); }
        store4(0u, m0 + 13u, n0, c13_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 13u, n0 + 4u, c13_1 * s1); }
        store4(0u, m0 + 14u, n0, c14_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 14u, n0 + 4u, c14_1 * s1); }
        store4(0u, m0 + 15u, n0, c15_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 15u, n0 + 4u, c15_1 * s1); }
    }
    if (TM > 16u) {
        store4(0u, m0 + 16u, n0, c16_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 16u, n0 + 4u, c16_1 * s1); }
        store4(0u, m0 + 17u, n0, c17_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 17u, n0 + 4u, c17_1 * s1); }
        store4(0u, m0 + 18u, n0, c18_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 18u, n0 + 4u, c18_1 * s1); }
        store4(0u, m0 + 19u, n0, c19_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 19u, n0 + 4u, c19_1 * s1); }
        store4(0u, m0 + 20u, n0, c20_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 20u, n0 + 4u, c20_1 * s1); }
        store4(0u, m0 + 21u, n0, c21_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 21u, n0 + 4u, c21_1 * s1); }
        store4(0u, m0 + 22u, n0, c22_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 22u, n0 + 4u, c22_1 * s1); }
        store4(0u, m0 + 23u, n0, c23_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 23u, n0 + 4u, c23_1 * s1); }
    }
    if (TM > 24u) {
        store4(0u, m0 + 24u, n0, c24_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 24u, n0 + 4u, c24_1 * s1); }
        store4(0u, m0 + 25u, n0, c25_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 25u, n0 + 4u, c25_1 * s1); }
        store4(0u, m0 + 26u, n0, c26_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 26u, n0 + 4u, c26_1 * s1); }
        store4(0u, m0 + 27u, n0, c27_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 27u, n0 + 4u, c27_1 * s1); }
        store4(0u, m0 + 28u, n0, c28_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 28u, n0 + 4u, c28_1 * s1); }
        store4(0u, m0 + 29u, n0, c29_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 29u, n0 + 4u, c29_1 * s1); }
        store4(0u, m0 + 30u, n0, c30_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 30u, n0 + 4u, c30_1 * s1); }
        store4(0u, m0 + 31u, n0, c31_0 * s0);
        if (TN > 4u) { store4(0u, m0 + 31u, n0 + 4u, c31_1 * s1); }
    }
}
