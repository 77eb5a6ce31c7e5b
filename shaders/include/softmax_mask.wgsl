// The fused scale, causal mask and additive mask of softmax_masked, prepended to softmax.wgsl and
// softmax_sg.wgsl after softmax_rows.wgsl. The kernels read a row's values only through `row_in`
// (a quad) and `row_at` (one element), which give scale * x + mask with columns past the causal
// limit at -inf. All three are specializations, not uniforms (lavapipe evaluates both sides of a
// branch on a uniform): with MASKED = 0, `row_in` is `load4`, `row_at` is `ld_x`, and the plain
// softmax compiles to what it was before the mask existed. Its `mask` binding then aliases x and
// is never read.
//
// The input is viewed as (d0, d1, T_q, T_k) (leading dims padded with 1) and the mask as the same
// four dims with strides ms0, ms1, msq (0 along a broadcast dim) and 1 along T_k (the host expands
// a mask whose last dim is 1). Row r is query i = r % T_q of matrix r / T_q.

// 1: softmax_masked (scale, and an all -inf row gives 0 rather than NaN).
const MASKED: u32 = 0u;
// 1: causal query i sees columns k < i + T_k - T_q + 1 only (the others are -inf, never loaded).
const CAUSAL: u32 = 0u;
// 1: add the mask binding.
const MASK: u32 = 0u;

// Where a row starts in x and out (base) and in the mask (mbase), and how many of its columns
// the causal mask leaves visible (vis; c without it).
struct Row {
    base: u32,
    vis: u32,
    mbase: u32,
}

fn row_of(row: u32) -> Row {
    var r = Row(row * p.c, p.c, 0u);
    if (CAUSAL != 0u || MASK != 0u) {
        let i = row % p.tq;
        if (CAUSAL != 0u) {
            r.vis = u32(clamp(i32(i) + p.diag, 0, i32(p.c)));
        }
        if (MASK != 0u) {
            let m = row / p.tq;
            r.mbase = (m / p.d1) * p.ms0 + (m % p.d1) * p.ms1 + i * p.msq;
        }
    }
    return r;
}

// Mask elements 4q..4q+4 of the mask row at `mbase`; 0 past the row end.
fn mask4(mbase: u32, q: u32) -> vec4<f32> {
    let i = 4u * q;
    if (i + 4u <= p.c) {
        return ld4_mask(mbase + i);
    }
    var v = vec4<f32>(0.0);
    for (var k = 0u; i + k < p.c; k++) {
        v[k] = ld_mask(mbase + i + k);
    }
    return v;
}

// Quad q of row r's values: scale * x + mask, -inf past the causal limit and the row end.
fn row_in(r: Row, q: u32) -> vec4<f32> {
    if (MASKED == 0u) {
        return load4(r.base, q);
    }
    let i = 4u * q;
    if (CAUSAL != 0u && i >= r.vis) {
        return vec4<f32>(neg_inf());
    }
    // scale > 0 keeps the -inf padding -inf.
    var v = load4(r.base, q) * p.scale;
    if (MASK != 0u) {
        v += mask4(r.mbase, q);
    }
    if (CAUSAL != 0u && i + 4u > r.vis) {
        let k = vec4<u32>(i, i + 1u, i + 2u, i + 3u);
        v = select(v, vec4<f32>(neg_inf()), k >= vec4<u32>(r.vis));
    }
    return v;
}

// Element k of row r's values (k < c).
fn row_at(r: Row, k: u32) -> f32 {
    if (MASKED == 0u) {
        return ld_x(r.base + k);
    }
    if (CAUSAL != 0u && k >= r.vis) {
        return neg_inf();
    }
    var v = ld_x(r.base + k) * p.scale;
    if (MASK != 0u) {
        v += ld_mask(r.mbase + k);
    }
    return v;
}
