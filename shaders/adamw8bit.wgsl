// 8-bit AdamW (Dettmers et al. 2021, "8-bit Optimizers via Block-wise Quantization"): both
// moments are u8 codes into a dynamic quantization map, with one f32 absmax per BLOCK elements
// (include/quant8_block.wgsl). A workgroup owns one block; each invocation owns four consecutive
// elements, that is one u32 word of codes per moment. It dequantizes its four, runs the AdamW
// update in f32 registers (include/adamw.wgsl), takes part in the workgroup max that gives the
// block's new absmax, requantizes its four and writes its words. A max is exact, so the result
// does not depend on the order of the reduction: the kernel is deterministic.
//
// Bindings (kernels/adamw8bit.rs):
//   p: the parameter, updated in place (KIND 1 reads it as the values to quantize, KIND 2
//      writes the dequantized values there);
//   g: its gradient (read; KIND 0 only);
//   qm, qv: the codes of m (signed map) and v (unsigned map), element 4w + k in byte k of word w;
//   am, av: the absmax of m and of v, one per block;
//   qmap: the two maps and their midpoints (1024 f32, laid out as MAP_* / MID_*).
// KIND 1 and 2 use p, qm, am and qmap only; the other bindings alias bound tensors.

struct Params {
    n: u32,               // elements
    decay: f32,           // 1 - lr * weight_decay (host f64)
    step_size: f32,       // lr / (1 - beta1^t) (host f64)
    beta1: f32,
    beta2: f32,
    one_minus_beta1: f32, // (host f64)
    one_minus_beta2: f32, // (host f64)
    eps: f32,
    bc2_sqrt: f32,        // sqrt(1 - beta2^t) (host f64)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}
@group(0) @binding(0) var<uniform> prm: Params;

// One invocation per code word (four elements) of a block.
const WG: u32 = 64u;
// 0: the fused AdamW update; 1: quantize p into (qm, am); 2: dequantize (qm, am) into p.
// Specialized per pipeline (lavapipe runs every case of a run-time switch).
const KIND: u32 = 0u;
// The map of KIND 1 and 2: 1 the signed one (first moments), 0 the unsigned one. Specialized.
const SIGNED: u32 = 1u;
// 1: p and g are vec4 bindings (n % 4 == 0): whole quads per load and store. Specialized.
const VEC: u32 = 0u;

// Offsets in tab: the signed and the unsigned map (256 values each, ascending), then the 255
// midpoints between neighbours of each (the 256th is padding, never read).
const MAP_S: u32 = 0u;
const MAP_U: u32 = 256u;
const MID_S: u32 = 512u;
const MID_U: u32 = 768u;

var<workgroup> tab: array<f32, 1024>;
var<workgroup> red: array<vec2<f32>, WG>;
// The block's absmax before this update (read by invocation 0 only, which writes the new one).
var<workgroup> old_absmax: vec2<f32>;

// The code of x in a block of absmax `absmax`: the number of midpoints t with t * absmax < x,
// i.e. the index of the map value nearest x / absmax (the lower one on a tie). The midpoint is
// multiplied rather than x divided: a product is correctly rounded on every adapter, a quotient
// is not, so the host reference finds the same codes bit for bit. Binary search without
// branches over the 255 midpoints.
fn encode(x: f32, absmax: f32, mid: u32) -> u32 {
    var c = 0u;
    for (var s = 128u; s > 0u; s = s >> 1u) {
        c = select(c, c + s, tab[mid + c + s - 1u] * absmax < x);
    }
    return c;
}

fn decode(code: u32, absmax: f32, map: u32) -> f32 {
    return tab[map + code] * absmax;
}

// Four codes of one word.
fn decode4(word: u32, absmax: f32, map: u32) -> vec4<f32> {
    return vec4<f32>(
        decode(word & 255u, absmax, map),
        decode((word >> 8u) & 255u, absmax, map),
        decode((word >> 16u) & 255u, absmax, map),
        decode(word >> 24u, absmax, map)
    );
}

fn encode4(x: vec4<f32>, absmax: f32, mid: u32) -> u32 {
    return encode(x.x, absmax, mid) | (encode(x.y, absmax, mid) << 8u)
        | (encode(x.z, absmax, mid) << 16u) | (encode(x.w, absmax, mid) << 24u);
}

fn max4(x: vec4<f32>) -> f32 {
    return max(max(x.x, x.y), max(x.z, x.w));
}

// Each component's max over the workgroup. Every invocation calls it (it has barriers).
fn block_max(lid: u32, local: vec2<f32>) -> vec2<f32> {
    red[lid] = local;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    return red[0];
}

// Elements e..e+4 of p (e a multiple of 4); zeros past n.
fn load_p(e: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    if (VEC == 1u) {
        if (e < prm.n) {
            x = ld4_p(e);
        }
        return x;
    }
    for (var k = 0u; k < 4u; k++) {
        if (e + k < prm.n) {
            x[k] = ld_p(e + k);
        }
    }
    return x;
}

fn load_g(e: u32) -> vec4<f32> {
    var x = vec4<f32>(0.0);
    if (VEC == 1u) {
        if (e < prm.n) {
            x = ld4_g(e);
        }
        return x;
    }
    for (var k = 0u; k < 4u; k++) {
        if (e + k < prm.n) {
            x[k] = ld_g(e + k);
        }
    }
    return x;
}

// Writes elements e..e+4 of p that are < n; the invocation owns both halves of each packed
// f16 word it writes (e is a multiple of 4).
fn store_p(e: u32, x: vec4<f32>) {
    if (e >= prm.n) {
        return;
    }
    if (VEC == 1u) {
        st4_p(e, x);
        return;
    }
    st2_p(e / 2u, x.x, x.y, prm.n);
    if (e + 2u < prm.n) {
        st2_p(e / 2u + 1u, x.z, x.w, prm.n);
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let block = wg.y * nwg.x + wg.x;
    // Uniform across the workgroup: the grid may hold a few workgroups past the last block.
    if (block * BLOCK >= prm.n) {
        return;
    }
    for (var j = 0u; j < 1024u / WG; j++) {
        tab[lid + WG * j] = ld_qmap(lid + WG * j);
    }
    if (KIND == 0u && lid == 0u) {
        old_absmax = vec2<f32>(am[block], av[block]);
    }
    workgroupBarrier();
    // This invocation's code word and its first element.
    let w = block * WG + lid;
    let e = 4u * w;
    let words = (prm.n + 3u) / 4u;
    if (KIND == 2u) {
        if (w < words) {
            store_p(e, decode4(qm[w], am[block], select(MAP_U, MAP_S, SIGNED == 1u)));
        }
        return;
    }
    if (KIND == 1u) {
        let x = load_p(e);
        let mx = block_max(lid, vec2<f32>(max4(abs(x)), 0.0));
        if (w < words) {
            qm[w] = encode4(x, mx.x, select(MID_U, MID_S, SIGNED == 1u));
        }
        if (lid == 0u) {
            am[block] = mx.x;
        }
        return;
    }
    var p4 = load_p(e);
    let g4 = load_g(e);
    var wm = 0u;
    var wv = 0u;
    if (w < words) {
        wm = qm[w];
        wv = qv[w];
    }
    let oa = old_absmax;
    let m_old = decode4(wm, oa.x, MAP_S);
    let v_old = decode4(wv, oa.y, MAP_U);
    var m4 = vec4<f32>(0.0);
    var v4 = vec4<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        let r = adamw_update(g4[k], p4[k], m_old[k], v_old[k]);
        // Elements past n stay zero, so they leave the absmax alone.
        let valid = e + k < prm.n;
        p4[k] = r.x;
        m4[k] = select(0.0, r.y, valid);
        v4[k] = select(0.0, r.z, valid);
    }
    let mx = block_max(lid, vec2<f32>(max4(abs(m4)), max4(v4)));
    if (w < words) {
        qm[w] = encode4(m4, mx.x, MID_S);
        qv[w] = encode4(v4, mx.y, MID_U);
        store_p(e, p4);
    }
    if (lid == 0u) {
        am[block] = mx.x;
        av[block] = mx.y;
    }
}
