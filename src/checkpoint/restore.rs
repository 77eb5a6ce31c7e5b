//! Reading a checkpoint back: its model configuration and the model rebuilt from it, the
//! checks against a model, the flags and the training data (each a typed error naming what to
//! change), and the model, optimizer and training state applied from it.

use super::*;

impl Checkpoint {
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
            if let Some((i, bad)) = t.first_nonfinite() {
                return Err(self.err(format!(
                    "tensor '{name}' holds {bad} (element {i}): the run that wrote it had \
                     diverged; resume from an earlier checkpoint, or start a new run without \
                     resuming"
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
            // A model of NaN or infinities evaluates to a NaN loss that reads as a result.
            if let Some((i, bad)) = h.first_nonfinite() {
                return Err(self.err(format!(
                    "tensor '{key}' holds {bad} (element {i}): a model that cannot compute; \
                     the run that wrote it had diverged, load an earlier checkpoint"
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
