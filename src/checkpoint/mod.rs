//! Checkpoints: a model's parameters, its optimizer's state and the trainer's progress in one
//! [safetensors](https://github.com/huggingface/safetensors) file, so PyTorch and numpy read it
//! as they read any other.
//!
//! A file holds tensors `model.<parameter name>` (`model.layers.0.weight`) and
//! `optim.<state name>` (`optim.0.exp_avg`), f32 or f16 with their shapes, little-endian and
//! row-major; 8-bit optimizer state's codes are 1-D U8 tensors (`optim.3.state1`, one byte per
//! element, beside their f32 `optim.3.absmax1`). Metadata are strings (the format allows no
//! other kind):
//!
//! | key | value |
//! |---|---|
//! | `format`, `version` | `fitgrad`, [`VERSION`] |
//! | `step`, `epoch`, `rng_state` | [`TrainingState`]'s fields, decimal |
//! | `scaler.scale`, `scaler.growth_tracker` | the loss scaler's state, when there is one |
//! | `optim.name`, `optim.step_count`, `optim.param_steps` | [`Optimizer::name`] and [`OptimizerState`]'s counters; steps comma-separated |
//! | `optim.hp.KEY` | [`Optimizer::hyperparameters`]: a resume with other values is refused |
//! | `extra.<key>` | [`TrainingState::extra`] |
//!
//! Saving goes through [`write_atomic`](crate::fsutil::write_atomic): the bytes land in a
//! temporary file that is flushed to disk and renamed over the old checkpoint, so a crash or a
//! kill mid-save leaves the previous checkpoint whole (and possibly a `.NAME.tmp-PID-RANDOM`
//! file beside it, which the next save to that path removes once PID no longer runs). Loading
//! checks everything a damaged or foreign file can get wrong and returns [`Error::Data`] naming
//! the file; it never panics on bad input.
//!
//! ```no_run
//! use fitgrad::checkpoint::{self, TrainingState};
//! use fitgrad::nn::{Activation, Mlp};
//! use fitgrad::optim::{AdamW, Optimizer};
//! # fn f(dev: &fitgrad::Device) -> fitgrad::Result<()> {
//! # use fitgrad::nn::Module;
//! let model = Mlp::new(dev, &[784, 128, 10], Activation::Relu, 0)?;
//! let mut opt = AdamW::new(model.parameters(), 1e-3)?;
//! let path = std::path::Path::new("run/last.safetensors");
//! checkpoint::save(path, &model, Some(&opt), &TrainingState::default().step(100))?;
//!
//! let ckpt = checkpoint::load(path)?;
//! ckpt.apply_model(&model)?; // in place: the optimizer keeps the same tensors
//! ckpt.apply_optimizer(&mut opt)?;
//! let state = ckpt.training_state()?;
//! # Ok(()) }
//! ```

mod format;
mod restore;

pub(crate) use format::{
    first_nonfinite, list, parse_safetensors, safetensors_bytes, RawTensor, Width,
};
pub use format::{HostTensor, NonFinite};

use crate::nn::Module;
use crate::optim::{Optimizer, OptimizerState};
use crate::tensor::MAX_RANK;
use crate::{DType, Device, Error, Result, Tensor};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

/// The layout version this code writes and the newest it reads.
pub const VERSION: u32 = 1;
/// The `format` metadata of fitgrad's checkpoints.
pub const FORMAT: &str = "fitgrad";
/// Prefix of the model's tensors.
pub const MODEL_PREFIX: &str = "model.";
/// Prefix of the optimizer's tensors and metadata.
pub const OPTIM_PREFIX: &str = "optim.";
/// Prefix of the optimizer's hyperparameters in the metadata
/// ([`Optimizer::hyperparameters`]).
pub const OPTIM_HP_PREFIX: &str = "optim.hp.";
const EXTRA_PREFIX: &str = "extra.";
/// Metadata keys of the model's configuration ([`Module::config`]).
pub const CONFIG_PREFIX: &str = "model.config.";
/// safetensors' own limit on the JSON header.
const MAX_HEADER: u64 = 100_000_000;
/// The largest shape or offset a header may hold: far past any real file (256 TiB), and far
/// enough below `usize::MAX` that safetensors' `offset + header length` cannot overflow.
const MAX_NUMBER: u64 = if usize::BITS >= 64 {
    1 << 48
} else {
    usize::MAX as u64 / 4
};

/// The loss scaler's state (mixed precision), built with [`ScalerState::new`].
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct ScalerState {
    /// The factor the loss is multiplied by.
    pub scale: f32,
    /// Steps since the scale last changed.
    pub growth_tracker: u64,
}

impl ScalerState {
    /// The state of a scaler at `scale` that last changed it `growth_tracker` steps ago.
    pub fn new(scale: f32, growth_tracker: u64) -> ScalerState {
        ScalerState {
            scale,
            growth_tracker,
        }
    }
}

/// Where training stands, besides the model and the optimizer. Built from [`Default`] with the
/// chained setters (new fields may be added).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct TrainingState {
    /// Optimizer steps taken.
    pub step: u64,
    /// Epochs completed.
    pub epoch: u64,
    /// The host generator's position ([`Rng::state`](crate::tensor::Rng::state)).
    pub rng_state: u64,
    /// The loss scaler's state, when training uses one.
    pub scaler: Option<ScalerState>,
    /// Anything else the application wants back (stored as `extra.<key>`).
    pub extra: BTreeMap<String, String>,
}

impl TrainingState {
    /// Sets the optimizer steps taken.
    pub fn step(mut self, step: u64) -> Self {
        self.step = step;
        self
    }

    /// Sets the epochs completed.
    pub fn epoch(mut self, epoch: u64) -> Self {
        self.epoch = epoch;
        self
    }

    /// Sets the host generator's position.
    pub fn rng_state(mut self, rng_state: u64) -> Self {
        self.rng_state = rng_state;
        self
    }

    /// Sets the loss scaler's state.
    pub fn scaler(mut self, scaler: ScalerState) -> Self {
        self.scaler = Some(scaler);
        self
    }

    /// Adds (or replaces) one application entry of [`extra`](Self::extra).
    pub fn extra(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.insert(key.into(), value.into());
        self
    }
}

/// One value a checkpoint must hold to be resumed by this run ([`Checkpoint::expect_config`],
/// [`Checkpoint::check_extra`]): the stored key, this run's value, and what to change when
/// they differ ("set --width as it was saved").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expect {
    /// The key (a model configuration key, or an extra entry's).
    pub key: String,
    /// This run's value, as stored.
    pub value: String,
    /// What the user changes when the values differ.
    pub change: String,
}

impl Expect {
    /// `key` must be `value`; else `change`.
    pub fn new(key: &str, value: impl ToString, change: impl Into<String>) -> Expect {
        Expect {
            key: key.into(),
            value: value.to_string(),
            change: change.into(),
        }
    }
}

/// A checkpoint on the host: tensors by name and string metadata, as in the file. Read with
/// [`load`], captured with [`Checkpoint::capture`], or built from [`Default`] by filling the
/// maps (new fields may be added).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Checkpoint {
    /// The tensors by their names in the file (`model.layers.0.weight`, `optim.0.exp_avg`).
    pub tensors: BTreeMap<String, HostTensor>,
    /// 1-D U8 tensors by name: the codes of 8-bit optimizer state (`optim.3.state1`).
    pub codes: BTreeMap<String, Vec<u8>>,
    /// The string metadata (the table of the module docs).
    pub metadata: BTreeMap<String, String>,
    /// The file it was read from, for error messages (empty for one captured in memory).
    pub source: String,
}

/// Saves `model`'s parameters, `optimizer`'s state and `state` to `path` atomically.
pub fn save(
    path: &Path,
    model: &dyn Module,
    optimizer: Option<&dyn Optimizer>,
    state: &TrainingState,
) -> Result<()> {
    Checkpoint::capture(model, optimizer, state)?.save(path)
}

/// Reads a checkpoint (any safetensors file of f32 and f16 tensors) to the host.
pub fn load(path: &Path) -> Result<Checkpoint> {
    if path.is_dir() {
        return Err(Error::Data {
            path: path.display().to_string(),
            reason: "a folder, not a checkpoint file: a sharded checkpoint (its index.json and \
                     one file per rank) is read by fitgrad::distributed::zero::load_checkpoint"
                .into(),
        });
    }
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    Checkpoint::from_bytes(&bytes, &path.display().to_string())
}

/// A checkpoint's metadata besides the optimizer's (the table of the module docs): format and
/// version, `model`'s configuration, the position in training, the scaler and the extras.
pub fn run_metadata(model: &dyn Module, state: &TrainingState) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for (k, v) in model.config() {
        m.insert(format!("{CONFIG_PREFIX}{k}"), v);
    }
    m.insert("format".into(), FORMAT.into());
    m.insert("version".into(), VERSION.to_string());
    m.insert("step".into(), state.step.to_string());
    m.insert("epoch".into(), state.epoch.to_string());
    m.insert("rng_state".into(), state.rng_state.to_string());
    if let Some(s) = &state.scaler {
        // Display of f32 is the shortest string that parses back to the same bits.
        m.insert("scaler.scale".into(), s.scale.to_string());
        m.insert("scaler.growth_tracker".into(), s.growth_tracker.to_string());
    }
    for (k, v) in &state.extra {
        m.insert(format!("{EXTRA_PREFIX}{k}"), v.clone());
    }
    m
}

/// The optimizer's metadata: its name, hyperparameters and the state's counters.
pub fn optimizer_metadata(
    opt: &dyn Optimizer,
    step_count: u64,
    param_steps: &[u64],
) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert("optim.name".into(), opt.name().into());
    for (k, v) in opt.hyperparameters() {
        m.insert(format!("{OPTIM_HP_PREFIX}{k}"), v);
    }
    m.insert("optim.step_count".into(), step_count.to_string());
    let steps: Vec<String> = param_steps.iter().map(u64::to_string).collect();
    m.insert("optim.param_steps".into(), steps.join(","));
    m
}

impl Checkpoint {
    /// Reads the model's parameters and the optimizer's state back to the host.
    pub fn capture(
        model: &dyn Module,
        optimizer: Option<&dyn Optimizer>,
        state: &TrainingState,
    ) -> Result<Checkpoint> {
        let mut c = Checkpoint::default();
        let mut put = |name: String, t: &Tensor| -> Result<()> {
            if c.tensors
                .insert(name.clone(), HostTensor::read(t)?)
                .is_some()
            {
                return Err(Error::InvalidArgument {
                    op: "checkpoint::save",
                    reason: format!("two tensors are named '{name}'"),
                });
            }
            Ok(())
        };
        // Buffers (batch norm's running statistics) are saved beside the parameters.
        for (name, t) in model
            .named_parameters()
            .into_iter()
            .chain(model.named_buffers())
        {
            put(format!("{MODEL_PREFIX}{name}"), &t)?;
        }
        c.metadata = run_metadata(model, state);
        if let Some(opt) = optimizer {
            let s = opt.checkpoint_state()?;
            for (name, t) in &s.tensors {
                put(format!("{OPTIM_PREFIX}{name}"), t)?;
            }
            for h in &s.host {
                let bytes = bytemuck::cast_slice(&h.values).to_vec();
                let name = format!("{OPTIM_PREFIX}{}", h.name);
                let t = HostTensor::new(DType::F32, &h.dims, bytes)?;
                if c.tensors.insert(name.clone(), t).is_some() {
                    return Err(Error::InvalidArgument {
                        op: "checkpoint::save",
                        reason: format!("two tensors are named '{name}'"),
                    });
                }
            }
            for code in &s.codes {
                let name = format!("{OPTIM_PREFIX}{}", code.name);
                let bytes = crate::optim::quant8::words_to_bytes(&code.words, code.len)?;
                if c.tensors.contains_key(&name) || c.codes.insert(name.clone(), bytes).is_some() {
                    return Err(Error::InvalidArgument {
                        op: "checkpoint::save",
                        reason: format!("two tensors are named '{name}'"),
                    });
                }
            }
            c.metadata
                .extend(optimizer_metadata(opt, s.step_count, &s.param_steps));
        }
        Ok(c)
    }

    /// The file's bytes in safetensors layout, the same bytes for the same checkpoint.
    ///
    /// The header is written here rather than by `safetensors::serialize`, which takes the
    /// metadata as a `HashMap` and writes it in that map's (per-process random) order. Here
    /// `__metadata__` comes first with its keys sorted, then the tensors in the order
    /// `safetensors::serialize` uses (larger dtype alignment first, then by name), their data
    /// back to back in that order, the header padded with spaces to a multiple of 8 bytes. With
    /// no metadata the bytes are exactly `safetensors::serialize`'s.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        use safetensors::View;
        let lens: Vec<[usize; 1]> = self.codes.values().map(|b| [b.len()]).collect();
        let tensors: Vec<RawTensor> = self
            .tensors
            .iter()
            .map(|(name, t)| RawTensor {
                name,
                dtype: t.dtype(),
                dims: &t.dims,
                bytes: &t.bytes,
            })
            .chain(
                self.codes
                    .iter()
                    .zip(&lens)
                    .map(|((name, b), len)| RawTensor {
                        name,
                        dtype: safetensors::Dtype::U8,
                        dims: len,
                        bytes: b,
                    }),
            )
            .collect();
        safetensors_bytes(&tensors, &self.metadata, &self.source)
    }

    /// Writes the checkpoint to `path` atomically (temporary file, fsync, rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = self.to_bytes().map_err(|e| match e {
            Error::Data { reason, .. } => Error::Data {
                path: path.display().to_string(),
                reason,
            },
            e => e,
        })?;
        crate::fsutil::write_atomic(path, &bytes)
    }

    /// Parses a safetensors file; `source` names it in errors.
    pub fn from_bytes(bytes: &[u8], source: &str) -> Result<Checkpoint> {
        let bad = |reason: String| Error::Data {
            path: source.to_string(),
            reason,
        };
        let (st, metadata) = parse_safetensors(bytes, source)?;
        let mut c = Checkpoint {
            source: source.to_string(),
            metadata,
            ..Default::default()
        };
        for (name, view) in st.iter() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::F16 => DType::F16,
                // 8-bit optimizer state's codes.
                safetensors::Dtype::U8
                    if name.starts_with(OPTIM_PREFIX) && view.shape().len() == 1 =>
                {
                    c.codes.insert(name.to_string(), view.data().to_vec());
                    continue;
                }
                other => {
                    return Err(bad(format!(
                        "tensor '{name}' has dtype {other}; fitgrad reads F32 and F16 (and 1-D U8 optimizer codes)"
                    )))
                }
            };
            let t = HostTensor::new(dtype, view.shape(), view.data().to_vec())
                .map_err(|e| bad(format!("tensor '{name}': {e}")))?;
            c.tensors.insert(name.to_string(), t);
        }
        if c.is_fitgrad() {
            let v = c.metadata.get("version").map(String::as_str).unwrap_or("");
            match v.parse::<u32>() {
                Ok(v) if v <= VERSION => {}
                Ok(v) => {
                    return Err(bad(format!(
                        "written by a newer fitgrad (checkpoint version {v}; this one reads up to {VERSION})"
                    )))
                }
                Err(_) => return Err(bad(format!("checkpoint version '{v}' is not a number"))),
            }
        }
        Ok(c)
    }

    /// Whether the metadata says fitgrad wrote the file (`format = "fitgrad"`).
    pub fn is_fitgrad(&self) -> bool {
        self.metadata.get("format").map(String::as_str) == Some(FORMAT)
    }

    fn err(&self, reason: String) -> Error {
        Error::Data {
            path: self.source.clone(),
            reason,
        }
    }

    fn not_fitgrad(&self, what: &str) -> String {
        if self.is_fitgrad() {
            String::new()
        } else {
            format!(
                " ({what}: the file was not written by fitgrad, it has no format = \"{FORMAT}\" metadata)"
            )
        }
    }

    /// The prefix of the model's tensors: `model.`, or none for a foreign file (a plain state
    /// dict) that has no `model.` tensor.
    fn model_prefix(&self) -> &'static str {
        let ours = self.tensors.keys().any(|k| k.starts_with(MODEL_PREFIX));
        if ours || self.is_fitgrad() {
            MODEL_PREFIX
        } else {
            ""
        }
    }
}
