// C = op(A) · op(B) (+ bias) (activation), batched over workgroup_id.z, with subgroup broadcasts.
// op(A) is (M, K): A is stored (M, K), or (K, M) with TRANS_A. op(B) is (K, N): B is stored
// (K, N), or (N, K) with TRANS_B. bias is (N). C is (M, N). f32 accumulation, k in order.
// Parameters (binding 0) and `store4` (the fused epilogue) come from include/matmul_common.wgsl,
// TRANS_A / TRANS_B / VEC_B and the loads a4, a1, b4 from include/matmul_loads.wgsl.
//
// A subgroup of SG lanes computes a TM x (SG * TN) block of C: every lane owns TN adjacent
// columns and all TM rows. Each step of four k, lane l loads rows l, l + SG, ... of op(A)
// (TM / SG quads, one row each) and its own TN columns of op(B); row r's quad is then handed to
// every lane with subgroupBroadcast(quad r / SG, lane r % SG). With TRANS_A the quads run along
// M instead (four rows at one k: the contiguous direction), and with TRANS_B each lane loads
// its columns as quads along k; either way every load is a whole, contiguous quad. So each element of A is loaded
// once per subgroup instead of once per lane. That is what makes this the fast kernel on CPU
// adapters: lavapipe runs a subgroup as one SIMD thread and loads a buffer element per lane in a
// scalar loop, while a broadcast is one register shuffle. No workgroup memory, no barriers.
//
// The accumulators must live in registers, which the CPU compilers only do for plain variables:
// an array indexed in loops ends up in memory (3x slower at 32 x 4). So the lines marked `//@`
// are expanded by src/kernels/matmul.rs into one statement per row, column quad and k, with
// variables named c{row}_{quad}; everything else is written here. Unexpanded, the file is a valid
// kernel that computes nothing (the naga test validates both forms).

const SG: u32 = 8u;  // lanes per subgroup: the adapter's fixed subgroup size
const TM: u32 = 8u;  // rows per subgroup, a multiple of SG
const TN: u32 = 4u;  // columns per lane, a multiple of 4
const WGS: u32 = 1u; // subgroups per workgroup, stacked along M
// A is bound as vec4 (TRANS_A: M % 4 == 0, else K % 4 == 0; batches aligned likewise).
override VEC_A: bool = false;

// op(A)[m .. m + 4, k] with TRANS_A: four rows at one k, contiguous in memory. Rows past M are
// clamped (their results are never stored).
fn at4(base: u32, k: u32, m: u32) -> vec4<f32> {
    let r = base + k * p.m;
    if (VEC_A) {
        return ld4_a(r + min(m, p.m - 4u));
    }
    return vec4<f32>(ld_a(r + min(m, p.m - 1u)), ld_a(r + min(m + 1u, p.m - 1u)),
                     ld_a(r + min(m + 2u, p.m - 1u)), ld_a(r + min(m + 3u, p.m - 1u)));
}

// op(B)[k .. k + 4, n] with TRANS_B: one column at four k, contiguous in memory (k + 3 < K).
fn bt4(base: u32, n: u32, k: u32) -> vec4<f32> {
    return ld4_b(base + min(n, p.n - 1u) * p.k + k);
}

@compute @workgroup_size(SG * WGS, 1, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(subgroup_invocation_id) lane: u32,
        @builtin(subgroup_id) sg: u32) {
    // No invocation returns early: a broadcast needs every lane of its subgroup. Rows and
    // columns past the edge are clamped when read and skipped when stored.
    let m0 = (wg.y * WGS + sg) * TM;
    let n0 = (wg.x * SG + lane) * TN;
    let a_base = wg.z * p.a_batch;
    let b_base = wg.z * p.b_batch;
    let c_base = wg.z * p.c_batch;
    let k4 = p.k & ~3u;
    //@ decl: the row (or, TRANS_A, the row quad and k) of each load of A; c{r}_{j} = 0
    for (var k = 0u; k < k4; k += 4u) {
        //@ quad: qa{i} = a4(ra{i}, k); b{kk}_{j} = b4(k + kk, n0 + 4j); x{r} = broadcast; 4 fma
    }
    for (var k = k4; k < p.k; k++) {
        //@ single: sa{i} = a1(ra{i}, k); b0_{j} = b4(k, n0 + 4j); one fma per block
    }
    //@ store: store4(c_base, m0 + r, n0 + 4j, c{r}_{j})
}
