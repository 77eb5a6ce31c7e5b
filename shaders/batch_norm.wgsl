// Batch norm's output from the batch statistics (include/batch_norm_channels.wgsl):
// out = (x - mean_c) rstd_c w_c + b_c, w and b (C) in x's dtype. Two outputs per invocation
// through include/batch_norm_pairs.wgsl.

fn value(i: u32, c: u32) -> f32 {
    return (ld_x(i) - ld_stats(c)) * ld_stats(p.c + c) * ld_wt(c) + ld_b(c);
}
