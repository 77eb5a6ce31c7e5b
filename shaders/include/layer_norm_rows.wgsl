// Shared by layer_norm.wgsl and layer_norm_dx.wgsl (prepended at build time): the parameters at
// binding 0, the RMS mode, which row and elements each invocation takes, the fixed-order row
// sum, and the pair store. Tensors are (rows, c) contiguous.
//
// 2^lane_shift invocations share a row (WG >> lane_shift rows per workgroup; one invocation per
// row for short rows). Lane l takes the element pairs q = l + lanes * t, elements 2q and
// 2q + 1, so on packed f16 (c is even there: odd rows go through f32) every invocation owns the
// whole words it writes. The lanes' partial sums meet in workgroup memory and every lane adds
// them in lane order, so each lane gets the same, shape-determined result: bitwise
// reproducible, no atomics.
// (softmax_rows.wgsl's helpers pad rows with -inf for maxima and lack eps; sums need neither.)

struct Params {
    rows: u32,
    c: u32,          // row length
    lane_shift: u32, // log2 of the invocations per row
    eps: f32,        // layer_norm.wgsl only
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;
// 1: RMS norm (Llama's RMSNorm): no mean is subtracted (the mean written is 0) and no bias is
// added, so y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps). Specialized.
const RMS: u32 = 0u;

var<workgroup> part: array<vec2<f32>, WG>;

// Where one invocation works. A lane of a row past the end (`live` false) reads and writes
// nothing but still reaches every barrier.
struct Lane {
    lid: u32,
    row: u32,
    lane: u32,
    lanes: u32,
    first: u32, // index in `part` of the row's lane 0
    live: bool,
    pairs: u32, // element pairs in the row; 0 when not live
}

fn lane_of(group: u32, lid: u32) -> Lane {
    let lanes = 1u << p.lane_shift;
    let slot = lid >> p.lane_shift;
    let row = group * (WG >> p.lane_shift) + slot;
    let live = row < p.rows;
    return Lane(lid, row, lid & (lanes - 1u), lanes, slot * lanes, live,
                select(0u, (p.c + 1u) / 2u, live));
}

// The sum of `v` over the lanes of the row, the same in each of them.
fn row_sum(l: Lane, v: vec2<f32>) -> vec2<f32> {
    part[l.lid] = v;
    workgroupBarrier();
    var s = vec2<f32>(0.0);
    for (var k = 0u; k < l.lanes; k++) {
        s += part[l.first + k];
    }
    // `part` is written again by the next call.
    workgroupBarrier();
    return s;
}
