//! [`ZeroOptimizer`]: the trainer's optimizer under ZeRO. It keeps state for this replica's
//! shard only (an optimizer of the same kind over views of the shard's pieces, which may start
//! and end inside a tensor), updates the shard in place, then all-gathers the parameters so
//! every replica holds all of them, bit for bit the same.

use super::{Piece, ShardLayout};
use crate::distributed::allreduce::{gather, write_into};
use crate::distributed::Communicator;
use crate::memory::Category;
use crate::optim::{Optimizer, OptimizerState};
use crate::{Error, Result, Tensor};
use std::sync::{Arc, Mutex};

/// One replica's optimizer under ZeRO (made by [`attach_zero`](super::attach_zero)).
pub struct ZeroOptimizer<C> {
    /// The optimizer over this replica's pieces; `None` when its shard is only padding.
    inner: Option<Box<dyn Optimizer>>,
    /// The parameters all-gathered after each update (all of them below stage 3, the ones in
    /// no unit at stage 3).
    gathered: Vec<Tensor>,
    /// The views the inner optimizer updates, one per piece of this replica's shard.
    views: Vec<Tensor>,
    layout: Arc<ShardLayout>,
    rank: usize,
    comm: Arc<Mutex<C>>,
    name: &'static str,
    /// The state tensors per parameter of the original optimizer ("exp_avg", ...).
    state_names: Vec<&'static str>,
    hyperparameters: Vec<(String, String)>,
    lr: f32,
    steps: u64,
    /// Every parameter of the model.
    params: Vec<Tensor>,
    /// Stage 3's sharded units: their pieces are updated with the rest, then become the
    /// shard the next fetch gathers.
    stage3: Option<Arc<super::stage3::Stage3>>,
    /// The parameters by shard layout, as indices into `params`: those of `layout`, then each
    /// unit's at stage 3.
    groups: Arc<Vec<Vec<usize>>>,
}

impl<C: Communicator> ZeroOptimizer<C> {
    pub(super) fn new(
        original: &dyn Optimizer,
        inner: Option<Box<dyn Optimizer>>,
        params: Vec<Tensor>,
        views: Vec<Tensor>,
        layout: Arc<ShardLayout>,
        rank: usize,
        comm: Arc<Mutex<C>>,
    ) -> ZeroOptimizer<C> {
        let all_params = params.clone();
        ZeroOptimizer {
            inner,
            gathered: params,
            views,
            layout,
            rank,
            comm,
            name: original.name(),
            state_names: match (original.name(), original.has_momentum()) {
                ("sgd", true) => vec!["momentum_buffer"],
                ("sgd", false) => vec![],
                _ => vec!["exp_avg", "exp_avg_sq"],
            },
            hyperparameters: original.hyperparameters(),
            lr: original.lr(),
            steps: 0,
            groups: Arc::new(vec![(0..all_params.len()).collect()]),
            params: all_params,
            stage3: None,
        }
    }

    /// `all` the model's parameters, the sharded units at stage 3, and the parameters by
    /// shard layout (indices into `all`: the flat layout's, then each unit's).
    pub(super) fn with_stage3(
        mut self,
        all: Vec<Tensor>,
        stage3: Option<Arc<super::stage3::Stage3>>,
        groups: Arc<Vec<Vec<usize>>>,
    ) -> ZeroOptimizer<C> {
        self.params = all;
        self.stage3 = stage3;
        self.groups = groups;
        self
    }

    /// Each shard layout with its parameters' indices in `params`: the flat layout's, then at
    /// stage 3 each unit's. This rank's pieces of them, in this order, are the inner
    /// optimizer's parts.
    fn layouts(&self) -> Vec<(ShardLayout, Vec<usize>)> {
        let mut out = vec![(ShardLayout::clone(&self.layout), self.groups[0].clone())];
        if let Some(s3) = &self.stage3 {
            let sh = s3.shards();
            for (u, at) in self.groups[1..].iter().enumerate() {
                out.push((sh.layout(u).clone(), at.clone()));
            }
        }
        out
    }

    /// This replica's pieces of the parameters (what its state covers).
    pub fn pieces(&self) -> Vec<Piece> {
        self.layout.pieces(self.rank)
    }

    /// The layout of the shards.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// Reads this replica's updated shard back (one buffer, counted as communication),
    /// all-gathers every replica's, and writes the parameters.
    fn all_gather_parameters(&mut self) -> Result<()> {
        let Some(first) = self.gathered.first() else {
            return Ok(());
        };
        let dev = first.device().clone();
        let l = &self.layout;
        let pieces = l.pieces(self.rank);
        let present: Vec<Option<Tensor>> = self.views.iter().map(|v| Some(v.clone())).collect();
        let at: Vec<usize> = pieces.iter().map(|p| p.at).collect();
        let shard = {
            let _c = dev.category_scope(Category::Communication);
            gather(&dev, &present, &at, l.shard_len(), None)?
        };
        if dev.is_planning() {
            return Ok(());
        }
        let mut flat = vec![0f32; l.padded_len()];
        crate::device::lock(&self.comm).all_gather_f32(&shard, &mut flat)?;
        for (p, &o) in self.gathered.iter().zip(l.offsets()) {
            if p.numel() > 0 {
                write_into(p, &flat[o..o + p.numel()])?;
            }
        }
        Ok(())
    }
}

impl<C: Communicator> ZeroOptimizer<C> {
    /// The whole state, as one optimizer over all the parameters holds it: every replica's
    /// shard of each state tensor all-gathered (every replica calls it at once). At stage 3
    /// each unit's shard is gathered the same way, by the unit's own layout. The tensors stay
    /// in host memory ([`OptimizerState::host`]): the whole state on the device would pass the
    /// budget a sharded step fits in.
    fn consolidated(&self) -> Result<OptimizerState> {
        let shard_state = self
            .inner
            .as_ref()
            .map_or_else(OptimizerState::default, |o| o.state());
        let groups = self.layouts();
        let n = self.params.len();
        let mut steps = vec![0u64; n];
        let mut j = 0;
        for (gl, at) in &groups {
            for pc in gl.pieces(self.rank) {
                steps[at[pc.param]] = shard_state.param_steps.get(j).copied().unwrap_or(0);
                j += 1;
            }
        }
        let mut comm = crate::device::lock(&self.comm);
        let all = comm.all_gather(&steps)?;
        let param_steps: Vec<u64> = (0..n)
            .map(|i| (0..comm.size()).map(|r| all[r * n + i]).max().unwrap_or(0))
            .collect();
        let find = |j: usize, name: &str| {
            let key = format!("{j}.{name}");
            shard_state.tensors.iter().find(|(k, _)| *k == key)
        };
        let mut host = Vec::new();
        for name in &self.state_names {
            // This rank's pieces of each group follow the previous groups' among the parts.
            let mut first = 0;
            for (gl, at) in &groups {
                let pieces = gl.pieces(self.rank);
                let mut shard = vec![0f32; gl.shard_len()];
                for (k, pc) in pieces.iter().enumerate() {
                    if let Some((_, t)) = find(first + k, name) {
                        let v = t.to_vec_f32()?;
                        shard[pc.at..pc.at + v.len()].copy_from_slice(&v);
                    }
                }
                first += pieces.len();
                let mut flat = vec![0f32; gl.padded_len()];
                comm.all_gather_f32(&shard, &mut flat)?;
                for (&i, &o) in at.iter().zip(gl.offsets()) {
                    if param_steps[i] > 0 {
                        let p = &self.params[i];
                        host.push(crate::optim::HostTensorState {
                            name: format!("{i}.{name}"),
                            dims: p.dims().to_vec(),
                            values: flat[o..o + p.numel()].to_vec(),
                        });
                    }
                }
            }
        }
        Ok(OptimizerState {
            step_count: self.steps,
            param_steps,
            host,
            ..OptimizerState::default()
        })
    }

    /// This replica's pieces of a whole state (a consolidated checkpoint's, from any number of
    /// replicas), named as the shard optimizer names them.
    fn shard_of(&self, state: OptimizerState) -> Result<OptimizerState> {
        let invalid = |reason: String| Error::InvalidArgument {
            op: "ZeroOptimizer::load_state",
            reason,
        };
        if !state.codes.is_empty() || !state.host.is_empty() {
            return Err(invalid("8-bit or host state does not shard".into()));
        }
        let n = self.params.len();
        if state.param_steps.len() != n {
            return Err(invalid(format!(
                "the state has steps for {} parameters, the model has {n}",
                state.param_steps.len(),
            )));
        }
        // This rank's pieces, group after group (the inner optimizer's parts), each with the
        // index of its parameter in `params`.
        let pieces: Vec<(usize, super::Piece)> = self
            .layouts()
            .into_iter()
            .flat_map(|(gl, at)| {
                gl.pieces(self.rank)
                    .into_iter()
                    .map(move |pc| (at[pc.param], pc))
            })
            .collect();
        let mut tensors = Vec::new();
        for (key, t) in &state.tensors {
            let Some((i, name)) = key
                .split_once('.')
                .and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n)))
                .filter(|(i, _)| *i < n)
            else {
                return Err(invalid(format!("unknown state tensor '{key}'")));
            };
            if t.numel() != self.params[i].numel() {
                return Err(Error::Shape {
                    op: "ZeroOptimizer::load_state",
                    lhs: self.params[i].dims().to_vec(),
                    rhs: t.dims().to_vec(),
                    reason: format!("state tensor '{key}' does not fit its parameter"),
                });
            }
            let values = t.to_vec_f32()?;
            for (j, (_, pc)) in pieces.iter().enumerate().filter(|(_, (p, _))| *p == i) {
                let v = &values[pc.within.clone()];
                let piece = Tensor::from_slice(t.device(), v, &[v.len()])?;
                tensors.push((format!("{j}.{name}"), piece));
            }
        }
        Ok(OptimizerState {
            step_count: state.step_count,
            param_steps: pieces.iter().map(|(i, _)| state.param_steps[*i]).collect(),
            tensors,
            ..OptimizerState::default()
        })
    }
}

impl<C: Communicator + 'static> Optimizer for ZeroOptimizer<C> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn has_momentum(&self) -> bool {
        self.inner.as_ref().is_some_and(|o| o.has_momentum())
    }

    fn step(&mut self) -> Result<()> {
        if let Some(inner) = self.inner.as_mut() {
            inner.set_lr(self.lr);
            inner.step()?;
        }
        self.all_gather_parameters()?;
        if let Some(s3) = &self.stage3 {
            let planning = self
                .params
                .first()
                .is_some_and(|p| p.device().is_planning());
            s3.write_back(planning)?;
        }
        self.steps += 1;
        Ok(())
    }

    fn zero_grad(&mut self) {
        for t in self.gathered.iter().chain(&self.views) {
            t.zero_grad();
        }
        if let Some(s3) = &self.stage3 {
            s3.tensors().iter().for_each(Tensor::zero_grad);
        }
    }

    fn lr(&self) -> f32 {
        self.lr
    }

    fn set_lr(&mut self, lr: f32) {
        self.lr = lr;
    }

    /// The model's parameters (every replica updates all of them: its shard by the update,
    /// the rest by the all-gather).
    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn step_count(&self) -> u64 {
        self.steps
    }

    /// This replica's shard of the state, named by piece (`"{piece}.{name}"`, see
    /// [`ZeroOptimizer::pieces`]).
    fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.inner
            .as_ref()
            .map_or_else(Vec::new, |o| o.state_tensors())
    }

    fn hyperparameters(&self) -> Vec<(String, String)> {
        self.hyperparameters.clone()
    }

    fn state(&self) -> OptimizerState {
        let mut s = self
            .inner
            .as_ref()
            .map_or_else(OptimizerState::default, |o| o.state());
        s.step_count = self.steps;
        s
    }

    fn checkpoint_state(&self) -> Result<OptimizerState> {
        self.consolidated()
    }

    /// Takes a whole state ([`Optimizer::checkpoint_state`]'s, from any number of replicas or
    /// one process) and keeps this replica's pieces of it.
    fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        let state = self.shard_of(state)?;
        let steps = state.step_count;
        match self.inner.as_mut() {
            Some(o) => o.load_state(state)?,
            None if state.tensors.is_empty() => {}
            None => {
                return Err(Error::InvalidArgument {
                    op: "ZeroOptimizer::load_state",
                    reason: "state given to a replica whose shard holds no parameter".into(),
                })
            }
        }
        self.steps = steps;
        Ok(())
    }

    fn fresh(&self) -> Box<dyn Optimizer> {
        Box::new(ZeroOptimizer {
            inner: self.inner.as_ref().map(|o| o.fresh()),
            gathered: self.gathered.clone(),
            views: self.views.clone(),
            layout: self.layout.clone(),
            rank: self.rank,
            comm: self.comm.clone(),
            name: self.name,
            state_names: self.state_names.clone(),
            hyperparameters: self.hyperparameters.clone(),
            lr: self.lr,
            steps: 0,
            params: self.params.clone(),
            stage3: self.stage3.clone(),
            groups: self.groups.clone(),
        })
    }
}
