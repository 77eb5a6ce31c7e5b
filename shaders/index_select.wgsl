// Row gather and its deterministic scatter-add (embedding lookup and its gradient). Rows are
// runs of `d` contiguous elements; `idx` holds raw u32 words built and checked on the host.
// Two outputs per invocation, elements 2w and 2w + 1 of the flat output (see kernels/mod.rs),
// each computed on its own, so a pair may span two rows.
//
// MODE 0, gather: x is the table (V, d), idx the n ids (each < V), out (n, d):
//   out[i * d + j] = x[idx[i] * d + j].
// MODE 1, scatter-add: x is the gradient of the gather's output (n, d), out the table's
//   gradient (V, d); idx is CSR: offsets idx[0..=V] (non-decreasing, idx[V] = n), then at
//   idx[V + 1 + k] the positions i with ids[i] = v for k in offsets v..v+1, increasing:
//   out[v * d + j] = sum over those k, in order, of x[pos_k * d + j] (0 for a row never used).
//   No atomics: one invocation owns each output and adds in a fixed order, so the result is
//   bitwise reproducible.

struct Params {
    n: u32,    // output elements
    d: u32,    // row length
    rows: u32, // MODE 1: V (rows of the table's gradient)
    _pad: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;
// 0: gather, 1: scatter-add. Specialized.
const MODE: u32 = 0u;

// Output element e.
fn value(e: u32) -> f32 {
    let r = e / p.d;
    let j = e % p.d;
    if (MODE == 0u) {
        return ld_x(idx[r] * p.d + j);
    }
    let start = idx[r];
    let end = idx[r + 1u];
    let pos = p.rows + 1u;
    var acc = 0.0;
    for (var k = start; k < end; k++) {
        acc += ld_x(idx[pos + k] * p.d + j);
    }
    return acc;
}
