// Gradient clipping by the global L2 norm (torch.nn.utils.clip_grad_norm_) with no atomics and
// no readback, in three kinds of dispatch (kernels/grad_norm.rs):
//   KIND 0, once per gradient g (n elements): workgroup w of the dispatch writes the sum of the
//     squares of its share of g to acc[slot + w]. Invocation t of T takes quads t, t + T, ...,
//     and each workgroup adds its WG sums as a tree.
//   KIND 1, once: a single workgroup adds acc[0..n] (invocation t takes slots t, t + WG, ...,
//     then a tree) and writes norm[0] = sqrt(total).
//   KIND 2, once per gradient: g *= max_norm / (norm + 1e-6) in place when that is below 1 (and
//     the norm is finite); otherwise g is left as it is (nothing is written).
// Every sum is f32, in an order fixed by the shapes alone: bitwise reproducible. A kind binds
// the tensors it does not use to one it does (never touched): KIND 0 binds norm to acc, KIND 1
// binds g to acc, KIND 2 binds acc to norm.

struct Params {
    n: u32,        // KIND 0 and 2: elements of g; KIND 1: slots to add
    slot: u32,     // KIND 0: the first slot of this gradient
    max_norm: f32, // KIND 2
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;
// 0: sums of squares, 1: the norm, 2: the in-place scale. Specialized.
const KIND: u32 = 0u;
// 1 (KIND 0 and 2): g is a vec4 binding and n % 4 == 0. Specialized.
const VEC: u32 = 0u;

var<workgroup> partial: array<f32, WG>;

// Adds partial[0..WG] as a tree into partial[0] (every invocation must call it).
fn tree(lid: u32) {
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half /= 2u) {
        if (lid < half) {
            partial[lid] += partial[lid + half];
        }
        workgroupBarrier();
    }
}

// Elements 4q..4q+4 of g, 0 past the end.
fn load4(q: u32) -> vec4<f32> {
    let i = 4u * q;
    if (VEC == 1u || i + 4u <= p.n) {
        return ld4_g(i);
    }
    var v = vec4<f32>(0.0);
    for (var k = 0u; i + k < p.n; k++) {
        v[k] = ld_g(i + k);
    }
    return v;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let group = wg.y * nwg.x + wg.x;
    if (KIND == 0u) {
        let t = group * WG + lid;
        let stride = nwg.x * nwg.y * WG;
        let quads = (p.n + 3u) / 4u;
        var s = 0.0;
        for (var q = t; q < quads; q += stride) {
            let v = load4(q);
            let sq = v * v;
            s += (sq.x + sq.y) + (sq.z + sq.w);
        }
        partial[lid] = s;
        tree(lid);
        if (lid == 0u) {
            st_acc(p.slot + group, partial[0]);
        }
        return;
    }
    if (KIND == 1u) {
        var s = 0.0;
        for (var i = lid; i < p.n; i += WG) {
            s += ld_acc(i);
        }
        partial[lid] = s;
        tree(lid);
        if (lid == 0u) {
            st_norm(0u, sqrt(partial[0]));
        }
        return;
    }
    // KIND 2. The same factor for every invocation, so the early exits are uniform.
    let norm = ld_norm(0u);
    let factor = p.max_norm / (norm + 1e-6);
    // Exponent all ones: an infinite or NaN norm leaves the gradients alone.
    let finite = (bitcast<u32>(norm) & 0x7f800000u) != 0x7f800000u;
    if (!finite || !(factor < 1.0)) {
        return;
    }
    let w = group * WG + lid;
    if (VEC == 1u) {
        let i = 4u * w;
        if (i < p.n) {
            st4_g(i, ld4_g(i) * factor);
        }
        return;
    }
    // Two elements per invocation: a packed f16 word is written whole by one invocation.
    let i = 2u * w;
    if (i >= p.n) {
        return;
    }
    var b = 0.0;
    if (i + 1u < p.n) {
        b = ld_g(i + 1u) * factor;
    }
    st2_g(w, ld_g(i) * factor, b, p.n);
}
