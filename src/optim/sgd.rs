//! Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay
//! (torch.optim.SGD).

use super::groups::{Groups, ParamGroup};
use super::{check, grad_of, take_state, zeros_like, Optimizer, OptimizerState};
use crate::kernels::optim::{sgd_step, SgdHyper};
use crate::{Result, Tensor};

const OP: &str = "Sgd";
const BUF: &str = "momentum_buffer";

/// SGD, per parameter and step (g the gradient, p the parameter):
/// ```text
/// g' = g + weight_decay * p
/// buf = momentum * buf + (1 - dampening) * g'   (first step: buf = g')   if momentum != 0
/// g' = nesterov ? g' + momentum * buf : buf                                if momentum != 0
/// p -= lr * g'
/// ```
/// Builder methods check their value ([`Error::InvalidArgument`](crate::Error::InvalidArgument));
/// `step()` checks them all again, with the learning rate of `set_lr` and Nesterov's conditions,
/// before it updates anything.
///
/// With [parameter groups](ParamGroup) ([`Sgd::with_groups`]) a parameter's `lr` is the
/// optimizer's times its group's `lr_scale`, and its `weight_decay` its group's, or the
/// optimizer's where the group sets none.
///
/// ```no_run
/// # fn f(params: Vec<fitgrad::Tensor>) -> fitgrad::Result<()> {
/// let opt = fitgrad::optim::Sgd::new(params, 0.1)?.momentum(0.9)?.nesterov(true)?;
/// # Ok(()) }
/// ```
pub struct Sgd {
    /// The parameters (in group order) and their groups' hyperparameters.
    groups: Groups,
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    nesterov: bool,
    /// Momentum buffers, created on a parameter's first update when momentum != 0.
    bufs: Vec<Option<Tensor>>,
    param_steps: Vec<u64>,
    steps: u64,
}

impl Sgd {
    /// Plain SGD over `params` (leaves that require grad) with learning rate `lr >= 0`.
    pub fn new(params: Vec<Tensor>, lr: f32) -> Result<Sgd> {
        Self::build(Groups::single(OP, params)?, lr)
    }

    /// SGD over parameter groups, each with its own weight decay and learning-rate scale
    /// (torch's `param_groups`; see [`decay_groups`](super::decay_groups)). State and
    /// checkpoints index the parameters in group order. The builder methods apply to every
    /// group (`weight_decay` to those that set none).
    pub fn with_groups(groups: Vec<ParamGroup>, lr: f32) -> Result<Sgd> {
        Self::build(Groups::new(OP, groups)?, lr)
    }

    fn build(groups: Groups, lr: f32) -> Result<Sgd> {
        check(OP, "lr", lr, lr >= 0.0, ">= 0")?;
        let n = groups.len();
        Ok(Sgd {
            groups,
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            bufs: vec![None; n],
            param_steps: vec![0; n],
            steps: 0,
        })
    }

    /// Momentum factor (>= 0; default 0, no buffer).
    pub fn momentum(mut self, momentum: f32) -> Result<Sgd> {
        check(OP, "momentum", momentum, momentum >= 0.0, ">= 0")?;
        self.momentum = momentum;
        Ok(self)
    }

    /// Dampening of the gradient's share of the momentum buffer (finite; default 0).
    pub fn dampening(mut self, dampening: f32) -> Result<Sgd> {
        check(OP, "dampening", dampening, true, "finite")?;
        self.dampening = dampening;
        Ok(self)
    }

    /// L2 penalty added to the gradient (>= 0; default 0). Groups that set their own keep
    /// theirs.
    pub fn weight_decay(mut self, weight_decay: f32) -> Result<Sgd> {
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

    /// Nesterov momentum (default off). It needs momentum > 0 and dampening 0, which `step()`
    /// checks (so the builder calls may come in any order).
    pub fn nesterov(mut self, nesterov: bool) -> Result<Sgd> {
        self.nesterov = nesterov;
        Ok(self)
    }

    fn check_hyperparameters(&self) -> Result<()> {
        check(OP, "lr", self.lr, self.lr >= 0.0, ">= 0")?;
        check(OP, "momentum", self.momentum, self.momentum >= 0.0, ">= 0")?;
        check(OP, "dampening", self.dampening, true, "finite")?;
        let wd = self.weight_decay;
        check(OP, "weight_decay", wd, wd >= 0.0, ">= 0")?;
        if self.nesterov {
            check(
                OP,
                "momentum",
                self.momentum,
                self.momentum > 0.0,
                "> 0 with nesterov",
            )?;
            check(
                OP,
                "dampening",
                self.dampening,
                self.dampening == 0.0,
                "0 with nesterov",
            )?;
        }
        Ok(())
    }
}

impl Sgd {
    /// These hyperparameters over `groups`, with no state and no step taken.
    fn restarted(&self, groups: Groups) -> Sgd {
        let n = groups.len();
        Sgd {
            groups,
            lr: self.lr,
            momentum: self.momentum,
            dampening: self.dampening,
            weight_decay: self.weight_decay,
            nesterov: self.nesterov,
            bufs: (0..n).map(|_| None).collect(),
            param_steps: vec![0; n],
            steps: 0,
        }
    }
}

impl Optimizer for Sgd {
    fn fresh(&self) -> Box<dyn Optimizer> {
        Box::new(self.restarted(self.groups.clone()))
    }

    fn over_parts(&self, parts: Vec<Tensor>, of: &[usize]) -> Result<Box<dyn Optimizer>> {
        Ok(Box::new(self.restarted(self.groups.parts(OP, parts, of)?)))
    }

    fn name(&self) -> &'static str {
        "sgd"
    }

    fn hyperparameters(&self) -> Vec<(String, String)> {
        let mut hp = vec![
            ("momentum".to_string(), self.momentum.to_string()),
            ("dampening".to_string(), self.dampening.to_string()),
            ("weight_decay".to_string(), self.weight_decay.to_string()),
            ("nesterov".to_string(), self.nesterov.to_string()),
        ];
        hp.extend(self.groups.hyperparameters());
        hp
    }

    fn has_momentum(&self) -> bool {
        self.momentum != 0.0
    }

    fn step(&mut self) -> Result<()> {
        self.check_hyperparameters()?;
        let grads = self
            .groups
            .params
            .iter()
            .map(|p| grad_of(OP, p))
            .collect::<Result<Vec<_>>>()?;
        // State first, so that running out of memory leaves every parameter as it was.
        let mut fresh = vec![false; self.groups.len()];
        if self.momentum != 0.0 {
            let mut new = Vec::new();
            for (i, g) in grads.iter().enumerate() {
                if g.is_some() && self.bufs[i].is_none() {
                    new.push((i, zeros_like(&self.groups.params[i])?));
                }
            }
            for (i, b) in new {
                self.bufs[i] = Some(b);
                fresh[i] = true;
            }
        }
        for (i, g) in grads.iter().enumerate() {
            let Some(g) = g else { continue };
            let buf = if self.momentum != 0.0 {
                self.bufs[i].as_ref()
            } else {
                None
            };
            let hp = SgdHyper {
                lr: self.groups.lr(i, self.lr),
                weight_decay: self.groups.weight_decay(i, self.weight_decay),
                momentum: self.momentum,
                dampening: self.dampening,
                nesterov: self.nesterov,
                // A new buffer takes the gradient as it is (torch: `buf = clone(grad)`).
                first_step: fresh[i],
            };
            sgd_step(&self.groups.params[i], g, buf, &hp)?;
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
        self.bufs
            .iter()
            .enumerate()
            .filter_map(|(i, b)| Some((format!("{i}.{BUF}"), b.clone()?)))
            .collect()
    }

    fn state(&self) -> OptimizerState {
        OptimizerState {
            step_count: self.steps,
            param_steps: self.param_steps.clone(),
            tensors: self.state_tensors(),
            ..Default::default()
        }
    }

    fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        let (steps, param_steps) = (state.step_count, state.param_steps.clone());
        let slots = take_state(OP, &self.groups.params, &[BUF], state)?;
        self.bufs = slots
            .into_iter()
            .map(|s| s.and_then(|mut s| s.pop()))
            .collect();
        self.param_steps = param_steps;
        self.steps = steps;
        Ok(())
    }
}
