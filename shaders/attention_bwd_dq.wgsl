// Fused self-attention, backward pass 1: the queries' gradient and each row's delta. RB
// queries per invocation, R RB of one (batch, head) matrix per workgroup, walking the key
// tiles the forward walked and rebuilding the probabilities from the saved lse (the (T, T)
// scores are never stored):
//   delta_i = dO_i . O_i                       (written for pass 2, attention_bwd_dkv.wgsl)
//   P_ij = exp(scale * q_i . k_j - lse_i),  dP_ij = dO_i . v_j,
//   dS_ij = P_ij (dP_ij - delta_i),  dQ_i = scale * sum_j dS_ij k_j.
// Rows, tiles and edges: include/attention_tiles.wgsl.

var<workgroup> ks: array<vec4<f32>, C * S>; // the tile's keys
var<workgroup> vs: array<vec4<f32>, C * S>; // and values

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

@compute @workgroup_size(R)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let tl = tile_of(wg, nwg);
    if (!tl.live) {
        return;
    }
    // This invocation's queries: row0 + li + R b; the keys and values of kv matrix m / G.
    let i0 = tl.row0 + li;
    let kvb = (tl.m / p.group) * p.t * p.d;
    var qr: array<array<vec4<f32>, S>, RB>;
    var dyr: array<array<vec4<f32>, S>, RB>;
    var acc: array<array<vec4<f32>, S>, RB>; // the rows' dQ
    var delta_r: array<f32, RB>;
    // Rows past T have zero q and dO, so lse 0 gives them finite, unused values.
    var lse_r: array<f32, RB>;
    for (var b = 0u; b < RB; b++) {
        let i = i0 + R * b;
        for (var qd = 0u; qd < S; qd++) {
            qr[b][qd] = tile_q(tl.base, i, qd);
            dyr[b][qd] = tile_dy(tl.base, i, qd);
            delta_r[b] += dot(dyr[b][qd], tile_o(tl.base, i, qd));
        }
        if (i < p.t) {
            lse_r[b] = ld_lse(tl.m * p.t + i);
            st_delta(tl.m * p.t + i, delta_r[b]);
        }
    }
    var kend = p.t;
    if (p.causal != 0u) {
        kend = min(p.t, tl.row0 + R * RB);
    }
    for (var j0 = 0u; j0 < kend; j0 += C) {
        workgroupBarrier();
        for (var e = li; e < C * S; e += R) {
            ks[e] = tile_k(kvb, j0 + e / S, e % S);
            vs[e] = tile_v(kvb, j0 + e / S, e % S);
        }
        workgroupBarrier();
        let n = min(tile_rows(j0), kend - j0);
        for (var c = 0u; c < n; c++) {
            // Each staged quad is read once per use and serves every row of the invocation.
            var s: array<f32, RB>;
            var dp: array<f32, RB>;
            for (var qd = 0u; qd < S; qd++) {
                let kq = ks[c * S + qd];
                let vq = vs[c * S + qd];
                for (var b = 0u; b < RB; b++) {
                    s[b] += dot(qr[b][qd], kq);
                    dp[b] += dot(dyr[b][qd], vq);
                }
            }
            var w: array<f32, RB>;
            for (var b = 0u; b < RB; b++) {
                let visible_b = visible(i0 + R * b, j0 + c);
                let pij = select(0.0, exp(p.scale * s[b] - lse_r[b]), visible_b);
                w[b] = pij * (dp[b] - delta_r[b]) * p.scale;
            }
            for (var qd = 0u; qd < S; qd++) {
                let kq = ks[c * S + qd];
                for (var b = 0u; b < RB; b++) {
                    acc[b][qd] += w[b] * kq;
                }
            }
        }
    }
    for (var b = 0u; b < RB; b++) {
        let i = i0 + R * b;
        if (i < p.t) {
            for (var qd = 0u; qd < S; qd++) {
                store_dq(tl.base, i, qd, acc[b][qd]);
            }
        }
    }
}
