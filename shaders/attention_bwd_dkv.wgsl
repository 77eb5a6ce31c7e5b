// Fused self-attention, backward pass 2: the keys' and values' gradients. RB keys per
// invocation, R RB of one (batch, head) matrix per workgroup, walking the query tiles that see them
// (causal: from the workgroup's first key on) and rebuilding the probabilities from lse and
// pass 1's delta:
//   P_ij = exp(scale * q_i . k_j - lse_i),  dV_j = sum_i P_ij dO_i,
//   dS_ij = P_ij (dO_i . v_j - delta_i),   dK_j = scale * sum_i dS_ij q_i.
// Rows, tiles and edges: include/attention_tiles.wgsl (here the rows are keys and the staged
// tiles queries). With grouped-query heads the workgroup's matrix m is a kv matrix and the sums
// run over the G query heads m G .. m G + G - 1 that read it, in that order (no atomics).

var<workgroup> qs: array<vec4<f32>, C * S>;  // the tile's queries
var<workgroup> dys: array<vec4<f32>, C * S>; // and their output gradients

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

@compute @workgroup_size(R)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let tl = tile_of(wg, nwg);
    if (!tl.live) {
        return;
    }
    // This invocation's keys: row0 + li + R b.
    let j0 = tl.row0 + li;
    var kr: array<array<vec4<f32>, S>, RB>;
    var vr: array<array<vec4<f32>, S>, RB>;
    var dk_acc: array<array<vec4<f32>, S>, RB>;
    var dv_acc: array<array<vec4<f32>, S>, RB>;
    for (var b = 0u; b < RB; b++) {
        for (var qd = 0u; qd < S; qd++) {
            kr[b][qd] = tile_k(tl.base, j0 + R * b, qd);
            vr[b][qd] = tile_v(tl.base, j0 + R * b, qd);
        }
    }
    // Causal: queries before the first key see none of these keys.
    var i_start = 0u;
    if (p.causal != 0u) {
        i_start = tl.row0;
    }
    for (var h = 0u; h < p.group; h++) {
        let mq = tl.m * p.group + h; // the query matrix
        let qb = mq * p.t * p.d;
        let stats = mq * p.t; // where its lse and delta start
        for (var i0 = i_start; i0 < p.t; i0 += C) {
            workgroupBarrier();
            for (var e = li; e < C * S; e += R) {
                qs[e] = tile_q(qb, i0 + e / S, e % S);
                dys[e] = tile_dy(qb, i0 + e / S, e % S);
            }
            workgroupBarrier();
            let n = tile_rows(i0);
            for (var c = 0u; c < n; c++) {
                let i = i0 + c; // the same query in every invocation
                let lse_i = ld_lse(stats + i);
                let delta_i = ld_delta(stats + i);
                var s: array<f32, RB>;
                var dp: array<f32, RB>;
                for (var qd = 0u; qd < S; qd++) {
                    let qq = qs[c * S + qd];
                    let gq = dys[c * S + qd];
                    for (var b = 0u; b < RB; b++) {
                        s[b] += dot(kr[b][qd], qq);
                        dp[b] += dot(vr[b][qd], gq);
                    }
                }
                var pij: array<f32, RB>;
                var w: array<f32, RB>;
                for (var b = 0u; b < RB; b++) {
                    let visible_b = visible(i, j0 + R * b);
                    pij[b] = select(0.0, exp(p.scale * s[b] - lse_i), visible_b);
                    w[b] = pij[b] * (dp[b] - delta_i) * p.scale;
                }
                for (var qd = 0u; qd < S; qd++) {
                    let qq = qs[c * S + qd];
                    let gq = dys[c * S + qd];
                    for (var b = 0u; b < RB; b++) {
                        dv_acc[b][qd] += pij[b] * gq;
                        dk_acc[b][qd] += w[b] * qq;
                    }
                }
            }
        }
    }
    for (var b = 0u; b < RB; b++) {
        let j = j0 + R * b;
        if (j < p.t) {
            for (var qd = 0u; qd < S; qd++) {
                store_dk(tl.base, j, qd, dk_acc[b][qd]);
                store_dv(tl.base, j, qd, dv_acc[b][qd]);
            }
        }
    }
}
