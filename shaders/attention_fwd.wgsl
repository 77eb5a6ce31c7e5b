// Fused self-attention, forward (flash-attention): o = softmax(scale * q kᵀ, causal) v. RB
// queries per invocation, R RB of one (batch, head) matrix per workgroup, walking the keys in
// staged tiles of C with an online softmax, so the (T, T) scores are never stored. Per key:
//   s = scale * q . k_j (masked: -inf),  m' = max(m, s),  a = exp(m - m'),
//   l = a l + exp(s - m'),  acc = a acc + exp(s - m') v_j,
// and at the end o = acc / l and lse = m + log(l) (natural log, f32), from which the backward
// rebuilds the probabilities. Causal: tiles past the workgroup's last query are never loaded.
// Rows, tiles and edges: include/attention_tiles.wgsl.

var<workgroup> ks: array<vec4<f32>, C * S>; // the tile's keys, C rows of S quads
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

// Quad qd of output row `row`. With D even every row starts on an even element, so each pair
// is a whole packed word; packed f16 with D odd is written to f32 first (the host stages it).
fn store_o(base: u32, row: u32, qd: u32, v: vec4<f32>) {
    let n = quad_len(row, qd);
    let i = base + row * p.d + 4u * qd;
    if ((p.d & 1u) == 0u) {
        for (var k = 0u; k < n; k += 2u) {
            st2_o((i + k) >> 1u, v[k], v[k + 1u], i + n);
        }
    } else {
        for (var k = 0u; k < n; k++) {
            st_o(i + k, v[k]);
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
    var acc: array<array<vec4<f32>, S>, RB>; // the unnormalized output rows
    var mx: array<f32, RB>;
    var l: array<f32, RB>;
    for (var b = 0u; b < RB; b++) {
        for (var qd = 0u; qd < S; qd++) {
            qr[b][qd] = tile_q(tl.base, i0 + R * b, qd);
        }
        mx[b] = neg_inf();
    }
    // Keys any of the workgroup's queries sees.
    var kend = p.t;
    if (p.causal != 0u) {
        kend = min(p.t, tl.row0 + R * RB);
    }
    for (var j0 = 0u; j0 < kend; j0 += C) {
        // The previous tile's readers are done.
        workgroupBarrier();
        for (var e = li; e < C * S; e += R) {
            ks[e] = tile_k(kvb, j0 + e / S, e % S);
            vs[e] = tile_v(kvb, j0 + e / S, e % S);
        }
        workgroupBarrier();
        let n = min(tile_rows(j0), kend - j0);
        for (var c = 0u; c < n; c++) {
            // Each staged quad is read once and used for every row of the invocation.
            var dotp: array<f32, RB>;
            for (var qd = 0u; qd < S; qd++) {
                let kq = ks[c * S + qd];
                for (var b = 0u; b < RB; b++) {
                    dotp[b] += dot(qr[b][qd], kq);
                }
            }
            // The online softmax one key at a time: no score array, which CPU adapters would
            // keep in memory rather than registers. A masked key (or a row with nothing
            // visible yet, m = -inf) adds exp(-inf) = 0.
            var a: array<f32, RB>;
            var pc: array<f32, RB>;
            for (var b = 0u; b < RB; b++) {
                let sc = select(neg_inf(), p.scale * dotp[b], visible(i0 + R * b, j0 + c));
                let m2 = max(mx[b], sc);
                let mu = select(m2, 0.0, m2 == neg_inf());
                a[b] = exp(mx[b] - mu);
                pc[b] = exp(sc - mu);
                l[b] = l[b] * a[b] + pc[b];
                mx[b] = m2;
            }
            for (var qd = 0u; qd < S; qd++) {
                let vq = vs[c * S + qd];
                for (var b = 0u; b < RB; b++) {
                    acc[b][qd] = acc[b][qd] * a[b] + pc[b] * vq;
                }
            }
        }
    }
    for (var b = 0u; b < RB; b++) {
        let i = i0 + R * b;
        if (i < p.t) {
            let inv = 1.0 / l[b];
            for (var qd = 0u; qd < S; qd++) {
                store_o(tl.base, i, qd, acc[b][qd] * inv);
            }
            st_lse(tl.m * p.t + i, mx[b] + log(l[b]));
        }
    }
}
