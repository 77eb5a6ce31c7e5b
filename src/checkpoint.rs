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

/// A tensor's bytes on the host: little-endian, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// The element type of `bytes`.
    pub dtype: DType,
    /// The tensor's dims.
    pub dims: Vec<usize>,
    /// `numel * dtype.size()` bytes, little-endian, row-major.
    pub bytes: Vec<u8>,
}

impl HostTensor {
    /// Checks that `bytes` holds exactly `dims` elements of `dtype`.
    pub fn new(dtype: DType, dims: &[usize], bytes: Vec<u8>) -> Result<HostTensor> {
        let want = dims.iter().try_fold(dtype.size(), |n, &d| n.checked_mul(d));
        if want != Some(bytes.len()) {
            return Err(Error::InvalidArgument {
                op: "HostTensor::new",
                reason: format!(
                    "{} bytes do not hold a {dtype} tensor of shape {dims:?}",
                    bytes.len()
                ),
            });
        }
        Ok(HostTensor {
            dtype,
            dims: dims.to_vec(),
            bytes,
        })
    }

    /// Reads a tensor back from its device (after all recorded work).
    pub fn read(t: &Tensor) -> Result<HostTensor> {
        let bytes = t.read_bytes()?;
        HostTensor::new(t.dtype(), t.dims(), bytes)
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// The values as f32 whatever the dtype.
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(&self.bytes),
            DType::F16 => bytemuck::pod_collect_to_vec::<u8, half::f16>(&self.bytes)
                .into_iter()
                .map(f32::from)
                .collect(),
        }
    }

    /// A new tensor on `device` with these bytes.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        match self.dtype {
            DType::F32 => Tensor::from_slice(
                device,
                &bytemuck::pod_collect_to_vec::<u8, f32>(&self.bytes),
                &self.dims,
            ),
            DType::F16 => Tensor::from_slice(
                device,
                &bytemuck::pod_collect_to_vec::<u8, half::f16>(&self.bytes),
                &self.dims,
            ),
        }
    }
}

impl safetensors::View for &HostTensor {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            DType::F32 => safetensors::Dtype::F32,
            DType::F16 => safetensors::Dtype::F16,
        }
    }
    fn shape(&self) -> &[usize] {
        &self.dims
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
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

    /// The model configuration stored with the file ([`Module::config`]): empty when the
    /// model had none.
    pub fn model_config(&self) -> std::collections::BTreeMap<String, String> {
        self.metadata
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(CONFIG_PREFIX)?.to_string(), v.clone())))
            .collect()
    }

    /// Rebuilds the model the file was saved from, with no flags needed: `build` makes an
    /// untrained model from the stored configuration (e.g. `|cfg| Mlp::from_config(&dev, cfg)`),
    /// then the weights are loaded into it. A configuration `build` refuses is an
    /// [`Error::Data`] naming the file.
    pub fn rebuild<M: Module>(
        &self,
        build: impl FnOnce(&std::collections::BTreeMap<String, String>) -> Result<M>,
    ) -> Result<M> {
        let model = build(&self.model_config()).map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => self.err(reason),
            e => e,
        })?;
        self.apply_model(&model)?;
        Ok(model)
    }

    /// A stored configuration must be the model's: a different activation or width with the
    /// same tensor shapes would load and compute something else, and a different width is
    /// better said as the width than as the tensors' shapes. [`Error::Data`] names the key.
    pub fn check_config(&self, model: &dyn Module) -> Result<()> {
        let stored = self.model_config();
        if stored.is_empty() {
            return Ok(());
        }
        for (k, v) in model.config() {
            match stored.get(&k) {
                Some(s) if *s != v => {
                    return Err(self.err(format!(
                        "the file's model has {k} = {s}, this model has {k} = {v}"
                    )))
                }
                // A file of another kind of model lacks this model's keys.
                None if k == "kind" => {
                    return Err(self.err(format!(
                        "the file holds another kind of model ({}), this model is {v}",
                        stored.get("kind").map_or("no kind stored", String::as_str)
                    )))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The stored model configuration must hold each of `want`'s keys with its value: a
    /// command's host-side check before any device work, so the error names the flag to
    /// change. A key the file lacks means another kind of model: `what` says which program
    /// writes the expected kind ("train_gpt").
    pub fn expect_config(&self, want: &[Expect], what: &str) -> Result<()> {
        let stored = self.model_config();
        for w in want {
            match stored.get(&w.key) {
                Some(v) if *v == w.value => {}
                Some(v) => {
                    return Err(self.err(format!(
                        "the checkpoint's model has {} {v}, this run {}: {}",
                        w.key, w.value, w.change
                    )))
                }
                None => {
                    return Err(self.err(format!(
                        "no '{}' in the checkpoint's model{}: not a model saved by {what}",
                        w.key,
                        stored
                            .get("kind")
                            .map_or(String::new(), |k| format!(" (it holds a {k})"))
                    )))
                }
            }
        }
        Ok(())
    }

    /// Each of `want`'s keys among the [`TrainingState::extra`] entries must hold its value
    /// (a file from before the key was stored lacks it and passes): what a run was trained
    /// with and on. [`Error::Data`] says both values and `change`.
    pub fn check_extra(&self, want: &[Expect]) -> Result<()> {
        for w in want {
            if let Some(saved) = self.metadata.get(&format!("{EXTRA_PREFIX}{}", w.key)) {
                if *saved != w.value {
                    return Err(self.err(format!(
                        "the checkpoint was trained with {} {saved}, this run uses {}; {}",
                        w.key, w.value, w.change
                    )));
                }
            }
        }
        Ok(())
    }

    /// Every tensor holds finite values: a checkpoint of a diverged run is refused by name
    /// before anything is loaded, instead of training on to a divergence that looks like a
    /// learning-rate problem.
    pub fn check_finite(&self) -> Result<()> {
        for (name, t) in &self.tensors {
            if let Some(bad) = t.to_f32().into_iter().find(|v| !v.is_finite()) {
                return Err(self.err(format!(
                    "tensor '{name}' holds {bad}: the run that wrote it had diverged; resume \
                     from an earlier checkpoint, or start a new run without resuming"
                )));
            }
        }
        Ok(())
    }

    /// Copies the saved parameters into `model`'s own tensors, in place: optimizers and other
    /// holders of those tensors see the new values. Every parameter must be in the file with
    /// the same shape and dtype, and the file must hold no other model tensor; nothing is
    /// written unless all of them fit.
    pub fn apply_model(&self, model: &dyn Module) -> Result<()> {
        // Another configuration is said as such, before the tensors it makes differ.
        self.check_config(model)?;
        let prefix = self.model_prefix();
        let mut params = model.named_parameters();
        params.extend(model.named_buffers());
        let mut missing = Vec::new();
        let mut plan = Vec::new();
        for (name, p) in &params {
            let key = format!("{prefix}{name}");
            let Some(h) = self.tensors.get(&key) else {
                missing.push(key);
                continue;
            };
            if h.dims != p.dims() || h.dtype != p.dtype() {
                return Err(self.err(format!(
                    "tensor '{key}' is {} {:?} in the file, the model's parameter is {} {:?}",
                    h.dtype,
                    h.dims,
                    p.dtype(),
                    p.dims()
                )));
            }
            plan.push((p, h));
        }
        if !missing.is_empty() {
            return Err(self.err(format!(
                "no tensor for the model's parameters {}{}",
                list(&missing),
                self.not_fitgrad("names must match")
            )));
        }
        let extra: Vec<String> = self
            .tensors
            .keys()
            .filter(|k| {
                let ours = if prefix.is_empty() {
                    !k.starts_with(OPTIM_PREFIX)
                } else {
                    k.starts_with(prefix)
                };
                ours && !params.iter().any(|(n, _)| k[prefix.len()..] == **n)
            })
            .cloned()
            .collect();
        if !extra.is_empty() {
            return Err(self.err(format!(
                "tensors {} are not parameters of the model",
                list(&extra)
            )));
        }
        for (p, h) in plan {
            p.write_bytes(&h.bytes)?;
        }
        Ok(())
    }

    /// The optimizer's state with its tensors uploaded to `device`, for
    /// [`Optimizer::load_state`].
    pub fn optimizer_state(&self, device: &Device) -> Result<OptimizerState> {
        self.optimizer_state_in(Some(device))
    }

    /// The optimizer's state with its f32 tensors in host memory ([`OptimizerState::host`]),
    /// for an optimizer that keeps its state there ([`Optimizer::state_on_host`]).
    pub fn optimizer_state_on_host(&self) -> Result<OptimizerState> {
        self.optimizer_state_in(None)
    }

    /// Tensors uploaded to `device`, or kept on the host with `None`.
    fn optimizer_state_in(&self, device: Option<&Device>) -> Result<OptimizerState> {
        let count = |key: &str, v: &str| {
            v.parse::<u64>()
                .map_err(|_| self.err(format!("metadata {key} = '{v}' is not a count")))
        };
        let Some(step_count) = self.metadata.get("optim.step_count") else {
            return Err(self.err(format!(
                "the checkpoint holds no optimizer state{}",
                self.not_fitgrad("no optim.step_count")
            )));
        };
        let step_count = count("optim.step_count", step_count)?;
        let steps = self
            .metadata
            .get("optim.param_steps")
            .ok_or_else(|| self.err("metadata optim.param_steps is missing".into()))?;
        let param_steps = steps
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| count("optim.param_steps", s))
            .collect::<Result<Vec<u64>>>()?;
        let mut tensors = Vec::new();
        let mut host = Vec::new();
        for (name, h) in &self.tensors {
            let Some(short) = name.strip_prefix(OPTIM_PREFIX) else {
                continue;
            };
            if h.dims.len() > MAX_RANK {
                return Err(self.err(format!(
                    "tensor '{name}' has rank {}; fitgrad tensors have at most {MAX_RANK} dimensions",
                    h.dims.len()
                )));
            }
            match device {
                Some(device) => tensors.push((short.to_string(), h.to_device(device)?)),
                None => host.push(crate::optim::HostTensorState {
                    name: short.to_string(),
                    dims: h.dims.clone(),
                    values: h.to_f32(),
                }),
            }
        }
        let mut codes = Vec::new();
        for (name, bytes) in &self.codes {
            let Some(short) = name.strip_prefix(OPTIM_PREFIX) else {
                continue;
            };
            let Some(device) = device else {
                return Err(self.err(format!(
                    "'{name}' holds 8-bit state; an optimizer with its state in host memory keeps f32 state"
                )));
            };
            codes.push(crate::optim::CodeTensor {
                name: short.to_string(),
                words: crate::optim::quant8::bytes_to_words(device, bytes)?,
                len: bytes.len(),
            });
        }
        Ok(OptimizerState {
            step_count,
            param_steps,
            tensors,
            codes,
            host,
        })
    }

    /// Loads the optimizer's state into `optimizer` (on its parameters' device); a state that
    /// does not fit its parameters is an [`Error::Data`] naming the file.
    pub fn apply_optimizer(&self, optimizer: &mut dyn Optimizer) -> Result<()> {
        let Some(device) = optimizer.params().first().map(|p| p.device().clone()) else {
            return Err(self.err("the optimizer has no parameters".into()));
        };
        if let Some(saved) = self.metadata.get("optim.name") {
            if saved != optimizer.name() {
                return Err(self.err(format!(
                    "the checkpoint holds {saved} state, the optimizer is {}",
                    optimizer.name()
                )));
            }
        }
        // A resume with other hyperparameters would silently train another run (files
        // without them predate the check).
        let saved: Vec<(&str, &String)> = self
            .metadata
            .iter()
            .filter_map(|(k, v)| k.strip_prefix(OPTIM_HP_PREFIX).map(|k| (k, v)))
            .collect();
        if !saved.is_empty() {
            let now = optimizer.hyperparameters();
            let differ: Vec<String> = now
                .iter()
                .filter_map(|(k, v)| {
                    let was = saved.iter().find(|(s, _)| s == k).map(|(_, v)| v.as_str());
                    (was != Some(v.as_str()))
                        .then(|| format!("{k} = {} (this run: {v})", was.unwrap_or("unset")))
                })
                .chain(
                    saved
                        .iter()
                        .filter(|(k, _)| !now.iter().any(|(n, _)| n == k))
                        .map(|(k, v)| format!("{k} = {v} (this run: unset)")),
                )
                .collect();
            if !differ.is_empty() {
                return Err(self.err(format!(
                    "the checkpoint was trained with other {} hyperparameters: {}; use the \
                     same ones to resume, or start a new run",
                    optimizer.name(),
                    differ.join(", ")
                )));
            }
        }
        let state = if optimizer.state_on_host() {
            self.optimizer_state_on_host()?
        } else {
            self.optimizer_state(&device)?
        };
        optimizer.load_state(state).map_err(|e| match e {
            Error::InvalidArgument { reason, .. } => {
                self.err(format!("the optimizer state does not fit: {reason}"))
            }
            Error::Shape {
                reason, lhs, rhs, ..
            } => self.err(format!(
                "the optimizer state does not fit: {reason} (parameter {lhs:?}, state {rhs:?})"
            )),
            e => e,
        })
    }

    /// Step, epoch, generator and scaler state, and the extra entries.
    pub fn training_state(&self) -> Result<TrainingState> {
        if !self.is_fitgrad() {
            return Err(self.err(format!(
                "not a fitgrad checkpoint (no format = \"{FORMAT}\" metadata): it holds tensors only"
            )));
        }
        let get = |key: &str| {
            self.metadata
                .get(key)
                .ok_or_else(|| self.err(format!("metadata {key} is missing")))
        };
        let int = |key: &str| {
            let v = get(key)?;
            v.parse::<u64>()
                .map_err(|_| self.err(format!("metadata {key} = '{v}' is not a count")))
        };
        let scaler = match (
            self.metadata.get("scaler.scale"),
            self.metadata.get("scaler.growth_tracker"),
        ) {
            (None, None) => None,
            (Some(s), Some(_)) => Some(ScalerState {
                scale: s.parse::<f32>().map_err(|_| {
                    self.err(format!("metadata scaler.scale = '{s}' is not a number"))
                })?,
                growth_tracker: int("scaler.growth_tracker")?,
            }),
            _ => {
                return Err(self
                    .err("metadata has only one of scaler.scale and scaler.growth_tracker".into()))
            }
        };
        Ok(TrainingState {
            step: int("step")?,
            epoch: int("epoch")?,
            rng_state: int("rng_state")?,
            scaler,
            extra: self
                .metadata
                .iter()
                .filter_map(|(k, v)| Some((k.strip_prefix(EXTRA_PREFIX)?.to_string(), v.clone())))
                .collect(),
        })
    }
}

/// A safetensors file's tensors (any dtype) and string metadata, after the checks a damaged or
/// foreign file can fail (each an [`Error::Data`] naming `source` and what is wrong; never a
/// panic). [`Checkpoint::from_bytes`] and the quantized models (`compress`) read through it.
pub(crate) fn parse_safetensors<'a>(
    bytes: &'a [u8],
    source: &str,
) -> Result<(safetensors::SafeTensors<'a>, BTreeMap<String, String>)> {
    let bad = |reason: String| Error::Data {
        path: source.to_string(),
        reason,
    };
    let len = bytes.len() as u64;
    // The checks safetensors makes too, with messages that say what is wrong; the integer
    // scan keeps its offset arithmetic from overflowing (which would panic).
    let Some(head) = bytes.get(..8) else {
        return Err(bad(format!(
            "{len} bytes is too short for a safetensors file (it starts with an 8-byte header length): empty or truncated"
        )));
    };
    let n = u64::from_le_bytes(head.try_into().expect("8 bytes"));
    if n > MAX_HEADER {
        return Err(bad(format!(
            "the header claims {n} bytes, past safetensors' limit of {MAX_HEADER}: not a safetensors file"
        )));
    }
    if 8 + n > len {
        return Err(bad(format!(
            "the header claims {n} bytes but only {} follow the length: truncated",
            len - 8
        )));
    }
    let header = &bytes[8..8 + n as usize];
    let data_len = len - 8 - n;
    if let Some(v) = bare_integer_above(header, MAX_NUMBER) {
        return Err(bad(format!(
            "the header holds the number {v}: no shape or data offset is that large"
        )));
    }
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| {
        use safetensors::SafeTensorError as E;
        bad(match e {
            E::InvalidHeader(_) => "the header is not UTF-8: not a safetensors file".into(),
            E::InvalidHeaderDeserialization(e) => {
                format!("the header is not valid safetensors JSON: {e}")
            }
            E::MetadataIncompleteBuffer => format!(
                "the tensors' data offsets do not end where the file does ({data_len} bytes of data): truncated, or offsets out of range"
            ),
            E::InvalidOffset(name) => format!(
                "tensor '{name}': data offsets out of order, overlapping or out of range"
            ),
            E::TensorInvalidInfo => {
                "a tensor's data offsets do not match its shape and dtype".into()
            }
            e => format!("not a valid safetensors file: {e}"),
        })
    })?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
    let metadata = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    Ok((st, metadata))
}

/// A tensor of any safetensors dtype, for [`safetensors_bytes`].
pub(crate) struct RawTensor<'a> {
    pub name: &'a str,
    pub dtype: safetensors::Dtype,
    pub dims: &'a [usize],
    /// Little-endian, row-major.
    pub bytes: &'a [u8],
}

/// The bytes of a safetensors file of `tensors` and `metadata`, laid out as
/// [`Checkpoint::to_bytes`] says (the same bytes for the same input); `source` names the file
/// in errors. Checkpoints and quantized models (`compress`) are both written through it.
pub(crate) fn safetensors_bytes(
    tensors: &[RawTensor],
    metadata: &BTreeMap<String, String>,
    source: &str,
) -> Result<Vec<u8>> {
    let bad = |reason: String| Error::Data {
        path: source.to_string(),
        reason: format!("cannot write a safetensors file: {reason}"),
    };
    let json_err = |e: serde_json::Error| bad(e.to_string());
    let mut order: Vec<&RawTensor> = tensors.iter().collect();
    order.sort_by(|a, b| b.dtype.cmp(&a.dtype).then(a.name.cmp(b.name)));
    let mut header = String::from("{");
    if !metadata.is_empty() {
        // A BTreeMap serializes in key order.
        header += "\"__metadata__\":";
        header += &serde_json::to_string(metadata).map_err(json_err)?;
    }
    let mut offset = 0usize;
    for t in &order {
        let name = t.name;
        // Whole bytes per element: fitgrad writes no sub-byte dtype.
        let want = t.dims.iter().product::<usize>() * t.dtype.bitsize() / 8;
        if t.bytes.len() != want {
            return Err(bad(format!(
                "tensor '{name}' holds {} bytes, its {} shape {:?} needs {want}",
                t.bytes.len(),
                t.dtype,
                t.dims
            )));
        }
        if header.len() > 1 {
            header.push(',');
        }
        // Display writes safetensors' own names ("F32", "I8").
        let dtype = t.dtype;
        header += &format!(
            "{}:{{\"dtype\":\"{dtype}\",\"shape\":{},\"data_offsets\":[{offset},{}]}}",
            serde_json::to_string(name).map_err(json_err)?,
            serde_json::to_string(&t.dims).map_err(json_err)?,
            offset + want
        );
        offset += want;
    }
    header.push('}');
    let padded = header.len().next_multiple_of(8);
    if padded as u64 > MAX_HEADER {
        return Err(bad(format!(
            "the header would take {padded} bytes, past safetensors' limit of {MAX_HEADER}"
        )));
    }
    let mut out = Vec::with_capacity(8 + padded + offset);
    out.extend_from_slice(&(padded as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.resize(8 + padded, b' ');
    for t in &order {
        out.extend_from_slice(t.bytes);
    }
    Ok(out)
}

/// `'a', 'b', 'c'`, at most eight names.
pub(crate) fn list(names: &[String]) -> String {
    let mut s: Vec<String> = names.iter().take(8).map(|n| format!("'{n}'")).collect();
    if names.len() > 8 {
        s.push(format!("and {} more", names.len() - 8));
    }
    s.join(", ")
}

/// The first integer written outside a string in a JSON header that is greater than `limit`
/// (in a safetensors header: the shapes and data offsets).
fn bare_integer_above(header: &[u8], limit: u64) -> Option<String> {
    let (mut in_string, mut escaped) = (false, false);
    let mut i = 0;
    while i < header.len() {
        let c = header[i];
        if in_string {
            match c {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if c == b'"' {
            in_string = true;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < header.len() && header[i].is_ascii_digit() {
                i += 1;
            }
            let digits = std::str::from_utf8(&header[start..i]).expect("ASCII digits");
            if digits.parse::<u64>().map_or(true, |v| v > limit) {
                return Some(digits.to_string());
            }
            continue;
        }
        i += 1;
    }
    None
}
