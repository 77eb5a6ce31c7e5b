// Optimizer updates, fused: one invocation reads each of p, g, m, sq once, does the whole update
// in f32 registers and writes p, m, sq once, for two elements (packed f16 words are written
// whole; see kernels/mod.rs), or four with VEC. Semantics are torch's (torch.optim.SGD / AdamW, single-tensor path).
//
// Bindings (kernels/optim.rs):
//   p: the parameter, updated in place;
//   g: its gradient (read);
//   m: SGD's momentum buffer / AdamW's first moment (updated in place);
//   sq: AdamW's second moment (updated in place).
// (`v` would clash with the accessors' argument names.) SGD without momentum has no state: m and
// sq are bound to p and never touched. SGD with momentum binds sq to m and never touches sq.

struct Params {
    n: u32,               // elements
    flags: u32,           // bit 0: nesterov (SGD); bit 1: first step, buf = g' (SGD with momentum)
    lr: f32,              // SGD: learning rate
    weight_decay: f32,    // SGD: L2 coefficient added to the gradient
    momentum: f32,        // SGD
    one_minus_damp: f32,  // SGD: 1 - dampening
    decay: f32,           // AdamW: 1 - lr * weight_decay (host f64)
    step_size: f32,       // AdamW: lr / (1 - beta1^t) (host f64)
    beta1: f32,           // AdamW
    beta2: f32,           // AdamW
    one_minus_beta1: f32, // AdamW (host f64)
    one_minus_beta2: f32, // AdamW (host f64)
    eps: f32,             // AdamW
    bc2_sqrt: f32,        // AdamW: sqrt(1 - beta2^t) (host f64)
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(0) var<uniform> prm: Params;

const WG: u32 = 256u;
// 0: SGD without momentum, 1: AdamW, 2: SGD with momentum. Specialized per pipeline (kernels/
// optim.rs): lavapipe runs every case of a run-time switch for every element, and Mesa 22.3
// recompiles a pipeline at each dispatch when folding a uniform would remove half of it. The
// remaining per-dispatch choices (nesterov, first step, weight decay) are `select`s, not branches.
const KIND: u32 = 0u;

// 1: every tensor is a vec4 binding and n % 4 == 0: four elements per invocation, read and
// written in whole quads (lavapipe loads a storage value one lane at a time). Specialized.
const VEC: u32 = 0u;

// The new (p, m, sq) of one element from its gradient, parameter and state.
fn update(grad: f32, param: f32, mom: f32, sq2: f32) -> vec3<f32> {
    if (KIND == 1u) {
        // AdamW: decoupled weight decay, then Adam with bias correction (include/adamw.wgsl).
        return adamw_update(grad, param, mom, sq2);
    }
    // SGD: L2 weight decay (torch adds it only when non-zero: 0 * inf would be NaN).
    var d = select(grad, grad + prm.weight_decay * param, prm.weight_decay != 0.0);
    var buf = 0.0;
    if (KIND == 2u) {
        let first = (prm.flags & 2u) != 0u;
        buf = select(prm.momentum * mom + prm.one_minus_damp * d, d, first);
        let nesterov = (prm.flags & 1u) != 0u;
        d = select(buf, d + prm.momentum * buf, nesterov);
    }
    return vec3<f32>(param - prm.lr * d, buf, 0.0);
}

// update() of element i; state is read only by the kinds that have it.
fn update_at(i: u32) -> vec3<f32> {
    var mom = 0.0;
    var sq2 = 0.0;
    if (KIND != 0u) {
        mom = ld_m(i);
    }
    if (KIND == 1u) {
        sq2 = ld_sq(i);
    }
    return update(ld_g(i), ld_p(i), mom, sq2);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let w = (wg.y * nwg.x + wg.x) * WG + lid;
    if (VEC == 1u) {
        let q = 4u * w;
        if (q >= prm.n) {
            return;
        }
        let g4 = ld4_g(q);
        let p4 = ld4_p(q);
        var m4 = vec4<f32>(0.0);
        var s4 = vec4<f32>(0.0);
        if (KIND != 0u) {
            m4 = ld4_m(q);
        }
        if (KIND == 1u) {
            s4 = ld4_sq(q);
        }
        let a = update(g4.x, p4.x, m4.x, s4.x);
        let b = update(g4.y, p4.y, m4.y, s4.y);
        let c = update(g4.z, p4.z, m4.z, s4.z);
        let d = update(g4.w, p4.w, m4.w, s4.w);
        st4_p(q, vec4<f32>(a.x, b.x, c.x, d.x));
        if (KIND != 0u) {
            st4_m(q, vec4<f32>(a.y, b.y, c.y, d.y));
        }
        if (KIND == 1u) {
            st4_sq(q, vec4<f32>(a.z, b.z, c.z, d.z));
        }
        return;
    }
    let i = 2u * w;
    if (i >= prm.n) {
        return;
    }
    let a = update_at(i);
    var b = vec3<f32>(0.0);
    if (i + 1u < prm.n) {
        b = update_at(i + 1u);
    }
    st2_p(w, a.x, b.x, prm.n);
    if (KIND != 0u) {
        st2_m(w, a.y, b.y, prm.n);
    }
    if (KIND == 1u) {
        st2_sq(w, a.z, b.z, prm.n);
    }
}
