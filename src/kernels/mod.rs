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

pub(crate) mod elementwise;
pub(crate) mod reduce;
pub(crate) mod transpose;

use crate::device::{Device, Kernel};
use crate::{DType, Result};
use std::sync::Arc;

/// Invocations per workgroup for the elementwise family: 256 is the largest size every adapter
/// accepts (wgpu's default `max_compute_invocations_per_workgroup`).
pub(crate) const WG: u32 = 256;

/// How a tensor's elements are stored as the shader sees them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Storage {
    F32,
    /// `array<f16>` (needs SHADER_F16).
    F16,
    /// f16 pairs packed in `array<u32>`, unpacked to f32 (works everywhere).
    F16Packed,
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
        }
    }

    fn wgsl_type(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::F16 => "f16",
            Storage::F16Packed => "u32",
        }
    }
}

/// A tensor binding of a shader: its name in the body, storage, and whether it is written.
#[derive(Clone, Copy, Debug)]
pub struct Binding {
    pub name: &'static str,
    pub storage: Storage,
    pub write: bool,
}

/// The full WGSL of `body` with declarations and accessors for `bindings` (binding 1, 2, ...).
pub fn assemble(body: &str, bindings: &[Binding]) -> String {
    let mut src = String::new();
    if bindings.iter().any(|b| b.storage == Storage::F16) {
        // Must be the first line of the module.
        src.push_str("enable f16;\n");
    }
    for (i, b) in bindings.iter().enumerate() {
        // Inputs are declared read_write too: tensors are ranges of shared arena buffers, and
        // wgpu forbids one buffer bound read-only and writable in the same dispatch, while
        // several writable bindings of one buffer are allowed. Blocks never overlap.
        let (n, t) = (b.name, b.storage.wgsl_type());
        src += &format!(
            "@group(0) @binding({}) var<storage, read_write> {n}: array<{t}>;\n",
            i + 1
        );
        src += &match b.storage {
            Storage::F32 | Storage::F16 => {
                format!("fn ld_{n}(i: u32) -> f32 {{ return f32({n}[i]); }}\n")
            }
            Storage::F16Packed => {
                format!("fn ld_{n}(i: u32) -> f32 {{ return unpack2x16float({n}[i >> 1u])[i & 1u]; }}\n")
            }
        };
        if b.write {
            src += &match b.storage {
                Storage::F32 | Storage::F16 => format!(
                    "fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{\n  \
                       let i = 2u * w;\n  \
                       if (i < n) {{ {n}[i] = {t}(v0); }}\n  \
                       if (i + 1u < n) {{ {n}[i + 1u] = {t}(v1); }}\n}}\n"
                ),
                Storage::F16Packed => format!(
                    "fn st2_{n}(w: u32, v0: f32, v1: f32, n: u32) {{ {n}[w] = pack2x16float(vec2<f32>(v0, v1)); }}\n"
                ),
            };
        }
    }
    src.push_str(body);
    src
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
    body: include_str!("../../shaders/binary.wgsl"),
    bindings: &[("a", false), ("b", false), ("out", true)],
};
pub const UNARY: ShaderFile = ShaderFile {
    name: "unary",
    body: include_str!("../../shaders/unary.wgsl"),
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
    body: include_str!("../../shaders/transpose.wgsl"),
    bindings: &[("x", false), ("out", true)],
};

/// Every shader file, for validation without a GPU (unit test and `cargo xtask shaders`).
pub const SHADERS: &[ShaderFile] = &[BINARY, UNARY, FILL, REDUCE, TRANSPOSE];

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
        device.kernel(&key, || assemble(self.body, &self.with_storage(storage)))
    }
}

/// Workgroups for a two-elements-per-invocation kernel over `n` elements.
pub(crate) fn pair_groups(n: usize) -> u32 {
    (n.div_ceil(2) as u32).div_ceil(WG)
}

/// Every storage combination a shader file is built in at run time.
pub fn variants(file: &ShaderFile) -> Vec<Vec<Storage>> {
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
        _ => [F32, F16, F16Packed].iter().map(|&s| vec![s; n]).collect(),
    }
}

/// Parses and validates `src` with naga, with the capabilities fitgrad's shaders rely on
/// (f16 where the adapter offers it, and pack/unpack of f16 pairs in f32 everywhere).
pub fn validate_wgsl(src: &str) -> std::result::Result<(), String> {
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    Validator::new(
        ValidationFlags::all(),
        Capabilities::SHADER_FLOAT16 | Capabilities::SHADER_FLOAT16_IN_FLOAT32,
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
        for storage in variants(file) {
            let src = assemble(file.body, &file.with_storage(&storage));
            out.push((format!("{} {storage:?}", file.name), validate_wgsl(&src)));
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
        let mut registered: Vec<String> = SHADERS.iter().map(|s| format!("{}.wgsl", s.name)).collect();
        registered.sort();
        assert_eq!(on_disk, registered, "every shader file must be registered in SHADERS");
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
