// Batch norm's input gradient in training (include/batch_norm_channels.wgsl), from the batch
// statistics and the channel sums of batch_norm_sums.wgsl:
//   dx = rstd w (dy - sum(dy) / count - xhat sum(dy xhat) / count),  xhat = (x - mean) rstd.
// Two outputs per invocation through include/batch_norm_pairs.wgsl.

fn value(i: u32, c: u32) -> f32 {
    let r = ld_stats(p.c + c);
    let xhat = (ld_x(i) - ld_stats(c)) * r;
    let n = f32(p.count);
    return r * ld_wt(c) * (ld_dy(i) - ld_sums(c) / n - xhat * ld_sums(p.c + c) / n);
}
