// c[i, j] (f32) = sum over r in order of l[r, i] * r[r, j], from zero or (p.onto) from what c
// holds: a weight gradient folded over its rows one after another, so any split of the rows
// into consecutive runs folded in order gives the bits of folding them whole (batch-invariant
// mode, src/tensor/invariant.rs). One invocation per output; l is (rows, ni), r (rows, nj).

struct Params {
    rows: u32,
    ni: u32,
    nj: u32,
    onto: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

@compute @workgroup_size(16, 16, 1)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let i = gid.y;
    if (i >= p.ni || j >= p.nj) {
        return;
    }
    let o = i * p.nj + j;
    var acc = 0.0;
    if (p.onto == 1u) {
        acc = c[o];
    }
    for (var k = 0u; k < p.rows; k++) {
        acc = fma(ld_l(k * p.ni + i), ld_r(k * p.nj + j), acc);
    }
    c[o] = acc;
}
