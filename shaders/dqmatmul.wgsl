// C = A · dequant(W)ᵀ (+ bias) or C = A · dequant(W), W frozen and quantized, dequantized per
// element as it is multiplied: the f32 weights never exist in memory. This is the matmul of a
// LoRA layer's frozen base: the forward (TRANS = 0) and the input gradient (TRANS = 1).
//
// W is (R, K) (out features, in features), in one of three formats (FMT, specialized):
//   0  int8 per output row, the layout of include/qmatmul_common.wgsl: row r is KW words, four
//      int8 each (k = 4j + b in byte b of word j), scale[r] per row.
//   1  NF4: element i = r * K + k of the flattened W is nibble i % 8 of word i / 8 (low nibble
//      first), its value NF4[nibble] * scale[i / 64] (one f32 absmax per block of 64).
//   2  NF4 with double quantization: block b's absmax is dq[code] * scale[b / 256] + dq[256],
//      code = byte b % 4 of qa[b / 4] (8-bit dynamic codes of the absmax minus their mean, one
//      f32 absmax per 256 blocks, as bitsandbytes' compress_statistics).
// A is (M, K) for TRANS = 0 and (M, R) for TRANS = 1; bias (R) f32 is added when p.bias is 1
// (forward only); C is (M, R) or (M, K). A and C are f32.
//
// One invocation per TM rows of one column of C: each weight is dequantized once for the TM
// rows (rows past M read row M - 1 and are not stored). In the forward, an NF4 code word is
// read once per 8 elements and a block's absmax once per 64 along the invocation's row of W.
// Where the adapter has a fixed subgroup size SG dividing WG (src/kernels/dqmatmul.rs expands
// the `//@` lines), lane l loads A's rows at j0 + l for SG terms and subgroupBroadcast hands
// term j0 + t to every lane (on lavapipe a buffer load is a loop over the lanes, even at one
// address); no invocation returns early then, and columns past N compute the last column's
// values without storing them. Without subgroups each invocation loads A itself. Each
// element's sum runs over the reduction axis in order with one fma per term (a fixed order:
// bitwise repeatable, and the same bits whatever TM, SG or the expansion). Row groups are
// spread over y and z (65535 workgroups per dimension). The `//@` lines, per row r of TM:
//   //@row TEXT    TEXT with {r} replaced, for every row;
//   //@lane        the subgroup lane builtin parameter (with subgroups);
//   //@load        lane l's values of A at j0 + l, x{r} (with subgroups);
//   //@terms       the SG terms j0 .. j0 + SG, in order.

struct Params {
    m: u32,     // rows of A and C
    n: u32,     // columns of C: R (forward) or K (input gradient)
    red: u32,   // the reduction: K (forward) or R (input gradient)
    cols: u32,  // K, W's row length
    kw: u32,    // words per row of the int8 layout
    bias: u32,  // 1: add bias[col]
    _p0: u32,
    _p1: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

// 0: C = A · Wᵀ; 1: C = A · W. Specialized.
const TRANS: u32 = 0u;
// The weight format (see above). Specialized.
const FMT: u32 = 1u;
// Invocations per workgroup, along the columns of C.
const WG: u32 = 64u;
// Row groups (TM rows of C each) per y slice of the grid.
const ROWS_Y: u32 = 65535u;
// Rows of C per invocation (the `//@row` lines' count).
const TM: u32 = 8u;
// Terms per step of the reduction loop: the subgroup size with subgroups.
const SG: u32 = 8u;

// QLoRA's NormalFloat4 code values (bitsandbytes' get_4bit_type("nf4")).
var<private> NF4: array<f32, 16> = array<f32, 16>(
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0);

// NF4[c] by selects on c's bits (a private array indexed per lane is a memory gather on CPU
// adapters; this is four levels of vector selects).
fn nf4(c: u32) -> f32 {
    let b0 = (c & 1u) != 0u;
    let b1 = (c & 2u) != 0u;
    let b2 = (c & 4u) != 0u;
    let q0 = select(select(NF4[0], NF4[1], b0), select(NF4[2], NF4[3], b0), b1);
    let q1 = select(select(NF4[4], NF4[5], b0), select(NF4[6], NF4[7], b0), b1);
    let q2 = select(select(NF4[8], NF4[9], b0), select(NF4[10], NF4[11], b0), b1);
    let q3 = select(select(NF4[12], NF4[13], b0), select(NF4[14], NF4[15], b0), b1);
    return select(select(q0, q1, b2), select(q2, q3, b2), (c & 8u) != 0u);
}

fn block_absmax(b: u32) -> f32 {
    if (FMT == 2u) {
        let code = (qa[b >> 2u] >> (8u * (b & 3u))) & 255u;
        return dq[code] * scale[b >> 8u] + dq[256u];
    }
    return scale[b];
}

// W[r, k] dequantized.
fn deq(r: u32, k: u32) -> f32 {
    if (FMT == 0u) {
        let word = w[r * p.kw + (k >> 2u)];
        let q = bitcast<i32>(word << (24u - 8u * (k & 3u))) >> 24u;
        return f32(q) * scale[r];
    }
    let i = r * p.cols + k;
    let nib = (w[i >> 3u] >> (4u * (i & 7u))) & 15u;
    return nf4(nib) * block_absmax(i >> 6u);
}

// W[r, k] of an NF4 weight at flattened index i = r * K + k, reusing `word` and `amax` (the
// code word and block absmax of the previous index) where i is not the first of its word or
// block and `fresh` is false.
fn deq_nf4_run(i: u32, fresh: bool, word: ptr<function, u32>, amax: ptr<function, f32>) -> f32 {
    if (fresh || (i & 7u) == 0u) {
        *word = w[i >> 3u];
    }
    if (fresh || (i & 63u) == 0u) {
        *amax = block_absmax(i >> 6u);
    }
    return nf4((*word >> (4u * (i & 7u))) & 15u) * *amax;
}

// W[r, k] with (r, k) = (col, j) in the forward, (j, col) in the input gradient.
fn weight(col: u32, j: u32, word: ptr<function, u32>, amax: ptr<function, f32>) -> f32 {
    if (TRANS == 0u && FMT != 0u) {
        return deq_nf4_run(col * p.cols + j, j == 0u, word, amax);
    }
    if (TRANS == 0u) {
        return deq(col, j);
    }
    return deq(j, col);
}

@compute @workgroup_size(WG, 1, 1)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
        //@lane
        ) {
    let row = (wg.z * ROWS_Y + wg.y) * TM;
    let col_in = wg.x * WG + lid.x;
    // Uniform over the workgroup. No barriers.
    if (row >= p.m) {
        return;
    }
    let col = min(col_in, p.n - 1u);
    let last = p.m - 1u;
    //@row let a{r} = min(row + {r}u, last) * p.red;
    //@row var s{r} = 0.0;
    var word = 0u;
    var amax = 0.0;
    for (var j0 = 0u; j0 < p.red; j0 += SG) {
        //@load
        //@terms
    }
    if (p.bias == 1u) {
        let b = bias[col];
        //@row s{r} += b;
    }
    if (col_in < p.n) {
        //@row if (row + {r}u < p.m) { st_c((row + {r}u) * p.n + col, s{r}); }
    }
}
