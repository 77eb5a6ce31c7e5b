//! Every Linear of a model quantized for inference ([`quantize_model`], [`QuantizedModel`]),
//! the quantized [`Mlp`] ([`QuantizedMlp`]), and their safetensors files.
//!
//! A file holds, per quantized layer with name prefix `P` (`layers.0`), `P.weight_q` (I8, (out,
//! in): torch and numpy read it as int8), `P.weight_scale` (F32, (out)) and `P.bias` (F32, (out))
//! when the layer has one; the parameters that were not quantized under their own names (F32 or
//! F16); and string metadata: `format` = [`QUANTIZED_FORMAT`], `version`, `quantization` (the
//! rule, `W = weight_scale[:, None] * weight_q`) and the model's configuration as
//! `model.config.KEY`. It is written atomically, with the checkpoints' reproducible layout.

use super::prune::prunable;
use super::quantize::QuantizedLinear;
use crate::checkpoint::CONFIG_PREFIX;
use crate::checkpoint::{parse_safetensors, safetensors_bytes, HostTensor, RawTensor};
use crate::nn::{self, Mlp, Module};
use crate::train::{BatchSource, ClassBatch, Evaluation};
use crate::{Activation, DType, Device, Error, Result, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// The `format` metadata of a quantized model's file.
pub const QUANTIZED_FORMAT: &str = "fitgrad-int8";
/// The layout version written, and the newest read.
pub const QUANTIZED_VERSION: u32 = 1;

/// Every Linear weight of `model` quantized (see [`QuantizedModel::from_module`]).
pub fn quantize_model(model: &dyn Module) -> Result<QuantizedModel> {
    QuantizedModel::from_module(model)
}

/// A model's Linear layers in int8 by name prefix, with the parameters that were not
/// quantized and the model's configuration: what an inference forward needs.
pub struct QuantizedModel {
    /// (name prefix, layer), in the model's order (in name order after a load).
    layers: Vec<(String, QuantizedLinear)>,
    /// Parameters kept as they were (norms, embeddings, biases of no Linear), detached.
    rest: Vec<(String, Tensor)>,
    config: BTreeMap<String, String>,
}

/// `P.weight` -> `P`, a bare `weight` -> "".
fn weight_prefix(name: &str) -> Option<&str> {
    if name == "weight" {
        Some("")
    } else {
        name.strip_suffix(".weight")
    }
}

/// `P` + `.` + `leaf`, or `leaf` for the empty prefix.
fn join(prefix: &str, leaf: &str) -> String {
    if prefix.is_empty() {
        leaf.to_string()
    } else {
        format!("{prefix}.{leaf}")
    }
}

impl QuantizedModel {
    /// Quantizes each Linear weight of `model`: every parameter named `weight` or `P.weight`
    /// that [`prunable`] accepts (2-D, no embedding or norm), with `P.bias` as its bias when
    /// that is (out). The other parameters are kept as they are (shared with the model,
    /// detached). A model with no such weight is an [`Error::InvalidArgument`].
    pub fn from_module(model: &dyn Module) -> Result<QuantizedModel> {
        let params = model.named_parameters();
        let mut used = vec![false; params.len()];
        let mut layers = Vec::new();
        for (i, (name, w)) in params.iter().enumerate() {
            let Some(prefix) = weight_prefix(name) else {
                continue;
            };
            if !prunable(name, w.dims()) {
                continue;
            }
            let bias_name = join(prefix, "bias");
            let bias = params
                .iter()
                .position(|(n, b)| *n == bias_name && b.dims() == [w.dims()[0]]);
            layers.push((
                prefix.to_string(),
                QuantizedLinear::quantize(w, bias.map(|j| &params[j].1))?,
            ));
            used[i] = true;
            if let Some(j) = bias {
                used[j] = true;
            }
        }
        if layers.is_empty() {
            return Err(Error::InvalidArgument {
                op: "quantize_model",
                reason: "the model has no 2-D Linear weight ('weight' or 'NAME.weight')".into(),
            });
        }
        let rest = params
            .into_iter()
            .zip(used)
            .filter(|(_, u)| !u)
            .map(|((n, t), _)| (n, t.detach()))
            .collect();
        Ok(QuantizedModel {
            layers,
            rest,
            config: model.config().into_iter().collect(),
        })
    }

    /// The layer whose weight was `prefix.weight` (`layers.0`; "" for a bare Linear).
    pub fn layer(&self, prefix: &str) -> Option<&QuantizedLinear> {
        self.layers
            .iter()
            .find(|(p, _)| p == prefix)
            .map(|(_, l)| l)
    }

    /// Every quantized layer with its name prefix.
    pub fn layers(&self) -> &[(String, QuantizedLinear)] {
        &self.layers
    }

    /// The parameters that were not quantized, by name.
    pub fn rest(&self) -> &[(String, Tensor)] {
        &self.rest
    }

    /// The model's configuration ([`Module::config`]).
    pub fn config(&self) -> &BTreeMap<String, String> {
        &self.config
    }

    /// Device bytes of the quantized weights (packed int8 and scales).
    pub fn weight_bytes(&self) -> u64 {
        self.layers.iter().map(|(_, l)| l.weight_bytes()).sum()
    }

    /// Device bytes of everything: the quantized layers with their biases, and the rest.
    pub fn parameter_bytes(&self) -> u64 {
        let layers: u64 = self.layers.iter().map(|(_, l)| l.parameter_bytes()).sum();
        layers
            + self
                .rest
                .iter()
                .map(|(_, t)| t.allocated_bytes())
                .sum::<u64>()
    }

    /// The file's bytes (see the module docs); the same model gives the same bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        use safetensors::View;
        let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (prefix, l) in &self.layers {
            let (out, inp) = (l.out_features(), l.in_features());
            let q = l.int8()?;
            let f32_bytes = |t: &Tensor| -> Result<Vec<u8>> {
                Ok(bytemuck::cast_slice(&t.to_vec_f32()?).to_vec())
            };
            owned.push((
                join(prefix, "weight_q"),
                safetensors::Dtype::I8,
                vec![out, inp],
                bytemuck::cast_slice(&q).to_vec(),
            ));
            owned.push((
                join(prefix, "weight_scale"),
                safetensors::Dtype::F32,
                vec![out],
                f32_bytes(l.scale())?,
            ));
            if let Some(b) = l.bias() {
                owned.push((
                    join(prefix, "bias"),
                    safetensors::Dtype::F32,
                    vec![out],
                    f32_bytes(b)?,
                ));
            }
        }
        for (name, t) in &self.rest {
            let h = HostTensor::read(t)?;
            owned.push((name.clone(), (&h).dtype(), h.dims.clone(), h.bytes));
        }
        let tensors: Vec<RawTensor> = owned
            .iter()
            .map(|(name, dtype, dims, bytes)| RawTensor {
                name,
                dtype: *dtype,
                dims,
                bytes,
            })
            .collect();
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), QUANTIZED_FORMAT.to_string());
        meta.insert("version".to_string(), QUANTIZED_VERSION.to_string());
        meta.insert(
            "quantization".to_string(),
            "int8 symmetric per output channel: W = weight_scale[:, None] * weight_q".to_string(),
        );
        for (k, v) in &self.config {
            meta.insert(format!("{CONFIG_PREFIX}{k}"), v.clone());
        }
        safetensors_bytes(&tensors, &meta, "")
    }

    /// Writes the model to `path` atomically (temporary file, fsync, rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = self.to_bytes()?;
        crate::write_atomic(path, &bytes)
    }

    /// Reads a model [`QuantizedModel::save`] wrote onto `device`. A file that is not one
    /// (another format, a newer version, a missing scale, a bad dtype or shape) is an
    /// [`Error::Data`] naming it.
    pub fn load(device: &Device, path: &Path) -> Result<QuantizedModel> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        QuantizedModel::from_bytes(device, &bytes, &path.display().to_string())
    }

    /// [`QuantizedModel::load`] from the file's bytes; `source` names it in errors.
    pub fn from_bytes(device: &Device, bytes: &[u8], source: &str) -> Result<QuantizedModel> {
        let bad = |reason: String| Error::Data {
            path: source.to_string(),
            reason,
        };
        let (st, meta) = parse_safetensors(bytes, source)?;
        let format = meta.get("format").map(String::as_str).unwrap_or("");
        if format != QUANTIZED_FORMAT {
            return Err(bad(format!(
                "not a quantized fitgrad model (format '{format}', expected '{QUANTIZED_FORMAT}')"
            )));
        }
        let version = meta.get("version").and_then(|v| v.parse::<u32>().ok());
        if version.is_none_or(|v| v > QUANTIZED_VERSION) {
            return Err(bad(format!(
                "version {:?} is not one this fitgrad reads (up to {QUANTIZED_VERSION})",
                meta.get("version")
            )));
        }
        // safetensors lists names in no fixed order; sorted, a load is the same every time.
        let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
        names.sort();
        let mut used: Vec<String> = Vec::new();
        let mut layers = Vec::new();
        let f32_of = |name: &str, len: usize| -> Result<Vec<f32>> {
            let t = st
                .tensor(name)
                .map_err(|_| bad(format!("tensor '{name}' is missing")))?;
            if t.dtype() != safetensors::Dtype::F32 || t.shape() != [len] {
                return Err(bad(format!(
                    "tensor '{name}' is {} {:?}, expected F32 [{len}]",
                    t.dtype(),
                    t.shape()
                )));
            }
            Ok(bytemuck::pod_collect_to_vec(t.data()))
        };
        for name in &names {
            let prefix = if name == "weight_q" {
                ""
            } else {
                match name.strip_suffix(".weight_q") {
                    Some(p) => p,
                    None => continue,
                }
            };
            let q = st.tensor(name).map_err(|e| bad(e.to_string()))?;
            let &[out, inp] = q.shape() else {
                return Err(bad(format!("tensor '{name}' is {:?}, not 2-D", q.shape())));
            };
            if q.dtype() != safetensors::Dtype::I8 {
                return Err(bad(format!("tensor '{name}' is {}, not I8", q.dtype())));
            }
            let scale_name = join(prefix, "weight_scale");
            let bias_name = join(prefix, "bias");
            let scale = f32_of(&scale_name, out)?;
            let bias = if names.contains(&bias_name) {
                used.push(bias_name.clone());
                Some(f32_of(&bias_name, out)?)
            } else {
                None
            };
            let values: Vec<i8> = bytemuck::cast_slice(q.data()).to_vec();
            let layer =
                QuantizedLinear::from_int8(device, &values, &scale, bias.as_deref(), out, inp)
                    .map_err(|e| bad(format!("layer '{prefix}': {e}")))?;
            layers.push((prefix.to_string(), layer));
            used.push(name.clone());
            used.push(scale_name);
        }
        let mut rest = Vec::new();
        for name in names.iter().filter(|n| !used.contains(n)) {
            let t = st.tensor(name).map_err(|e| bad(e.to_string()))?;
            let dtype = match t.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::F16 => DType::F16,
                other => {
                    return Err(bad(format!(
                        "tensor '{name}' has dtype {other}; expected F32 or F16"
                    )))
                }
            };
            let h = HostTensor::new(dtype, t.shape(), t.data().to_vec())
                .map_err(|e| bad(format!("tensor '{name}': {e}")))?;
            rest.push((name.clone(), h.to_device(device)?));
        }
        if layers.is_empty() {
            return Err(bad("the file holds no quantized layer ('*weight_q')".into()));
        }
        let config = meta
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(CONFIG_PREFIX)?.to_string(), v.clone())))
            .collect();
        Ok(QuantizedModel {
            layers,
            rest,
            config,
        })
    }
}

/// An [`Mlp`] with int8 weights, for inference: the same layers and activation, each a
/// [`QuantizedLinear`].
pub struct QuantizedMlp {
    model: QuantizedModel,
    /// `layers.0`, `layers.1`, ... in order.
    order: Vec<usize>,
    act: Activation,
}

impl QuantizedMlp {
    /// Quantizes every layer of `mlp`.
    pub fn from_mlp(mlp: &Mlp) -> Result<QuantizedMlp> {
        QuantizedMlp::from_model(quantize_model(mlp)?)
    }

    /// The Mlp in a quantized model: its configuration must be an mlp's (`kind`,
    /// `activation`) and its layers `layers.0 ..` must chain (each one's output the next one's
    /// input); otherwise an [`Error::InvalidArgument`].
    pub fn from_model(model: QuantizedModel) -> Result<QuantizedMlp> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "QuantizedMlp::from_model",
            reason,
        };
        let cfg = model.config();
        if cfg.get("kind").map(String::as_str) != Some("mlp") {
            return Err(bad(format!(
                "the model's configuration is not an mlp's (kind {:?})",
                cfg.get("kind")
            )));
        }
        let act: Activation = cfg
            .get("activation")
            .ok_or_else(|| bad("no activation in the configuration".into()))?
            .parse()?;
        let order: Vec<usize> = (0..)
            .map_while(|i| {
                let name = format!("layers.{i}");
                model.layers.iter().position(|(p, _)| *p == name)
            })
            .collect();
        if order.len() != model.layers.len() || !model.rest.is_empty() {
            return Err(bad(
                "an mlp holds layers.0, layers.1, ... and nothing else".into()
            ));
        }
        for w in order.windows(2) {
            let (a, b) = (&model.layers[w[0]].1, &model.layers[w[1]].1);
            if a.out_features() != b.in_features() {
                return Err(bad(format!(
                    "layer widths do not chain: {} outputs into {} inputs",
                    a.out_features(),
                    b.in_features()
                )));
            }
        }
        Ok(QuantizedMlp { model, order, act })
    }

    /// Reads a file [`QuantizedMlp::save`] (or [`QuantizedModel::save`] of an Mlp) wrote.
    pub fn load(device: &Device, path: &Path) -> Result<QuantizedMlp> {
        QuantizedMlp::from_model(QuantizedModel::load(device, path)?).map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => Error::Data {
                path: path.display().to_string(),
                reason,
            },
            e => e,
        })
    }

    /// Writes the model to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        self.model.save(path)
    }

    /// The layers and configuration.
    pub fn model(&self) -> &QuantizedModel {
        &self.model
    }

    /// The layers, input first.
    pub fn layers(&self) -> impl Iterator<Item = &QuantizedLinear> {
        self.order.iter().map(|&i| &self.model.layers[i].1)
    }

    /// Logits (B, out) from x (B, in), in x's dtype: the activation after every layer but
    /// the last, as in the f32 model.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let last = self.order.len() - 1;
        let mut h = x.clone();
        for (i, layer) in self.layers().enumerate() {
            let act = if i == last {
                Activation::None
            } else {
                self.act
            };
            h = layer.forward_act(&h, act)?;
        }
        Ok(h)
    }

    /// Mean cross-entropy and accuracy over `data`, in batches of `batch` samples.
    pub fn evaluate<D>(&self, data: &D, batch: usize) -> Result<Evaluation>
    where
        D: BatchSource<Batch = ClassBatch>,
    {
        let _g = crate::no_grad();
        let dev = self.model.layers[0].1.scale().device().clone();
        let idx: Vec<usize> = (0..data.len()).collect();
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for chunk in idx.chunks(batch.max(1)) {
            let b = data.batch(chunk)?;
            let logits = self.forward(&b.x.to_device(&dev)?)?;
            loss += nn::cross_entropy(&logits, &b.y)?.item()? as f64 * chunk.len() as f64;
            correct += nn::correct(&logits, &b.y)?;
        }
        let n = data.len().max(1) as f64;
        Ok(Evaluation {
            loss: (loss / n) as f32,
            accuracy: Some((correct as f64 / n) as f32),
        })
    }
}
