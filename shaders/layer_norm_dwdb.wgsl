// Layer norm backward, partial column sums of the weight's and bias's gradients: dy and x are
// (rows, C), mean and rstd (rows, f32) are the forward's; dw and db (f32) are (chunks, C):
//   dw[k, j] = sum over rows r of chunk k of dy[r, j] * (x[r, j] - mean[r]) * rstd[r],
//   db[k, j] = sum over the same rows of dy[r, j],
// rows in increasing order, one invocation per (chunk, column). The chunks are then summed in
// order by the reduce kernel, so the result depends only on the shape.

struct Params {
    rows: u32,
    c: u32,
    chunk: u32, // rows per chunk
    n: u32,     // chunks * c
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let o = (wg.y * nwg.x + wg.x) * WG + lid;
    if (o >= p.n) {
        return;
    }
    let j = o % p.c;
    let r0 = (o / p.c) * p.chunk;
    let r1 = min(p.rows, r0 + p.chunk);
    var gw = 0.0;
    var gb = 0.0;
    for (var r = r0; r < r1; r++) {
        let g = ld_dy(r * p.c + j);
        gw += g * (ld_x(r * p.c + j) - ld_mean(r)) * ld_rstd(r);
        gb += g;
    }
    st_dw(o, gw);
    st_db(o, gb);
}
