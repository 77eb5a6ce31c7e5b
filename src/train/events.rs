//! What the trainer decided on its own during training ([`TrainEvent`]): a micro-batch shrunk
//! after an out-of-memory, a step skipped or a loss scale grown by loss scaling.

use crate::error::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt;

/// One decision the trainer took on its own (see [`Trainer::take_events`]). Its `Display` is
/// the line the examples print.
///
/// [`Trainer::take_events`]: super::Trainer::take_events
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum TrainEvent {
    /// The device ran out of memory in the middle of step `step`: the step's gradients and
    /// activations were dropped, the micro-batch went from `micro_before` to `micro_after`
    /// (chosen by the planner under a budget when `planned`, else halved) and the step ran
    /// again from the start.
    OomRetry {
        /// The optimizer step (0-based).
        step: u64,
        /// Bytes the failed allocation asked for.
        requested: u64,
        /// Samples per forward/backward before.
        micro_before: usize,
        /// Samples per forward/backward after.
        micro_after: usize,
        /// Whether the planner chose the new micro-batch (else it was halved).
        planned: bool,
    },
    /// Loss scaling: the gradients of step `step` overflowed f16, the update was skipped and
    /// the scale lowered.
    StepSkipped {
        /// The optimizer step (0-based) that was skipped.
        step: u64,
        /// The loss scale before.
        scale_before: f32,
        /// The loss scale after.
        scale_after: f32,
    },
    /// Loss scaling: a run of steps without overflow raised the scale.
    ScaleGrew {
        /// The optimizer step (0-based) after which it grew.
        step: u64,
        /// The loss scale before.
        scale_before: f32,
        /// The loss scale after.
        scale_after: f32,
    },
}

impl TrainEvent {
    /// The optimizer step the event happened at.
    pub fn step(&self) -> u64 {
        match *self {
            TrainEvent::OomRetry { step, .. }
            | TrainEvent::StepSkipped { step, .. }
            | TrainEvent::ScaleGrew { step, .. } => step,
        }
    }

    /// Which mechanism stepped in: "out-of-memory retry" or "loss scaling".
    pub fn mechanism(&self) -> &'static str {
        match self {
            TrainEvent::OomRetry { .. } => "out-of-memory retry",
            TrainEvent::StepSkipped { .. } | TrainEvent::ScaleGrew { .. } => "loss scaling",
        }
    }
}

impl fmt::Display for TrainEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TrainEvent::OomRetry {
                step,
                requested,
                micro_before,
                micro_after,
                planned,
            } => write!(
                f,
                "step {step}: out of memory (asked for {}); micro-batch {micro_before} -> \
                 {micro_after}{}, redoing the step",
                Bytes(requested),
                if planned { " (planned)" } else { "" }
            ),
            TrainEvent::StepSkipped {
                step, scale_after, ..
            } => write!(
                f,
                "step {step}: gradients overflowed; step skipped, loss scale now {scale_after}"
            ),
            TrainEvent::ScaleGrew {
                step,
                scale_before,
                scale_after,
            } => write!(
                f,
                "step {step}: no overflow for a while; loss scale {scale_before} -> {scale_after}"
            ),
        }
    }
}
