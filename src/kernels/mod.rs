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
mod shaders;
pub(crate) mod softmax;
pub(crate) mod transpose;
mod validate;

pub(crate) use operand::Operand;
pub use shaders::*;
pub(crate) use validate::storage_variants;
pub use validate::validate_all;
#[cfg(test)]
pub(crate) use validate::{validate_wgsl, variants};

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
                 return vec4<f32>(fg16_unpack2(w.x), fg16_unpack2(w.y)); }}\n",
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
                "fn ld_{n}(i: u32) -> f32 {{ return fg16_to_f32({} >> (16u * (i & 1u))); }}\n",
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
    // f32 to the stored type: native f16 by fitgrad's integer code too (include/f16_bits.wgsl),
    // as the spec leaves `f16(v)` of NaN and of values past f16's range open.
    let conv = |v: &str| match b.storage {
        Storage::F16 => format!("fg16_h({v})"),
        _ => format!("{t}({v})"),
    };
    let conv4 = |v: &str| match b.storage {
        Storage::F16 => format!("fg16_h4({v})"),
        _ => format!("vec4<{t}>({v})"),
    };
    s += &match (b.vec4, b.storage) {
        (true, Storage::F16Packed) => format!(
            "fn st4_{n}(i: u32, v: vec4<f32>) {{ {}; }}\n\
             fn st_{n}(i: u32, v: f32) {{\n  var w = ld4_{n}(i & ~3u);\n  w[i & 3u] = v;\n  st4_{n}(i & ~3u, w);\n}}\n\
             fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{ {}; }}\n",
            wr("i >> 2u", "vec2<u32>(fg16_pack2(v.xy), fg16_pack2(v.zw))"),
            wrc("w >> 1u", "w & 1u", "fg16_pack2(vec2<f32>(v0, v1))")
        ),
        (true, _) => format!(
            "fn st4_{n}(i: u32, v: vec4<f32>) {{ {}; }}\n\
             fn st_{n}(i: u32, v: f32) {{ {}; }}\n\
             fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{\n  \
               let i = 2u * w;\n  \
               if (i < n) {{ st_{n}(i, v0); }}\n  \
               if (i + 1u < n) {{ st_{n}(i + 1u, v1); }}\n}}\n",
            wr("i >> 2u", &conv4("v")),
            wrc("i >> 2u", "i & 3u", &conv("v"))
        ),
        (false, Storage::F16Packed) => format!(
            "fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{ {}; }}\n\
             fn st4_{n}(i: u32, v: vec4<f32>) {{ {}; {}; }}\n\
             fn st_{n}(i: u32, v: f32) {{ {}; }}\n",
            wr("w", "fg16_pack2(vec2<f32>(v0, v1))"),
            wr("i >> 1u", "fg16_pack2(v.xy)"),
            wr("(i >> 1u) + 1u", "fg16_pack2(v.zw)"),
            wr(
                "i >> 1u",
                &format!("fg16_set_half({}, i & 1u, v)", rd("i >> 1u"))
            )
        ),
        (false, _) => format!(
            "fn st_{n}(i: u32, v: f32) {{ {}; }}\n\
             fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{\n  \
               let i = 2u * w;\n  \
               if (i < n) {{ {}; }}\n  \
               if (i + 1u < n) {{ {}; }}\n}}\n\
             fn st4_{n}(i: u32, v: vec4<f32>) {{ {}; {}; {}; {}; }}\n",
            wr("i", &conv("v")),
            wr("i", &conv("v0")),
            wr("i + 1u", &conv("v1")),
            wr("i", &conv("v.x")),
            wr("i + 1u", &conv("v.y")),
            wr("i + 2u", &conv("v.z")),
            wr("i + 3u", &conv("v.w"))
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
    if bindings
        .iter()
        .any(|b| matches!(b.storage, Storage::F16Packed | Storage::F16))
    {
        // The f16 accessors convert on the bits (see the file).
        src.push_str(include_str!("../../shaders/include/f16_bits.wgsl"));
    }
    if bindings
        .iter()
        .any(|b| b.storage == Storage::F16 && b.write)
    {
        // Native f16 stores: rounded by the integer code, then converted exactly (the f32 holds
        // an f16 value). naga 30 has no 16-bit bitcast, so a NaN's payload and sign are the
        // hardware conversion's: the one thing the native path leaves to the driver.
        src.push_str(
            "fn fg16_h(v: f32) -> f16 { return f16(fg16_to_f32(fg16_from_f32(v))); }\n\
             fn fg16_h4(v: vec4<f32>) -> vec4<f16> {\n  \
               return vec4<f16>(fg16_h(v.x), fg16_h(v.y), fg16_h(v.z), fg16_h(v.w));\n}\n",
        );
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
