// Layer norm over the last dim, forward: x and y are (rows, C), w and b are (C), mean and rstd
// (rows, f32) are kept for the backward. In f32 whatever the storage, two passes over the row:
//   mean = sum(x) / C,  var = sum((x - mean)^2) / C,  rstd = 1 / sqrt(var + eps),
//   y = (x - mean) * rstd * w + b.
// With RMS (include/layer_norm_rows.wgsl) mean = 0 and b is not read: y = x * rstd * w.
// Rows, lanes and the row sum: include/layer_norm_rows.wgsl.

fn bias(i: u32) -> f32 {
    if (RMS == 1u) {
        return 0.0;
    }
    return ld_b(i);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let l = lane_of(wg.y * nwg.x + wg.x, lid);
    let base = l.row * p.c;
    var mean_v = 0.0;
    if (RMS == 0u) {
        var s = 0.0;
        for (var q = l.lane; q < l.pairs; q += l.lanes) {
            let i = 2u * q;
            s += ld_x(base + i);
            if (i + 1u < p.c) {
                s += ld_x(base + i + 1u);
            }
        }
        mean_v = row_sum(l, vec2<f32>(s, 0.0)).x / f32(p.c);
    }
    var ss = 0.0;
    for (var q = l.lane; q < l.pairs; q += l.lanes) {
        let i = 2u * q;
        let d0 = ld_x(base + i) - mean_v;
        ss += d0 * d0;
        if (i + 1u < p.c) {
            let d1 = ld_x(base + i + 1u) - mean_v;
            ss += d1 * d1;
        }
    }
    let variance = row_sum(l, vec2<f32>(ss, 0.0)).x / f32(p.c);
    let r = 1.0 / sqrt(variance + p.eps);
    if (!l.live) {
        return;
    }
    if (l.lane == 0u) {
        st_mean(l.row, mean_v);
        st_rstd(l.row, r);
    }
    for (var q = l.lane; q < l.pairs; q += l.lanes) {
        let i = 2u * q;
        let y0 = (ld_x(base + i) - mean_v) * r * ld_w(i) + bias(i);
        var y1 = 0.0;
        if (i + 1u < p.c) {
            y1 = (ld_x(base + i + 1u) - mean_v) * r * ld_w(i + 1u) + bias(i + 1u);
        }
        if ((p.c & 1u) == 0u) {
            // Rows start on even elements: the pair is one packed word.
            st2_y((base + i) >> 1u, y0, y1, base + p.c);
        } else {
            // Odd rows (never packed f16).
            st_y(base + i, y0);
            if (i + 1u < p.c) {
                st_y(base + i + 1u, y1);
            }
        }
    }
}
