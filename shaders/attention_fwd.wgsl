// Fused self-attention, forward (flash-attention): o = softmax(scale * q kᵀ, causal) v, one
// workgroup per R queries of one (batch, head) matrix, walking the keys in tiles of C with an
// online softmax, so the (T, T) scores never leave workgroup memory. Per tile:
//   s = scale * q kᵀ (masked: -inf),  m' = max(m, max_j s),  a = exp(m - m'),
//   l = a l + sum_j exp(s - m'),  acc = a acc + sum_j exp(s - m') v_j,
// and at the end o = acc / l and lse = m + log(l) (natural log, f32), which the backward uses to
// rebuild the probabilities. Causal: tiles past the workgroup's last query are never loaded.
// Tiles, lanes and edges: include/attention_tiles.wgsl.

var<workgroup> qs: array<vec4<f32>, R * S>; // the queries, R rows of S quads
var<workgroup> kv: array<vec4<f32>, C * S>; // the tile's keys, then its values
var<workgroup> sc: array<f32, R * C>;       // the tile's scaled, masked scores

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
    }
    var mx = neg_inf();
    var l = 0.0;
    var acc: array<vec4<f32>, NQ>; // quads g + G t of the row's unnormalized output
    // Keys any of the tile's queries sees.
    var kend = p.t;
    if (p.causal != 0u) {
        kend = min(p.t, tl.row0 + R);
    }
    for (var j0 = 0u; j0 < kend; j0 += C) {
        // The previous tile's readers of kv and sc (and the staging of qs) are done.
        workgroupBarrier();
        for (var e = li; e < C * S; e += WG) {
            kv[e] = tile_k(tl.base, j0 + e / S, e % S);
        }
        workgroupBarrier();
        for (var t = 0u; t < NC; t++) {
            let c = g + G * t;
            var s = neg_inf();
            if (visible(i, j0 + c)) {
                var dotp = 0.0;
                for (var qd = 0u; qd < p.d4; qd++) {
                    dotp += dot(qs[r * S + qd], kv[c * S + qd]);
                }
                s = p.scale * dotp;
            }
            sc[r * C + c] = s;
        }
        workgroupBarrier();
        for (var e = li; e < C * S; e += WG) {
            kv[e] = tile_v(tl.base, j0 + e / S, e % S);
        }
        workgroupBarrier();
        // Every lane of the row reads the whole score row in the same order, so all get the
        // same max and sum.
        var tm = mx;
        for (var c = 0u; c < C; c++) {
            tm = max(tm, sc[r * C + c]);
        }
        // A row with nothing visible yet keeps m = -inf and adds exp(-inf) = 0.
        let mu = select(tm, 0.0, tm == neg_inf());
        let a = exp(mx - mu);
        for (var t = 0u; t < NQ; t++) {
            acc[t] *= a;
        }
        var ls = 0.0;
        for (var c = 0u; c < C; c++) {
            let pc = exp(sc[r * C + c] - mu);
            ls += pc;
            for (var t = 0u; t < NQ; t++) {
                acc[t] += pc * kv[c * S + g + G * t];
            }
        }
        l = l * a + ls;
        mx = tm;
    }
    if (i >= p.t) {
        return;
    }
    let inv = 1.0 / l;
    for (var t = 0u; t < NQ; t++) {
        store_o(tl.base, i, g + G * t, acc[t] * inv);
    }
    if (g == 0u) {
        st_lse(tl.m * p.t + i, mx + log(l));
    }
}
