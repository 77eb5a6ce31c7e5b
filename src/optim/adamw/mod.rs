//! Adam with decoupled weight decay (torch.optim.AdamW), with f32 or 8-bit state, on the device
//! or offloaded to host memory. Its state as checkpoints see it (the named tensors, the
//! checked load) is state.rs.

mod state;

use crate::kernels::optim::{adamw_step, AdamWHyper};
use crate::optim::groups::{Groups, ParamGroup};
use crate::optim::offload::{self, HostState, HOST_BYTES_PER_ELEMENT};
use crate::optim::quant8::{self, Moments8};
use crate::optim::{check, grad_of, zeros_like, Optimizer, OptimizerState};
use crate::{DType, Error, Result, Tensor};

const OP: &str = "AdamW";
const NAMES: [&str; 2] = ["exp_avg", "exp_avg_sq"];

/// One parameter's moments.
#[derive(Clone)]
enum Moments {
    F32(Tensor, Tensor),
    Q8(Moments8),
}

/// AdamW, per parameter and step (g the gradient, p the parameter, t the parameter's update
/// count including this one):
/// ```text
/// p *= 1 - lr * weight_decay
/// m = beta1 * m + (1 - beta1) * g
/// v = beta2 * v + (1 - beta2) * g^2
/// p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
/// ```
/// Defaults as torch: betas (0.9, 0.999), eps 1e-8, weight decay 0.01. Builder methods check
/// their value ([`Error::InvalidArgument`](crate::Error::InvalidArgument)); `step()` checks them
/// all again, with the learning rate of `set_lr`, before it updates anything.
///
/// With [parameter groups](ParamGroup) ([`AdamW::with_groups`]) a parameter's `lr` is the
/// optimizer's times its group's `lr_scale`, and its `weight_decay` its group's, or the
/// optimizer's where the group sets none.
///
/// With [`AdamW::eight_bit`] both moments of every tensor of at least
/// [`MIN_NUMEL`](quant8::MIN_NUMEL) elements are kept in 8 bits ([`quant8`]): about a quarter of
/// the f32 state's bytes.
///
/// ```no_run
/// # fn f(params: Vec<fitgrad::Tensor>) -> fitgrad::Result<()> {
/// let opt = fitgrad::optim::AdamW::new(params, 3e-4)?.betas(0.9, 0.95)?.weight_decay(0.1)?;
/// # Ok(()) }
/// ```
pub struct AdamW {
    /// The parameters (in group order) and their groups' hyperparameters.
    groups: Groups,
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    /// (m, v) per parameter, created on its first update.
    moments: Vec<Option<Moments>>,
    /// Large tensors keep 8-bit moments.
    eight_bit: bool,
    /// The 8-bit kernel's map table (`quant8::table`), made on the first 8-bit update and
    /// shared with `fresh` copies, so a plan holds the same one table as the real step.
    table: Option<Tensor>,
    /// With [`AdamW::offload`], each parameter's master weights and moments in host memory
    /// (made on its first update); `None` keeps the state on the device.
    host: Option<Vec<Option<HostState>>>,
    /// Updates per parameter: the bias corrections' t (torch keeps it per parameter too).
    param_steps: Vec<u64>,
    steps: u64,
}

impl AdamW {
    /// AdamW over `params` (leaves that require grad) with learning rate `lr >= 0`.
    pub fn new(params: Vec<Tensor>, lr: f32) -> Result<AdamW> {
        Self::build(Groups::single(OP, params)?, lr)
    }

    /// AdamW over parameter groups, each with its own weight decay and learning-rate scale
    /// (torch's `param_groups`; see [`decay_groups`](super::decay_groups)). State and
    /// checkpoints index the parameters in group order. The builder methods apply to every
    /// group (`weight_decay` to those that set none).
    pub fn with_groups(groups: Vec<ParamGroup>, lr: f32) -> Result<AdamW> {
        Self::build(Groups::new(OP, groups)?, lr)
    }

    fn build(groups: Groups, lr: f32) -> Result<AdamW> {
        check(OP, "lr", lr, lr >= 0.0, ">= 0")?;
        let n = groups.len();
        Ok(AdamW {
            groups,
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            moments: vec![None; n],
            eight_bit: false,
            table: None,
            host: None,
            param_steps: vec![0; n],
            steps: 0,
        })
    }

    /// Keeps both moments in 8 bits, block-wise with the dynamic map of Dettmers et al. 2021
    /// ([`quant8`]), for every parameter of at least [`MIN_NUMEL`](quant8::MIN_NUMEL) elements;
    /// smaller ones keep f32 state. Each update is one fused kernel per parameter that
    /// dequantizes, updates in f32 and requantizes in registers. [`Optimizer::name`] becomes
    /// `"adamw8bit"`. Call it before the first step.
    pub fn eight_bit(mut self) -> AdamW {
        self.eight_bit = true;
        self
    }

    /// Keeps f32 master weights and both moments in host memory ([`offload`]): each step
    /// reads the gradients back, updates on the host with several threads and uploads the
    /// parameters, so the device holds only parameters and gradients. An
    /// [`Error::HostMemory`](crate::Error::HostMemory) when MemAvailable is short of 12 bytes
    /// per parameter; [`Error::InvalidArgument`] with 8-bit state or f16 parameters (use mixed
    /// precision: f32 parameters on the device, f16 compute).
    pub fn offload(mut self) -> Result<AdamW> {
        self.offload_to_host()?;
        Ok(self)
    }

    /// Whether the state lives in host memory ([`AdamW::offload`]).
    pub fn is_offloaded(&self) -> bool {
        self.host.is_some()
    }

    /// The update of parameter `i` at its next step.
    fn hyper(&self, i: usize) -> AdamWHyper {
        AdamWHyper {
            lr: self.groups.lr(i, self.lr),
            weight_decay: self.groups.weight_decay(i, self.weight_decay),
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            step: self.param_steps[i] + 1,
        }
    }

    /// [`Optimizer::step`] with the state in host memory.
    fn step_offloaded(&mut self, grads: Vec<Option<Tensor>>) -> Result<()> {
        let hps: Vec<AdamWHyper> = (0..grads.len()).map(|i| self.hyper(i)).collect();
        let planning = self.groups.params[0].device().is_planning();
        // Streamed parameters' gradients were summed in host memory (src/residency/).
        let mut host_grads: Vec<Option<Vec<f32>>> = if planning {
            vec![None; grads.len()]
        } else {
            self.groups
                .params
                .iter()
                .map(Tensor::take_host_grad)
                .collect()
        };
        let stepped: Vec<bool> = grads
            .iter()
            .zip(&host_grads)
            .map(|(g, h)| g.is_some() || h.is_some())
            .collect();
        if !planning {
            let host = self.host.as_mut().expect("offloaded");
            let mut jobs = Vec::new();
            for (i, (g, st)) in grads.iter().zip(host.iter_mut()).enumerate() {
                let p = &self.groups.params[i];
                let g = match (g, host_grads[i].take()) {
                    (Some(g), _) => offload::Grad::Device(g),
                    (None, Some(h)) => offload::Grad::Host(h),
                    (None, None) => continue,
                };
                let n = p.numel();
                let st = st.get_or_insert_with(|| HostState::zeros(n));
                // The master weights are read once: on the first update, or after a load.
                if st.master.len() != n {
                    st.master = p.to_vec_f32()?;
                }
                jobs.push(offload::Job {
                    param: p,
                    grad: g,
                    state: st,
                    coefficients: hps[i].coefficients(),
                });
            }
            offload::step(jobs)?;
        }
        for (i, s) in stepped.into_iter().enumerate() {
            if s {
                self.param_steps[i] += 1;
            }
        }
        self.steps += 1;
        Ok(())
    }

    /// Whether [`AdamW::eight_bit`] is on.
    pub fn is_eight_bit(&self) -> bool {
        self.eight_bit
    }

    /// The moments of parameter `i` as f32 device tensors of its shape (the 8-bit ones
    /// dequantized), or `None` before its first update.
    pub fn moments_f32(&self, i: usize) -> Result<Option<(Tensor, Tensor)>> {
        let Some(Some(mv)) = self.moments.get(i) else {
            return Ok(None);
        };
        match mv {
            Moments::F32(m, v) => Ok(Some((m.clone(), v.clone()))),
            Moments::Q8(q) => {
                let dims = self.groups.params[i].dims();
                let table = self.table.as_ref().expect("8-bit moments have a table");
                let (m, v) = q.dequantize(dims.iter().product(), table)?;
                Ok(Some((m.reshape(dims)?, v.reshape(dims)?)))
            }
        }
    }

    /// Whether parameter `p` gets 8-bit moments.
    fn quantized(&self, p: &Tensor) -> bool {
        self.eight_bit && p.numel() >= quant8::MIN_NUMEL
    }
    /// Decay rates of the first and second moments (each in [0, 1); default 0.9, 0.999).
    pub fn betas(mut self, beta1: f32, beta2: f32) -> Result<AdamW> {
        check(OP, "beta1", beta1, in_unit(beta1), "in [0, 1)")?;
        check(OP, "beta2", beta2, in_unit(beta2), "in [0, 1)")?;
        self.beta1 = beta1;
        self.beta2 = beta2;
        Ok(self)
    }

    /// Added to the denominator (> 0; default 1e-8).
    pub fn eps(mut self, eps: f32) -> Result<AdamW> {
        check(OP, "eps", eps, eps > 0.0, "> 0")?;
        self.eps = eps;
        Ok(self)
    }

    /// Decoupled weight decay (>= 0; default 0.01): p *= 1 - lr * weight_decay each step. Groups
    /// that set their own keep theirs.
    pub fn weight_decay(mut self, weight_decay: f32) -> Result<AdamW> {
        check(
            OP,
            "weight_decay",
            weight_decay,
            weight_decay >= 0.0,
            ">= 0",
        )?;
        self.weight_decay = weight_decay;
        Ok(self)
    }

    fn check_hyperparameters(&self) -> Result<()> {
        check(OP, "lr", self.lr, self.lr >= 0.0, ">= 0")?;
        check(OP, "beta1", self.beta1, in_unit(self.beta1), "in [0, 1)")?;
        check(OP, "beta2", self.beta2, in_unit(self.beta2), "in [0, 1)")?;
        check(OP, "eps", self.eps, self.eps > 0.0, "> 0")?;
        let wd = self.weight_decay;
        check(OP, "weight_decay", wd, wd >= 0.0, ">= 0")?;
        if self.eight_bit && self.host.is_some() {
            return Err(not_with_offload());
        }
        Ok(())
    }
}

fn not_with_offload() -> Error {
    Error::InvalidArgument {
        op: OP,
        reason: "8-bit state and optimizer offload do not combine: offload keeps f32 state in \
                 host memory, 8-bit state is for the device; choose one"
            .into(),
    }
}

fn in_unit(b: f32) -> bool {
    (0.0..1.0).contains(&b)
}

impl Optimizer for AdamW {
    fn fresh(&self) -> Box<dyn Optimizer> {
        let n = self.groups.len();
        Box::new(Self {
            groups: self.groups.clone(),
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            moments: (0..n).map(|_| None).collect(),
            eight_bit: self.eight_bit,
            table: self.table.clone(),
            host: self.host.as_ref().map(|h| vec![None; h.len()]),
            param_steps: vec![0; n],
            steps: 0,
        })
    }

    fn over_parts(&self, parts: Vec<Tensor>, of: &[usize]) -> Result<Box<dyn Optimizer>> {
        if self.eight_bit || self.host.is_some() {
            return Err(Error::InvalidArgument {
                op: "zero",
                reason: "8-bit AdamW state and optimizer offload do not shard (yet); use f32 \
                         AdamW state on the device with --zero"
                    .into(),
            });
        }
        let n = parts.len();
        let mut fresh = AdamW::build(self.groups.parts(OP, parts, of)?, self.lr)?;
        (fresh.beta1, fresh.beta2) = (self.beta1, self.beta2);
        (fresh.eps, fresh.weight_decay) = (self.eps, self.weight_decay);
        debug_assert_eq!(fresh.moments.len(), n);
        Ok(Box::new(fresh))
    }

    fn name(&self) -> &'static str {
        if self.eight_bit {
            "adamw8bit"
        } else {
            "adamw"
        }
    }

    fn hyperparameters(&self) -> Vec<(String, String)> {
        let mut hp = vec![
            ("beta1".to_string(), self.beta1.to_string()),
            ("beta2".to_string(), self.beta2.to_string()),
            ("eps".to_string(), self.eps.to_string()),
            ("weight_decay".to_string(), self.weight_decay.to_string()),
        ];
        hp.extend(self.groups.hyperparameters());
        hp
    }

    fn step(&mut self) -> Result<()> {
        self.check_hyperparameters()?;
        let grads = self
            .groups
            .params
            .iter()
            .map(|p| grad_of(OP, p))
            .collect::<Result<Vec<_>>>()?;
        if self.host.is_some() {
            return self.step_offloaded(grads);
        }
        // State first, so that running out of memory leaves every parameter and state as it was.
        let mut new = Vec::new();
        for (i, g) in grads.iter().enumerate() {
            if g.is_some() && self.moments[i].is_none() {
                let p = &self.groups.params[i];
                new.push((
                    i,
                    if self.quantized(p) {
                        Moments::Q8(Moments8::zeros(p)?)
                    } else {
                        Moments::F32(zeros_like(p)?, zeros_like(p)?)
                    },
                ));
            }
        }
        if self.table.is_none() && new.iter().any(|(_, m)| matches!(m, Moments::Q8(_))) {
            self.table = Some(quant8::table(self.groups.params[0].device())?);
        }
        for (i, mv) in new {
            self.moments[i] = Some(mv);
        }
        for (i, g) in grads.iter().enumerate() {
            let (Some(g), Some(mv)) = (g, &self.moments[i]) else {
                continue;
            };
            let hp = self.hyper(i);
            let p = &self.groups.params[i];
            match mv {
                Moments::F32(m, v) => adamw_step(p, g, m, v, &hp)?,
                Moments::Q8(q) => q.step(p, g, self.table.as_ref().expect("made above"), &hp)?,
            }
            self.param_steps[i] += 1;
        }
        self.steps += 1;
        Ok(())
    }

    fn lr(&self) -> f32 {
        self.lr
    }

    fn set_lr(&mut self, lr: f32) {
        self.lr = lr;
    }

    fn params(&self) -> &[Tensor] {
        &self.groups.params
    }

    fn step_count(&self) -> u64 {
        self.steps
    }

    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        state::tensors(self)
    }

    /// The moments and, with 8-bit state, the map table (4 KiB).
    fn state_bytes(&self) -> u64 {
        let table = self.table.as_ref().map_or(0, Tensor::allocated_bytes);
        self.state_tensors()
            .iter()
            .map(|(_, t)| t.allocated_bytes())
            .sum::<u64>()
            + table
    }

    fn host_bytes(&self) -> u64 {
        match self.host {
            Some(_) => {
                self.groups
                    .params
                    .iter()
                    .map(|p| p.numel() as u64)
                    .sum::<u64>()
                    * HOST_BYTES_PER_ELEMENT
            }
            None => 0,
        }
    }

    fn can_offload(&self) -> bool {
        true
    }

    fn offload_to_host(&mut self) -> Result<()> {
        if self.host.is_some() {
            return Ok(());
        }
        if self.eight_bit {
            return Err(not_with_offload());
        }
        if let Some(p) = self.groups.params.iter().find(|p| p.dtype() == DType::F16) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: format!(
                    "optimizer offload keeps f32 master weights in host memory and uploads f32 \
                     parameters; parameter {p:?} is f16 (use mixed precision: f32 parameters, f16 compute)"
                ),
            });
        }
        let n: u64 = self.groups.params.iter().map(|p| p.numel() as u64).sum();
        offload::check_host_memory(
            "optimizer offload (f32 master weights and AdamW's two moments)",
            n * HOST_BYTES_PER_ELEMENT,
        )?;
        // State already on the device moves to the host.
        let mut host = Vec::with_capacity(self.moments.len());
        for mv in &self.moments {
            host.push(match mv {
                Some(Moments::F32(m, v)) => Some(HostState {
                    master: Vec::new(),
                    m: m.to_vec_f32()?,
                    v: v.to_vec_f32()?,
                }),
                Some(Moments::Q8(_)) => return Err(not_with_offload()),
                None => None,
            });
        }
        self.moments = vec![None; host.len()];
        self.host = Some(host);
        Ok(())
    }

    fn state_on_host(&self) -> bool {
        self.host.is_some()
    }

    fn set_state_kind(&mut self, eight_bit: bool, host: bool) -> Result<()> {
        if eight_bit && host {
            return Err(not_with_offload());
        }
        if self.steps > 0 || self.moments.iter().any(Option::is_some) {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "the kind of state is chosen before the first step".into(),
            });
        }
        self.eight_bit = eight_bit;
        if host {
            self.offload_to_host()
        } else {
            self.host = None;
            Ok(())
        }
    }

    fn state(&self) -> OptimizerState {
        state::of(self)
    }

    fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        let (steps, param_steps) = (state.step_count, state.param_steps.clone());
        if self.host.is_some() {
            self.host = Some(offload::load_host(OP, &self.groups.params, &NAMES, state)?);
            self.param_steps = param_steps;
            self.steps = steps;
            return Ok(());
        }
        let moments = state::load_moments(self, state)?;
        if self.table.is_none() && moments.iter().any(|m| matches!(m, Some(Moments::Q8(_)))) {
            self.table = Some(quant8::table(self.groups.params[0].device())?);
        }
        self.moments = moments;
        self.param_steps = param_steps;
        self.steps = steps;
        Ok(())
    }
}
