// Copies a block of (outer, len, inner) elements between two tensors viewed as
// (outer, x_len, inner) and (outer, out_len, inner): element (o, l, i) of the block is read at
// l + x_off and written at l + out_off along the middle axis. It serves narrow (out_len = len),
// each input of a cat (one dispatch per input), and narrow's backward (out zeroed first).
// Elements of out outside the block keep their values.
//
// Ownership: each invocation owns one word of out (elements 2w and 2w + 1, a packed f16 word
// whole) within the span of words the block touches, and writes both of its elements; an element
// outside the block is read and written back unchanged. So no two invocations write one word, and
// a word shared by two inputs of a cat is finished by the later dispatch, which sees the earlier
// one's writes (dispatches are ordered).

struct Params {
    n: u32,       // elements of out
    w0: u32,      // the first word of out the block touches
    words: u32,   // words in the span, from w0
    inner: u32,
    x_len: u32,
    x_off: u32,
    out_len: u32,
    out_off: u32,
    len: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

// The new value of out's element e: from x inside the block, else out's own.
fn value(e: u32) -> f32 {
    let row = e / p.inner;
    let i = e % p.inner;
    let o = row / p.out_len;
    // Wraps to a huge value below out_off, so one comparison tests both ends.
    let l = row % p.out_len - p.out_off;
    if (l < p.len) {
        return ld_x((o * p.x_len + p.x_off + l) * p.inner + i);
    }
    return ld_out(e);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let t = (wg.y * nwg.x + wg.x) * WG + lid;
    if (t >= p.words) {
        return;
    }
    let w = p.w0 + t;
    let e = 2u * w;
    var v1 = 0.0;
    if (e + 1u < p.n) {
        v1 = value(e + 1u);
    }
    st2_out(w, value(e), v1, p.n);
}
