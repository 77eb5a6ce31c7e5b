// Max and argmax along one axis. x is viewed as (outer, len, inner); out (the max) and idx (its
// index along the axis, as f32) are (outer, inner), both f32:
//   out[o * inner + i] = max_k x[(o * len + k) * inner + i], idx = the first such k.
// As in torch, NaN counts as larger than everything (the first NaN wins) and ties go to the first
// index. `better` is a total order on (value, index), so the result does not depend on the order
// of the comparisons; it is deterministic. len >= 1 (the host checks).
//
// mode 0, long rows: 2^lane_shift invocations per output (16 to WG), WG >> lane_shift outputs per
// workgroup; invocation t of an output scans k = t, t + lanes, ..., then the output's candidates
// merge in two stages (PARTS invocations merge lanes / PARTS each, then the first merges those):
// two barriers per workgroup. Several outputs per workgroup keep the barriers few where they are
// expensive (CPU drivers run them as coroutine switches).
// mode 1, short rows: one invocation per output, scanning k in order.

struct Params {
    outputs: u32,    // outer * inner
    len: u32,
    inner: u32,
    lane_shift: u32, // log2 of the invocations per output (mode 0)
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;
// 0: several invocations per output, 1: one. Specialized, not a uniform: lavapipe recompiles a
// shader at every dispatch when inlining a uniform would remove half of it.
const MODE: u32 = 0u;
const PARTS: u32 = 4u;
// Outputs per workgroup are at most WG / MIN_LANES (include/lanes.wgsl).
// No candidate (an invocation past the end of a short row).
const NONE: u32 = 0xffffffffu;

var<workgroup> wv: array<f32, WG>;
var<workgroup> wi: array<u32, WG>;
var<workgroup> pv: array<f32, WG / MIN_LANES * PARTS>;
var<workgroup> pi: array<u32, WG / MIN_LANES * PARTS>;

// On the bits: GL drivers may assume no NaN in float comparisons.
fn is_nan(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

// Whether candidate (v, i) beats the current best (bv, bi).
fn better(v: f32, i: u32, bv: f32, bi: u32) -> bool {
    if (i == NONE) {
        return false;
    }
    if (bi == NONE) {
        return true;
    }
    let vn = is_nan(v);
    let bn = is_nan(bv);
    if (vn != bn) {
        return vn;
    }
    if (vn || v == bv) {
        return i < bi;
    }
    return v > bv;
}

fn base(o: u32) -> u32 {
    return (o / p.inner) * p.len * p.inner + o % p.inner;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let group = wg.y * nwg.x + wg.x;
    if (MODE == 0u) {
        // Every invocation reaches both barriers; those of an output past the end scan nothing.
        let lanes = 1u << p.lane_shift;
        let slot = lid >> p.lane_shift;
        let lane = lid & (lanes - 1u);
        let o = group * (WG >> p.lane_shift) + slot;
        let live = o < p.outputs;
        let len = select(0u, p.len, live);
        let b = base(o);
        var bv = 0.0;
        var bi = NONE;
        for (var k = lane; k < len; k += lanes) {
            let v = ld_x(b + k * p.inner);
            if (better(v, k, bv, bi)) {
                bv = v;
                bi = k;
            }
        }
        wv[lid] = bv;
        wi[lid] = bi;
        workgroupBarrier();
        if (lane < PARTS) {
            let per_part = lanes / PARTS;
            let j0 = slot * lanes + lane * per_part;
            var v = wv[j0];
            var i = wi[j0];
            for (var j = 1u; j < per_part; j++) {
                if (better(wv[j0 + j], wi[j0 + j], v, i)) {
                    v = wv[j0 + j];
                    i = wi[j0 + j];
                }
            }
            pv[slot * PARTS + lane] = v;
            pi[slot * PARTS + lane] = i;
        }
        workgroupBarrier();
        if (live && lane == 0u) {
            var v = pv[slot * PARTS];
            var i = pi[slot * PARTS];
            for (var j = 1u; j < PARTS; j++) {
                if (better(pv[slot * PARTS + j], pi[slot * PARTS + j], v, i)) {
                    v = pv[slot * PARTS + j];
                    i = pi[slot * PARTS + j];
                }
            }
            st_out(o, v);
            st_idx(o, f32(i));
        }
        return;
    }
    let o = group * WG + lid;
    if (o >= p.outputs) {
        return;
    }
    let b = base(o);
    var bv = ld_x(b);
    var bi = 0u;
    for (var k = 1u; k < p.len; k++) {
        let v = ld_x(b + k * p.inner);
        if (better(v, k, bv, bi)) {
            bv = v;
            bi = k;
        }
    }
    st_out(o, bv);
    st_idx(o, f32(bi));
}
