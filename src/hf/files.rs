//! The weights of a Hugging Face folder on the host: `model.safetensors`, or the shards a
//! `model.safetensors.index.json` lists, each tensor converted from f32, f16 or bf16 to the
//! dtype asked for. Every damaged file, dtype or overflow is an [`Error::Data`] naming the file
//! and the tensor, before any device work.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::checkpoint::{
    first_nonfinite, parse_safetensors, safetensors_bytes, HostTensor, RawTensor, Width,
};
use crate::{DType, Error, Result};

/// The single-file weights' name.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of sharded weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One tensor as read from its file, in the dtype asked for.
#[derive(Clone, Debug)]
pub struct FileTensor {
    /// The file it was read from (errors about it name this file).
    pub file: String,
    /// The values, little-endian, row-major.
    pub tensor: HostTensor,
}

/// Every tensor of a folder's weights by its name in the files.
pub type Tensors = BTreeMap<String, FileTensor>;

/// The shard of each tensor, by name, as an index lists them.
type ShardIndex = BTreeMap<String, String>;

/// The weight files of `dir`: `[model.safetensors]`, or the shards of the index in order.
/// Errors: neither file ([`Error::Data`] naming the folder), an index that is not JSON or has
/// no `weight_map`, or a shard name with a path in it.
pub fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<ShardIndex>)> {
    let single = dir.join(WEIGHTS_FILE);
    if single.is_file() {
        return Ok((vec![single], None));
    }
    let index = dir.join(INDEX_FILE);
    if !index.is_file() {
        return Err(Error::Data {
            path: dir.display().to_string(),
            reason: format!(
                "no {WEIGHTS_FILE} or {INDEX_FILE} in the folder (fitgrad reads safetensors \
                 weights; a pytorch_model.bin can be converted with transformers' save_pretrained)"
            ),
        });
    }
    let source = index.display().to_string();
    let bad = |reason: String| Error::Data {
        path: source.clone(),
        reason,
    };
    let json = super::config::read_json(&index)?;
    let map = json
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no weight_map object".into()))?;
    let mut by_name = BTreeMap::new();
    let mut files: Vec<String> = Vec::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("tensor '{name}': the file {file} is not a name")))?;
        if file.contains(['/', '\\']) || file == ".." || file.is_empty() {
            return Err(bad(format!(
                "tensor '{name}': shard '{file}' is not a file name in the folder"
            )));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
        by_name.insert(name.clone(), file.to_string());
    }
    files.sort();
    Ok((files.iter().map(|f| dir.join(f)).collect(), Some(by_name)))
}

/// Reads every tensor of `dir`'s weights converted to `dtype`, except those `skip` names (buffers
/// such as GPT-2's causal masks, of any dtype). With an index, each tensor must be in the shard
/// it names and each shard's tensors in the index.
pub fn read_tensors(dir: &Path, dtype: DType, skip: &dyn Fn(&str) -> bool) -> Result<Tensors> {
    let (files, index) = weight_files(dir)?;
    let mut out = Tensors::new();
    let mut seen = std::collections::BTreeSet::new();
    for path in &files {
        let source = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| Error::Io {
            path: source.clone(),
            source: e,
        })?;
        let (st, _) = parse_safetensors(&bytes, &source)?;
        let file_name = path.file_name().map(|f| f.to_string_lossy().into_owned());
        for (name, view) in st.tensors() {
            let bad = |reason: String| Error::Data {
                path: source.clone(),
                reason: format!("tensor '{name}': {reason}"),
            };
            if let Some(index) = &index {
                if index.get(&name) != file_name.as_ref() {
                    return Err(bad(format!(
                        "the index places it in {}",
                        index
                            .get(&name)
                            .map_or("no shard".into(), |f| format!("'{f}'"))
                    )));
                }
            }
            if !seen.insert(name.clone()) {
                return Err(bad("it is in two shards".into()));
            }
            if skip(&name) {
                continue;
            }
            let tensor = convert(view.dtype(), view.shape(), view.data(), dtype).map_err(bad)?;
            out.insert(
                name,
                FileTensor {
                    file: source.clone(),
                    tensor,
                },
            );
        }
    }
    if let Some(index) = &index {
        if let Some((name, file)) = index.iter().find(|(n, _)| !seen.contains(*n)) {
            return Err(Error::Data {
                path: dir.join(file).display().to_string(),
                reason: format!("tensor '{name}': the index places it here, the file lacks it"),
            });
        }
    }
    Ok(out)
}

/// `bytes` of a `from` tensor of `dims` as `to`; the reason of a refusal.
pub(crate) fn convert(
    from: safetensors::Dtype,
    dims: &[usize],
    bytes: &[u8],
    to: DType,
) -> std::result::Result<HostTensor, String> {
    use safetensors::Dtype as S;
    // A model holding NaN or infinities evaluates to a NaN loss that reads as a result: refused
    // here, on the bits, for every float dtype a folder or adapter can hold.
    let width = match from {
        S::F32 => Some(Width::F32),
        S::F16 => Some(Width::F16),
        S::BF16 => Some(Width::BF16),
        _ => None,
    };
    if let Some((i, bad)) = width.and_then(|w| first_nonfinite(w, bytes)) {
        return Err(format!(
            "element {i} is {bad}: a model that cannot compute (a diverged or damaged save); \
             use a folder of finite weights"
        ));
    }
    let values: Vec<f32> = match from {
        S::F32 if to == DType::F32 => {
            return HostTensor::new(to, dims, bytes.to_vec()).map_err(|e| e.to_string())
        }
        S::F16 if to == DType::F16 => {
            return HostTensor::new(to, dims, bytes.to_vec()).map_err(|e| e.to_string())
        }
        S::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        S::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        // bf16 is the high half of an f32: exact in f32.
        S::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "dtype {other} is not one fitgrad loads (F32, F16 or BF16)"
            ))
        }
    };
    let out = match to {
        DType::F32 => bytemuck::cast_slice(&values).to_vec(),
        DType::F16 => {
            let halves: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
            // Rounded to infinity although finite: past 65504 by more than half a step.
            if let Some(i) =
                (0..values.len()).find(|&i| values[i].is_finite() && halves[i].is_infinite())
            {
                return Err(format!(
                    "element {i} = {} overflows f16 (largest {}); load it as f32",
                    values[i],
                    half::f16::MAX
                ));
            }
            bytemuck::cast_slice(&halves).to_vec()
        }
    };
    HostTensor::new(to, dims, out).map_err(|e| e.to_string())
}

/// Writes `tensors` to `dir/file` as a safetensors file transformers and PEFT read (metadata
/// `format = "pt"`, which transformers requires), creating `dir`, atomically.
pub(crate) fn write_safetensors(
    dir: &Path,
    file: &str,
    tensors: &[(String, HostTensor)],
) -> Result<()> {
    let raw: Vec<RawTensor> = tensors
        .iter()
        .map(|(name, t)| RawTensor {
            name,
            dtype: match t.dtype {
                DType::F32 => safetensors::Dtype::F32,
                DType::F16 => safetensors::Dtype::F16,
            },
            dims: &t.dims,
            bytes: &t.bytes,
        })
        .collect();
    let path = dir.join(file);
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors_bytes(&raw, &metadata, &path.display().to_string())?;
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.display().to_string(),
        source,
    })?;
    crate::write_atomic(&path, &bytes)
}
