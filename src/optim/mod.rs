//! Optimizers ([`Sgd`], [`AdamW`], with torch's semantics and [parameter groups](ParamGroup)),
//! gradient clipping ([`clip_grad_norm`]) and learning-rate schedules.
//!
//! Each update is one fused kernel per parameter (shaders/optim.wgsl), in place: it reads the
//! parameter, its gradient and its state once and writes the parameter and the state once. The
//! same AdamW update written with tensor ops is about eight elementwise dispatches (decay, two
//! moment updates, square root, two bias corrections, add, divide), each reading and writing whole
//! tensors and allocating temporaries: several times the memory traffic, and a transient peak of
//! several parameter-sized buffers right when the gradients are also alive. The fused kernel
//! computes in f32 registers whatever the storage, and allocates nothing.
//!
//! State (momentum buffers, moments) is created on the first step that sees a parameter's
//! gradient, as zeros of the parameter's shape and dtype, and stays on the GPU. After that a step
//! creates no tensor at all. A parameter without a gradient is skipped (as in torch).
//!
//! ```no_run
//! use fitgrad::optim::{AdamW, Optimizer};
//! # fn f(params: Vec<fitgrad::Tensor>, loss: impl Fn() -> fitgrad::Result<fitgrad::Tensor>) -> fitgrad::Result<()> {
//! let mut opt = AdamW::new(params, 1e-3)?.weight_decay(0.1)?;
//! for _ in 0..100 {
//!     opt.zero_grad();
//!     loss()?.backward()?;
//!     opt.step()?;
//! }
//! # Ok(()) }
//! ```

mod adamw;
mod clip;
mod groups;
pub mod offload;
pub mod quant8;
mod scaler;
pub mod schedule;
mod sgd;

pub use adamw::AdamW;
pub(crate) use clip::{clip_factor, clip_grad_norm_sharded, global_norm_of, scale_by_norm};
pub use clip::{clip_grad_norm, clip_grad_norm_tensor};
pub use groups::{decay_groups, ParamGroup};
pub use quant8::Quantized;
pub use scaler::GradScaler;
pub use schedule::LrSchedule;
pub use sgd::Sgd;

use crate::{Error, Result, Tensor};

/// An optimizer over a fixed list of parameters. `Send`, so an application can train on a
/// worker thread.
pub trait Optimizer: Send {
    /// "sgd", "adamw" or "adamw8bit" (reports, the memory planner, checkpoints).
    fn name(&self) -> &'static str;
    /// Whether the optimizer keeps a state tensor per parameter beyond AdamW's two moments
    /// (SGD's momentum buffer).
    fn has_momentum(&self) -> bool {
        false
    }
    /// Updates every parameter that has a gradient, from its gradient and state.
    fn step(&mut self) -> Result<()>;
    /// Drops every parameter's gradient (torch's `zero_grad(set_to_none=True)`).
    fn zero_grad(&mut self) {
        for p in self.params() {
            p.zero_grad();
        }
    }
    /// The learning rate the next step uses.
    fn lr(&self) -> f32;
    /// Sets the learning rate for the next steps (checked by `step`).
    fn set_lr(&mut self, lr: f32);
    /// The parameters it updates, in order.
    fn params(&self) -> &[Tensor];
    /// `step()` calls that succeeded.
    fn step_count(&self) -> u64;
    /// The state on the GPU, named `"{param index}.{torch name}"` (`"0.exp_avg"`,
    /// `"3.momentum_buffer"`); parameters not updated yet have none.
    fn state_tensors(&self) -> Vec<(String, Tensor)>;
    /// Bytes of arena memory the state holds.
    fn state_bytes(&self) -> u64 {
        self.state_tensors()
            .iter()
            .map(|(_, t)| t.allocated_bytes())
            .sum()
    }
    /// The hyperparameters that change the math of a step besides the learning rate (which
    /// schedules move), as key-value pairs: checkpoints store them (`optim.hp.KEY`) and a
    /// resume with other values is refused. Empty by default.
    fn hyperparameters(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    /// Everything a checkpoint needs besides the hyperparameters.
    fn state(&self) -> OptimizerState;
    /// The state a checkpoint stores: [`Optimizer::state`], or (a sharded optimizer) the whole
    /// state put together from every replica's shard, which every replica then calls at once.
    fn checkpoint_state(&self) -> Result<OptimizerState> {
        Ok(self.state())
    }
    /// Restores a state taken from an optimizer over parameters of the same shapes. The tensors
    /// are adopted, not copied: later steps update them in place.
    fn load_state(&mut self, state: OptimizerState) -> Result<()>;
    /// Bytes of host memory the state takes once every parameter has been updated (optimizer
    /// offload); 0 for state on the device.
    fn host_bytes(&self) -> u64 {
        0
    }
    /// Whether [`Optimizer::offload_to_host`] can move this kind of optimizer's state to host
    /// memory at all (it may still refuse a configuration of it, such as 8-bit state).
    fn can_offload(&self) -> bool {
        false
    }
    /// Moves the state to host memory from now on (the trainer's `offload_optimizer`).
    /// Optimizers that cannot refuse with [`Error::InvalidArgument`].
    fn offload_to_host(&mut self) -> Result<()> {
        Err(Error::InvalidArgument {
            op: "offload_optimizer",
            reason: format!(
                "the {} optimizer keeps its state on the device; AdamW can keep it in host memory",
                self.name()
            ),
        })
    }
    /// Chooses where and how the state is kept before the first step: 8-bit codes on the
    /// device (`eight_bit`), f32 on the device, or f32 in host memory (`host`); fit auto's
    /// ladder moves through them. Optimizers with one kind of state, or with state already
    /// made, refuse with [`Error::InvalidArgument`].
    fn set_state_kind(&mut self, eight_bit: bool, host: bool) -> Result<()> {
        let _ = (eight_bit, host);
        Err(Error::InvalidArgument {
            op: "fit auto",
            reason: format!("the {} optimizer has one kind of state", self.name()),
        })
    }
    /// Whether [`Optimizer::load_state`] takes its state in [`OptimizerState::host`].
    fn state_on_host(&self) -> bool {
        false
    }
    /// The same optimizer (parameters, hyperparameters, learning rate) without any state and
    /// at step 0: the planner runs a step with it, so the real state is left alone.
    fn fresh(&self) -> Box<dyn Optimizer>;
    /// The same optimizer (hyperparameters, groups, learning rate) without state and at step
    /// 0, over `parts`: `parts[j]` is a range of this one's parameter `of[j]` (ZeRO's update
    /// of one rank's shard, which may start and end inside a tensor). Optimizers whose state
    /// cannot be split refuse with [`Error::InvalidArgument`].
    fn over_parts(&self, parts: Vec<Tensor>, of: &[usize]) -> Result<Box<dyn Optimizer>> {
        let _ = (parts, of);
        Err(Error::InvalidArgument {
            op: "zero",
            reason: format!("the {} optimizer's state cannot be sharded", self.name()),
        })
    }
}

/// What a checkpoint saves of an optimizer besides its hyperparameters.
#[derive(Clone, Debug, Default)]
pub struct OptimizerState {
    /// `step()` calls so far.
    pub step_count: u64,
    /// Per parameter, the updates it has had (AdamW's bias-correction step; parameters skipped
    /// for lack of a gradient do not count, as in torch).
    pub param_steps: Vec<u64>,
    /// As [`Optimizer::state_tensors`], but for the codes of 8-bit state.
    pub tensors: Vec<(String, Tensor)>,
    /// 8-bit state's codes ([`AdamW::eight_bit`]): one byte per element, held on the device as
    /// u32 words; checkpoints store them as U8 tensors.
    pub codes: Vec<CodeTensor>,
    /// State kept in host memory ([`AdamW::offload`]), named as `tensors`.
    pub host: Vec<HostTensorState>,
}

/// One f32 state tensor in host memory (`"3.exp_avg"` of an offloaded AdamW).
#[derive(Clone, Debug)]
pub struct HostTensorState {
    /// The state name, as in [`Optimizer::state_tensors`].
    pub name: String,
    /// Its parameter's dims.
    pub dims: Vec<usize>,
    /// Row-major values.
    pub values: Vec<f32>,
}

/// One tensor of u8 codes of an optimizer's state (`"3.state1"`).
#[derive(Clone, Debug)]
pub struct CodeTensor {
    /// The state name, as in [`Optimizer::state_tensors`].
    pub name: String,
    /// `ceil(len / 4)` u32 words (element i in byte i % 4 of word i / 4) in an f32-typed tensor.
    pub words: Tensor,
    /// Codes (elements).
    pub len: usize,
}

/// Checks the parameter list: non-empty, leaves that require grad, one device, no tensor twice
/// (it would be updated twice per step).
fn check_params(op: &'static str, params: &[Tensor]) -> Result<()> {
    let invalid = |reason: String| Err(Error::InvalidArgument { op, reason });
    let Some(first) = params.first() else {
        return invalid("the parameter list is empty".into());
    };
    let mut seen = std::collections::HashSet::new();
    for (i, p) in params.iter().enumerate() {
        if !p.requires_grad() {
            return invalid(format!(
                "parameter {i} {p:?} does not require grad (call with_requires_grad())"
            ));
        }
        if !p.is_leaf() {
            return invalid(format!(
                "parameter {i} {p:?} is an op's output, not a leaf: it never gets a gradient"
            ));
        }
        if p.device() != first.device() {
            return Err(Error::DeviceMismatch { op });
        }
        let b = p.block();
        if p.numel() > 0 && !seen.insert((b.plan_id, b.segment, b.offset)) {
            return invalid(format!(
                "parameter {i} shares its memory with an earlier parameter"
            ));
        }
    }
    Ok(())
}

/// `Err(InvalidArgument)` naming the hyperparameter unless `ok`.
fn check(op: &'static str, name: &str, value: f32, ok: bool, want: &str) -> Result<()> {
    if ok && value.is_finite() {
        Ok(())
    } else {
        Err(Error::InvalidArgument {
            op,
            reason: format!("{name} = {value} must be {want}"),
        })
    }
}

/// The gradient of `p`, checked against it: same device and element count.
fn grad_of(op: &'static str, p: &Tensor) -> Result<Option<Tensor>> {
    let Some(g) = p.grad() else {
        return Ok(None);
    };
    if g.device() != p.device() {
        return Err(Error::DeviceMismatch { op });
    }
    if g.dims() != p.dims() {
        return Err(Error::Shape {
            op,
            lhs: p.dims().to_vec(),
            rhs: g.dims().to_vec(),
            reason: "the gradient's shape differs from the parameter's".into(),
        });
    }
    Ok(Some(g))
}

/// New optimizer state for `p`: zeros of its shape, always f32. An f16 second moment of
/// AdamW underflows (g² < 6e-8 is 0 in f16), and then `m / (sqrt(v) + eps)` blows up; f32 state
/// with eps applied in f32 lets pure-f16 training converge.
fn zeros_like(p: &Tensor) -> Result<Tensor> {
    Tensor::zeros(p.device(), p.dims(), crate::DType::F32)
}

/// Checks a loaded state against `params` and the state names of one optimizer, and returns
/// per parameter the tensor of each name (all present or none).
fn take_state(
    op: &'static str,
    params: &[Tensor],
    names: &[&str],
    state: OptimizerState,
) -> Result<Vec<Option<Vec<Tensor>>>> {
    let invalid = |reason: String| Error::InvalidArgument { op, reason };
    if let Some(h) = state.host.first() {
        return Err(invalid(format!(
            "host state tensor '{}' given to an optimizer with device state",
            h.name
        )));
    }
    if let Some(c) = state.codes.first() {
        return Err(invalid(format!(
            "8-bit state tensor '{}' given to an optimizer with f32 state",
            c.name
        )));
    }
    if state.param_steps.len() != params.len() {
        return Err(invalid(format!(
            "the state has steps for {} parameters, the optimizer has {}",
            state.param_steps.len(),
            params.len()
        )));
    }
    let mut slots: Vec<Vec<Option<Tensor>>> = vec![vec![None; names.len()]; params.len()];
    for (key, t) in state.tensors {
        let parsed = key.split_once('.').and_then(|(i, name)| {
            let i: usize = i.parse().ok()?;
            let j = names.iter().position(|n| *n == name)?;
            (i < params.len()).then_some((i, j))
        });
        let Some((i, j)) = parsed else {
            return Err(invalid(format!("unknown state tensor '{key}'")));
        };
        let p = &params[i];
        if t.device() != p.device() {
            return Err(Error::DeviceMismatch { op });
        }
        if t.dims() != p.dims() {
            return Err(Error::Shape {
                op,
                lhs: p.dims().to_vec(),
                rhs: t.dims().to_vec(),
                reason: format!("state tensor '{key}' does not fit its parameter"),
            });
        }
        if slots[i][j].replace(t.detach()).is_some() {
            return Err(invalid(format!("state tensor '{key}' given twice")));
        }
    }
    slots
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let have = s.iter().filter(|t| t.is_some()).count();
            if have == 0 {
                Ok(None)
            } else if have < s.len() {
                Err(invalid(format!("parameter {i} has only part of its state")))
            } else {
                Ok(Some(s.into_iter().flatten().collect()))
            }
        })
        .collect()
}
