// Shared by the matmul shaders (prepended at build time): the parameters at binding 0 and the
// fused epilogue applied to each output before it is stored. The blocked kernels store through
// `store4`, which applies the epilogue to four columns as vector operations: written per element
// it made the unrolled kernels several times slower to compile.

struct Params {
    m: u32,
    n: u32,
    k: u32,
    epilogue: u32, // bit 0: add bias; bits 1..: 0 none, 1 relu, 2 gelu
    a_batch: u32,  // elements between batches of A (0: shared)
    b_batch: u32,
    c_batch: u32,
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

// The sum over k runs in blocks: a block starts where k & K_MASK == 0 (K_MASK = 15: blocks of 16),
// each block is summed from zero and the block sums are added in order (all ones: one block).
// A batch that a split cuts at block boundaries (micro-batches, ranks) then sums each block
// with the same bits, and blocked sums round less than one running sum.
override K_MASK: u32 = 0xffffffffu;

fn block_starts(k: u32) -> bool {
    return k != 0u && (k & K_MASK) == 0u;
}

// Where the sum over k starts: zero, or (ONTO) what C holds, so the kernel folds the products onto
// C in k order (batch-invariant weight gradients, src/tensor/invariant.rs; no bias, no
// activation). C[m, n .. n + 4], rows and columns past the edge clamped (never stored).
override ONTO: bool = false;

fn start4(base: u32, m: u32, n: u32) -> vec4<f32> {
    if (!ONTO) {
        return vec4<f32>(0.0);
    }
    let row = base + min(m, p.m - 1u) * p.n;
    let last = p.n - 1u;
    return vec4<f32>(ld_c(row + min(n, last)), ld_c(row + min(n + 1u, last)),
                     ld_c(row + min(n + 2u, last)), ld_c(row + min(n + 3u, last)));
}

// C rows start on 16-byte boundaries (N % 4 == 0): whole vec4 stores.
override VEC_C: bool = false;
// The epilogue as a pipeline constant, or ANY_EPILOGUE to read it from the parameters. Kernels
// that store many quads (the unrolled subgroup kernel) are specialized: otherwise every store
// carries the code of every epilogue, which made them compile several times slower.
const ANY_EPILOGUE: u32 = 0xffffffffu;
override EPILOGUE: u32 = ANY_EPILOGUE;

fn epilogue() -> u32 {
    return select(EPILOGUE, p.epilogue, EPILOGUE == ANY_EPILOGUE);
}

// tanh-form GELU; tanh through exp(-2|u|) so large |x| gives x or 0, never NaN.
fn gelu(x: f32) -> f32 {
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    let e = exp(-2.0 * abs(u));
    let t = sign(u) * (1.0 - e) / (1.0 + e);
    return 0.5 * x * (1.0 + t);
}

fn finish(v: f32, col: u32) -> f32 {
    var r = v;
    if ((epilogue() & 1u) != 0u) {
        r += ld_bias(col);
    }
    let act = epilogue() >> 1u;
    if (act == 1u) {
        r = select(r, 0.0, bitcast<u32>(r) > 0x80000000u && bitcast<u32>(r) <= 0xff800000u); // relu keeping NaN (see unary.wgsl)
    } else if (act == 2u) {
        r = gelu(r);
    }
    return r;
}


fn gelu4(x: vec4<f32>) -> vec4<f32> {
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    let e = exp(-2.0 * abs(u));
    let t = sign(u) * (1.0 - e) / (1.0 + e);
    return 0.5 * x * (1.0 + t);
}

// `finish` of columns n .. n + 4 (those past N read the last bias; they are never stored).
fn finish4(v: vec4<f32>, n: u32) -> vec4<f32> {
    var r = v;
    let e = epilogue();
    if ((e & 1u) != 0u) {
        let last = p.n - 1u;
        r += vec4<f32>(ld_bias(min(n, last)), ld_bias(min(n + 1u, last)),
                       ld_bias(min(n + 2u, last)), ld_bias(min(n + 3u, last)));
    }
    let act = e >> 1u;
    if (act == 1u) {
        let b = bitcast<vec4<u32>>(r);
        r = select(r, vec4<f32>(0.0), (b > vec4<u32>(0x80000000u)) & (b <= vec4<u32>(0xff800000u)));
    } else if (act == 2u) {
        r = gelu4(r);
    }
    return r;
}

// Applies the epilogue to C[m, n .. n + 4] of the batch at `base` and stores the elements inside
// C: one vec4 store where VEC_C (an override) allows, else element by element.
fn store4(base: u32, m: u32, n: u32, v: vec4<f32>) {
    if (m >= p.m || n >= p.n) {
        return;
    }
    let o = base + m * p.n + n;
    let y = finish4(v, n);
    if (VEC_C && n + 3u < p.n) {
        st4_c(o, y);
        return;
    }
    for (var q = 0u; q < 4u; q++) {
        if (n + q < p.n) {
            st_c(o + q, y[q]);
        }
    }
}
