// Batch norm's backward sums, one workgroup per channel (include/batch_norm_channels.wgsl):
// sums (f32, (2, C)) = (sum dy, sum dy xhat) with xhat = (x - mean) rstd: the bias's and the
// weight's gradients, and what the input's gradient subtracts.

@compute @workgroup_size(CH_WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let c = min(wg.y * nwg.x + wg.x, p.c - 1u);
    let live = wg.y * nwg.x + wg.x < p.c;
    let mean_v = ld_stats(c);
    let r = ld_stats(p.c + c);
    var s = vec2<f32>(0.0);
    var at = first(lid);
    for (var e = lid; e < p.count; e += CH_WG) {
        let i = channel_elem(c, at);
        at = next(at);
        let g = ld_dy(i);
        s += vec2<f32>(g, g * (ld_x(i) - mean_v) * r);
    }
    let t = channel_sum(lid, s);
    if (live && lid == 0u) {
        st_sums(c, t.x);
        st_sums(p.c + c, t.y);
    }
}
