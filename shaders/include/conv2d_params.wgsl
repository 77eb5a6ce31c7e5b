// Shared by conv2d_fwd.wgsl, conv2d_dx.wgsl and conv2d_dw.wgsl (prepended at build time): the
// convolution's geometry at binding 0. Tensors are NCHW and contiguous: x (n, c, h, w), the
// weight (oc, cg, kh, kw) with cg = c / groups, y and dy (n, oc, oh, ow), where
// oh = (h + 2 ph - dh (kh - 1) - 1) / sh + 1 (and so for ow). Indices fit in u32 (checked by the
// caller); input coordinates are i32 since padding puts them below 0.

struct Params {
    n: u32,
    c: u32,
    h: u32,
    w: u32,
    oc: u32,
    oh: u32,
    ow: u32,
    groups: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    ph: u32,
    pw: u32,
    dh: u32,
    dw: u32,
    cg: u32,      // input channels per group
    ocg: u32,     // output channels per group
    m_blocks: u32, // blocks of TM rows per group (the grid's y is groups * m_blocks)
    has_bias: u32, // conv2d_fwd: the bias binding holds one value per output channel
    chunk: u32,   // conv2d_dw: positions (n, oh, ow) summed per partial
    chunks: u32,  // conv2d_dw: partial sums per weight element
    k_lanes: u32, // conv2d_dw: lanes of a workgroup spanning the weight columns (a power of 2)
    onto: u32,    // conv2d_dw with one chunk: 1 to continue the sums from what part holds
}
@group(0) @binding(0) var<uniform> p: Params;
