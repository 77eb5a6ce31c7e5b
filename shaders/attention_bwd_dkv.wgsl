// Fused self-attention, backward pass 2: the keys' and values' gradients. One workgroup per R
// keys of one (batch, head) matrix, walking the query tiles that see them (causal: from the
// workgroup's first key on) and rebuilding the probabilities from lse and delta (pass 1):
//   P_ij = exp(scale * q_i . k_j - lse_i),  dV_j = sum_i P_ij dO_i,
//   dS_ij = P_ij (dO_i . v_j - delta_i),   dK_j = scale * sum_i dS_ij q_i.
// One buffer holds a query tile's Q, then its dO (for dP and dV), then Q again (for dK).
// Tiles, lanes and edges: include/attention_tiles.wgsl (here rows are keys, columns queries).

var<workgroup> ks: array<vec4<f32>, R * S>; // the keys
var<workgroup> vs: array<vec4<f32>, R * S>; // their values
var<workgroup> x: array<vec4<f32>, C * S>;  // the tile's queries, or their output gradients
var<workgroup> pt: array<f32, R * C>;       // pt[r * C + c] = P of (query c, key r)
var<workgroup> dst: array<f32, R * C>;      // scale * dS of (query c, key r)

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
fn store_dk(base: u32, row: u32, qd: u32, v: vec4<f32>) {
    let n = quad_len(row, qd);
    let i = base + row * p.d + 4u * qd;
    if ((p.d & 1u) == 0u) {
        for (var k = 0u; k < n; k += 2u) {
            st2_dk((i + k) >> 1u, v[k], v[k + 1u], i + n);
        }
    } else {
        for (var k = 0u; k < n; k++) {
            st_dk(i + k, v[k]);
        }
    }
}

fn store_dv(base: u32, row: u32, qd: u32, v: vec4<f32>) {
    let n = quad_len(row, qd);
    let i = base + row * p.d + 4u * qd;
    if ((p.d & 1u) == 0u) {
        for (var k = 0u; k < n; k += 2u) {
            st2_dv((i + k) >> 1u, v[k], v[k + 1u], i + n);
        }
    } else {
        for (var k = 0u; k < n; k++) {
            st_dv(i + k, v[k]);
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
    let j = tl.row0 + r; // this lane's key
    for (var e = li; e < R * S; e += WG) {
        ks[e] = tile_k(tl.base, tl.row0 + e / S, e % S);
        vs[e] = tile_v(tl.base, tl.row0 + e / S, e % S);
    }
    var acc_k: array<vec4<f32>, NQ>; // quads g + G t of the row's dK
    var acc_v: array<vec4<f32>, NQ>; // and of its dV
    // Causal: queries before the first key see none of these keys.
    var i_start = 0u;
    if (p.causal != 0u) {
        i_start = (tl.row0 / C) * C;
    }
    let stats = tl.m * p.t; // where the matrix's lse and delta start
    for (var i0 = i_start; i0 < p.t; i0 += C) {
        // The previous tile's readers of x, pt and dst (and the staging of ks, vs) are done.
        workgroupBarrier();
        for (var e = li; e < C * S; e += WG) {
            x[e] = tile_q(tl.base, i0 + e / S, e % S);
        }
        workgroupBarrier();
        for (var t = 0u; t < NC; t++) {
            let c = g + G * t;
            let i = i0 + c;
            var pij = 0.0;
            if (i < p.t && visible(i, j)) {
                var s = 0.0;
                for (var qd = 0u; qd < p.d4; qd++) {
                    s += dot(ks[r * S + qd], x[c * S + qd]);
                }
                pij = exp(p.scale * s - ld_lse(stats + i));
            }
            pt[r * C + c] = pij;
        }
        workgroupBarrier();
        for (var e = li; e < C * S; e += WG) {
            x[e] = tile_dy(tl.base, i0 + e / S, e % S);
        }
        workgroupBarrier();
        for (var t = 0u; t < NC; t++) {
            let c = g + G * t;
            let i = i0 + c;
            var w = 0.0;
            let pij = pt[r * C + c];
            if (pij != 0.0) {
                var dp = 0.0;
                for (var qd = 0u; qd < p.d4; qd++) {
                    dp += dot(vs[r * S + qd], x[c * S + qd]);
                }
                w = pij * (dp - ld_delta(stats + i)) * p.scale;
            }
            dst[r * C + c] = w;
        }
        workgroupBarrier();
        for (var c = 0u; c < C; c++) {
            let pc = pt[r * C + c];
            for (var t = 0u; t < NQ; t++) {
                acc_v[t] += pc * x[c * S + g + G * t];
            }
        }
        workgroupBarrier();
        for (var e = li; e < C * S; e += WG) {
            x[e] = tile_q(tl.base, i0 + e / S, e % S);
        }
        workgroupBarrier();
        for (var c = 0u; c < C; c++) {
            let w = dst[r * C + c];
            for (var t = 0u; t < NQ; t++) {
                acc_k[t] += w * x[c * S + g + G * t];
            }
        }
    }
    if (j >= p.t) {
        return;
    }
    for (var t = 0u; t < NQ; t++) {
        store_dk(tl.base, j, g + G * t, acc_k[t]);
        store_dv(tl.base, j, g + G * t, acc_v[t]);
    }
}
