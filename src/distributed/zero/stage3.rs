//! ZeRO stage 3's home for a model's units: each rank keeps only its shard of every unit's
//! parameters and of their summed gradients, and the streaming machinery (src/residency/)
//! materializes a unit on the device only around its work, with [`ShardedSource`] as its
//! [`UnitSource`]:
//!
//! - a fetch all-gathers the unit's shards from every rank into the streamed tensors' host
//!   copies (the staging buffer the upload reads) and uploads them, before the unit's forward
//!   and again before its recomputation in backward (FSDP's FULL_SHARD);
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

/// One rank's shards of every unit: values, summed gradients and the bytes sent for them.
pub struct UnitShards {
    layouts: Vec<ShardLayout>,
    values: Vec<Vec<f32>>,
    grads: Vec<Option<Vec<f32>>>,
    rank: usize,
    sent: u64,
    gathers: u64,
    scatters: u64,
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
        self.sent
    }

    /// All-gathers and reduce-scatters made.
    pub fn collectives(&self) -> (u64, u64) {
        (self.gathers, self.scatters)
    }

    /// Elements this rank keeps per unit kind of buffer (values or gradients): the sum of the
    /// units' shard lengths.
    pub fn shard_elements(&self) -> u64 {
        self.layouts.iter().map(|l| l.shard_len() as u64).sum()
    }

    fn ring_bytes(&self, unit: usize) -> u64 {
        let l = &self.layouts[unit];
        ((l.ranks() - 1) * l.shard_len() * 4) as u64
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
    fn fetch(&mut self, params: &[Tensor]) -> Result<u64> {
        let Some(i) = self.unit_of(params)? else {
            return Ok(0);
        };
        let planning = params[0].device().is_planning();
        {
            let mut s = lock(&self.shards);
            s.sent += s.ring_bytes(i);
            s.gathers += 1;
            if !planning {
                let l = &s.layouts[i];
                let mut flat = vec![0f32; l.padded_len()];
                lock(&self.comm).all_gather_f32(&s.values[i], &mut flat)?;
                for (p, &o) in params.iter().zip(l.offsets()) {
                    p.with_host(|h| h.values.copy_from_slice(&flat[o..o + p.numel()]));
                }
            }
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
        s.sent += s.ring_bytes(i);
        s.scatters += 1;
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
        sent: 0,
        gathers: 0,
        scatters: 0,
    }));
    let source = ShardedSource {
        shards: shards.clone(),
        comm,
    };
    let streaming = Streaming::start_with(device, units, Box::new(source))?;
    Ok((streaming, shards))
}
