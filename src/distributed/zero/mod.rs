//! ZeRO (Rajbhandari et al. 2019) stages 1 and 2: data parallelism that spreads the optimizer
//! state, and then the gradients, over the replicas instead of copying them to each.
//!
//! The parameters are laid end to end in one flat buffer and cut into one equal shard per
//! replica ([`ShardLayout`]). Each step, every replica's gradients are reduce-scattered, so a
//! replica receives the sums of its own shard only; the rest of the step (unscaling,
//! clipping, the finite check, the update) runs on views of that shard, the decisions taken
//! on every replica alike ([`GradientSync::any`], [`GradientSync::global_norm`]); the
//! optimizer ([`ZeroOptimizer`]) keeps state for the shard only, updates it in place and
//! all-gathers the parameters, so every replica ends the step with the same bits.
//!
//! - Stage 1 reads every gradient back at once and frees them after the exchange.
//! - Stage 2 reads them back in buckets of about [`Zero::bucket_elements`] elements during
//!   backward, each as soon as backward has completed its gradients, adding them to the
//!   step's host sums and freeing them on the device (src/distributed/zero/bucket.rs), so the
//!   full gradient set never exists on the device at once.
//!
//! A reduce-scatter plus an all-gather move what one all-reduce moves (a ring counts
//! (N-1)/N of the buffer for each, 2(N-1)/N for the all-reduce), so stages 1 and 2 send the
//! bytes of stage 0, less the loss and flags the all-reduce carries and plus the shards'
//! padding ([`Zero::collectives`] counts each collective).

mod bucket;
pub mod checkpoint;
mod layout;
mod optimizer;
mod plan;
mod stage3;

pub use layout::{Piece, ShardLayout, GRANULE};
pub use optimizer::ZeroOptimizer;
pub use plan::{Collective, CollectiveKind, RankPlan, RankPlans, StepCollectives};
pub use stage3::{start_stage3, ShardedSource, UnitShards};

use super::allreduce::{broadcast_from_rank0, check_same_run, copy_from_rank0};
use super::allreduce::{new_grad, write_into};
use super::comm::{share_of, Communicator};
use super::AllReduceStats;
use crate::memory::Category;
use crate::nn::Module;
use crate::train::{GradientSync, Trainer};
use crate::{Device, Error, Result, Tensor};
use bucket::{buckets, read_bucket, Pending};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Elements per gradient bucket of stage 2 by default (4 MiB of f32).
pub const DEFAULT_BUCKET: usize = 1 << 20;

/// Which ZeRO stage a data-parallel run uses, and stage 2's bucket size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Zero {
    stage: u8,
    bucket: usize,
}

impl Default for Zero {
    fn default() -> Self {
        Zero::OFF
    }
}

impl Zero {
    /// Stage 0: everything replicated (plain data parallelism).
    pub const OFF: Zero = Zero {
        stage: 0,
        bucket: DEFAULT_BUCKET,
    };

    /// Stage `stage`: 0 (replicated), 1 (optimizer state sharded), 2 (and gradients) or 3 (and
    /// the parameters of the model's units, each gathered around its forward and backward).
    pub fn stage(stage: u8) -> Result<Zero> {
        match stage {
            0..=3 => Ok(Zero { stage, ..Zero::OFF }),
            _ => Err(Error::InvalidArgument {
                op: "--zero",
                reason: format!("there is no ZeRO stage {stage} (0, 1, 2 or 3)"),
            }),
        }
    }

    /// The stage a `--zero` flag names (none is 0).
    pub fn from_flag(flag: Option<&str>) -> Result<Zero> {
        match flag {
            None => Ok(Zero::OFF),
            Some(s) => match s.parse::<u8>() {
                Ok(n) => Zero::stage(n),
                Err(_) => Err(Error::InvalidArgument {
                    op: "--zero",
                    reason: format!("'{s}' is not a ZeRO stage (0, 1, 2 or 3)"),
                }),
            },
        }
    }

    /// Stage 2's bucket: gradients are read back and freed about `n` elements at a time (at
    /// least one parameter per bucket).
    pub fn bucket_elements(mut self, n: usize) -> Result<Zero> {
        if n == 0 {
            return Err(Error::InvalidArgument {
                op: "Zero::bucket_elements",
                reason: "a bucket holds at least one element".into(),
            });
        }
        self.bucket = n;
        Ok(self)
    }

    /// The stage number.
    pub fn number(&self) -> u8 {
        self.stage
    }

    /// Elements per stage-2 bucket.
    pub fn bucket(&self) -> usize {
        self.bucket
    }
}

/// The trainer's [`GradientSync`] under ZeRO stages 1 and 2 (installed by [`attach_zero`]).
pub struct ZeroSync<C> {
    comm: Arc<Mutex<C>>,
    zero: Zero,
    layout: Arc<ShardLayout>,
    pieces: Vec<Piece>,
    /// One view per piece, sharing the parameter's memory and (as clones) the gradient slot
    /// the optimizer reads.
    views: Vec<Tensor>,
    device: Device,
    rank: usize,
    /// The last step exchanged: its shard sums, loss and which parameters have a gradient,
    /// reapplied when the trainer redoes that step.
    last: Option<(u64, Vec<f32>, f32, Vec<bool>)>,
    /// The model's index of each of the optimizer's parameters (the layout's order).
    order: Vec<usize>,
    /// The step's gradients read so far (stage 2 reads them during backward).
    pending: Arc<Mutex<Pending>>,
    stats: Arc<Mutex<AllReduceStats>>,
    /// Stage 3: the units sharded over the ranks (the layout above covers the other
    /// parameters).
    stage3: Option<Arc<stage3::Stage3>>,
    /// The optimizer's parameters by shard layout ([`GradientSync::shard_groups`]).
    groups: Arc<Vec<Vec<usize>>>,
    /// Stage 3: the units' traffic when the last step ended (cumulative), and that step's.
    units_seen: crate::train::UnitTraffic,
    units_step: Option<crate::train::UnitTraffic>,
}

impl<C: Communicator> ZeroSync<C> {
    fn error(&self, rank: usize, reason: String) -> Error {
        Error::Distributed { rank, reason }
    }

    /// Reads what is left of this replica's gradients on the device into the step's flat host
    /// buffer (all of them in stage 1; in stage 2 the backward hook took most bucket by
    /// bucket), freeing them, then reduce-scatters it.
    fn exchange(&mut self, step: u64, params: &[Tensor], loss: &Tensor) -> Result<()> {
        let dev = self.device.clone();
        let planning = dev.is_planning();
        let l = self.layout.clone();
        let t0 = Instant::now();
        if !planning {
            dev.sync()?;
        }
        let t1 = Instant::now();
        let (flat, has) = {
            let mut pending = crate::device::lock(&self.pending);
            if !planning && pending.step != Some(step) {
                pending.reset(step, l.padded_len(), params.len());
            }
            for b in buckets(l.numels(), self.zero) {
                read_bucket(&dev, &l, params, b, &mut pending, planning)?;
            }
            for p in params {
                p.zero_grad();
            }
            if planning {
                return Ok(());
            }
            pending.step = None;
            (
                std::mem::take(&mut pending.flat),
                std::mem::take(&mut pending.has),
            )
        };
        let t2 = Instant::now();
        let mut comm = crate::device::lock(&self.comm);
        let (rank, size) = (comm.rank(), comm.size());
        let mut shard = vec![0f32; l.shard_len()];
        comm.reduce_scatter(&flat, &mut shard)?;
        // The step check, the loss and the gradient flags in one small all-gather: every
        // replica sums the losses in rank order and ORs the flags, so all agree.
        let local_loss = loss.item()?;
        let mut words = vec![step, flat.len() as u64, u64::from(local_loss.to_bits())];
        words.extend(has.chunks(64).map(|c| {
            c.iter()
                .enumerate()
                .fold(0u64, |w, (k, &h)| w | (u64::from(h) << k))
        }));
        let all = comm.all_gather(&words)?;
        drop(comm);
        let w = words.len();
        let at = |r: usize, k: usize| all[r * w + k];
        if let Some(r) = (0..size).find(|&r| at(r, 0) != step || at(r, 1) != flat.len() as u64) {
            return Err(self.error(
                rank,
                format!(
                    "rank {r} was at step {} with {} reduce-scatter values while rank {rank} was \
                     at step {step} with {}: the ranks no longer run the same steps",
                    at(r, 0),
                    at(r, 1),
                    flat.len()
                ),
            ));
        }
        let loss_sum = (0..size).fold(0f32, |s, r| s + f32::from_bits(at(r, 2) as u32));
        let flags: Vec<bool> = (0..params.len())
            .map(|i| (0..size).any(|r| at(r, 3 + i / 64) >> (i % 64) & 1 == 1))
            .collect();
        let t3 = Instant::now();
        let mut st = crate::device::lock(&self.stats);
        st.steps += 1;
        st.buffer_bytes = (flat.len() * 4) as u64;
        st.backward_wait += t1 - t0;
        st.gather += t2 - t1;
        st.communicate += t3 - t2;
        drop(st);
        self.last = Some((step, shard, loss_sum, flags));
        Ok(())
    }
}

impl<C: Communicator> GradientSync for ZeroSync<C> {
    fn share(&self, n: usize) -> Range<usize> {
        let l = &self.layout;
        share_of(n, self.rank, l.ranks())
    }

    fn reduce(&mut self, step: u64, model_params: &[Tensor], loss: &Tensor) -> Result<()> {
        let params: Vec<Tensor> = self
            .order
            .iter()
            .map(|&m| model_params[m].clone())
            .collect();
        let params = &params[..];
        let planning = self.device.is_planning();
        if planning || !matches!(&self.last, Some((s, ..)) if *s == step) {
            self.exchange(step, params, loss)?;
        } else {
            // A step redone (after an out-of-memory): its sums were exchanged already.
            for p in params {
                p.zero_grad();
            }
        }
        let t = Instant::now();
        let _c = self.device.category_scope(Category::Gradients);
        for (piece, view) in self.pieces.iter().zip(&self.views) {
            let len = piece.within.len();
            let g = if planning {
                Some(Tensor::zeros(
                    &self.device,
                    &[len],
                    params[piece.param].dtype(),
                )?)
            } else {
                let (_, shard, _, flags) = self.last.as_ref().expect("exchanged");
                match flags[piece.param] {
                    true => Some(new_grad(view, &shard[piece.at..piece.at + len])?),
                    false => None,
                }
            };
            view.set_grad(g)?;
        }
        if let Some(s3) = &self.stage3 {
            s3.set_grads(planning)?;
            // Every unit's gradients were retired before the exchange; the next step's first
            // gather comes after it.
            let now = s3.shards().traffic();
            self.units_step = Some(now.since(&self.units_seen));
            self.units_seen = now;
        }
        if let Some((_, _, loss_sum, _)) = &self.last {
            if !planning {
                write_into(loss, &[*loss_sum])?;
            }
        }
        crate::device::lock(&self.stats).scatter += t.elapsed();
        Ok(())
    }

    fn sync_buffers(&mut self, buffers: &[Tensor]) -> Result<()> {
        broadcast_from_rank0(&mut *crate::device::lock(&self.comm), buffers)
    }

    /// Stage 2: a hook that reads and frees each bucket's gradients as soon as backward has
    /// completed them (the step's host sums start at its first micro-batch).
    fn backward_hook(
        &mut self,
        step: u64,
        model_params: &[Tensor],
        first: bool,
    ) -> Result<Option<crate::tensor::autograd::LeafHook>> {
        if self.zero.stage < 2 {
            return Ok(None);
        }
        let params: Vec<Tensor> = self
            .order
            .iter()
            .map(|&m| model_params[m].clone())
            .collect();
        if first {
            if let Some(s3) = &self.stage3 {
                s3.clear_grads();
            }
        }
        if first && !self.device.is_planning() {
            let l = &self.layout;
            crate::device::lock(&self.pending).reset(step, l.padded_len(), params.len());
        }
        Ok(Some(bucket::hook(
            self.device.clone(),
            self.layout.clone(),
            params,
            self.zero,
            self.pending.clone(),
        )))
    }

    fn gather_parameters(&self) -> Result<()> {
        match &self.stage3 {
            Some(s3) => s3.gather_host(&mut *crate::device::lock(&self.comm)),
            None => Ok(()),
        }
    }

    fn parameters_written(&mut self) -> Result<()> {
        match &self.stage3 {
            Some(s3) => s3.take_shards_from_host(),
            None => Ok(()),
        }
    }

    fn shard_groups(&self) -> Option<Vec<Vec<usize>>> {
        Some(self.groups.to_vec())
    }

    fn unit_traffic(&self) -> Option<crate::train::UnitTraffic> {
        self.units_step
    }

    fn step_tensors(&self) -> Option<Vec<Tensor>> {
        let mut all = self.views.clone();
        if let Some(s3) = &self.stage3 {
            all.extend(s3.tensors());
        }
        Some(all)
    }

    fn any(&mut self, local: bool) -> Result<bool> {
        if self.device.is_planning() {
            return Ok(local);
        }
        let all = crate::device::lock(&self.comm).all_gather(&[u64::from(local)])?;
        Ok(all.iter().any(|&v| v != 0))
    }

    fn global_norm(&mut self, local: f32) -> Result<f32> {
        // While planning nothing is sent: ranks may plan different numbers of steps.
        if self.device.is_planning() {
            return Ok(local);
        }
        let all = crate::device::lock(&self.comm).all_gather(&[u64::from(local.to_bits())])?;
        // Rank order in f64: the same norm on every replica.
        let sq: f64 = all
            .iter()
            .map(|&b| f64::from(f32::from_bits(b as u32)).powi(2))
            .sum();
        Ok(sq.sqrt() as f32)
    }
}

/// Makes `trainer` one member of data-parallel training over `comm` at ZeRO stage `zero`
/// (stage 0 is [`attach`](super::attach)). Checks that every member holds the same model,
/// settings and stage, copies rank 0's parameters to the others, replaces the optimizer by a
/// [`ZeroOptimizer`] over this member's shard (same hyperparameters, no state yet: attach
/// before the first step) and installs the [`ZeroSync`]. Every member calls it at the same
/// point.
///
/// At stage 3 the model may be made inside
/// [`born_on_host`](crate::residency::born_on_host) (DeepSpeed's `zero.Init`), so no device
/// ever holds it whole: its trainer streams the units from host memory until this call, which
/// ends that streaming (and the optimizer offload the birth turned on) and takes each rank's
/// shard of every unit from the host values. A trainer whose configuration asks for
/// streamed parameters (`offload_parameters`) is refused at stage 3.
pub fn attach_zero<M: Module, C: Communicator + 'static>(
    trainer: &mut Trainer<M>,
    mut comm: C,
    zero: Zero,
) -> Result<Arc<Mutex<AllReduceStats>>> {
    if zero.stage == 0 {
        return super::attach(trainer, comm);
    }
    let op = "distributed::attach_zero";
    if trainer.has_gradient_sync() {
        return Err(Error::InvalidArgument {
            op,
            reason: "this trainer is already a data-parallel replica".into(),
        });
    }
    if trainer.optimizer.step_count() > 0 {
        return Err(Error::InvalidArgument {
            op,
            reason: "the optimizer has taken steps already; make a trainer a ZeRO replica \
                     before it trains or resumes (the shard's state is made from then on)"
                .into(),
        });
    }
    check_same_run(trainer, &mut comm, &[format!("zero stage {}", zero.stage)])?;
    copy_from_rank0(trainer, &mut comm)?;
    // The shards follow the optimizer's order of the parameters (its groups may reorder the
    // model's), so its per-parameter settings and its state's names stay its own.
    let model_params = trainer.model.parameters();
    let params: Vec<Tensor> = trainer.optimizer.params().to_vec();
    let order = params
        .iter()
        .map(|p| model_params.iter().position(|m| m.is_same(p)))
        .collect::<Option<Vec<usize>>>()
        .filter(|o| o.len() == model_params.len())
        .ok_or_else(|| Error::InvalidArgument {
            op,
            reason: "the optimizer does not hold exactly the model's parameters; ZeRO shards \
                     the parameters the optimizer updates"
                .into(),
        })?;
    let device = trainer.device().clone();
    let comm = Arc::new(Mutex::new(comm));
    // Stage 3: the units' parameters go to the ranks' shards; the layout covers the rest.
    let (stage3, unit_of) = match zero.stage {
        3 => {
            let units = trainer.model.units();
            if units.iter().all(|(_, p)| p.is_empty()) {
                return Err(Error::InvalidArgument {
                    op: "--zero 3",
                    reason: crate::residency::HOW_TO_MARK_UNITS.into(),
                });
            }
            // A model made in host memory streams from there until now; from here on its
            // units stream from the ranks, each keeping its shard of the host values.
            trainer.end_born_streaming("--zero 3")?;
            let (s3, of) = stage3::Stage3::start(&device, units, comm.clone(), &params)?;
            (Some(Arc::new(s3)), of)
        }
        _ => (None, Vec::new()),
    };
    let in_units: Vec<bool> = match &stage3 {
        Some(_) => {
            let units = trainer.model.units();
            let unit_params: Vec<&Tensor> = units.iter().flat_map(|(_, p)| p.iter()).collect();
            params
                .iter()
                .map(|p| unit_params.iter().any(|u| u.is_same(p)))
                .collect()
        }
        None => vec![false; params.len()],
    };
    let flat_idx: Vec<usize> = (0..params.len()).filter(|&k| !in_units[k]).collect();
    // The groups laid out over the ranks, as indices into the optimizer's parameters: those in
    // no unit, then each unit's (in the order its layout lists them).
    let mut groups = vec![flat_idx.clone()];
    if let Some(s3) = &stage3 {
        for ps in s3.unit_params() {
            groups.push(
                ps.iter()
                    .filter_map(|u| params.iter().position(|p| p.is_same(u)))
                    .collect(),
            );
        }
    }
    let groups = Arc::new(groups);
    let all_params = params.clone();
    let params: Vec<Tensor> = flat_idx.iter().map(|&k| all_params[k].clone()).collect();
    let order: Vec<usize> = flat_idx.iter().map(|&k| order[k]).collect();
    let (rank, size) = {
        let c = crate::device::lock(&comm);
        (c.rank(), c.size())
    };
    let numels: Vec<usize> = params.iter().map(Tensor::numel).collect();
    let layout = Arc::new(ShardLayout::new(&numels, size)?);
    let pieces = layout.pieces(rank);
    let views = pieces
        .iter()
        .map(|pc| {
            let v = params[pc.param].range_view(pc.within.start, pc.within.len())?;
            Ok(v.with_requires_grad())
        })
        .collect::<Result<Vec<Tensor>>>()?;
    let mut of: Vec<usize> = pieces.iter().map(|pc| flat_idx[pc.param]).collect();
    let mut parts = views.clone();
    if let Some(s3) = &stage3 {
        parts.extend(s3.tensors());
        of.extend(unit_of);
    }
    let inner = match parts.is_empty() {
        true => None,
        false => Some(trainer.optimizer.over_parts(parts, &of)?),
    };
    let stats = Arc::new(Mutex::new(AllReduceStats::default()));
    let opt = ZeroOptimizer::new(
        trainer.optimizer.as_ref(),
        inner,
        params,
        views.clone(),
        layout.clone(),
        rank,
        comm.clone(),
    )
    .with_stage3(all_params, stage3.clone(), groups.clone());
    trainer.optimizer = Box::new(opt);
    trainer.set_gradient_sync(Some(Box::new(ZeroSync {
        comm,
        zero,
        layout,
        pieces,
        views,
        device,
        rank,
        last: None,
        order,
        pending: Arc::default(),
        stats: stats.clone(),
        stage3,
        groups,
        units_seen: Default::default(),
        units_step: None,
    })));
    Ok(stats)
}
