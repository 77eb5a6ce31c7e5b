// C = op(A) · op(B) (+ bias) (activation), one invocation per output: the plain reference kernel
// the benchmark reports ratios against. Parameters and epilogue: include/matmul_common.wgsl.

override TRANS_A: bool = false;
override TRANS_B: bool = false;

@compute @workgroup_size(16, 16, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let col = gid.x;
    let row = gid.y;
    if (row >= p.m || col >= p.n) {
        return;
    }
    let a_base = gid.z * p.a_batch;
    let b_base = gid.z * p.b_batch;
    var sum = 0.0; // the blocks before k's
    var acc = start4(gid.z * p.c_batch, row, col).x; // k's block
    for (var k = 0u; k < p.k; k++) {
        if (block_starts(k)) {
            sum += acc;
            acc = 0.0;
        }
        var a = 0.0;
        var b = 0.0;
        if (TRANS_A) { a = ld_a(a_base + k * p.m + row); } else { a = ld_a(a_base + row * p.k + k); }
        if (TRANS_B) { b = ld_b(b_base + col * p.k + k); } else { b = ld_b(b_base + k * p.n + col); }
        acc = fma(a, b, acc);
    }
    st_c(gid.z * p.c_batch + row * p.n + col, finish(sum + acc, col));
}
