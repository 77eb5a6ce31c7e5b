//! `GPT2LMHeadModel` folders into [`Gpt`] and back: the name table between transformers' and
//! fitgrad's parameters, Conv1D weights stored (in, out) turned into Linear's (out, in), the
//! tied head, and the checks (missing, extra, wrong shape) that come before any device work.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::config::{gpt2_json, Gpt2Config};
use super::files::{read_tensors, FileTensor, INDEX_FILE, WEIGHTS_FILE};
use super::tokenizer::TOKENIZER_FILE;
use crate::checkpoint::{list, safetensors_bytes, Checkpoint, HostTensor, RawTensor};
use crate::nn::{Gpt, GptConfig, Module};
use crate::{DType, Device, Error, Result};

/// The prefix `GPT2LMHeadModel.save_pretrained` puts before the body's tensors (a `GPT2Model`
/// folder, such as the original GPT-2 uploads, has none).
const BODY_PREFIX: &str = "transformer.";
/// The head, tied to `wte.weight`; written by some exporters, omitted by save_pretrained.
const HEAD: &str = "lm_head.weight";

/// One parameter: its name in a Hugging Face file (without `transformer.`), in [`Gpt`], its
/// dims in the file, and whether the file stores it transposed (Conv1D's (in, out)).
struct Entry {
    hf: String,
    ours: String,
    dims: Vec<usize>,
    transposed: bool,
}

/// Every parameter of a GPT-2 of `cfg`, in [`Gpt::named_parameters`]' order.
fn entries(cfg: &GptConfig) -> Vec<Entry> {
    let c = cfg.dim;
    let e = |hf: String, ours: String, dims: &[usize], transposed| Entry {
        hf,
        ours,
        dims: dims.to_vec(),
        transposed,
    };
    let mut out = vec![
        e(
            "wte.weight".into(),
            "wte.weight".into(),
            &[cfg.vocab_size, c],
            false,
        ),
        e(
            "wpe.weight".into(),
            "wpe.weight".into(),
            &[cfg.context, c],
            false,
        ),
    ];
    for i in 0..cfg.layers {
        let (h, b) = (format!("h.{i}"), format!("blocks.{i}"));
        // (hf part, our part, out features, in features); norms have no in features.
        let linears = [
            ("attn.c_attn", "attn.qkv", 3 * c, c),
            ("attn.c_proj", "attn.proj", c, c),
            ("mlp.c_fc", "mlp.fc", 4 * c, c),
            ("mlp.c_proj", "mlp.proj", c, 4 * c),
        ];
        let norm = |hf: &str, ours: &str, out: &mut Vec<Entry>| {
            for p in ["weight", "bias"] {
                out.push(e(
                    format!("{h}.{hf}.{p}"),
                    format!("{b}.{ours}.{p}"),
                    &[c],
                    false,
                ));
            }
        };
        norm("ln_1", "ln1", &mut out);
        for (hf, ours, o, i) in &linears[..2] {
            out.push(e(
                format!("{h}.{hf}.weight"),
                format!("{b}.{ours}.weight"),
                &[*i, *o],
                true,
            ));
            out.push(e(
                format!("{h}.{hf}.bias"),
                format!("{b}.{ours}.bias"),
                &[*o],
                false,
            ));
        }
        norm("ln_2", "ln2", &mut out);
        for (hf, ours, o, i) in &linears[2..] {
            out.push(e(
                format!("{h}.{hf}.weight"),
                format!("{b}.{ours}.weight"),
                &[*i, *o],
                true,
            ));
            out.push(e(
                format!("{h}.{hf}.bias"),
                format!("{b}.{ours}.bias"),
                &[*o],
                false,
            ));
        }
    }
    for p in ["weight", "bias"] {
        out.push(e(format!("ln_f.{p}"), format!("ln_f.{p}"), &[c], false));
    }
    out
}

/// Whether `name` (without the prefix) is one of the causal-mask buffers older GPT-2 files hold
/// beside the parameters (`h.{i}.attn.bias`, `h.{i}.attn.masked_bias`): not weights, skipped.
fn is_buffer(name: &str) -> bool {
    let name = name.strip_prefix(BODY_PREFIX).unwrap_or(name);
    name.strip_prefix("h.")
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(i, rest)| {
            i.parse::<usize>().is_ok() && matches!(rest, "attn.bias" | "attn.masked_bias")
        })
}

/// The file that lists the weights: the single file, or the index of the shards.
fn weights_source(dir: &Path) -> &'static str {
    if dir.join(WEIGHTS_FILE).is_file() {
        WEIGHTS_FILE
    } else {
        INDEX_FILE
    }
}

/// A row-major (rows, cols) tensor transposed to (cols, rows).
fn transpose(t: &HostTensor) -> HostTensor {
    let (rows, cols) = (t.dims[0], t.dims[1]);
    let size = t.dtype.size();
    let mut out = vec![0u8; t.bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (from, to) = ((r * cols + c) * size, (c * rows + r) * size);
            out[to..to + size].copy_from_slice(&t.bytes[from..from + size]);
        }
    }
    HostTensor {
        dtype: t.dtype,
        dims: vec![cols, rows],
        bytes: out,
    }
}

/// A GPT-2 Hugging Face folder read and checked on the host: the model's configuration and its
/// weights under [`Gpt`]'s names, ready to [`build`](PretrainedGpt::build) on a device.
pub struct PretrainedGpt {
    /// The configuration from `config.json` (`dtype` is the one the weights were read as).
    pub config: GptConfig,
    /// The folder.
    pub dir: PathBuf,
    weights: Checkpoint,
}

impl PretrainedGpt {
    /// Reads `dir`'s `config.json` and weights (`model.safetensors` or a sharded index; names
    /// with or without `transformer.`; f32, f16 or bf16, converted to `dtype`).
    ///
    /// Errors, all before any device work, each an [`Error::Data`] naming the file (and the
    /// tensor): those of [`Gpt2Config::from_file`]; no weights file; a damaged or truncated
    /// file; a tensor missing, extra, of another shape than the config gives, or of a dtype
    /// other than F32 / F16 / BF16; a value that overflows f16 when `dtype` is f16; a
    /// `lm_head.weight` other than `wte.weight` (an untied head). An [`Error::Io`] when a file
    /// cannot be read.
    pub fn open(dir: &Path, dtype: DType) -> Result<PretrainedGpt> {
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(Error::Data {
                path: dir.display().to_string(),
                reason: "no config.json: not a Hugging Face model folder".into(),
            });
        }
        let mut cfg = Gpt2Config::from_file(&config_path)?.cfg;
        cfg.dtype = dtype;
        let mut found = read_tensors(dir, dtype, &is_buffer)?;
        // Names without the prefix; a name both with and without it is a conflict.
        let mut named: BTreeMap<String, FileTensor> = BTreeMap::new();
        for (name, t) in std::mem::take(&mut found) {
            let short = name.strip_prefix(BODY_PREFIX).unwrap_or(&name).to_string();
            if named.contains_key(&short) {
                return Err(Error::Data {
                    path: t.file,
                    reason: format!(
                        "tensor '{name}' is there both with and without '{BODY_PREFIX}'"
                    ),
                });
            }
            named.insert(short, t);
        }
        let source = |t: &FileTensor| t.file.clone();
        let mut weights = Checkpoint {
            source: dir.display().to_string(),
            ..Checkpoint::default()
        };
        let mut missing = Vec::new();
        for e in entries(&cfg) {
            let Some(t) = named.remove(&e.hf) else {
                missing.push(e.hf);
                continue;
            };
            if t.tensor.dims != e.dims {
                return Err(Error::Data {
                    path: source(&t),
                    reason: format!(
                        "tensor '{}' is {:?}, the config's model needs {:?} (vocab_size {}, \
                         n_positions {}, n_embd {})",
                        e.hf, t.tensor.dims, e.dims, cfg.vocab_size, cfg.context, cfg.dim
                    ),
                });
            }
            let tensor = if e.transposed {
                transpose(&t.tensor)
            } else {
                t.tensor
            };
            weights.tensors.insert(e.ours, tensor);
        }
        if !missing.is_empty() {
            return Err(Error::Data {
                path: dir.join(weights_source(dir)).display().to_string(),
                reason: format!(
                    "missing tensors {} for a {}-layer GPT-2",
                    list(&missing),
                    cfg.layers
                ),
            });
        }
        if let Some(head) = named.remove(HEAD) {
            if Some(&head.tensor) != weights.tensors.get("wte.weight") {
                return Err(Error::Data {
                    path: head.file,
                    reason: format!(
                        "tensor '{HEAD}' differs from wte.weight: an untied head, which fitgrad's \
                         GPT-2 does not have"
                    ),
                });
            }
        }
        if let Some(t) = named.values().next() {
            let extra: Vec<String> = named.keys().cloned().collect();
            return Err(Error::Data {
                path: t.file.clone(),
                reason: format!(
                    "tensors {} are not parameters of a {}-layer GPT-2",
                    list(&extra),
                    cfg.layers
                ),
            });
        }
        Ok(PretrainedGpt {
            config: cfg,
            dir: dir.to_path_buf(),
            weights,
        })
    }

    /// The model on `device` with these weights and `config` ([`Gpt::new`] starts in training
    /// mode, with no dropout unless `config` has it).
    ///
    /// Errors: an [`Error::Limit`] naming the largest tensor when it passes the adapter's
    /// storage-binding limit (before any device work: GPT-2 124M's f32 token embedding is
    /// 147 MiB, past lavapipe's 128 MiB; read it as f16), and those of [`Gpt::new`].
    pub fn build(&self, device: &Device) -> Result<Gpt> {
        let limit = device.info().limits.max_storage_buffer_binding_size;
        if let Some((name, t)) = self
            .weights
            .tensors
            .iter()
            .max_by_key(|(_, t)| t.bytes.len())
            .filter(|(_, t)| t.bytes.len() as u64 > limit)
        {
            return Err(Error::Limit {
                op: "PretrainedGpt::build",
                what: if name == "wte.weight" {
                    "the token embedding wte.weight (load it as f16, or use an adapter with larger bindings)"
                } else {
                    "a weight's size in bytes"
                },
                value: t.bytes.len() as u64,
                limit,
            });
        }
        let gpt = Gpt::new(device, self.config.clone())?;
        self.weights.apply_model(&gpt)?;
        Ok(gpt)
    }

    /// The weights on the host, by [`Gpt`]'s parameter names, in the dtype they were read as.
    pub fn host_weights(&self) -> &BTreeMap<String, HostTensor> {
        &self.weights.tensors
    }

    /// The folder's `tokenizer.json`, or an [`Error::Data`] naming the folder if it has none.
    pub fn tokenizer(&self) -> Result<super::Tokenizer> {
        super::tokenizer::folder_tokenizer(&self.dir)
    }
}

/// Writes `model` to `dir` as a `GPT2LMHeadModel` folder that transformers loads:
/// `config.json`, `model.safetensors` (`transformer.` names, Conv1D weights (in, out), the
/// head left tied, in the parameters' dtype) and, when given, a copy of `tokenizer` as
/// `tokenizer.json`. Each file is written atomically; `dir` is created if missing.
///
/// Errors: an [`Error::Io`] when `tokenizer` cannot be read (checked before the weights are
/// read back) or a file cannot be written; readback errors.
pub fn save_gpt2(model: &Gpt, dir: &Path, tokenizer: Option<&Path>) -> Result<()> {
    let tokenizer = tokenizer
        .map(|p| {
            std::fs::read(p).map_err(|source| Error::Io {
                path: p.display().to_string(),
                source,
            })
        })
        .transpose()?;
    let cfg = model.gpt_config();
    let params: BTreeMap<String, crate::Tensor> = model.named_parameters().into_iter().collect();
    let mut tensors = Vec::new();
    for e in entries(&cfg) {
        let p = params.get(&e.ours).ok_or_else(|| Error::InvalidArgument {
            op: "save_gpt2",
            reason: format!("the model has no parameter '{}'", e.ours),
        })?;
        let host = HostTensor::read(p)?;
        let host = if e.transposed { transpose(&host) } else { host };
        tensors.push((format!("{BODY_PREFIX}{}", e.hf), host));
    }
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
    let weights_path = dir.join(WEIGHTS_FILE);
    // transformers refuses a safetensors file whose metadata lacks format = "pt".
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let bytes = safetensors_bytes(&raw, &metadata, &weights_path.display().to_string())?;
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.display().to_string(),
        source,
    })?;
    crate::write_atomic(&weights_path, &bytes)?;
    let mut json = gpt2_json(&cfg);
    // GPT-2's one special token starts and ends texts; without a tokenizer there is none.
    let eot = tokenizer
        .as_deref()
        .and_then(|b| super::Tokenizer::from_bytes(b, "tokenizer.json").ok())
        .and_then(|t| t.token_id("<|endoftext|>"));
    json["bos_token_id"] = eot.into();
    json["eos_token_id"] = eot.into();
    json["torch_dtype"] = match cfg.dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
    }
    .into();
    let text = serde_json::to_string_pretty(&json).expect("a JSON value serializes");
    crate::write_atomic(&dir.join("config.json"), text.as_bytes())?;
    if let Some(bytes) = tokenizer {
        crate::write_atomic(&dir.join(TOKENIZER_FILE), &bytes)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_recognised() {
        assert!(is_buffer("h.0.attn.bias"));
        assert!(is_buffer("transformer.h.11.attn.masked_bias"));
        assert!(!is_buffer("h.0.attn.c_attn.bias"));
        assert!(!is_buffer("h.x.attn.bias"));
    }

    #[test]
    fn transpose_moves_elements() {
        let t = HostTensor::new(
            DType::F32,
            &[2, 3],
            bytemuck::cast_slice(&[0f32, 1., 2., 3., 4., 5.]).to_vec(),
        )
        .unwrap();
        let back = transpose(&t);
        assert_eq!(back.dims, [3, 2]);
        assert_eq!(back.to_f32(), [0., 3., 1., 4., 2., 5.]);
        assert_eq!(transpose(&back), t);
    }
}
