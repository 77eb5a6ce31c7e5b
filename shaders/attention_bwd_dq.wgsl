// Fused self-attention, backward pass 1: the queries' gradient and each row's delta. One
// workgroup per R queries of one (batch, head) matrix, walking the key tiles the forward walked
// and rebuilding the probabilities from the saved lse (the (T, T) scores are never stored):
//   delta_i = dO_i . O_i                       (written for pass 2, attention_bwd_dkv.wgsl)
//   P_ij = exp(scale * q_i . k_j - lse_i),  dP_ij = dO_i . v_j,
//   dS_ij = P_ij (dP_ij - delta_i),  dQ_i = scale * sum_j dS_ij k_j.
// Each tile stages V (for dP), then K (for the scores and dQ) in the same buffer.
// Tiles, lanes and edges: include/attention_tiles.wgsl.

var<workgroup> qs: array<vec4<f32>, R * S>;  // the queries
var<workgroup> dys: array<vec4<f32>, R * S>; // their output gradients dO
var<workgroup> kv: array<vec4<f32>, C * S>;  // the tile's values, then its keys
var<workgroup> ds: array<f32, R * C>;        // dP, then scale * dS, of the tile

fn tile_q(base: u32, row: u32, qd: u32) -> vec4<f32> {
    let n = quad_len(row, qd);
    let i = base + row * p.d + 4u * qd;
    if (n == 4u) {
        return ld4_q(i);
    }
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < n; k++) {
        v[k] = ld_q(i + k);
    }
    return v;
}

fn tile_k(base: u32, row: u32, qd: u32) -> vec4<f32> {
    let n = quad_len(row, qd);
    let i = base + row * p.d + 4u * qd;
    if (n == 4u) {
        return ld4_k(i);
    }
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < n; k++) {
        v[k] = ld_k(i + k);
    }
    return v;
}

fn tile_v(base: u32, row: u32, qd: u32) -> vec4<f32> {
    let n = quad_len(row, qd);
    let i = base + row * p.d + 4u * qd;
    if (n == 4u) {
        return ld4_v(i);
    }
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < n; k++) {
        v[k] = ld_v(i + k);
    }
    return v;
}

fn tile_o(base: u32, row: u32, qd: u32) -> vec4<f32> {
    let n = quad_len(row, qd);
    let i = base + row * p.d + 4u * qd;
    if (n == 4u) {
        return ld4_o(i);
    }
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < n; k++) {
        v[k] = ld_o(i + k);
    }
    return v;
}

fn tile_dy(base: u32, row: u32, qd: u32) -> vec4<f32> {
    let n = quad_len(row, qd);
    let i = base + row * p.d + 4u * qd;
    if (n == 4u) {
        return ld4_dy(i);
    }
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < n; k++) {
        v[k] = ld_dy(i + k);
    }
    return v;
}

// As attention_fwd.wgsl's store_o: pairs are whole packed words when D is even.
fn store_dq(base: u32, row: u32, qd: u32, v: vec4<f32>) {
    let n = quad_len(row, qd);
    let i = base + row * p.d + 4u * qd;
    if ((p.d & 1u) == 0u) {
        for (var k = 0u; k < n; k += 2u) {
            st2_dq((i + k) >> 1u, v[k], v[k + 1u], i + n);
        }
    } else {
        for (var k = 0u; k < n; k++) {
            st_dq(i + k, v[k]);
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let tl = tile_of(wg, nwg);
    if (!tl.live) {
        return;
    }
    let r = li / G;
    let g = li % G;
    let i = tl.row0 + r; // this lane's query
    for (var e = li; e < R * S; e += WG) {
        qs[e] = tile_q(tl.base, tl.row0 + e / S, e % S);
        dys[e] = tile_dy(tl.base, tl.row0 + e / S, e % S);
    }
    workgroupBarrier();
    // delta and lse of the row, the same in every lane (one fixed order).
    var delta_i = 0.0;
    var lse_i = 0.0;
    if (i < p.t) {
        for (var qd = 0u; qd < p.d4; qd++) {
            delta_i += dot(dys[r * S + qd], tile_o(tl.base, i, qd));
        }
        lse_i = ld_lse(tl.m * p.t + i);
        if (g == 0u) {
            st_delta(tl.m * p.t + i, delta_i);
        }
    }
    var acc: array<vec4<f32>, NQ>; // quads g + G t of the row's dQ
    var kend = p.t;
    if (p.causal != 0u) {
        kend = min(p.t, tl.row0 + R);
    }
    for (var j0 = 0u; j0 < kend; j0 += C) {
        workgroupBarrier();
        for (var e = li; e < C * S; e += WG) {
            kv[e] = tile_v(tl.base, j0 + e / S, e % S);
        }
        workgroupBarrier();
        for (var t = 0u; t < NC; t++) {
            let c = g + G * t;
            var dp = 0.0;
            for (var qd = 0u; qd < p.d4; qd++) {
                dp += dot(dys[r * S + qd], kv[c * S + qd]);
            }
            ds[r * C + c] = dp;
        }
        workgroupBarrier();
        for (var e = li; e < C * S; e += WG) {
            kv[e] = tile_k(tl.base, j0 + e / S, e % S);
        }
        workgroupBarrier();
        // Each lane rewrites only its own entries of ds here.
        for (var t = 0u; t < NC; t++) {
            let c = g + G * t;
            var w = 0.0;
            if (visible(i, j0 + c)) {
                var s = 0.0;
                for (var qd = 0u; qd < p.d4; qd++) {
                    s += dot(qs[r * S + qd], kv[c * S + qd]);
                }
                let pij = exp(p.scale * s - lse_i);
                w = pij * (ds[r * C + c] - delta_i) * p.scale;
            }
            ds[r * C + c] = w;
        }
        workgroupBarrier();
        for (var c = 0u; c < C; c++) {
            let w = ds[r * C + c];
            for (var t = 0u; t < NQ; t++) {
                acc[t] += w * kv[c * S + g + G * t];
            }
        }
    }
    if (i >= p.t) {
        return;
    }
    for (var t = 0u; t < NQ; t++) {
        store_dq(tl.base, i, g + G * t, acc[t]);
    }
}
