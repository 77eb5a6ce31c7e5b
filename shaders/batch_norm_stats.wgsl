// Batch norm's training statistics, one workgroup per channel (include/batch_norm_channels.wgsl):
// mean = sum(x) / count, var = sum((x - mean)^2) / count (two passes, f32), written to stats as
// (mean, 1 / sqrt(var + eps)). With `update`, the running statistics (f32, (C)) move as torch's:
//   running_mean = (1 - momentum) running_mean + momentum mean,
//   running_var  = (1 - momentum) running_var  + momentum var count / (count - 1)   (unbiased).

@compute @workgroup_size(CH_WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    // Workgroups past the channels still reach every barrier.
    let c = min(wg.y * nwg.x + wg.x, p.c - 1u);
    let live = wg.y * nwg.x + wg.x < p.c;
    var s = 0.0;
    var at = first(lid);
    for (var e = lid; e < p.count; e += CH_WG) {
        s += ld_x(channel_elem(c, at));
        at = next(at);
    }
    let mean_v = channel_sum(lid, vec2<f32>(s, 0.0)).x / f32(p.count);
    var ss = 0.0;
    at = first(lid);
    for (var e = lid; e < p.count; e += CH_WG) {
        let d = ld_x(channel_elem(c, at)) - mean_v;
        ss += d * d;
        at = next(at);
    }
    let var_v = channel_sum(lid, vec2<f32>(ss, 0.0)).x / f32(p.count);
    if (!live || lid != 0u) {
        return;
    }
    st_stats(c, mean_v);
    st_stats(p.c + c, 1.0 / sqrt(var_v + p.eps));
    if (p.update != 0u) {
        let unbiased = var_v * f32(p.count) / f32(max(p.count, 2u) - 1u);
        st_rmean(c, (1.0 - p.momentum) * ld_rmean(c) + p.momentum * mean_v);
        st_rvar(c, (1.0 - p.momentum) * ld_rvar(c) + p.momentum * unbiased);
    }
}
