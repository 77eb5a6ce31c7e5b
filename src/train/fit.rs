//! `--fit auto`: the memory budget picks the training strategy ([`Trainer::fit_auto`]).
//!
//! The strategies are tried cheapest first, each with the planner (train/plan.rs), which runs
//! the real step on the device's planning mode, so nothing is estimated:
//!
//! 1. the whole batch in one forward/backward;
//! 2. a smaller micro-batch with gradient accumulation: the same update (up to float
//!    rounding), only less parallel work per dispatch;
//! 3. activation checkpointing (where the model supports it), again the largest micro-batch
//!    that fits: exact too, at the price of recomputing forward pieces in backward;
//! 4. mixed precision (f16 activations and matmuls, f32 master weights and optimizer state,
//!    loss scaling): it changes the numbers — without, then with checkpointing;
//! 5. then, with checkpointing and the last precision, where the optimizer's state lives:
//!    8-bit state on the device (AdamW; changes the numbers), f32 state in host memory
//!    (optimizer offload, exact), and the parameters of the model's units streamed from host
//!    memory too (exact; needs units, and no data parallelism). Each is
//!    taken only when nothing before it fits; each candidate's plan gives its device peak,
//!    host bytes and bytes moved per step;
//! 6. where nothing fits, the most frugal configuration at the last residence (f32 can be, since
//!    mixed precision adds f16 copies of the weights), at its largest micro-batch, when that
//!    fits; else the error names its minimum, and a budget of that minimum fits.
//!
//! Over MPI the rungs that keep everything on the device run at each ZeRO stage the ranks try
//! ([`Trainer::fit_auto_on_device`], agreed through the communicator by
//! `distributed::Job::fit_auto_stage`).
//!
//! The precision fallback is to [`Precision::Mixed`] only, from [`Precision::F32`]: both keep
//! f32 parameters, so the model built for f32 trains mixed as it is (its forward reads
//! [`StepContext::dtype`](super::StepContext)); pure f16 would need the model rebuilt in f16.
//!
//! The choice depends only on the plans, which depend on the model, the batch, the budget and
//! the arena's state — not on timing. Arena rounding is the same on every adapter; what can
//! differ is the temporaries some kernels need on some adapters (a packed-f16 output whose rows
//! are not whole words is written through an f32 temporary), so a mixed-precision candidate
//! may plan a little higher where f16 is stored packed.

use super::fit_choice::describe;
use super::fit_choice::{Candidate, FitChoice, Residence, VariantsChoice};
use super::model::{BatchSource, TrainModel};
use super::{Precision, Trainer};
use crate::nn::Module;
use crate::optim::GradScaler;
use crate::{Error, Result};
use std::fmt;

impl<M: Module> Trainer<M> {
    /// Chooses how a step on `data` fits `budget` bytes — micro-batch, activation
    /// checkpointing, precision, in that order (see the module docs) — applies it to this
    /// trainer and the model, and says what it chose and why. The batch and accumulation stay
    /// as configured (a configured micro-batch is replaced); checkpointing is turned off unless
    /// chosen; an [`Precision::F32`] trainer may become [`Precision::Mixed`] (unless its sums
    /// are batch-invariant), other precisions stay. Nothing runs on the device but plans.
    ///
    /// When no candidate fits, the trainer keeps its micro-batch and precision (checkpointing
    /// off) but the last residence tried (streamed parameters stay streamed: drop it or train
    /// it that way), and the error is [`Error::BudgetTooSmall`] naming the smallest budget
    /// under which some configuration runs with every strategy on (one sample per
    /// micro-batch): `fit_auto` with exactly that budget on a fresh trainer succeeds, and so
    /// does training under it.
    pub fn fit_auto<D>(&mut self, data: &D, budget: u64) -> Result<FitChoice>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        self.fit_auto_into(data, budget, &mut Vec::new(), true, &mut Ok)
    }

    /// [`Trainer::fit_auto`]'s rungs that keep every byte on the device (micro-batch,
    /// checkpointing, mixed precision; nothing that moves state to host memory), the
    /// candidates planned appended to `candidates`. `agree` turns each rung's verdict here
    /// (whether it fits) into the verdict taken: on a rank of a job, whether it fits on every
    /// rank, so every rank takes the same rung (each calls `agree` once per rung, in the same
    /// order); `Ok` alone. A rung that fits here and not everywhere is listed as not fitting.
    pub fn fit_auto_on_device<D>(
        &mut self,
        data: &D,
        budget: u64,
        candidates: &mut Vec<Candidate>,
        agree: &mut dyn FnMut(bool) -> Result<bool>,
    ) -> Result<FitChoice>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        self.fit_auto_into(data, budget, candidates, false, agree)
    }

    /// [`Trainer::fit_auto`], with the candidates planned left in `candidates` whether one
    /// fits or not; the rungs that move state off the device (8-bit state, offload, streamed
    /// parameters) only when `residences`; `agree` as in [`Trainer::fit_auto_on_device`].
    fn fit_auto_into<D>(
        &mut self,
        data: &D,
        budget: u64,
        candidates: &mut Vec<Candidate>,
        residences: bool,
        agree: &mut dyn FnMut(bool) -> Result<bool>,
    ) -> Result<FitChoice>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let idx = self.plan_indices(data)?;
        let start = self.config.precision;
        let (micro_before, micro_config) = (self.micro, self.config.micro_batch);
        let can_checkpoint = self.model.set_checkpointing(false);
        let mut configs = Vec::new();
        // Mixed precision would round away the bits batch-invariant sums keep.
        let precisions: Vec<Precision> = if start == Precision::F32 && !self.config.batch_invariant
        {
            vec![Precision::F32, Precision::Mixed]
        } else {
            vec![start]
        };
        let start_residence = self.residence();
        for &p in &precisions {
            configs.push((false, p, start_residence));
            if can_checkpoint {
                configs.push((true, p, start_residence));
            }
        }
        let last_precision = *precisions.last().expect("one precision at least");
        for r in [
            Residence::EightBit,
            Residence::OffloadOptimizer,
            Residence::StreamedParameters,
        ] {
            if residences && r > start_residence && self.can_use(r) {
                configs.push((can_checkpoint, last_precision, r));
            }
        }
        let batch = self.config.batch_size.min(idx.len());
        let result = (|| {
            for &(ckpt, precision, residence) in &configs {
                self.use_strategy(ckpt, precision);
                self.use_residence(residence)?;
                let whole = self.candidate(data, &idx, (batch, batch), ckpt, budget)?;
                let mut fits = whole.fits.then_some(batch);
                candidates.push(whole);
                if fits.is_none() && batch > 1 {
                    let micro = self
                        .largest_fitting(data, &idx, Some(budget), batch - 1)?
                        .unwrap_or(1);
                    let c = self.candidate(data, &idx, (batch, micro), ckpt, budget)?;
                    fits = c.fits.then_some(micro);
                    candidates.push(c);
                }
                if !agree(fits.is_some())? && fits.take().is_some() {
                    let last = candidates.last_mut().expect("a candidate of this rung");
                    last.fits = false;
                    last.description += " (fits here, not on every rank)";
                }
                if let Some(micro) = fits {
                    self.set_micro_batch(micro)?;
                    return Ok(Some((micro, ckpt, precision, residence)));
                }
            }
            Ok(None)
        })();
        let chosen = match result {
            Ok(Some(c)) => c,
            other => {
                // Nothing fits: the smallest budget of any configuration (one sample per
                // micro-batch) with every residence strategy on (the last one reached), the
                // cheaper one on a tie. Mixed precision is not always the most frugal: its f16
                // copies of the weights can outweigh what it saves.
                let reached = self.residence();
                let smallest = other.and_then(|_| {
                    let mut best: Option<(u64, (bool, Precision))> = None;
                    let precisions = precisions.iter();
                    let all = precisions.flat_map(|&p| [(false, p), (true, p)]);
                    for (ckpt, precision) in all.filter(|&(c, _)| can_checkpoint || !c) {
                        self.use_strategy(ckpt, precision);
                        let m = self.smallest_budget(data, &idx)?;
                        if best.is_none_or(|(b, _)| m < b) {
                            best = Some((m, (ckpt, precision)));
                        }
                    }
                    Ok(best.expect("at least one configuration"))
                });
                self.use_strategy(false, start);
                (self.micro, self.config.micro_batch) = (micro_before, micro_config);
                let (minimum, (ckpt, precision)) = smallest?;
                // The residence rungs keep checkpointing and mixed precision on, which is not
                // always the most frugal: the configuration that is may fit where they did not.
                if minimum <= budget && reached > start_residence {
                    let last = (|| {
                        self.use_strategy(ckpt, precision);
                        let micro = self
                            .largest_fitting(data, &idx, Some(budget), batch)?
                            .unwrap_or(1);
                        let c = self.candidate(data, &idx, (batch, micro), ckpt, budget)?;
                        let fits = c.fits;
                        candidates.push(c);
                        if agree(fits)? {
                            self.set_micro_batch(micro)?;
                            return Ok(Some(micro));
                        }
                        Ok(None)
                    })();
                    if let Ok(Some(micro)) = last {
                        let chosen = (micro, ckpt, precision, reached);
                        return Ok(Self::choice(budget, batch, chosen, candidates));
                    }
                    self.use_strategy(false, start);
                    (self.micro, self.config.micro_batch) = (micro_before, micro_config);
                    last?;
                }
                return Err(Error::BudgetTooSmall {
                    budget,
                    minimum,
                    what: format!(
                        "a training step of {} parameters ({}{})",
                        self.model.num_parameters(),
                        describe(batch, 1, ckpt, precision),
                        reached.suffix()
                    ),
                });
            }
        };
        Ok(Self::choice(budget, batch, chosen, candidates))
    }

    /// The choice of (micro-batch, checkpointing, precision, residence) under `budget`.
    fn choice(
        budget: u64,
        batch: usize,
        chosen: (usize, bool, Precision, Residence),
        candidates: &[Candidate],
    ) -> FitChoice {
        FitChoice {
            budget,
            batch_size: batch,
            micro_batch: chosen.0,
            checkpointing: chosen.1,
            precision: chosen.2,
            residence: chosen.3,
            candidates: candidates.to_vec(),
        }
    }

    /// Where the parameters and the optimizer state live now.
    pub(super) fn residence(&self) -> Residence {
        if self.streaming.is_some() {
            Residence::StreamedParameters
        } else if self.optimizer.state_on_host() {
            Residence::OffloadOptimizer
        } else if self.optimizer.name() == "adamw8bit" {
            Residence::EightBit
        } else {
            Residence::Device
        }
    }

    /// Whether `r` can serve this trainer: an optimizer whose state can move (AdamW) that has
    /// made none yet; for streamed parameters, a model with units and no data parallelism.
    fn can_use(&self, r: Residence) -> bool {
        let adamw = matches!(self.optimizer.name(), "adamw" | "adamw8bit");
        let fresh = self.optimizer.step_count() == 0 && self.optimizer.state_tensors().is_empty();
        let fp16_params = self
            .model
            .parameters()
            .iter()
            .any(|p| p.dtype() != crate::DType::F32);
        match r {
            Residence::Device => true,
            Residence::EightBit => adamw && fresh,
            Residence::OffloadOptimizer => adamw && fresh && !fp16_params,
            Residence::StreamedParameters => {
                adamw
                    && fresh
                    && !fp16_params
                    && self.sync.is_none()
                    && self.model.units().iter().any(|(_, p)| !p.is_empty())
            }
        }
    }

    /// Moves to `r` (never back: streamed parameters stay streamed).
    fn use_residence(&mut self, r: Residence) -> Result<()> {
        if r == self.residence() {
            return Ok(());
        }
        match r {
            Residence::Device => {}
            Residence::EightBit => self.optimizer.set_state_kind(true, false)?,
            Residence::OffloadOptimizer => {
                self.optimizer.set_state_kind(false, true)?;
                self.config.offload_optimizer = true;
            }
            Residence::StreamedParameters => {
                self.optimizer.set_state_kind(false, true)?;
                self.config.offload_optimizer = true;
                self.streaming = Some(Self::start_streaming(&self.model, &self.device)?);
                self.config.offload_parameters = true;
            }
        }
        Ok(())
    }

    /// [`Trainer::build_fit_auto`] over variants of the model that change what it holds (a
    /// frozen base kept dense, int8 or NF4 under LoRA): each variant, in the order given, is
    /// built by `build` and fitted by [`Trainer::fit_auto`]'s ladder (its rungs that move state
    /// off the device only for the last variant); the first that fits is returned with every candidate planned on the way. When none fits, the error is
    /// [`Error::BudgetTooSmall`] with the smallest budget of any variant.
    pub fn build_fit_auto_variants<D, V: fmt::Display>(
        device: &crate::Device,
        data: &D,
        variants: &[V],
        mut build: impl FnMut(&V) -> Result<Trainer<M>>,
    ) -> Result<(Trainer<M>, VariantsChoice)>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let Some(budget) = device.memory_stats().budget else {
            return Err(Error::InvalidArgument {
                op: "Trainer::build_fit_auto_variants",
                reason: "fit auto needs a memory budget to fit (set one on the device)".into(),
            });
        };
        let mut tried = Vec::new();
        let mut smallest: Option<Error> = None;
        for (i, v) in variants.iter().enumerate() {
            device.set_memory_budget(None)?;
            let mut candidates = Vec::new();
            let built = build(v).and_then(|mut t| {
                // The variants shrink what the model holds first; the residence rungs follow
                // the last variant's.
                let last = i + 1 == variants.len();
                let choice = t.fit_auto_into(data, budget, &mut candidates, last, &mut Ok)?;
                Ok((t, choice))
            });
            if built.is_err() {
                device.empty_cache();
            }
            device.set_memory_budget(Some(budget))?;
            tried.push((v.to_string(), candidates));
            match built {
                Ok((t, choice)) => {
                    return Ok((
                        t,
                        VariantsChoice {
                            tried,
                            chosen: i,
                            choice,
                        },
                    ))
                }
                Err(e @ Error::BudgetTooSmall { .. }) => {
                    let better = match (&smallest, &e) {
                        (
                            Some(Error::BudgetTooSmall { minimum: old, .. }),
                            Error::BudgetTooSmall { minimum, .. },
                        ) => minimum < old,
                        _ => true,
                    };
                    if better {
                        smallest = Some(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(smallest.unwrap_or_else(|| Error::InvalidArgument {
            op: "Trainer::build_fit_auto_variants",
            reason: "no variants to fit".into(),
        }))
    }

    /// Builds the trainer with `build` on `device` and runs [`Trainer::fit_auto`] under the
    /// device's budget ([`Error::InvalidArgument`] when it has none): what
    /// [`Trainer::build_within_budget`] is for a micro-batch alone.
    ///
    /// The model is first made whole on the device, under the budget. When the ladder picks
    /// streamed parameters, it is made again inside
    /// [`born_on_host`](crate::residency::born_on_host), so the run never holds it whole;
    /// when its parameters alone pass the budget, it is made that way from the start (a model
    /// with units). When nothing fits, the model is made with the budget lifted, so a model
    /// over the budget is one more configuration that does not fit and the error names the
    /// smallest budget for the model and a step together. The budget is set again before
    /// returning, error or not. A model made again starts the device's peaks afresh: what an
    /// attempt held (within the budget) is gone.
    pub fn build_fit_auto<D>(
        device: &crate::Device,
        data: &D,
        build: impl Fn() -> Result<Trainer<M>>,
    ) -> Result<(Trainer<M>, FitChoice)>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let Some(budget) = device.memory_stats().budget else {
            return Err(Error::InvalidArgument {
                op: "Trainer::build_fit_auto",
                reason: "fit auto needs a memory budget to fit (set one on the device)".into(),
            });
        };
        // The ladder plans against `budget` itself; the device's own is lifted while it runs.
        let fit = |mut t: Trainer<M>| -> Result<(Trainer<M>, FitChoice)> {
            device.set_memory_budget(None)?;
            let choice = t.fit_auto(data, budget);
            device.set_memory_budget(Some(budget))?;
            Ok((t, choice?))
        };
        let born = || crate::residency::born_on_host(device, &build);
        let made = match build() {
            Ok(t) => Ok((t, false)),
            // The parameters alone pass the budget: only streaming can hold them.
            Err(Error::OutOfMemory { .. }) => {
                // Nothing of the attempt stays, and its peak is not the run's.
                device.empty_cache();
                device.reset_peak();
                match born() {
                    Ok(t) => Ok((t, true)),
                    // Not even so: made (in host memory where it can be, else whole) with the
                    // budget lifted, so the ladder's error says how far off the budget is.
                    Err(_) => {
                        device.empty_cache();
                        device.set_memory_budget(None)?;
                        let t = born().map(|t| (t, true)).or_else(|_| {
                            device.empty_cache();
                            build().map(|t| (t, false))
                        });
                        device.set_memory_budget(Some(budget))?;
                        t
                    }
                }
            }
            Err(e) => Err(e),
        };
        let fitted = made.and_then(|(t, made_born)| Ok((fit(t)?, made_born)));
        let ((t, choice), made_born) = match fitted {
            Ok(f) => f,
            Err(e) => {
                // The failed trainer is dropped: give its segments back.
                device.empty_cache();
                return Err(e);
            }
        };
        if choice.residence != Residence::StreamedParameters || made_born {
            return Ok((t, choice));
        }
        // Streamed from a model made whole: made again in host memory, with the same choice.
        drop(t);
        device.empty_cache();
        device.reset_peak();
        let mut t = born()?;
        t.use_strategy(choice.checkpointing, choice.precision);
        t.set_micro_batch(choice.micro_batch)?;
        Ok((t, choice))
    }

    /// Sets the model's checkpointing and the trainer's precision (F32 and Mixed only differ in
    /// the compute dtype and the loss scaler; the parameters stay f32).
    fn use_strategy<B>(&mut self, checkpointing: bool, precision: Precision)
    where
        M: TrainModel<B>,
    {
        self.model.set_checkpointing(checkpointing);
        if self.config.precision != precision {
            self.config.precision = precision;
            self.scaler = (precision == Precision::Mixed).then(GradScaler::new);
        }
    }

    /// The candidate `micro` of a batch of `batch` with the strategy in use (`checkpointing`
    /// says whether it is on): its plan under the budget when it fits, else without a budget.
    fn candidate<D>(
        &mut self,
        data: &D,
        idx: &[usize],
        (batch, micro): (usize, usize),
        checkpointing: bool,
        budget: u64,
    ) -> Result<Candidate>
    where
        D: BatchSource,
        M: TrainModel<D::Batch>,
    {
        let under = self.plan_within(data, idx, micro, Some(budget))?;
        let fits = under.is_some();
        let (plan, limit) = match under {
            Some(p) => (p, ""),
            None => match self.plan_at(data, idx, micro, None, 0) {
                Ok(p) => (p, ""),
                // Figures of 0: the step cannot be made on this adapter at all.
                Err(Error::Limit { .. }) => (
                    super::Plan::default(),
                    " (past the adapter's per-buffer limit)",
                ),
                Err(e) => return Err(e),
            },
        };
        let precision = self.config.precision;
        let residence = self.residence();
        Ok(Candidate {
            description: describe(batch, micro, checkpointing, precision)
                + residence.suffix()
                + limit,
            residence,
            host_bytes: plan.host_bytes,
            bytes_moved: plan.bytes_moved,
            micro_batch: micro,
            checkpointing,
            precision,
            planned_peak: plan.peak,
            planned_reserved: plan.peak_reserved,
            fits,
        })
    }
}
