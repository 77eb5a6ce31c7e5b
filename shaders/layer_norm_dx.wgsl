// Layer norm backward, the input's gradient: dy, x and dx are (rows, C), w is (C), mean and
// rstd (rows, f32) are the forward's. With xh = (x - mean) * rstd and gw = dy * w, per row:
//   dx = rstd * (gw - sum(gw) / C - xh * sum(gw * xh) / C),
// both sums from one pass (as a vec2), in f32. RMS norm (mean = 0) drops the sum(gw) term:
//   dx = rstd * (gw - xh * sum(gw * xh) / C). Rows, lanes and the row sum:
// include/layer_norm_rows.wgsl.

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let l = lane_of(wg.y * nwg.x + wg.x, lid);
    let base = l.row * p.c;
    var m = 0.0;
    var r = 0.0;
    if (l.live) {
        m = ld_mean(l.row);
        r = ld_rstd(l.row);
    }
    var acc = vec2<f32>(0.0);
    for (var q = l.lane; q < l.pairs; q += l.lanes) {
        let i = 2u * q;
        let g0 = ld_dy(base + i) * ld_w(i);
        acc += vec2<f32>(g0, g0 * (ld_x(base + i) - m) * r);
        if (i + 1u < p.c) {
            let g1 = ld_dy(base + i + 1u) * ld_w(i + 1u);
            acc += vec2<f32>(g1, g1 * (ld_x(base + i + 1u) - m) * r);
        }
    }
    var s = row_sum(l, acc) / f32(p.c);
    if (RMS == 1u) {
        s.x = 0.0;
    }
    if (!l.live) {
        return;
    }
    for (var q = l.lane; q < l.pairs; q += l.lanes) {
        let i = 2u * q;
        let xh0 = (ld_x(base + i) - m) * r;
        let d0 = r * (ld_dy(base + i) * ld_w(i) - s.x - xh0 * s.y);
        var d1 = 0.0;
        if (i + 1u < p.c) {
            let xh1 = (ld_x(base + i + 1u) - m) * r;
            d1 = r * (ld_dy(base + i + 1u) * ld_w(i + 1u) - s.x - xh1 * s.y);
        }
        if ((p.c & 1u) == 0u) {
            st2_dx((base + i) >> 1u, d0, d1, base + p.c);
        } else {
            st_dx(base + i, d0);
            if (i + 1u < p.c) {
                st_dx(base + i + 1u, d1);
            }
        }
    }
}
