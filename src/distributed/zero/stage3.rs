//! ZeRO stage 3's home for a model's units: each rank keeps only its shard of every unit's
//! parameters and of their summed gradients, and the streaming machinery (src/residency/)
//! materializes a unit on the device only around its work, with [`ShardedSource`] as its
//! [`UnitSource`]:
//!
//! - a fetch all-gathers the unit's shards from every rank into the streamed tensors' host
//!   copies (the staging buffer the upload reads) and uploads them, before the unit's forward
//!   and again before its recomputation in backward (FSDP's FULL_SHARD); the gather is the
//!   source's preparation, made after the work recorded so far is submitted and before any
//!   eviction (whose gradients' read-back waits for the device), so it overlaps the compute of
//!   the unit before;
//! - retiring a unit (evicted after its backward, or at the end of a step) reads its gradients
//!   back, reduce-scatters them and adds this rank's shard of the sum to the shard's gradient
//!   (the f32 addition on-device accumulation makes, so micro-batches add up), then frees them.
//!
//! Each unit has its own [`ShardLayout`], so every rank holds 1/N of every unit and a gather
//! moves each rank's part. Every rank fetches and retires the same units in the same order
//! (the same model runs the same graph), which is what pairs their collectives; a rank whose
//! unit has no gradient still takes part in its reduce-scatter with zeros. While planning
//! nothing is sent: the fetch only allocates (counted as parameters) and the bytes a ring
//! would send are counted all the same.

use super::ShardLayout;
use crate::distributed::Communicator;
use crate::residency::{HostSource, Streaming, UnitSource};
use crate::{Device, Error, Result, Tensor};
use std::sync::{Arc, Mutex, MutexGuard};

pub use crate::train::UnitTraffic;

/// One rank's shards of every unit: values, summed gradients and the bytes sent for them.
pub struct UnitShards {
    layouts: Vec<ShardLayout>,
    values: Vec<Vec<f32>>,
    grads: Vec<Option<Vec<f32>>>,
    rank: usize,
    /// The all-gathers and reduce-scatters made so far, and their results' bytes.
    traffic: UnitTraffic,
    /// Per unit: its parameters' host copies hold this rank's current values (gathered by
    /// [`Stage3::gather_host`] since the last update), so a fetch uploads them without a
    /// collective and a rank may run the model alone (evaluation, sampling on rank 0).
    current: Vec<bool>,
    /// The unit whose gather [`UnitSource::prepare`] made for the fetch that follows it.
    prepared: Option<usize>,
}

impl UnitShards {
    /// Unit `unit`'s layout over the ranks (its parameters in [`Module::units`] order).
    ///
    /// [`Module::units`]: crate::nn::Module::units
    pub fn layout(&self, unit: usize) -> &ShardLayout {
        &self.layouts[unit]
    }

    /// Units.
    pub fn units(&self) -> usize {
        self.layouts.len()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// This rank's shard of unit `unit`'s parameters (what the next fetch gathers; an
    /// optimizer updates it in place).
    pub fn values_mut(&mut self, unit: usize) -> &mut [f32] {
        &mut self.values[unit]
    }

    /// This rank's shard of unit `unit`'s parameters.
    pub fn values(&self, unit: usize) -> &[f32] {
        &self.values[unit]
    }

    /// This rank's shard of unit `unit`'s summed gradient, taken (the next step starts from
    /// zero); `None` when no retirement reached it.
    pub fn take_grad(&mut self, unit: usize) -> Option<Vec<f32>> {
        self.grads[unit].take()
    }

    /// Bytes this rank has sent for the units, counted as a ring moves them: (N-1)/N of the
    /// padded unit for each all-gather and each reduce-scatter.
    pub fn bytes_sent(&self) -> u64 {
        // Every unit's padded length is the ranks times its shard's.
        let t = &self.traffic;
        let ranks = self.layouts.first().map_or(1, |l| l.ranks()) as u64;
        (t.gathered_bytes + t.scattered_bytes) / ranks * (ranks - 1)
    }

    /// All-gathers and reduce-scatters made.
    pub fn collectives(&self) -> (u64, u64) {
        (self.traffic.gathers, self.traffic.scatters)
    }

    /// What the units' collectives moved so far (cumulative; a step's is a difference).
    pub fn traffic(&self) -> UnitTraffic {
        self.traffic
    }

    /// Elements this rank keeps per unit kind of buffer (values or gradients): the sum of the
    /// units' shard lengths.
    pub fn shard_elements(&self) -> u64 {
        self.layouts.iter().map(|l| l.shard_len() as u64).sum()
    }

    fn padded_bytes(&self, unit: usize) -> u64 {
        (self.layouts[unit].padded_len() * 4) as u64
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The [`UnitSource`] of ZeRO stage 3: units gathered from the ranks (see the module docs).
pub struct ShardedSource<C> {
    shards: Arc<Mutex<UnitShards>>,
    comm: Arc<Mutex<C>>,
}

impl<C: Communicator> ShardedSource<C> {
    fn unit_of(&self, params: &[Tensor]) -> Result<Option<usize>> {
        let Some(i) = params.iter().find_map(Tensor::stream_unit) else {
            return Ok(None);
        };
        if i >= lock(&self.shards).units() {
            return Err(Error::InvalidArgument {
                op: "ZeRO stage 3",
                reason: format!("unit {i} is not one of the units this rank shards"),
            });
        }
        Ok(Some(i))
    }
}

impl<C: Communicator> UnitSource for ShardedSource<C> {
    /// The unit's all-gather into its parameters' host copies (counted while planning, where
    /// nothing is sent). The device is handed the work recorded so far first, so it computes
    /// the unit before this one while the ranks exchange this one's shards.
    fn prepare(&mut self, params: &[Tensor]) -> Result<()> {
        let Some(i) = self.unit_of(params)? else {
            return Ok(());
        };
        let dev = params[0].device();
        let planning = dev.is_planning();
        let mut s = lock(&self.shards);
        if s.current[i] && !planning {
            // Gathered already and not updated since: the host copies are the values.
            return Ok(());
        }
        s.prepared = None;
        s.traffic.gathered_bytes += s.padded_bytes(i);
        s.traffic.gathers += 1;
        if !planning {
            dev.flush()?;
            let l = &s.layouts[i];
            let mut flat = vec![0f32; l.padded_len()];
            lock(&self.comm).all_gather_f32(&s.values[i], &mut flat)?;
            for (p, &o) in params.iter().zip(l.offsets()) {
                p.with_host(|h| h.values.copy_from_slice(&flat[o..o + p.numel()]));
            }
        }
        s.prepared = Some(i);
        Ok(())
    }

    fn fetch(&mut self, params: &[Tensor]) -> Result<u64> {
        let Some(i) = self.unit_of(params)? else {
            return Ok(0);
        };
        // Prepared just before (the residency layer's order), or prepared now: the gather, or
        // nothing where the host copies are current.
        if lock(&self.shards).prepared.take() != Some(i) {
            self.prepare(params)?;
            lock(&self.shards).prepared = None;
        }
        HostSource.fetch(params)
    }

    fn retire_grads(&mut self, params: &[Tensor], planning: bool) -> Result<u64> {
        let Some(i) = self.unit_of(params)? else {
            return Ok(0);
        };
        if params.iter().all(|p| p.grad().is_none()) {
            // A unit evicted in the forward, before its backward: nothing to exchange.
            return Ok(0);
        }
        let mut s = lock(&self.shards);
        let l = s.layouts[i].clone();
        let mut flat = vec![0f32; if planning { 0 } else { l.padded_len() }];
        let mut moved = 0;
        for (p, &o) in params.iter().zip(l.offsets()) {
            let Some(g) = p.grad() else {
                continue;
            };
            if !planning {
                flat[o..o + p.numel()].copy_from_slice(&g.to_vec_f32()?);
            }
            moved += (g.numel() * g.dtype().size()) as u64;
            p.set_grad(None)?;
        }
        s.traffic.scattered_bytes += s.padded_bytes(i);
        s.traffic.scatters += 1;
        if !planning {
            let mut shard = vec![0f32; l.shard_len()];
            lock(&self.comm).reduce_scatter(&flat, &mut shard)?;
            match &mut s.grads[i] {
                // The same f32 addition the device's in-place accumulation makes.
                Some(sum) => sum.iter_mut().zip(&shard).for_each(|(a, v)| *a += v),
                None => s.grads[i] = Some(shard),
            }
        }
        Ok(moved)
    }

    fn release(&mut self, params: &[Tensor]) {
        HostSource.release(params)
    }
}

/// Streams `units` on `device` from this rank's shards: each unit is laid out over the
/// communicator's ranks, this rank keeps its shard of the values (every rank must hold the
/// same parameters when it starts), and from then on the units are gathered from the ranks.
/// Returns the streaming (ended when dropped) and the shards.
pub fn start_stage3<C: Communicator + 'static>(
    device: &Device,
    units: Vec<(String, Vec<Tensor>)>,
    comm: Arc<Mutex<C>>,
) -> Result<(Streaming, Arc<Mutex<UnitShards>>)> {
    if units.iter().all(|(_, p)| p.is_empty()) {
        return Err(Error::InvalidArgument {
            op: "--zero 3",
            reason: crate::residency::HOW_TO_MARK_UNITS.into(),
        });
    }
    let (rank, ranks) = {
        let c = lock(&comm);
        (c.rank(), c.size())
    };
    let mut layouts = Vec::with_capacity(units.len());
    let mut values = Vec::with_capacity(units.len());
    for (_, ps) in &units {
        let numels: Vec<usize> = ps.iter().map(Tensor::numel).collect();
        let l = ShardLayout::new(&numels, ranks)?;
        let mut flat = vec![0f32; l.padded_len()];
        for (p, &o) in ps.iter().zip(l.offsets()) {
            flat[o..o + p.numel()].copy_from_slice(&p.to_vec_f32()?);
        }
        values.push(flat[l.shard(rank)].to_vec());
        layouts.push(l);
    }
    let n = units.len();
    let shards = Arc::new(Mutex::new(UnitShards {
        layouts,
        values,
        grads: vec![None; n],
        rank,
        traffic: UnitTraffic::default(),
        current: vec![false; n],
        prepared: None,
    }));
    let source = ShardedSource {
        shards: shards.clone(),
        comm,
    };
    let streaming = Streaming::start_with(device, units, Box::new(source))?;
    Ok((streaming, shards))
}

/// What a trainer's ZeRO stage 3 holds besides stage 2's: the streaming of the model's units
/// from the ranks, their shards, and this rank's pieces of each unit as device tensors (what
/// the shard optimizer updates in place; their gradients are the reduce-scattered sums).
pub(super) struct Stage3 {
    _streaming: Streaming,
    shards: Arc<Mutex<UnitShards>>,
    /// Per unit: each piece of this rank's shard and its device tensor.
    pieces: Vec<Vec<(super::Piece, Tensor)>>,
    /// Each unit's parameters.
    units: Vec<Vec<Tensor>>,
}

impl Stage3 {
    /// Shards `units` over the ranks of `comm` and streams them from there; returns the stage
    /// and, per piece tensor in [`Stage3::tensors`] order, its index in `opt_params`.
    pub fn start<C: Communicator + 'static>(
        device: &Device,
        units: Vec<(String, Vec<Tensor>)>,
        comm: Arc<Mutex<C>>,
        opt_params: &[Tensor],
    ) -> Result<(Stage3, Vec<usize>)> {
        let unit_params: Vec<Vec<Tensor>> = units.iter().map(|(_, p)| p.clone()).collect();
        let mut of = Vec::new();
        for p in unit_params.iter().flatten() {
            if p.dtype() != crate::DType::F32 {
                return Err(Error::InvalidArgument {
                    op: "--zero 3",
                    reason: format!(
                        "sharded unit parameters are f32; {p:?} is {} (use mixed precision: \
                         f32 parameters, f16 compute)",
                        p.dtype()
                    ),
                });
            }
        }
        let (streaming, shards) = start_stage3(device, units, comm)?;
        let s = lock(&shards);
        let _c = device.category_scope(crate::memory::Category::Parameters);
        let mut pieces = Vec::with_capacity(unit_params.len());
        for (u, ps) in unit_params.iter().enumerate() {
            let mut mine = Vec::new();
            for pc in s.layout(u).pieces(s.rank()) {
                let len = pc.within.len();
                let v = &s.values(u)[pc.at..pc.at + len];
                let t = Tensor::from_slice(device, v, &[len])?.with_requires_grad();
                let at = opt_params
                    .iter()
                    .position(|o| o.is_same(&ps[pc.param]))
                    .ok_or_else(|| Error::InvalidArgument {
                        op: "--zero 3",
                        reason: "a unit's parameter is not one the optimizer updates".into(),
                    })?;
                of.push(at);
                mine.push((pc, t));
            }
            pieces.push(mine);
        }
        drop(s);
        let stage = Stage3 {
            _streaming: streaming,
            shards,
            pieces,
            units: unit_params,
        };
        Ok((stage, of))
    }

    /// Every unit all-gathered from the ranks into its parameters' host copies (what reading
    /// the model returns); every rank calls it at once.
    pub fn gather_host<C: Communicator>(&self, comm: &mut C) -> Result<()> {
        let mut s = lock(&self.shards);
        for (u, params) in self.units.iter().enumerate() {
            if s.current[u] {
                continue;
            }
            let l = s.layout(u);
            let mut flat = vec![0f32; l.padded_len()];
            comm.all_gather_f32(s.values(u), &mut flat)?;
            for (p, &o) in params.iter().zip(l.offsets()) {
                p.with_host(|h| h.values.copy_from_slice(&flat[o..o + p.numel()]));
            }
            s.current[u] = true;
        }
        Ok(())
    }

    /// After the model's parameters were written (a checkpoint resumed: the units' host
    /// copies hold the whole model on every rank), this rank's shard of every unit is taken
    /// from them again, into the shards a fetch gathers and the piece tensors the optimizer
    /// updates; the host copies are current, so the next fetch needs no collective.
    pub fn take_shards_from_host(&self) -> Result<()> {
        let mut s = lock(&self.shards);
        for (u, params) in self.units.iter().enumerate() {
            let l = s.layout(u).clone();
            let mut flat = vec![0f32; l.padded_len()];
            for (p, &o) in params.iter().zip(l.offsets()) {
                let v = p.to_vec_f32()?;
                flat[o..o + v.len()].copy_from_slice(&v);
            }
            let mine = &flat[l.shard(s.rank())];
            for (pc, t) in &self.pieces[u] {
                crate::distributed::allreduce::write_into(
                    t,
                    &mine[pc.at..pc.at + pc.within.len()],
                )?;
            }
            s.values_mut(u).copy_from_slice(mine);
            s.current[u] = true;
        }
        s.prepared = None;
        Ok(())
    }

    /// The units' parameters (per unit, in [`Module::units`](crate::nn::Module::units) order).
    pub fn unit_params(&self) -> &[Vec<Tensor>] {
        &self.units
    }

    /// The units' shards (layouts, values) of this rank.
    pub fn shards(&self) -> MutexGuard<'_, UnitShards> {
        lock(&self.shards)
    }

    /// This rank's piece tensors, unit by unit.
    pub fn tensors(&self) -> Vec<Tensor> {
        self.pieces
            .iter()
            .flatten()
            .map(|(_, t)| t.clone())
            .collect()
    }

    /// Drops the reduce-scattered sums a failed step may have left (a step starts from zero).
    pub fn clear_grads(&self) {
        let mut s = lock(&self.shards);
        for u in 0..s.units() {
            s.take_grad(u);
        }
    }

    /// Gives each piece tensor its part of the step's reduce-scattered sum (zeros of its size
    /// while planning), or none when no retirement reached its unit.
    pub fn set_grads(&self, planning: bool) -> Result<()> {
        let mut s = lock(&self.shards);
        for (u, mine) in self.pieces.iter().enumerate() {
            let g = s.take_grad(u);
            for (pc, t) in mine {
                let len = pc.within.len();
                let grad = match (&g, planning) {
                    (_, true) => {
                        let dev = t.device();
                        let _c = dev.category_scope(crate::memory::Category::Gradients);
                        Some(Tensor::zeros(dev, &[len], crate::DType::F32)?)
                    }
                    (Some(g), false) => Some(crate::distributed::allreduce::new_grad(
                        t,
                        &g[pc.at..pc.at + len],
                    )?),
                    (None, false) => None,
                };
                t.set_grad(grad)?;
            }
        }
        Ok(())
    }

    /// After the update: the piece tensors' values become the shard the next fetch gathers
    /// (read back; nothing is read while planning).
    pub fn write_back(&self, planning: bool) -> Result<()> {
        if planning {
            return Ok(());
        }
        let mut s = lock(&self.shards);
        s.current.iter_mut().for_each(|c| *c = false);
        s.prepared = None;
        for (u, mine) in self.pieces.iter().enumerate() {
            for (pc, t) in mine {
                let v = t.to_vec_f32()?;
                s.values_mut(u)[pc.at..pc.at + v.len()].copy_from_slice(&v);
            }
        }
        Ok(())
    }
}
