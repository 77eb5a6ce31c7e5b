// C = op(A) · op(B) (+ bias) (activation), batched over workgroup_id.z; shapes and flags as in
// matmul_reg.wgsl.
//
// Workgroup-tiled for GPUs: a (BN/4 x BM/4) workgroup stages a BM x BK tile of A and a BK x BN
// tile of B in workgroup memory, then each invocation accumulates a 4 x 4 block of C from it
// with vec4 reads. Tiles past the matrix edge are zero-filled, so any M, N, K works.

const BM: u32 = 64u;  // rows of C per workgroup
const BN: u32 = 64u;  // columns of C per workgroup
const BK: u32 = 16u;  // k per stage
const THREADS: u32 = 256u; // (BN / 4) * (BM / 4)
override TRANS_A: bool = false;
override TRANS_B: bool = false;

// As[kk * BM / 4 + i] holds rows 4i .. 4i + 4 of the A tile at k = kk; Bs likewise for columns.
var<workgroup> As: array<vec4<f32>, BK * BM / 4>;
var<workgroup> Bs: array<vec4<f32>, BK * BN / 4>;

// op(A)[row, k], 0 outside the matrix.
fn a_at(base: u32, row: u32, k: u32) -> f32 {
    if (row >= p.m || k >= p.k) {
        return 0.0;
    }
    if (TRANS_A) {
        return ld_a(base + k * p.m + row);
    }
    return ld_a(base + row * p.k + k);
}

// op(B)[k, col], 0 outside the matrix.
fn b_at(base: u32, k: u32, col: u32) -> f32 {
    if (col >= p.n || k >= p.k) {
        return 0.0;
    }
    if (TRANS_B) {
        return ld_b(base + col * p.k + k);
    }
    return ld_b(base + k * p.n + col);
}

@compute @workgroup_size(BN / 4u, BM / 4u, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let row0 = wg.y * BM;
    let col0 = wg.x * BN;
    let a_base = wg.z * p.a_batch;
    let b_base = wg.z * p.b_batch;
    // C[row0 + 4 lid.y + i, col0 + 4 lid.x .. + 4] = sum[i] + acc[i]: acc is k's block (K_MASK,
    // include/matmul_common.wgsl), sum the blocks before it.
    var acc: array<vec4<f32>, 4>;
    var sum: array<vec4<f32>, 4>;
    let c_base = wg.z * p.c_batch;
    for (var i = 0u; i < 4u; i++) {
        acc[i] = start4(c_base, row0 + 4u * lid.y + i, col0 + 4u * lid.x);
    }
    for (var k0 = 0u; k0 < p.k; k0 += BK) {
        // Stage the tiles: consecutive invocations take consecutive k of A (or of B's rows when
        // transposed) so reads along memory are adjacent.
        for (var e = li; e < BM * BK; e += THREADS) {
            var r = e / BK;
            var kk = e % BK;
            if (TRANS_A) {
                r = e % BM;
                kk = e / BM;
            }
            As[kk * (BM / 4u) + r / 4u][r % 4u] = a_at(a_base, row0 + r, k0 + kk);
        }
        for (var e = li; e < BK * BN; e += THREADS) {
            var c = e % BN;
            var kk = e / BN;
            if (TRANS_B) {
                c = e / BK;
                kk = e % BK;
            }
            Bs[kk * (BN / 4u) + c / 4u][c % 4u] = b_at(b_base, k0 + kk, col0 + c);
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            if (block_starts(k0 + kk)) {
                for (var i = 0u; i < 4u; i++) {
                    sum[i] += acc[i];
                    acc[i] = vec4<f32>(0.0);
                }
            }
            let a = As[kk * (BM / 4u) + lid.y];
            let b = Bs[kk * (BN / 4u) + lid.x];
            acc[0] = fma(vec4<f32>(a.x), b, acc[0]);
            acc[1] = fma(vec4<f32>(a.y), b, acc[1]);
            acc[2] = fma(vec4<f32>(a.z), b, acc[2]);
            acc[3] = fma(vec4<f32>(a.w), b, acc[3]);
        }
        workgroupBarrier();
    }
    let n = col0 + 4u * lid.x;
    for (var i = 0u; i < 4u; i++) {
        let m = row0 + 4u * lid.y + i;
        if (m >= p.m || n >= p.n) {
            continue;
        }
        store4(c_base, m, n, sum[i] + acc[i]);
    }
}
