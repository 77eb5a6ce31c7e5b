//! The plan of a data-parallel run per rank: each rank's planned device bytes for parameters,
//! gradients and optimizer state (what ZeRO spreads), and the collectives of one step with the
//! bytes each rank sends in them, counted as a ring algorithm moves them: an all-reduce of
//! `n` bytes sends 2(N-1)/N·n, a reduce-scatter or an all-gather of an `n`-byte result
//! (N-1)/N·n.

use super::{ShardLayout, Zero};
use crate::distributed::Communicator;
use crate::train::Plan;
use crate::{Bytes, Result};
use serde::Serialize;
use std::fmt;

/// The collective's kind, for the ring count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CollectiveKind {
    /// Every rank ends with the sum: 2(N-1)/N of the buffer sent.
    AllReduce,
    /// Each rank ends with its part of the sum: (N-1)/N sent.
    ReduceScatter,
    /// Each rank ends with every rank's part: (N-1)/N sent.
    AllGather,
}

/// One collective of a step.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Collective {
    /// What it carries.
    pub what: &'static str,
    /// How it moves the buffer.
    pub kind: CollectiveKind,
    /// The bytes of the whole result (the all-reduced buffer; every rank's parts together).
    pub buffer_bytes: u64,
    /// The bytes each rank sends in it, as a ring moves them.
    pub sent_bytes: u64,
}

impl Collective {
    /// `kind` over a result of `buffer_bytes` among `ranks` ranks.
    pub fn new(what: &'static str, kind: CollectiveKind, buffer_bytes: u64, ranks: usize) -> Self {
        let n = ranks.max(1) as u64;
        let factor = match kind {
            CollectiveKind::AllReduce => 2,
            CollectiveKind::ReduceScatter | CollectiveKind::AllGather => 1,
        };
        Collective {
            what,
            kind,
            buffer_bytes,
            sent_bytes: factor * (n - 1) * buffer_bytes / n,
        }
    }
}

/// What a step's collectives depend on besides the stage: the decisions the replicas take
/// together when the gradients are sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCollectives {
    /// The trainer clips the gradient norm (the norm is gathered every step).
    pub clipping: bool,
    /// Steps between checks that the gradients are finite: 1 under loss scaling (the
    /// overflow check), the trainer's `check_finite_every` otherwise, 0 for none.
    pub finite_check_every: u64,
}

impl Default for StepCollectives {
    /// No clipping; a finite check every step (the trainer's default).
    fn default() -> Self {
        StepCollectives {
            clipping: false,
            finite_check_every: 1,
        }
    }
}

impl Zero {
    /// The collectives of one step over parameters of `numels` elements among `ranks` ranks,
    /// as the trainer's gradient exchange and the optimizer run them (f32 values on the host).
    /// Stage 0: one all-reduce of the gradients, the loss and a flag per parameter, and the
    /// check of the sums (three words per rank). Stages 1 and 2: a reduce-scatter of the padded
    /// gradients, an all-gather of the step check, loss and flags, the decisions taken
    /// together ([`StepCollectives`]), and an all-gather of the updated parameters.
    pub fn collectives(
        &self,
        numels: &[usize],
        ranks: usize,
        step: StepCollectives,
    ) -> Result<Vec<Collective>> {
        use CollectiveKind::*;
        let n = ranks.max(1);
        let words = |w: usize| (w * 8 * n) as u64;
        if self.stage == 0 {
            let values = numels.iter().sum::<usize>() + 1 + numels.len();
            return Ok(vec![
                Collective::new("gradients, loss and flags", AllReduce, values as u64 * 4, n),
                Collective::new("check of the sums", AllGather, words(3), n),
            ]);
        }
        let padded = ShardLayout::new(numels, n)?.padded_len() as u64 * 4;
        let mut out = vec![
            Collective::new("gradients", ReduceScatter, padded, n),
            Collective::new(
                "step check, loss and flags",
                AllGather,
                words(3 + numels.len().div_ceil(64)),
                n,
            ),
        ];
        // Counted per step: one all-gather every `finite_check_every` steps.
        let check = Collective::new("finite check", AllGather, words(1), n);
        if let (Some(buffer_bytes), Some(sent_bytes)) = (
            check.buffer_bytes.checked_div(step.finite_check_every),
            check.sent_bytes.checked_div(step.finite_check_every),
        ) {
            out.push(Collective {
                buffer_bytes,
                sent_bytes,
                ..check
            });
        }
        if step.clipping {
            out.push(Collective::new("gradient norm", AllGather, words(1), n));
        }
        out.push(Collective::new("parameters", AllGather, padded, n));
        Ok(out)
    }
}

impl Zero {
    /// [`Zero::collectives`] of the parameters in the flat shards (`numels`; at stage 3 those
    /// in no unit, exchanged as at stage 2), and at stage 3 the units' all-gathers and
    /// reduce-scatters of a step as the trainer's last step, planned or run, made them
    /// (`units`; counted by the fetches and retirements themselves, since how many gathers a
    /// step needs depends on which units stay resident).
    pub fn collectives_with_units(
        &self,
        numels: &[usize],
        ranks: usize,
        step: StepCollectives,
        units: Option<crate::train::UnitTraffic>,
    ) -> Result<Vec<Collective>> {
        if self.stage < 3 {
            return self.collectives(numels, ranks, step);
        }
        let mut out = Zero::stage(2)?.collectives(numels, ranks, step)?;
        let u = units.unwrap_or_default();
        let n = ranks.max(1);
        use CollectiveKind::*;
        out.push(Collective::new(
            "units (forward, recomputation)",
            AllGather,
            u.gathered_bytes,
            n,
        ));
        out.push(Collective::new(
            "units' gradients",
            ReduceScatter,
            u.scattered_bytes,
            n,
        ));
        Ok(out)
    }
}

/// One rank's planned device bytes at its step's peak.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankPlan {
    /// The rank.
    pub rank: usize,
    /// Parameters alive at the peak.
    pub parameters: u64,
    /// Gradients alive at the peak.
    pub gradients: u64,
    /// Optimizer state alive at the peak.
    pub optimizer_state: u64,
    /// The step's peak in use.
    pub peak: u64,
    /// The step's peak reserved.
    pub peak_reserved: u64,
}

impl RankPlan {
    /// The words a rank contributes to the all-gather of the plans.
    fn words(plan: &Plan) -> [u64; 5] {
        [
            plan.parameters,
            plan.gradients,
            plan.optimizer_state,
            plan.peak,
            plan.peak_reserved,
        ]
    }

    /// Rank `rank`'s plan from its words.
    fn from_words(rank: usize, w: &[u64]) -> RankPlan {
        RankPlan {
            rank,
            parameters: w[0],
            gradients: w[1],
            optimizer_state: w[2],
            peak: w[3],
            peak_reserved: w[4],
        }
    }
}

/// Every rank's plan and the step's collectives: what `--plan` prints for a data-parallel run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankPlans {
    /// The ZeRO stage.
    pub zero_stage: u8,
    /// Every rank's plan, rank 0 first.
    pub ranks: Vec<RankPlan>,
    /// The collectives of one step.
    pub collectives: Vec<Collective>,
    /// The bytes each rank sends per step, all collectives together.
    pub bytes_sent_per_step: u64,
}

impl RankPlans {
    /// The plans of `ranks` at `zero` with a step's `collectives`, their bytes summed.
    pub fn new(zero: Zero, ranks: Vec<RankPlan>, collectives: Vec<Collective>) -> RankPlans {
        RankPlans {
            zero_stage: zero.number(),
            bytes_sent_per_step: collectives.iter().map(|c| c.sent_bytes).sum(),
            ranks,
            collectives,
        }
    }
}

impl RankPlans {
    /// Every member's plan (one small all-gather over `comm`; every member calls it at once)
    /// and the collectives of a step at stage `zero` over parameters of `numels` elements.
    pub fn gather<C: Communicator + ?Sized>(
        comm: &mut C,
        plan: &Plan,
        numels: &[usize],
        zero: Zero,
        step: StepCollectives,
    ) -> Result<RankPlans> {
        let collectives = zero.collectives(numels, comm.size(), step)?;
        RankPlans::gather_with(comm, plan, zero, collectives)
    }

    /// [`RankPlans::gather`] with the step's collectives given.
    pub fn gather_with<C: Communicator + ?Sized>(
        comm: &mut C,
        plan: &Plan,
        zero: Zero,
        collectives: Vec<Collective>,
    ) -> Result<RankPlans> {
        let all = comm.all_gather(&RankPlan::words(plan))?;
        let ranks = all
            .chunks(5)
            .enumerate()
            .map(|(r, w)| RankPlan::from_words(r, w))
            .collect();
        Ok(RankPlans::new(zero, ranks, collectives))
    }
}

impl fmt::Display for RankPlans {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "per rank (ZeRO stage {}, {} ranks), planned at each rank's step peak:",
            self.zero_stage,
            self.ranks.len()
        )?;
        writeln!(
            f,
            "  rank   parameters    gradients  optim state         peak     reserved"
        )?;
        for r in &self.ranks {
            writeln!(
                f,
                "  {:>4} {:>12} {:>12} {:>12} {:>12} {:>12}",
                r.rank,
                Bytes(r.parameters).to_string(),
                Bytes(r.gradients).to_string(),
                Bytes(r.optimizer_state).to_string(),
                Bytes(r.peak).to_string(),
                Bytes(r.peak_reserved).to_string()
            )?;
        }
        writeln!(
            f,
            "collectives of a step (each rank sends, as a ring moves it):"
        )?;
        for c in &self.collectives {
            let kind = match c.kind {
                CollectiveKind::AllReduce => "all-reduce",
                CollectiveKind::ReduceScatter => "reduce-scatter",
                CollectiveKind::AllGather => "all-gather",
            };
            writeln!(
                f,
                "  {kind:<14} {:<28} {:>12} of {}",
                c.what,
                Bytes(c.sent_bytes).to_string(),
                Bytes(c.buffer_bytes)
            )?;
        }
        writeln!(
            f,
            "  = sent per step {:>40}",
            Bytes(self.bytes_sent_per_step).to_string()
        )
    }
}
