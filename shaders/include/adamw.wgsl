// The AdamW update of one element in f32 registers, shared by shaders/optim.wgsl and
// shaders/adamw8bit.wgsl (one copy of the formula; src/optim/host.rs has its host twin). The
// including shader's `prm` holds the coefficients the host computes in f64 (kernels/optim.rs,
// `AdamWHyper::coefficients`): decay = 1 - lr * wd, step_size = lr / (1 - beta1^t),
// bc2_sqrt = sqrt(1 - beta2^t). Returns the new (p, m, v).
fn adamw_update(grad: f32, param: f32, mom: f32, sq2: f32) -> vec3<f32> {
    let m1 = prm.beta1 * mom + prm.one_minus_beta1 * grad;
    let m2 = prm.beta2 * sq2 + prm.one_minus_beta2 * grad * grad;
    let denom = sqrt(m2) / prm.bc2_sqrt + prm.eps;
    return vec3<f32>(param * prm.decay - prm.step_size * (m1 / denom), m1, m2);
}
