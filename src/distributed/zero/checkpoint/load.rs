//! Reading a sharded checkpoint back: the index checked, every rank file checked against it,
//! and the shards put together as the one-file checkpoint of the same run.

use super::{
    hex, params_hash, ShardIndex, INDEX, INDEX_FORMAT, INDEX_VERSION, SHARD_OPTIM, SHARD_PARAMS,
};
use crate::checkpoint::{self, Checkpoint, HostTensor, MODEL_PREFIX, OPTIM_PREFIX};
use crate::hash::Fnv1a;
use crate::{DType, Error, Result};
use std::path::{Component, Path};

/// A checkpoint file, or a sharded checkpoint's folder ([`load_sharded`]).
pub fn load_checkpoint(path: &Path) -> Result<Checkpoint> {
    match path.is_dir() {
        true => load_sharded(path),
        false => checkpoint::load(path),
    }
}

/// Reads and checks `dir`'s index (every error an [`Error::Data`] naming it).
pub fn read_index(dir: &Path) -> Result<ShardIndex> {
    let path = dir.join(INDEX);
    let bad = |reason: String| crate::error::data_err(&path, reason);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(bad(format!(
                "missing: {} is not a sharded checkpoint (its index is written last, so a save \
                 that never finished has none)",
                dir.display()
            )))
        }
        Err(source) => {
            return Err(Error::Io {
                path: path.display().to_string(),
                source,
            })
        }
    };
    let index: ShardIndex = serde_json::from_slice(&bytes)
        .map_err(|e| bad(format!("not a sharded checkpoint's index: {e}")))?;
    if index.format != INDEX_FORMAT {
        return Err(bad(format!(
            "format '{}', not '{INDEX_FORMAT}'",
            index.format
        )));
    }
    if index.version > INDEX_VERSION {
        return Err(bad(format!(
            "written by a newer fitgrad (index version {}; this one reads up to {INDEX_VERSION})",
            index.version
        )));
    }
    if index.ranks == 0 || index.files.len() != index.ranks {
        return Err(bad(format!(
            "{} rank files for {} ranks",
            index.files.len(),
            index.ranks
        )));
    }
    let lens = group_lens(&index);
    if lens.iter().try_fold(0usize, |a, &l| a.checked_add(l)) != Some(index.shard_len) {
        return Err(bad(format!(
            "groups of {:?} elements make no shard of {}",
            index.groups, index.shard_len
        )));
    }
    let padded: Vec<usize> = lens
        .iter()
        .map(|&len| {
            index
                .ranks
                .checked_mul(len)
                .filter(|&p| p > 0 && p <= 1 << 48)
                .ok_or_else(|| bad(format!("a shard of {len} elements")))
        })
        .collect::<Result<_>>()?;
    // Each parameter's range of its group's flat buffer, to find overlaps.
    let mut ranges = Vec::with_capacity(index.params.len());
    for p in &index.params {
        let numel = p
            .dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .filter(|_| p.dims.len() <= crate::tensor::MAX_RANK)
            .ok_or_else(|| bad(format!("parameter '{}' has shape {:?}", p.name, p.dims)))?;
        if p.dtype != "f32" && p.dtype != "f16" {
            return Err(bad(format!(
                "parameter '{}' has dtype '{}' (f32 or f16)",
                p.name, p.dtype
            )));
        }
        let Some(&padded) = padded.get(p.group) else {
            return Err(bad(format!(
                "parameter '{}' is in group {} of {}",
                p.name,
                p.group,
                padded.len()
            )));
        };
        if p.offset.checked_add(numel).is_none_or(|e| e > padded) {
            return Err(bad(format!(
                "parameter '{}' at offset {} lies past the {padded} elements of its group's \
                 shards",
                p.name, p.offset
            )));
        }
        ranges.push((p.group, p.offset, p.offset + numel, &p.name));
    }
    ranges.sort();
    if let Some(w) = ranges
        .windows(2)
        .find(|w| w[0].0 == w[1].0 && w[1].1 < w[0].2)
    {
        return Err(bad(format!(
            "parameter '{}' at offset {} overlaps '{}'",
            w[1].3, w[1].1, w[0].3
        )));
    }
    if params_hash(&index.params) != index.params_hash {
        return Err(bad(format!(
            "its parameter list hashes to {}, it records {}: edited or damaged",
            params_hash(&index.params),
            index.params_hash
        )));
    }
    for (r, f) in index.files.iter().enumerate() {
        let plain = Path::new(&f.file)
            .components()
            .all(|c| matches!(c, Component::Normal(_)));
        if f.rank != r || !plain || f.file.is_empty() {
            return Err(bad(format!(
                "rank file {r} is '{}' of rank {}: not a file of this folder for rank {r}",
                f.file, f.rank
            )));
        }
    }
    Ok(index)
}

/// Each group's shard length (one group of the whole shard without groups).
fn group_lens(index: &ShardIndex) -> Vec<usize> {
    match index.groups.is_empty() {
        true => vec![index.shard_len],
        false => index.groups.clone(),
    }
}

/// Reads a sharded checkpoint's folder and puts it together as the one-file checkpoint of the
/// same run (see the module docs); its `source` is the index. A missing, truncated, damaged or
/// foreign rank file is an [`Error::Data`] naming that file.
pub fn load_sharded(dir: &Path) -> Result<Checkpoint> {
    let index = read_index(dir)?;
    let index_path = dir.join(INDEX);
    let n = index.shard_len;
    let mut shards = Vec::with_capacity(index.ranks);
    for f in &index.files {
        let path = dir.join(&f.file);
        let bad = |reason: String| crate::error::data_err(&path, reason);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(bad(format!(
                    "missing: {} names it as rank {}'s shard of {}; every rank's file is \
                     needed to resume",
                    index_path.display(),
                    f.rank,
                    index.ranks
                )))
            }
            Err(source) => {
                return Err(Error::Io {
                    path: path.display().to_string(),
                    source,
                })
            }
        };
        if bytes.len() as u64 != f.bytes {
            return Err(bad(format!(
                "{} bytes, the index says {}: truncated, or written by another save",
                bytes.len(),
                f.bytes
            )));
        }
        let hash = hex(Fnv1a::default().bytes(&bytes).finish());
        if hash != f.fnv1a64 {
            return Err(bad(format!(
                "its bytes hash to {hash}, the index says {}: damaged, or written by another save",
                f.fnv1a64
            )));
        }
        let c = Checkpoint::from_bytes(&bytes, &path.display().to_string())?;
        let meta = |k: &str| c.metadata.get(k).map(String::as_str).unwrap_or("");
        let want = [
            ("shard.rank", f.rank.to_string()),
            ("shard.ranks", index.ranks.to_string()),
            ("shard.len", n.to_string()),
            ("shard.save", index.save.to_string()),
            ("shard.params_hash", index.params_hash.clone()),
        ];
        if let Some((k, v)) = want.iter().find(|(k, v)| meta(k) != v.as_str()) {
            return Err(bad(format!(
                "{k} is '{}', the index says '{v}': a shard of another save{}",
                meta(k),
                if *k == "shard.params_hash" {
                    " (of other parameters)"
                } else {
                    ""
                }
            )));
        }
        for (name, t) in &c.tensors {
            let ours = name == SHARD_PARAMS || name.starts_with(SHARD_OPTIM);
            if ours && (t.dtype != DType::F32 || t.dims != [n]) {
                return Err(bad(format!(
                    "tensor '{name}' is {} {:?}, a shard is f32 [{n}]",
                    t.dtype, t.dims
                )));
            }
        }
        if !c.tensors.contains_key(SHARD_PARAMS) {
            return Err(bad(format!("no tensor '{SHARD_PARAMS}'")));
        }
        shards.push(c);
    }
    // Each group's flat buffer of the tensor `name`: every rank's shard of it in rank order.
    let lens = group_lens(&index);
    let flat = |name: &str| -> Vec<Vec<f32>> {
        let all: Vec<Option<Vec<f32>>> = shards
            .iter()
            .map(|s| s.tensors.get(name).map(HostTensor::to_f32))
            .collect();
        let mut start = 0;
        lens.iter()
            .map(|&len| {
                let mut out = Vec::with_capacity(len * shards.len());
                for v in &all {
                    match v {
                        Some(v) => out.extend_from_slice(&v[start..start + len]),
                        None => out.resize(out.len() + len, 0.0),
                    }
                }
                start += len;
                out
            })
            .collect()
    };
    let bad = |reason: String| crate::error::data_err(&index_path, reason);
    let steps = index
        .metadata
        .get("optim.param_steps")
        .map(String::as_str)
        .unwrap_or("");
    let param_steps: Vec<u64> = steps
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u64>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| {
            bad(format!(
                "optim.param_steps = '{steps}' is not a list of counts"
            ))
        })?;
    if param_steps.len() != index.params.len() {
        return Err(bad(format!(
            "optim.param_steps has {} counts for {} parameters",
            param_steps.len(),
            index.params.len()
        )));
    }
    let mut out = Checkpoint {
        metadata: index.metadata.clone(),
        source: index_path.display().to_string(),
        ..Checkpoint::default()
    };
    let values = flat(SHARD_PARAMS);
    for p in &index.params {
        let v = &values[p.group][p.offset..p.offset + p.dims.iter().product::<usize>()];
        let t = match p.dtype.as_str() {
            "f16" => {
                let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
                HostTensor::new(DType::F16, &p.dims, bytemuck::cast_slice(&h).to_vec())?
            }
            _ => HostTensor::new(DType::F32, &p.dims, bytemuck::cast_slice(v).to_vec())?,
        };
        out.tensors.insert(format!("{MODEL_PREFIX}{}", p.name), t);
    }
    for (name, t) in &shards[0].tensors {
        if name.starts_with(MODEL_PREFIX) && out.tensors.insert(name.clone(), t.clone()).is_some() {
            return Err(bad(format!("'{name}' is both a parameter and a buffer")));
        }
    }
    let mut state_names: Vec<&str> = shards
        .iter()
        .flat_map(|s| s.tensors.keys())
        .filter_map(|k| k.strip_prefix(SHARD_OPTIM))
        .collect();
    state_names.sort_unstable();
    state_names.dedup();
    for name in state_names {
        let v = flat(&format!("{SHARD_OPTIM}{name}"));
        for (i, p) in index.params.iter().enumerate() {
            if param_steps[i] > 0 {
                let s = &v[p.group][p.offset..p.offset + p.dims.iter().product::<usize>()];
                let t = HostTensor::new(DType::F32, &p.dims, bytemuck::cast_slice(s).to_vec())?;
                out.tensors.insert(format!("{OPTIM_PREFIX}{i}.{name}"), t);
            }
        }
    }
    Ok(out)
}
