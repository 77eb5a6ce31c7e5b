// Strided indexing shared by binary.wgsl, where.wgsl and permute.wgsl (prepended at build time).
// The including shader's `p.shape` is out's shape, padded on the left with 1 to rank 4.

// Offset of out's linear index `i` in a tensor read through strides `s` (in elements): 0 along
// broadcast dims, an input's own strides reordered for a permutation.
fn offset(i: u32, s: vec4<u32>) -> u32 {
    let i3 = i % p.shape.w;
    var r = i / p.shape.w;
    let i2 = r % p.shape.z;
    r = r / p.shape.z;
    let i1 = r % p.shape.y;
    let i0 = r / p.shape.y;
    return i0 * s.x + i1 * s.y + i2 * s.z + i3 * s.w;
}
