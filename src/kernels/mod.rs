//! Kernels: WGSL assembly, the pipeline cache key, and dispatch helpers. One Rust file per shader
//! family; the shader bodies live in `shaders/*.wgsl`.
//!
//! A shader file holds its parameter struct (binding 0) and `main`. It reads and writes tensors
//! only through generated accessors, so one body serves every storage type:
//! - `ld_NAME(i) -> f32` reads element `i`;
//! - `st2_NAME(w, v0, v1, n)` writes elements `2w` and `2w + 1` (the latter only if `< n`).
//!
//! Elementwise kernels therefore compute two outputs per invocation: packed f16 stores whole
//! 32-bit words, and two invocations never write halves of the same word.

pub(crate) mod adamw8bit;
pub(crate) mod attention;
pub(crate) mod attention_sg;
pub(crate) mod batch_norm;
pub(crate) mod conv2d;
pub(crate) mod dqmatmul;
pub(crate) mod dropout;
pub(crate) mod elementwise;
pub(crate) mod grad_norm;
pub(crate) mod index_select;
pub(crate) mod layer_norm;
pub(crate) mod layout;
pub mod matmul;
pub(crate) mod nonfinite;
mod operand;
pub(crate) mod optim;
pub(crate) mod pool2d;
pub(crate) mod qmatmul;
pub(crate) mod reduce;
pub(crate) mod reduce_max;
pub(crate) mod rope;
pub(crate) mod softmax;
pub(crate) mod transpose;

pub(crate) use operand::Operand;

use crate::device::{Device, Kernel};
use crate::{DType, Result};
use std::sync::Arc;

/// Invocations per workgroup for the elementwise family: 256 is the largest size every adapter
/// accepts (wgpu's default `max_compute_invocations_per_workgroup`).
pub(crate) const WG: u32 = 256;

/// The fewest invocations sharing one row or output in the row kernels' mode 0 (softmax,
/// cross-entropy, max/argmax), read from shaders/include/lanes.wgsl so the shaders' workgroup
/// arrays and the dispatch's lane counts cannot disagree.
pub(crate) const MIN_LANES: usize = wgsl_const(include_str!("../../shaders/include/lanes.wgsl"));

/// The value of the first `const NAME: u32 = 123u;` line in `src`: the digits after its `=`.
const fn wgsl_const(src: &str) -> usize {
    let b = src.as_bytes();
    let mut i = 0;
    // Skip comment lines, then find the '=' of the const.
    while i < b.len() && b[i] != b'=' {
        if b[i] == b'/' && i + 1 < b.len() && b[i + 1] == b'/' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        }
        i += 1;
    }
    i += 1;
    while i < b.len() && b[i] == b' ' {
        i += 1;
    }
    let mut v = 0;
    while i < b.len() && b[i].is_ascii_digit() {
        v = v * 10 + (b[i] - b'0') as usize;
        i += 1;
    }
    assert!(v > 0, "no `const NAME: u32 = N;` line");
    v
}

/// How a tensor's elements are stored as the shader sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    F32,
    /// `array<f16>` (needs SHADER_F16).
    F16,
    /// f16 pairs packed in `array<u32>`, unpacked to f32 (works everywhere).
    F16Packed,
    /// Raw `array<u32>` words (row indices built on the host), read directly as `NAME[i]`; no
    /// accessors are generated.
    U32,
}

impl Storage {
    pub(crate) fn of(device: &Device, dtype: DType) -> Storage {
        match dtype {
            DType::F32 => Storage::F32,
            DType::F16 if device.f16_native() => Storage::F16,
            DType::F16 => Storage::F16Packed,
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::F16 => "f16",
            Storage::F16Packed => "f16p",
            Storage::U32 => "u32",
        }
    }
}

/// A tensor binding of a shader: its name in the body, storage, whether it is written, and
/// whether it is declared as an array of 4-element vectors (16-byte loads and stores).
#[derive(Clone, Copy, Debug)]
pub struct Binding {
    pub name: &'static str,
    pub storage: Storage,
    pub write: bool,
    pub vec4: bool,
    /// Bound as several windows of one buffer (a tensor larger than one storage binding may
    /// see); `None` for one binding.
    pub split: Option<Split>,
}

/// How a split binding's windows cut its array: window `w` holds array indices
/// `w * len .. (w + 1) * len` and is declared `NAME_w` (window 0 is `NAME` itself, at the
/// binding's own number; the others follow every plain binding, in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// Windows, at least 2.
    pub windows: u32,
    /// Bytes of each window but the last (a multiple of 256).
    pub window_bytes: u64,
}

/// Bytes of one array element of a binding (a vec4 binding's element is four tensor elements).
fn array_elem_bytes(b: &Binding) -> u64 {
    match (b.storage, b.vec4) {
        (Storage::F16, false) => 2,
        (Storage::F32 | Storage::F16Packed | Storage::U32, false) => 4,
        (Storage::F16, true) | (Storage::F16Packed, true) => 8,
        (Storage::F32 | Storage::U32, true) => 16,
    }
}

/// Reads and writes of a split binding's array by index: `rd_N(j)`, `wr_N(j, v)` and, for
/// vector elements, `wrc_N(j, c, v)` (one component, so two invocations may write the halves
/// of one element's words, as the plain accessors do).
fn split_accessors(b: &Binding, sp: &Split) -> String {
    let n = b.name;
    let t = wgsl_array_type(b);
    let len = sp.window_bytes / array_elem_bytes(b);
    let arr = |w: u32| {
        if w == 0 {
            n.to_string()
        } else {
            format!("{n}_{w}")
        }
    };
    let mut rd = format!("fn rd_{n}(ix_: u32) -> {t} {{\n");
    let mut wr = format!("fn wr_{n}(ix_: u32, val_: {t}) {{\n");
    let vector = t.starts_with("vec");
    let scalar = t
        .trim_start_matches("vec4<")
        .trim_start_matches("vec2<")
        .trim_end_matches('>');
    let mut wrc = format!("fn wrc_{n}(ix_: u32, cx_: u32, val_: {scalar}) {{\n");
    for w in 0..sp.windows {
        let lo = w as u64 * len;
        let a = arr(w);
        let cond = if w + 1 < sp.windows {
            format!("if (ix_ < {}u) ", lo + len)
        } else {
            String::new()
        };
        rd += &format!("  {cond}{{ return {a}[ix_ - {lo}u]; }}\n");
        wr += &format!("  {cond}{{ {a}[ix_ - {lo}u] = val_; return; }}\n");
        wrc += &format!("  {cond}{{ {a}[ix_ - {lo}u][cx_] = val_; return; }}\n");
    }
    let mut s = rd + "}\n";
    if b.write {
        s += &(wr + "}\n");
        if vector {
            s += &(wrc + "}\n");
        }
    }
    s
}

/// The WGSL element type of a binding.
fn wgsl_array_type(b: &Binding) -> &'static str {
    match (b.storage, b.vec4) {
        (Storage::F32, false) => "f32",
        (Storage::F16, false) => "f16",
        (Storage::F16Packed, false) => "u32",
        (Storage::F32, true) => "vec4<f32>",
        (Storage::F16, true) => "vec4<f16>",
        (Storage::F16Packed, true) => "vec2<u32>",
        (Storage::U32, false) => "u32",
        // Four raw words per load (the quantized matmul's weights).
        (Storage::U32, true) => "vec4<u32>",
    }
}

/// Accessors of one binding; indices are always element indices.
/// - `ld_N(i) -> f32`, `ld4_N(i) -> vec4<f32>` (elements i..i+4; i a multiple of 4 for a vec4
///   binding);
/// - if written: `st_N(i, v)`, `st2_N(w, v0, v1, n)` (elements 2w and 2w+1 if < n; a packed
///   vec4 binding writes the word whole, so n is even there),
///   `st4_N(i, v)` (elements i..i+4; i a multiple of 4, and even for packed f16).
///
/// On packed f16 a 32-bit word holds two elements, so `st_N` is a read-modify-write of the word:
/// a kernel may use it only where one invocation owns both halves of every word it writes.
fn accessors(b: &Binding) -> String {
    let n = b.name;
    let t = match b.storage {
        Storage::F32 => "f32",
        Storage::F16 => "f16",
        Storage::F16Packed => "u32",
        Storage::U32 => return String::new(),
    };
    // Array reads and writes: in place, or through a split binding's window accessors.
    let split = b.split.is_some();
    let rd = |j: &str| {
        if split {
            format!("rd_{n}({j})")
        } else {
            format!("{n}[{j}]")
        }
    };
    let wr = |j: &str, v: &str| {
        if split {
            format!("wr_{n}({j}, {v})")
        } else {
            format!("{n}[{j}] = {v}")
        }
    };
    let wrc = |j: &str, c: &str, v: &str| {
        if split {
            format!("wrc_{n}({j}, {c}, {v})")
        } else {
            format!("{n}[{j}][{c}] = {v}")
        }
    };
    let mut s = match &b.split {
        Some(sp) => split_accessors(b, sp),
        None => String::new(),
    };
    match (b.vec4, b.storage) {
        (true, Storage::F16Packed) => {
            s += &format!(
                "fn ld4_{n}(i: u32) -> vec4<f32> {{ let w = {}; \
                 return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)); }}\n",
                rd("i >> 2u")
            );
        }
        (true, _) => {
            s += &format!(
                "fn ld4_{n}(i: u32) -> vec4<f32> {{ return vec4<f32>({}); }}\n",
                rd("i >> 2u")
            )
        }
        (false, Storage::F16Packed) => {
            s += &format!(
                "fn ld_{n}(i: u32) -> f32 {{ return unpack2x16float({})[i & 1u]; }}\n",
                rd("i >> 1u")
            );
        }
        (false, _) => s += &format!("fn ld_{n}(i: u32) -> f32 {{ return f32({}); }}\n", rd("i")),
    }
    if b.vec4 {
        s += &format!("fn ld_{n}(i: u32) -> f32 {{ return ld4_{n}(i & ~3u)[i & 3u]; }}\n");
    } else {
        s += &format!(
            "fn ld4_{n}(i: u32) -> vec4<f32> {{ return vec4<f32>(ld_{n}(i), ld_{n}(i + 1u), ld_{n}(i + 2u), ld_{n}(i + 3u)); }}\n"
        );
    }
    if !b.write {
        return s;
    }
    s += &match (b.vec4, b.storage) {
        (true, Storage::F16Packed) => format!(
            "fn st4_{n}(i: u32, v: vec4<f32>) {{ {}; }}\n\
             fn st_{n}(i: u32, v: f32) {{\n  var w = ld4_{n}(i & ~3u);\n  w[i & 3u] = v;\n  st4_{n}(i & ~3u, w);\n}}\n\
             fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{ {}; }}\n",
            wr("i >> 2u", "vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw))"),
            wrc("w >> 1u", "w & 1u", "pack2x16float(vec2<f32>(v0, v1))")
        ),
        (true, _) => format!(
            "fn st4_{n}(i: u32, v: vec4<f32>) {{ {}; }}\n\
             fn st_{n}(i: u32, v: f32) {{ {}; }}\n\
             fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{\n  \
               let i = 2u * w;\n  \
               if (i < n) {{ st_{n}(i, v0); }}\n  \
               if (i + 1u < n) {{ st_{n}(i + 1u, v1); }}\n}}\n",
            wr("i >> 2u", &format!("vec4<{t}>(v)")),
            wrc("i >> 2u", "i & 3u", &format!("{t}(v)"))
        ),
        (false, Storage::F16Packed) => format!(
            "fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{ {}; }}\n\
             fn st4_{n}(i: u32, v: vec4<f32>) {{ {}; {}; }}\n\
             fn st_{n}(i: u32, v: f32) {{\n  var w = unpack2x16float({});\n  w[i & 1u] = v;\n  {};\n}}\n",
            wr("w", "pack2x16float(vec2<f32>(v0, v1))"),
            wr("i >> 1u", "pack2x16float(v.xy)"),
            wr("(i >> 1u) + 1u", "pack2x16float(v.zw)"),
            rd("i >> 1u"),
            wr("i >> 1u", "pack2x16float(w)")
        ),
        (false, _) => format!(
            "fn st_{n}(i: u32, v: f32) {{ {}; }}\n\
             fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{\n  \
               let i = 2u * w;\n  \
               if (i < n) {{ {}; }}\n  \
               if (i + 1u < n) {{ {}; }}\n}}\n\
             fn st4_{n}(i: u32, v: vec4<f32>) {{ {}; {}; {}; {}; }}\n",
            wr("i", &format!("{t}(v)")),
            wr("i", &format!("{t}(v0)")),
            wr("i + 1u", &format!("{t}(v1)")),
            wr("i", &format!("{t}(v.x)")),
            wr("i + 1u", &format!("{t}(v.y)")),
            wr("i + 2u", &format!("{t}(v.z)")),
            wr("i + 3u", &format!("{t}(v.w)"))
        ),
    };
    s
}

/// The full WGSL of `body` with declarations and accessors for `bindings` (binding 1, 2, ...).
pub fn assemble(body: &str, bindings: &[Binding]) -> String {
    let mut src = String::new();
    if bindings.iter().any(|b| b.storage == Storage::F16) {
        // Must be the first line of the module.
        src.push_str("enable f16;\n");
    }
    // A split binding's further windows take the numbers after every plain binding, in order
    // (the device binds a block's windows in the same order).
    let mut next = bindings.len() + 1;
    for (i, b) in bindings.iter().enumerate() {
        // Inputs are declared read_write too: tensors are ranges of shared arena buffers, and
        // wgpu forbids one buffer bound read-only and writable in the same dispatch, while
        // several writable bindings of one buffer are allowed. Blocks never overlap.
        src += &format!(
            "@group(0) @binding({}) var<storage, read_write> {}: array<{}>;\n",
            i + 1,
            b.name,
            wgsl_array_type(b)
        );
        for w in 1..b.split.map_or(1, |s| s.windows) {
            src += &format!(
                "@group(0) @binding({next}) var<storage, read_write> {}_{w}: array<{}>;\n",
                b.name,
                wgsl_array_type(b)
            );
            next += 1;
        }
        src += &accessors(b);
    }
    src.push_str(body);
    src
}

/// Replaces the value of `const NAME: u32 = ...;` lines in a shader body (tile sizes that size
/// arrays must be `const`, which pipeline overrides cannot fill).
pub fn specialize(body: &str, consts: &[(&str, u32)]) -> String {
    let mut out = String::with_capacity(body.len());
    for line in body.lines() {
        let t = line.trim_start();
        match consts
            .iter()
            .find(|(name, _)| t.starts_with(&format!("const {name}: u32 =")))
        {
            Some((name, v)) => out += &format!("const {name}: u32 = {v}u;"),
            None => out += line,
        }
        out.push('\n');
    }
    out
}

/// A shader file: its name (cache key prefix) and body.
pub struct ShaderFile {
    pub name: &'static str,
    pub body: &'static str,
    /// Binding names in order, with whether each is written.
    pub bindings: &'static [(&'static str, bool)],
}

pub const BINARY: ShaderFile = ShaderFile {
    name: "binary",
    body: concat!(
        include_str!("../../shaders/include/activations.wgsl"),
        include_str!("../../shaders/include/broadcast.wgsl"),
        include_str!("../../shaders/binary.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("out", true)],
};
pub const UNARY: ShaderFile = ShaderFile {
    name: "unary",
    body: concat!(
        include_str!("../../shaders/include/activations.wgsl"),
        include_str!("../../shaders/unary.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};
pub const WHERE: ShaderFile = ShaderFile {
    name: "where",
    body: concat!(
        include_str!("../../shaders/include/broadcast.wgsl"),
        include_str!("../../shaders/where.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("c", false), ("a", false), ("b", false), ("out", true)],
};
pub const PERMUTE: ShaderFile = ShaderFile {
    name: "permute",
    body: concat!(
        include_str!("../../shaders/include/broadcast.wgsl"),
        include_str!("../../shaders/permute.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};
pub const STRIDED_COPY: ShaderFile = ShaderFile {
    name: "strided_copy",
    body: include_str!("../../shaders/strided_copy.wgsl"),
    bindings: &[("x", false), ("out", true)],
};
pub const FILL: ShaderFile = ShaderFile {
    name: "fill",
    body: include_str!("../../shaders/fill.wgsl"),
    bindings: &[("out", true)],
};
pub const REDUCE: ShaderFile = ShaderFile {
    name: "reduce",
    body: include_str!("../../shaders/reduce.wgsl"),
    bindings: &[("x", false), ("out", true)],
};
pub const TRANSPOSE: ShaderFile = ShaderFile {
    name: "transpose",
    body: concat!(
        include_str!("../../shaders/transpose.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};
pub const REDUCE_MAX: ShaderFile = ShaderFile {
    name: "reduce_max",
    body: concat!(
        include_str!("../../shaders/include/lanes.wgsl"),
        include_str!("../../shaders/reduce_max.wgsl")
    ),
    bindings: &[("x", false), ("out", true), ("idx", true)],
};
pub const SOFTMAX: ShaderFile = ShaderFile {
    name: "softmax",
    body: concat!(
        include_str!("../../shaders/include/lanes.wgsl"),
        include_str!("../../shaders/include/softmax_rows.wgsl"),
        include_str!("../../shaders/include/softmax_mask.wgsl"),
        include_str!("../../shaders/softmax.wgsl")
    ),
    // Without a mask, x is bound as `mask` too (never read).
    bindings: &[("x", false), ("out", true), ("mask", false)],
};
pub const SOFTMAX_SG: ShaderFile = ShaderFile {
    name: "softmax_sg",
    body: concat!(
        include_str!("../../shaders/include/lanes.wgsl"),
        include_str!("../../shaders/include/softmax_rows.wgsl"),
        include_str!("../../shaders/include/softmax_mask.wgsl"),
        include_str!("../../shaders/softmax_sg.wgsl")
    ),
    // Without a mask, x is bound as `mask` too (never read).
    bindings: &[("x", false), ("out", true), ("mask", false)],
};
pub const CROSS_ENTROPY: ShaderFile = ShaderFile {
    name: "cross_entropy",
    body: concat!(
        include_str!("../../shaders/include/lanes.wgsl"),
        include_str!("../../shaders/include/softmax_rows.wgsl"),
        include_str!("../../shaders/cross_entropy.wgsl")
    ),
    // out is the gradient.
    bindings: &[("x", false), ("t", false), ("out", true), ("loss", true)],
};
pub const NONFINITE: ShaderFile = ShaderFile {
    name: "nonfinite",
    body: include_str!("../../shaders/nonfinite.wgsl"),
    bindings: &[("x", false), ("flag", true)],
};

pub const GRAD_NORM: ShaderFile = ShaderFile {
    name: "grad_norm",
    body: include_str!("../../shaders/grad_norm.wgsl"),
    bindings: &[("g", true), ("acc", true), ("norm", true)],
};

pub const OPTIM: ShaderFile = ShaderFile {
    name: "optim",
    body: concat!(
        include_str!("../../shaders/include/adamw.wgsl"),
        include_str!("../../shaders/optim.wgsl")
    ),
    bindings: &[("p", true), ("g", false), ("m", true), ("sq", true)],
};

pub const ADAMW8BIT: ShaderFile = ShaderFile {
    name: "adamw8bit",
    body: concat!(
        include_str!("../../shaders/include/quant8_block.wgsl"),
        include_str!("../../shaders/include/adamw.wgsl"),
        include_str!("../../shaders/adamw8bit.wgsl")
    ),
    // qm and qv are raw u32 code words; am, av and qmap are f32.
    bindings: &[
        ("p", true),
        ("g", false),
        ("qm", true),
        ("qv", true),
        ("am", true),
        ("av", true),
        ("qmap", false),
    ],
};

pub const MATMUL_REG: ShaderFile = ShaderFile {
    name: "matmul_reg",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/include/matmul_loads.wgsl"),
        include_str!("../../shaders/matmul_reg.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("bias", false), ("c", true)],
};
pub const MATMUL_TILED: ShaderFile = ShaderFile {
    name: "matmul_tiled",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/matmul_tiled.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("bias", false), ("c", true)],
};
pub const MATMUL_SG: ShaderFile = ShaderFile {
    name: "matmul_sg",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/include/matmul_loads.wgsl"),
        include_str!("../../shaders/matmul_sg.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("bias", false), ("c", true)],
};
pub const MATMUL_NAIVE: ShaderFile = ShaderFile {
    name: "matmul_naive",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/matmul_naive.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("bias", false), ("c", true)],
};
pub const INDEX_SELECT: ShaderFile = ShaderFile {
    name: "index_select",
    body: concat!(
        include_str!("../../shaders/index_select.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("idx", false), ("x", false), ("out", true)],
};
pub const LAYER_NORM: ShaderFile = ShaderFile {
    name: "layer_norm",
    body: concat!(
        include_str!("../../shaders/include/layer_norm_rows.wgsl"),
        include_str!("../../shaders/layer_norm.wgsl")
    ),
    bindings: &[
        ("x", false),
        ("w", false),
        ("b", false),
        ("y", true),
        ("mean", true),
        ("rstd", true),
    ],
};
pub const LAYER_NORM_DX: ShaderFile = ShaderFile {
    name: "layer_norm_dx",
    body: concat!(
        include_str!("../../shaders/include/layer_norm_rows.wgsl"),
        include_str!("../../shaders/layer_norm_dx.wgsl")
    ),
    bindings: &[
        ("dy", false),
        ("x", false),
        ("w", false),
        ("mean", false),
        ("rstd", false),
        ("dx", true),
    ],
};
pub const LAYER_NORM_DWDB: ShaderFile = ShaderFile {
    name: "layer_norm_dwdb",
    body: include_str!("../../shaders/layer_norm_dwdb.wgsl"),
    bindings: &[
        ("dy", false),
        ("x", false),
        ("mean", false),
        ("rstd", false),
        ("dw", true),
        ("db", true),
    ],
};
pub const ROPE: ShaderFile = ShaderFile {
    name: "rope",
    body: include_str!("../../shaders/rope.wgsl"),
    bindings: &[("x", false), ("cs", false), ("y", true)],
};
pub const DROPOUT: ShaderFile = ShaderFile {
    name: "dropout",
    body: concat!(
        include_str!("../../shaders/dropout.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};

pub const QMATMUL: ShaderFile = ShaderFile {
    name: "qmatmul",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/include/qmatmul_common.wgsl"),
        include_str!("../../shaders/qmatmul.wgsl")
    ),
    // w holds the int8 weights as raw u32 words; scale and bias are f32.
    bindings: &[
        ("a", false),
        ("w", false),
        ("scale", false),
        ("bias", false),
        ("c", true),
    ],
};
pub const QMATMUL_SG: ShaderFile = ShaderFile {
    name: "qmatmul_sg",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/include/qmatmul_common.wgsl"),
        include_str!("../../shaders/qmatmul_sg.wgsl")
    ),
    bindings: QMATMUL.bindings,
};
pub const DQMATMUL: ShaderFile = ShaderFile {
    name: "dqmatmul",
    body: include_str!("../../shaders/dqmatmul.wgsl"),
    // w and qa hold codes as raw u32 words; scale, dq and bias are f32.
    bindings: &[
        ("a", false),
        ("w", false),
        ("scale", false),
        ("qa", false),
        ("dq", false),
        ("bias", false),
        ("c", true),
    ],
};
pub const ATTENTION_FWD: ShaderFile = ShaderFile {
    name: "attention_fwd",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/include/attention_tiles.wgsl"),
        include_str!("../../shaders/attention_fwd.wgsl")
    ),
    bindings: &[
        ("q", false),
        ("k", false),
        ("v", false),
        ("o", true),
        ("lse", true),
    ],
};
pub const ATTENTION_BWD_DQ: ShaderFile = ShaderFile {
    name: "attention_bwd_dq",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/include/attention_tiles.wgsl"),
        include_str!("../../shaders/attention_bwd_dq.wgsl")
    ),
    bindings: &[
        ("q", false),
        ("k", false),
        ("v", false),
        ("o", false),
        ("dy", false),
        ("lse", false),
        ("dq", true),
        ("delta", true),
    ],
};
pub const ATTENTION_BWD_DKV: ShaderFile = ShaderFile {
    name: "attention_bwd_dkv",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/include/attention_tiles.wgsl"),
        include_str!("../../shaders/attention_bwd_dkv.wgsl")
    ),
    bindings: &[
        ("q", false),
        ("k", false),
        ("v", false),
        ("dy", false),
        ("lse", false),
        ("delta", false),
        ("dk", true),
        ("dv", true),
    ],
};

pub const ATTENTION_SG_FWD: ShaderFile = ShaderFile {
    name: "attention_sg_fwd",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/attention_sg_fwd.wgsl")
    ),
    bindings: ATTENTION_FWD.bindings,
};
pub const ATTENTION_SG_DQ: ShaderFile = ShaderFile {
    name: "attention_sg_dq",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/attention_sg_dq.wgsl")
    ),
    bindings: ATTENTION_BWD_DQ.bindings,
};
pub const ATTENTION_SG_DKV: ShaderFile = ShaderFile {
    name: "attention_sg_dkv",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/attention_sg_dkv.wgsl")
    ),
    bindings: ATTENTION_BWD_DKV.bindings,
};

pub const CONV2D_FWD: ShaderFile = ShaderFile {
    name: "conv2d_fwd",
    body: concat!(
        include_str!("../../shaders/include/conv2d_params.wgsl"),
        include_str!("../../shaders/conv2d_fwd.wgsl")
    ),
    // Without a bias, the weight is bound as `b` too (never read).
    bindings: &[("x", false), ("wt", false), ("b", false), ("y", true)],
};
pub const CONV2D_DX: ShaderFile = ShaderFile {
    name: "conv2d_dx",
    body: concat!(
        include_str!("../../shaders/include/conv2d_params.wgsl"),
        include_str!("../../shaders/conv2d_dx.wgsl")
    ),
    bindings: &[("dy", false), ("wt", false), ("dx", true)],
};
pub const CONV2D_DW: ShaderFile = ShaderFile {
    name: "conv2d_dw",
    body: concat!(
        include_str!("../../shaders/include/conv2d_params.wgsl"),
        include_str!("../../shaders/conv2d_dw.wgsl")
    ),
    bindings: &[("dy", false), ("x", false), ("part", true)],
};

pub const POOL2D_FWD: ShaderFile = ShaderFile {
    name: "pool2d_fwd",
    body: concat!(
        include_str!("../../shaders/include/pool2d_window.wgsl"),
        include_str!("../../shaders/pool2d_fwd.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};
pub const POOL2D_BWD: ShaderFile = ShaderFile {
    name: "pool2d_bwd",
    body: concat!(
        include_str!("../../shaders/include/pool2d_window.wgsl"),
        include_str!("../../shaders/pool2d_bwd.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("dy", false), ("out", true)],
};
pub const BATCH_NORM_STATS: ShaderFile = ShaderFile {
    name: "batch_norm_stats",
    body: concat!(
        include_str!("../../shaders/include/batch_norm_channels.wgsl"),
        include_str!("../../shaders/batch_norm_stats.wgsl")
    ),
    // Without running statistics, stats is bound as rmean and rvar too (never written).
    bindings: &[
        ("x", false),
        ("stats", true),
        ("rmean", true),
        ("rvar", true),
    ],
};
pub const BATCH_NORM: ShaderFile = ShaderFile {
    name: "batch_norm",
    body: concat!(
        include_str!("../../shaders/include/batch_norm_channels.wgsl"),
        include_str!("../../shaders/batch_norm.wgsl"),
        include_str!("../../shaders/include/batch_norm_pairs.wgsl")
    ),
    bindings: &[
        ("x", false),
        ("wt", false),
        ("b", false),
        ("stats", false),
        ("out", true),
    ],
};
pub const BATCH_NORM_SUMS: ShaderFile = ShaderFile {
    name: "batch_norm_sums",
    body: concat!(
        include_str!("../../shaders/include/batch_norm_channels.wgsl"),
        include_str!("../../shaders/batch_norm_sums.wgsl")
    ),
    bindings: &[
        ("dy", false),
        ("x", false),
        ("stats", false),
        ("sums", true),
    ],
};
pub const BATCH_NORM_DX: ShaderFile = ShaderFile {
    name: "batch_norm_dx",
    body: concat!(
        include_str!("../../shaders/include/batch_norm_channels.wgsl"),
        include_str!("../../shaders/batch_norm_dx.wgsl"),
        include_str!("../../shaders/include/batch_norm_pairs.wgsl")
    ),
    bindings: &[
        ("dy", false),
        ("x", false),
        ("wt", false),
        ("stats", false),
        ("sums", false),
        ("out", true),
    ],
};

/// Every shader file, for validation without a GPU (unit test and `cargo xtask shaders`).
pub const SHADERS: &[ShaderFile] = &[
    BINARY,
    UNARY,
    FILL,
    REDUCE,
    TRANSPOSE,
    MATMUL_REG,
    MATMUL_TILED,
    MATMUL_SG,
    MATMUL_NAIVE,
    REDUCE_MAX,
    SOFTMAX,
    SOFTMAX_SG,
    CROSS_ENTROPY,
    NONFINITE,
    OPTIM,
    ADAMW8BIT,
    INDEX_SELECT,
    LAYER_NORM,
    LAYER_NORM_DX,
    LAYER_NORM_DWDB,
    ROPE,
    DROPOUT,
    WHERE,
    PERMUTE,
    STRIDED_COPY,
    GRAD_NORM,
    QMATMUL,
    QMATMUL_SG,
    DQMATMUL,
    ATTENTION_FWD,
    ATTENTION_BWD_DQ,
    ATTENTION_BWD_DKV,
    ATTENTION_SG_FWD,
    ATTENTION_SG_DQ,
    ATTENTION_SG_DKV,
    CONV2D_FWD,
    CONV2D_DX,
    CONV2D_DW,
    POOL2D_FWD,
    POOL2D_BWD,
    BATCH_NORM_STATS,
    BATCH_NORM,
    BATCH_NORM_SUMS,
    BATCH_NORM_DX,
];

impl ShaderFile {
    /// The bindings with one storage per tensor, in declaration order.
    pub fn with_storage(&self, storage: &[Storage]) -> Vec<Binding> {
        self.bindings
            .iter()
            .zip(storage)
            .map(|(&(name, w), &s)| Binding {
                name,
                storage: s,
                write: w,
                vec4: false,
                split: None,
            })
            .collect()
    }

    /// The compiled kernel for these storages, cached on the device.
    pub(crate) fn kernel(&self, device: &Device, storage: &[Storage]) -> Result<Arc<Kernel>> {
        let mut key = self.name.to_string();
        for s in storage {
            key.push('_');
            key.push_str(s.tag());
        }
        device.kernel(&key, &[], false, || {
            assemble(self.body, &self.with_storage(storage))
        })
    }

    /// [`ShaderFile::kernel`] with `const NAME: u32` lines of the body replaced by `consts`
    /// (see [`specialize`]).
    pub(crate) fn kernel_with(
        &self,
        device: &Device,
        storage: &[Storage],
        consts: &[(&str, u32)],
    ) -> Result<Arc<Kernel>> {
        let mut key = self.name.to_string();
        for (name, v) in consts {
            key += &format!("_{name}{v}");
        }
        for s in storage {
            key.push('_');
            key.push_str(s.tag());
        }
        device.kernel(&key, &[], false, || {
            assemble(&specialize(self.body, consts), &self.with_storage(storage))
        })
    }
}

/// The split of each binding of one dispatch (see [`Split`]): a tensor whose block passes the
/// device's binding limit is bound as several windows of its buffer, and the kernel reads it
/// through window accessors. Kernels that take large tensors (parameters, their gradients and
/// optimizer state, the embedding and the head over a vocabulary) build their bindings
/// through this; the others bind every tensor whole, and the device refuses a large one.
pub(crate) struct Splits(Vec<Option<Split>>);

impl Splits {
    /// The splits of `blocks`, in binding order. Errors: an [`Error::Limit`] when the windows
    /// pass the adapter's storage bindings per kernel (before any pipeline is made).
    pub(crate) fn of(dev: &Device, blocks: &[&crate::memory::Block]) -> Result<Splits> {
        let window_bytes = dev.window_bytes();
        let windows: Vec<u32> = blocks.iter().map(|b| dev.binding_windows(b.size)).collect();
        dev.check_storage_bindings(windows.iter().map(|&w| w as u64).sum())?;
        Ok(Splits(
            windows
                .into_iter()
                .map(|windows| {
                    (windows > 1).then_some(Split {
                        windows,
                        window_bytes,
                    })
                })
                .collect(),
        ))
    }

    /// The pipeline-key suffix: empty when nothing is split, else each binding's windows and
    /// the window size.
    pub(crate) fn key(&self) -> String {
        let Some(bytes) = self.0.iter().flatten().map(|s| s.window_bytes).next() else {
            return String::new();
        };
        let w: Vec<String> = self
            .0
            .iter()
            .map(|s| s.map_or(1, |s| s.windows).to_string())
            .collect();
        format!("_w{}x{bytes}", w.join("."))
    }

    /// `bindings` with their splits set.
    pub(crate) fn apply(&self, bindings: Vec<Binding>) -> Vec<Binding> {
        bindings
            .into_iter()
            .zip(&self.0)
            .map(|(b, &split)| Binding { split, ..b })
            .collect()
    }
}

/// Workgroups for a two-elements-per-invocation kernel over `n` elements.
pub(crate) fn pair_groups(n: usize) -> u32 {
    (n.div_ceil(2) as u32).div_ceil(WG)
}

impl ShaderFile {
    /// [`ShaderFile::kernel_with`] for a dispatch over `blocks`, large ones bound as windows
    /// (see [`Splits`]).
    pub(crate) fn kernel_for(
        &self,
        device: &Device,
        storage: &[Storage],
        consts: &[(&str, u32)],
        blocks: &[&crate::memory::Block],
    ) -> Result<Arc<Kernel>> {
        let splits = Splits::of(device, blocks)?;
        let mut key = self.name.to_string();
        for (name, v) in consts {
            key += &format!("_{name}{v}");
        }
        for s in storage {
            key.push('_');
            key.push_str(s.tag());
        }
        key += &splits.key();
        device.kernel(&key, &[], false, || {
            assemble(
                &specialize(self.body, consts),
                &splits.apply(self.with_storage(storage)),
            )
        })
    }
}

/// Every binding combination a shader file is built in at run time.
pub fn variants(file: &ShaderFile) -> Vec<Vec<Binding>> {
    let mut out: Vec<Vec<Binding>> = storage_variants(file)
        .iter()
        .map(|st| file.with_storage(st))
        .collect();
    if file.name.starts_with("qmatmul") {
        // The weights are always read as vec4<u32> (rows padded to whole quads of words).
        for b in out.iter_mut().flatten().filter(|b| b.name == "w") {
            b.vec4 = true;
        }
    }
    if file.name == "adamw8bit" {
        // With n % 4 == 0 the parameter and gradient are read and written as vec4.
        let vectorized: Vec<Vec<Binding>> = out
            .iter()
            .map(|b| {
                b.iter()
                    .map(|&x| Binding {
                        vec4: x.name == "p" || x.name == "g",
                        ..x
                    })
                    .collect()
            })
            .collect();
        out.extend(vectorized);
    }
    if file.name.starts_with("matmul_") {
        // With 16-byte aligned rows, A, B and C are read and written as vec4.
        let vectorized: Vec<Vec<Binding>> = out
            .iter()
            .map(|b| {
                b.iter()
                    .map(|&x| Binding {
                        vec4: x.name != "bias",
                        ..x
                    })
                    .collect()
            })
            .collect();
        out.extend(vectorized);
    }
    out
}

/// Every storage combination `file` is built in (the registry's validation and the kernels'
/// own tests).
pub(crate) fn storage_variants(file: &ShaderFile) -> Vec<Vec<Storage>> {
    use Storage::*;
    let n = file.bindings.len();
    match file.name {
        // The reduction accumulates and writes f32 whatever it reads.
        "reduce" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32])
            .collect(),
        // Unary ops also cast.
        "unary" => vec![
            vec![F32, F32],
            vec![F16, F16],
            vec![F16Packed, F16Packed],
            vec![F32, F16],
            vec![F16, F32],
            vec![F32, F16Packed],
            vec![F16Packed, F32],
        ],
        // The condition may have another dtype than the values (an f32 mask on f16 data).
        "where" => [
            (F32, F32),
            (F16, F16),
            (F16Packed, F16Packed),
            (F32, F16),
            (F16, F32),
            (F32, F16Packed),
            (F16Packed, F32),
        ]
        .iter()
        .map(|&(c, s)| vec![c, s, s, s])
        .collect(),
        // Max and argmax are written in f32; nonfinite's flag is f32.
        "reduce_max" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, F32])
            .collect(),
        "nonfinite" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32])
            .collect(),
        // The slots and the norm are f32.
        "grad_norm" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, F32])
            .collect(),
        // Packed f16 rows of odd length are written to f32 first; the mask has x's dtype.
        "softmax" | "softmax_sg" => vec![
            vec![F32, F32, F32],
            vec![F16, F16, F16],
            vec![F16Packed, F16Packed, F16Packed],
            vec![F16Packed, F32, F16Packed],
        ],
        // Targets and row losses are f32.
        "cross_entropy" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, s, F32])
            .chain([vec![F16Packed, F32, F32, F32]])
            .collect(),
        // Indices are raw u32 words.
        "index_select" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![U32, s, s])
            .collect(),
        // Row statistics are f32; packed f16 rows of odd length are written to f32 first.
        "layer_norm" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, s, s, F32, F32])
            .chain([vec![F16Packed, F16Packed, F16Packed, F32, F32, F32]])
            .collect(),
        "layer_norm_dx" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, s, F32, F32, s])
            .chain([vec![F16Packed, F16Packed, F16Packed, F32, F32, F32]])
            .collect(),
        // Weights are raw u32 words, scales and bias f32; packed f16 rows of N % 4 != 0 are
        // written to f32 first.
        "qmatmul" | "qmatmul_sg" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, U32, F32, F32, s])
            .chain([vec![F16Packed, U32, F32, F32, F32]])
            .collect(),
        // Codes are raw words; A, C, the statistics and the bias f32.
        "dqmatmul" => vec![vec![F32, U32, F32, U32, F32, F32, F32]],
        // The parameter and its gradient in any storage (f16 gradients beside f32 master
        // weights under mixed precision); codes are raw words, absmax and the map f32.
        "adamw8bit" => [
            [F32, F32],
            [F16, F16],
            [F16Packed, F16Packed],
            [F32, F16],
            [F32, F16Packed],
        ]
        .iter()
        .map(|&[p, g]| vec![p, g, U32, U32, F32, F32, F32])
        .collect(),
        // The angles are f32; packed f16 rows whose halves start on odd elements are written
        // to f32 first.
        "rope" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, s])
            .chain([vec![F16Packed, F32, F32]])
            .collect(),
        // Column partial sums are f32.
        "layer_norm_dwdb" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, F32, F32, F32, F32])
            .collect(),
        // Attention's row statistics are f32; packed f16 outputs with D odd are written to f32.
        "attention_fwd" | "attention_bwd_dq" | "attention_bwd_dkv" | "attention_sg_fwd"
        | "attention_sg_dq" | "attention_sg_dkv" => attention_storage(file.name),
        // Outputs of packed f16 with odd planes are written to f32 first; weight partials are f32.
        "conv2d_fwd" | "conv2d_dx" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s; n])
            .chain([[vec![F16Packed; n - 1], vec![F32]].concat()])
            .collect(),
        "conv2d_dw" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, F32])
            .collect(),
        // Batch norm's statistics, running statistics and sums are f32.
        "batch_norm_stats" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, F32, F32])
            .collect(),
        "batch_norm" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, s, F32, s])
            .collect(),
        "batch_norm_sums" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, F32, F32])
            .collect(),
        "batch_norm_dx" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, s, F32, F32, s])
            .collect(),
        _ => [F32, F16, F16Packed].iter().map(|&s| vec![s; n]).collect(),
    }
}

/// The attention passes' storage combinations; the workgroup and subgroup variants of a pass
/// bind the same tensors.
fn attention_storage(name: &str) -> Vec<Vec<Storage>> {
    use Storage::*;
    let f = F32;
    let mut out: Vec<Vec<Storage>> = Vec::new();
    for (s, o) in [
        (F32, F32),
        (F16, F16),
        (F16Packed, F16Packed),
        (F16Packed, F32),
    ] {
        out.push(if name.ends_with("fwd") {
            // q, k, v, o, lse
            vec![s, s, s, o, f]
        } else if name.ends_with("dq") {
            // q, k, v, o, dO, lse, dQ, delta
            vec![s, s, s, s, s, f, o, f]
        } else {
            // q, k, v, dO, lse, delta, dK, dV
            vec![s, s, s, s, f, f, o, o]
        });
    }
    out
}

/// Parses and validates `src` with naga, with the capabilities fitgrad's shaders rely on
/// (f16 and subgroup operations where the adapter offers them, and pack/unpack of f16 pairs in
/// f32 everywhere).
pub fn validate_wgsl(src: &str) -> std::result::Result<(), String> {
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    Validator::new(
        ValidationFlags::all(),
        Capabilities::SHADER_FLOAT16
            | Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | Capabilities::SUBGROUP,
    )
    .validate(&module)
    .map_err(|e| format!("{e:?}"))?;
    Ok(())
}

/// Validates every variant of every shader file without a GPU: one line per variant, with the
/// error where one fails.
pub fn validate_all() -> Vec<(String, std::result::Result<(), String>)> {
    let mut out = Vec::new();
    for file in SHADERS {
        // The subgroup attention shaders are templates: only their expansions are kernels.
        if file.name.starts_with("attention_sg") {
            let forms = attention_sg::validation_sources(file);
            out.extend(forms.into_iter().map(|(n, src)| (n, validate_wgsl(&src))));
            continue;
        }
        // The subgroup matmul is validated as written and expanded (a 16 x 8 block, in its
        // plain and transposed forms).
        let mut bodies = vec![(String::new(), file.body.to_string())];
        if file.name == "matmul_sg" {
            let body = specialize(file.body, &[("SG", 8), ("TM", 16), ("TN", 8)]);
            for (ta, tb) in [(false, false), (true, true)] {
                bodies.push((
                    format!(" expanded 16x8 ta{ta} tb{tb}"),
                    matmul::expand_subgroup(&body, 8, 16, 8, ta, tb),
                ));
            }
        }
        if file.name.starts_with("conv2d_") {
            // The conv2d shaders' `//@row` lines expanded, at the largest tile.
            let body = specialize(file.body, &[("TM", 32)]);
            bodies.push((
                " expanded 32 rows".into(),
                conv2d::expand_rows(&body, 32, None),
            ));
            bodies.push((
                " expanded 32 rows subgroups 8".into(),
                conv2d::expand_rows(&body, 32, Some(8)),
            ));
        }
        for (bindings, (form, body)) in variants(file)
            .into_iter()
            .flat_map(|b| bodies.iter().map(move |x| (b.clone(), x)))
        {
            let src = assemble(body, &bindings);
            let desc: Vec<String> = bindings
                .iter()
                .map(|b| {
                    format!(
                        "{}:{}{}",
                        b.name,
                        b.storage.tag(),
                        if b.vec4 { "x4" } else { "" }
                    )
                })
                .collect();
            out.push((
                format!("{}{form} {}", file.name, desc.join(" ")),
                validate_wgsl(&src),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file in shaders/ is registered, and every variant of it parses and validates.
    #[test]
    fn every_shader_validates_with_naga() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/shaders");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".wgsl"))
            .collect();
        on_disk.sort();
        let mut registered: Vec<String> =
            SHADERS.iter().map(|s| format!("{}.wgsl", s.name)).collect();
        registered.sort();
        assert_eq!(
            on_disk, registered,
            "every shader file must be registered in SHADERS"
        );
        let results = validate_all();
        // f32, native f16 and packed f16 of each file at least.
        assert!(results.len() >= 3 * SHADERS.len());
        for (name, r) in results {
            if let Err(e) = r {
                panic!("{name} does not validate:\n{e}");
            }
        }
    }

    #[test]
    fn a_broken_shader_is_reported() {
        assert!(validate_wgsl("fn main() { let x: u32 = 1.5; }").is_err());
    }
}
