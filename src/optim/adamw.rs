//! Adam with decoupled weight decay (torch.optim.AdamW).

use super::groups::{Groups, ParamGroup};
use super::{check, grad_of, take_state, zeros_like, Optimizer, OptimizerState};
use crate::kernels::optim::{adamw_step, AdamWHyper};
use crate::{Result, Tensor};

const OP: &str = "AdamW";
const NAMES: [&str; 2] = ["exp_avg", "exp_avg_sq"];

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
    moments: Vec<Option<(Tensor, Tensor)>>,
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
            param_steps: vec![0; n],
            steps: 0,
        })
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
        check(OP, "weight_decay", wd, wd >= 0.0, ">= 0")
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
            param_steps: vec![0; n],
            steps: 0,
        })
    }

    fn name(&self) -> &'static str {
        "adamw"
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
        // State first, so that running out of memory leaves every parameter and state as it was.
        let mut new = Vec::new();
        for (i, g) in grads.iter().enumerate() {
            if g.is_some() && self.moments[i].is_none() {
                let p = &self.groups.params[i];
                new.push((i, (zeros_like(p)?, zeros_like(p)?)));
            }
        }
        for (i, mv) in new {
            self.moments[i] = Some(mv);
        }
        for (i, g) in grads.iter().enumerate() {
            let (Some(g), Some((m, v))) = (g, &self.moments[i]) else {
                continue;
            };
            let hp = AdamWHyper {
                lr: self.groups.lr(i, self.lr),
                weight_decay: self.groups.weight_decay(i, self.weight_decay),
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                step: self.param_steps[i] + 1,
            };
            adamw_step(&self.groups.params[i], g, m, v, &hp)?;
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
        let mut out = Vec::new();
        for (i, mv) in self.moments.iter().enumerate() {
            if let Some((m, v)) = mv {
                out.push((format!("{i}.{}", NAMES[0]), m.clone()));
                out.push((format!("{i}.{}", NAMES[1]), v.clone()));
            }
        }
        out
    }

    fn state(&self) -> OptimizerState {
        OptimizerState {
            step_count: self.steps,
            param_steps: self.param_steps.clone(),
            tensors: self.state_tensors(),
        }
    }

    fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        let (steps, param_steps) = (state.step_count, state.param_steps.clone());
        let slots = take_state(OP, &self.groups.params, &NAMES, state)?;
        self.moments = slots
            .into_iter()
            .map(|s| {
                s.map(|s| {
                    let mut it = s.into_iter();
                    (it.next().unwrap(), it.next().unwrap())
                })
            })
            .collect();
        self.param_steps = param_steps;
        self.steps = steps;
        Ok(())
    }
}
