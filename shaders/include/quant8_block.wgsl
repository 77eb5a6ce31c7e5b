// Elements per block of the 8-bit optimizer state: one f32 absmax per block of codes. Its only
// copy: the Rust side (kernels/adamw8bit.rs) reads the value from this file.
const BLOCK: u32 = 256u;
