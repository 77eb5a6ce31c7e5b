//! Parameter groups (torch's `param_groups`): per-group weight decay and learning-rate scale,
//! and [`decay_groups`], the usual split that exempts biases and norm gains from weight decay.

use super::{check, check_params};
use crate::{Result, Tensor};

/// Parameters that share hyperparameters within an optimizer ([`AdamW::with_groups`],
/// [`Sgd::with_groups`]), built with [`ParamGroup::new`] and the chained setters (new options
/// may be added).
///
/// [`AdamW::with_groups`]: super::AdamW::with_groups
/// [`Sgd::with_groups`]: super::Sgd::with_groups
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ParamGroup {
    /// The group's parameters (leaves that require grad).
    pub params: Vec<Tensor>,
    /// This group's weight decay (>= 0); `None` takes the optimizer's (its builder's
    /// `weight_decay`, or its default).
    pub weight_decay: Option<f32>,
    /// This group's learning rate is the optimizer's times this (>= 0; default 1), so schedules
    /// and `set_lr` move every group together.
    pub lr_scale: f32,
}

impl ParamGroup {
    /// A group with the optimizer's weight decay and learning rate.
    pub fn new(params: Vec<Tensor>) -> ParamGroup {
        ParamGroup {
            params,
            weight_decay: None,
            lr_scale: 1.0,
        }
    }

    /// Sets this group's weight decay (checked by the optimizer's constructor).
    pub fn weight_decay(mut self, weight_decay: f32) -> ParamGroup {
        self.weight_decay = Some(weight_decay);
        self
    }

    /// Sets this group's learning-rate multiplier (checked by the optimizer's constructor).
    pub fn lr_scale(mut self, lr_scale: f32) -> ParamGroup {
        self.lr_scale = lr_scale;
        self
    }
}

/// Splits named parameters into `[decayed, not decayed]` groups, the rule of nanoGPT and most
/// transformer recipes: tensors of rank >= 2 (weight matrices, embeddings) get `weight_decay`;
/// tensors of rank < 2 (biases, LayerNorm / RMSNorm gains, scalars) and any tensor whose name's
/// last dotted part contains "bias" (a bias stored as (1, N)) get 0. The order within each group
/// is the input's. Either group may be empty.
///
/// ```no_run
/// # fn f(model: &impl fitgrad::nn::Module) -> fitgrad::Result<()> {
/// use fitgrad::optim::{decay_groups, AdamW};
/// let opt = AdamW::with_groups(decay_groups(model.named_parameters(), 0.1), 3e-4)?;
/// # Ok(()) }
/// ```
pub fn decay_groups(named: Vec<(String, Tensor)>, weight_decay: f32) -> Vec<ParamGroup> {
    let (mut decay, mut none) = (Vec::new(), Vec::new());
    for (name, t) in named {
        let last = name.rsplit('.').next().unwrap_or(&name);
        if t.rank() < 2 || last.contains("bias") {
            none.push(t);
        } else {
            decay.push(t);
        }
    }
    vec![
        ParamGroup::new(decay).weight_decay(weight_decay),
        ParamGroup::new(none).weight_decay(0.0),
    ]
}

/// The groups of one optimizer, flattened: its parameters in group order (the indices its state
/// and checkpoints use) and each one's hyperparameters.
#[derive(Clone)]
pub(super) struct Groups {
    pub params: Vec<Tensor>,
    /// Per group: (weight decay override, lr scale).
    hyper: Vec<(Option<f32>, f32)>,
    /// Per parameter: its group.
    group_of: Vec<usize>,
}

impl Groups {
    /// Each group's hyperparameters as text (`"0.weight_decay"`, `"0.lr_scale"`; an override
    /// of none is `"default"`), for checkpoints; f32s in their shortest exact form.
    pub fn hyperparameters(&self) -> Vec<(String, String)> {
        let mut out = vec![("groups".to_string(), self.hyper.len().to_string())];
        for (i, (wd, scale)) in self.hyper.iter().enumerate() {
            let wd = wd.map_or("default".to_string(), |w| w.to_string());
            out.push((format!("{i}.weight_decay"), wd));
            out.push((format!("{i}.lr_scale"), scale.to_string()));
        }
        out
    }

    /// Checks every group's hyperparameters and the flattened parameter list (non-empty, leaves
    /// that require grad, one device, no tensor twice, also across groups).
    pub fn new(op: &'static str, groups: Vec<ParamGroup>) -> Result<Groups> {
        let mut out = Groups {
            params: Vec::new(),
            hyper: Vec::new(),
            group_of: Vec::new(),
        };
        for (k, g) in groups.into_iter().enumerate() {
            if let Some(wd) = g.weight_decay {
                check(
                    op,
                    &format!("group {k} weight_decay"),
                    wd,
                    wd >= 0.0,
                    ">= 0",
                )?;
            }
            let s = g.lr_scale;
            check(op, &format!("group {k} lr_scale"), s, s >= 0.0, ">= 0")?;
            out.hyper.push((g.weight_decay, g.lr_scale));
            out.group_of.extend(std::iter::repeat_n(k, g.params.len()));
            out.params.extend(g.params);
        }
        check_params(op, &out.params)?;
        Ok(out)
    }

    /// One group holding `params`, with the optimizer's hyperparameters.
    /// The same groups over `parts`, `parts[j]` a range of parameter `of[j]` (in its group).
    pub fn parts(&self, op: &'static str, parts: Vec<Tensor>, of: &[usize]) -> Result<Groups> {
        if !parts.is_empty() {
            check_params(op, &parts)?;
        }
        Ok(Groups {
            params: parts,
            hyper: self.hyper.clone(),
            group_of: of.iter().map(|&i| self.group_of[i]).collect(),
        })
    }

    pub fn single(op: &'static str, params: Vec<Tensor>) -> Result<Groups> {
        Self::new(op, vec![ParamGroup::new(params)])
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// Parameter `i`'s learning rate when the optimizer's is `lr`.
    pub fn lr(&self, i: usize, lr: f32) -> f32 {
        let s = self.hyper[self.group_of[i]].1;
        if s == 1.0 {
            lr
        } else {
            (lr as f64 * s as f64) as f32
        }
    }

    /// Parameter `i`'s weight decay when the optimizer's is `default`.
    pub fn weight_decay(&self, i: usize, default: f32) -> f32 {
        self.hyper[self.group_of[i]].0.unwrap_or(default)
    }
}
