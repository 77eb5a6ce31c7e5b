// Shared by the barrier-free matmul kernels, matmul_reg.wgsl and matmul_sg.wgsl (prepended after
// matmul_common.wgsl): operand layout overrides and the loads of op(A) and op(B) with clamping.

override TRANS_A: bool = false;
override TRANS_B: bool = false;
// B (not transposed) rows start on 16-byte boundaries: whole vec4 loads.
override VEC_B: bool = false;

// op(A)[row, k .. k + 4]
fn a4(base: u32, row: u32, k: u32) -> vec4<f32> {
    if (TRANS_A) {
        return vec4<f32>(ld_a(base + k * p.m + row), ld_a(base + (k + 1u) * p.m + row),
                         ld_a(base + (k + 2u) * p.m + row), ld_a(base + (k + 3u) * p.m + row));
    }
    return ld4_a(base + row * p.k + k);
}

fn a1(base: u32, row: u32, k: u32) -> f32 {
    if (TRANS_A) {
        return ld_a(base + k * p.m + row);
    }
    return ld_a(base + row * p.k + k);
}

// op(B)[k, n .. n + 4], columns clamped into range (their results are never stored).
fn b4(base: u32, k: u32, n: u32) -> vec4<f32> {
    if (TRANS_B) {
        let c0 = min(n, p.n - 1u) * p.k;
        let c1 = min(n + 1u, p.n - 1u) * p.k;
        let c2 = min(n + 2u, p.n - 1u) * p.k;
        let c3 = min(n + 3u, p.n - 1u) * p.k;
        return vec4<f32>(ld_b(base + c0 + k), ld_b(base + c1 + k), ld_b(base + c2 + k), ld_b(base + c3 + k));
    }
    if (VEC_B) {
        return ld4_b(base + k * p.n + min(n, p.n - 4u));
    }
    let r = base + k * p.n;
    return vec4<f32>(ld_b(r + min(n, p.n - 1u)), ld_b(r + min(n + 1u, p.n - 1u)),
                     ld_b(r + min(n + 2u, p.n - 1u)), ld_b(r + min(n + 3u, p.n - 1u)));
}
