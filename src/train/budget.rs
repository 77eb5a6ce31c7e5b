//! The micro-batch from plans: the largest that fits a budget ([`Trainer::fit_to_budget`]) or
//! the adapter's limits ([`Trainer::fit_to_limits`]), the model built under a budget
//! ([`Trainer::build_within_budget`]), the check against the device's memory, and the arena
//! preallocated to the planned peak ([`Trainer::prealloc`]).

use super::model::{BatchSource, TrainModel};
use super::plan::Plan;
use super::Trainer;
use crate::error::Bytes;
use crate::nn::Module;
use crate::{Device, Error, Result};

impl<M: Module> Trainer<M> {
    /// Chooses the largest micro-batch whose planned step fits `budget` bytes (the effective
    /// batch stays: more micro-batches accumulate) and returns it. A budget too small for one
    /// sample is [`Error::BudgetTooSmall`] naming the smallest budget that works, before any
    /// step runs.
    ///
    /// That figure is for the model as the arena laid it out: a model made under a smaller
    /// budget lies in segments of its own sizes, and made afresh under the figure can take
    /// larger shared ones and need more (train_cnn's ResNet made under 1 MiB names 3,544,576
    /// B; made under that, it needs 3,608,576). For the figure of a fresh run, make the model
    /// with [`Trainer::build_within_budget`] (or [`Trainer::build_fit_auto`]), which builds it
    /// afresh under each budget it tries.
    pub fn fit_to_budget<D>(&mut self, data: &D, budget: u64) -> Result<usize>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let idx = self.plan_indices(data)?;
        match self.largest_fitting(data, &idx, Some(budget), self.config.batch_size)? {
            Some(m) => {
                self.set_micro_batch(m)?;
                Ok(m)
            }
            None => {
                let minimum = self.smallest_budget(data, &idx)?;
                Err(Error::BudgetTooSmall {
                    budget,
                    minimum,
                    what: format!(
                        "a training step of {} parameters at any micro-batch",
                        self.model.num_parameters()
                    ),
                })
            }
        }
    }

    /// Builds the model, its optimizer and the trainer with `build` on `device`, then fits the
    /// micro-batch to the device's budget (when it has one) with [`Trainer::fit_to_budget`]:
    /// the budget logic covers the model too. When the model or a one-sample step does not
    /// fit, the result is an [`Error::BudgetTooSmall`] (not a bare out-of-memory) naming the
    /// smallest budget under which this same call succeeds: found by bisection, each probe
    /// building and fitting afresh under the budget it tries, since the budget also decides
    /// how the arena lays the model out. That figure works, one byte less does not. A model
    /// too big for the device at all keeps the driver's error. Without a budget the
    /// micro-batch is fitted to the adapter's per-buffer limits ([`Trainer::fit_to_limits`]).
    pub fn build_within_budget<D>(
        device: &Device,
        data: &D,
        build: impl Fn() -> Result<Trainer<M>>,
    ) -> Result<Trainer<M>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let Some(budget) = device.memory_stats().budget else {
            let mut t = build()?;
            t.fit_to_limits(data)?;
            return Ok(t);
        };
        let what = match build() {
            Ok(mut t) => match t.fit_to_budget(data, budget) {
                Ok(_) => return Ok(t),
                Err(Error::BudgetTooSmall { what, .. }) => what,
                Err(e) => return Err(e),
            },
            Err(Error::OutOfMemory { .. }) => String::new(),
            Err(e) => return Err(e),
        };
        // Nothing of the failed attempt stays: its trainer is dropped, its segments returned.
        device.empty_cache();
        device.set_memory_budget(None)?;
        let free = build().and_then(|mut t| {
            let idx = t.plan_indices(data)?;
            Ok((t.plan_at(data, &idx, 1, None, 0)?, t.model.num_parameters()))
        });
        device.empty_cache();
        let minimum = free.and_then(|(one, params)| {
            let fits = |b: u64| {
                device.set_memory_budget(Some(b))?;
                // What fit_to_budget decides, without its own search for a minimum.
                let fits = match build() {
                    Ok(mut t) => {
                        let idx = t.plan_indices(data)?;
                        let max = t.config.batch_size;
                        t.largest_fitting(data, &idx, Some(b), max)?.is_some()
                    }
                    Err(Error::OutOfMemory { .. }) => false,
                    Err(e) => return Err(e),
                };
                device.empty_cache();
                Ok(fits)
            };
            // From 0: under a budget the arena lays the model out in other segments, and a
            // run can need less than the unbudgeted plan's peak in use.
            Ok((smallest_fitting(0, one.peak_reserved, fits)?, params))
        });
        device.empty_cache();
        device.set_memory_budget(Some(budget))?;
        let (minimum, params) = minimum?;
        Err(Error::BudgetTooSmall {
            budget,
            minimum,
            what: if what.is_empty() {
                format!("the model ({params} parameters) with its optimizer and a training step")
            } else {
                what
            },
        })
    }

    /// Without a budget, refuses a step whose planned peak reserved passes the device memory
    /// the adapter reports, before it runs: an [`Error::BudgetTooSmall`] with that memory as
    /// the budget and the smallest budget that works (which the adapter does not have). A
    /// device that only plans, a budget, or an adapter that reports no memory pass.
    pub fn check_device_memory<D>(&mut self, data: &D) -> Result<()>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let dev = self.device.clone();
        let (None, Some(memory), false) = (
            dev.memory_stats().budget,
            dev.info().adapter.memory,
            dev.is_planning(),
        ) else {
            return Ok(());
        };
        let idx = self.plan_indices(data)?;
        let micro = self.micro;
        if self.plan_at(data, &idx, micro, None, 0)?.peak_reserved <= memory {
            return Ok(());
        }
        let minimum = self.smallest_budget(data, &idx)?;
        Err(Error::BudgetTooSmall {
            budget: memory,
            minimum,
            what: format!(
                "a training step of {} parameters (the device memory '{}' reports)",
                self.model.num_parameters(),
                dev.info().adapter.name
            ),
        })
    }

    /// The smallest budget under which a step at some micro-batch fits the arena as it is
    /// now (what [`Trainer::fit_to_budget`] then finds), found by bisection on whole 256-byte
    /// blocks up to the one-sample step's peak reserved without a budget (which fits). A run
    /// with exactly this budget succeeds; one byte less does not.
    pub(super) fn smallest_budget<D>(&mut self, data: &D, indices: &[usize]) -> Result<u64>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let free = self.plan_at(data, indices, 1, None, 0)?;
        // From 0, and any micro-batch: one sample is not always the cheapest step (with
        // accumulation the first micro-batch's gradients wait for the next one's).
        let max = self.config.batch_size;
        smallest_fitting(0, free.peak_reserved, |budget| {
            Ok(self
                .largest_fitting(data, indices, Some(budget), max)?
                .is_some())
        })
    }

    /// The plan of a step over `indices` at micro-batch `micro` under `budget`, or `None` when
    /// it does not fit: past the budget, or a tensor past the adapter's per-buffer limit
    /// (`max_storage_buffer_binding_size`, `max_buffer_size`), which binds with or without a
    /// budget.
    pub(super) fn plan_within<D>(
        &mut self,
        data: &D,
        indices: &[usize],
        micro: usize,
        budget: Option<u64>,
    ) -> Result<Option<Plan>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        match self.plan_at(data, indices, micro, budget, 0) {
            // The arena checks the budget only when it creates a segment: what it already
            // holds may be over it.
            Ok(p) if budget.is_none_or(|b| p.peak_reserved <= b) => Ok(Some(p)),
            Ok(_) | Err(Error::OutOfMemory { .. } | Error::Limit { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Lowers the micro-batch, where a step at the current one would make a tensor past the
    /// adapter's per-buffer limit, to the largest whose step stays within every limit (the
    /// effective batch stays: more micro-batches accumulate); returns the micro-batch. When
    /// even one sample passes a limit, that [`Error::Limit`] is the answer: the sample itself
    /// is too big for this adapter.
    pub fn fit_to_limits<D>(&mut self, data: &D) -> Result<usize>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let idx = self.plan_indices(data)?;
        match self.largest_fitting(data, &idx, None, self.micro)? {
            Some(m) if m == self.micro => Ok(m),
            Some(m) => {
                self.set_micro_batch(m)?;
                Ok(m)
            }
            None => self.plan_at(data, &idx, 1, None, 0).map(|_| self.micro),
        }
    }

    /// The largest micro-batch up to `max` whose step over `indices` fits `budget` (and the
    /// adapter's limits) in the arena as it is now; `None` when not even one sample fits.
    pub(super) fn largest_fitting<D>(
        &mut self,
        data: &D,
        indices: &[usize],
        budget: Option<u64>,
        max: usize,
    ) -> Result<Option<usize>>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let fits = |t: &mut Self, micro: usize| {
            Ok::<_, Error>(t.plan_within(data, indices, micro, budget)?.is_some())
        };
        let max = max.min(indices.len()).max(1);
        if fits(self, max)? {
            return Ok(Some(max));
        }
        if !fits(self, 1)? {
            return Ok(None);
        }
        // The planned peak grows with the micro-batch: binary search the largest that fits.
        let (mut lo, mut hi) = (1, max - 1);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if fits(self, mid)? {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Ok(Some(lo))
    }

    /// Reserves, up front, the device memory a step on `data` will need, so training creates
    /// no buffer afterwards; returns the bytes reserved. The amount is planned: the step is
    /// planned on top of the reservation until it needs no new segment.
    pub fn prealloc<D>(&mut self, data: &D) -> Result<u64>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let idx = self.plan_indices(data)?;
        let budget = self.device.memory_stats().budget;
        let mut reserve = {
            let p = self.plan_at(data, &idx, self.micro, budget, 0)?;
            p.peak_reserved
                .saturating_sub(self.device.memory_stats().bytes_reserved)
        };
        for _ in 0..8 {
            if reserve == 0 {
                return Ok(0);
            }
            let p = self.plan_at(data, &idx, self.micro, budget, reserve)?;
            if p.new_buffers == 0 {
                self.device.reserve(reserve)?;
                return Ok(reserve);
            }
            // Fragmentation in the reserved segment: add what the step still created.
            let held = self.device.memory_stats().bytes_reserved + reserve;
            reserve += p
                .peak_reserved
                .saturating_sub(held)
                .max(crate::memory::LARGE_ROUND);
        }
        Err(Error::InvalidArgument {
            op: "Trainer::prealloc",
            reason: format!(
                "no reservation up to {} lets a step run without new buffers",
                Bytes(reserve)
            ),
        })
    }
}

/// The smallest budget for which `fits` holds, between `peak` (bytes in use at the peak:
/// nothing fits below it) and `reserved` (the peak reserved without a budget, which fits),
/// found by bisection on whole 256-byte blocks, as the arena reserves. `fits` of one block
/// less fails, so the figure is exact; `reserved` when even it does not fit.
pub(super) fn smallest_fitting(
    peak: u64,
    reserved: u64,
    mut fits: impl FnMut(u64) -> Result<bool>,
) -> Result<u64> {
    let align = crate::memory::BLOCK_ALIGN;
    let (mut lo, mut hi) = (peak / align, reserved.div_ceil(align));
    if !fits(hi * align)? {
        return Ok(reserved);
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid * align)? {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Ok(hi * align)
}
