//! What `--fit auto` chose and why (train/fit.rs makes the choice): each candidate planned
//! ([`Candidate`]), where the parameters and optimizer state live ([`Residence`]), the choice
//! with its candidates ([`FitChoice`], [`VariantsChoice`]) and how they print.

use super::Precision;
use crate::error::Bytes;
use std::fmt;

/// One configuration [`Trainer::fit_auto`](super::Trainer::fit_auto) planned.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Candidate {
    /// What was planned, e.g. "micro-batch 16 (4 per batch), checkpointing, mixed".
    pub description: String,
    /// Samples per forward/backward.
    pub micro_batch: usize,
    /// Activation checkpointing on.
    pub checkpointing: bool,
    /// The precision planned.
    pub precision: Precision,
    /// Planned peak bytes in use of one step: under the budget when it fits (what the run
    /// will do), without one when it does not (what it would need).
    pub planned_peak: u64,
    /// Planned peak bytes the arena holds from the driver (what the budget limits), measured
    /// the same way.
    pub planned_reserved: u64,
    /// Whether the step planned under the budget stays within it.
    pub fits: bool,
    /// Where the parameters and the optimizer state live.
    #[serde(default)]
    pub residence: Residence,
    /// Planned host bytes (offloaded optimizer state, streamed units).
    #[serde(default)]
    pub host_bytes: u64,
    /// Planned bytes moved between host and device per step.
    #[serde(default)]
    pub bytes_moved: u64,
}

/// Where fit auto keeps the parameters and the optimizer state, cheapest first.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    serde::Serialize,
    serde::Deserialize,
)]
pub enum Residence {
    /// Everything on the device, as configured.
    #[default]
    Device,
    /// AdamW's moments as 8-bit codes on the device.
    EightBit,
    /// Master weights and f32 state in host memory (optimizer offload).
    OffloadOptimizer,
    /// The units' parameters in host memory too, streamed through the device.
    StreamedParameters,
}

impl Residence {
    /// "", ", 8-bit state", ", optimizer offload", ", streamed parameters".
    pub(super) fn suffix(self) -> &'static str {
        match self {
            Residence::Device => "",
            Residence::EightBit => ", 8-bit state",
            Residence::OffloadOptimizer => ", optimizer offload",
            Residence::StreamedParameters => ", streamed parameters",
        }
    }
}

/// What [`Trainer::fit_auto`](super::Trainer::fit_auto) chose, and every candidate it planned
/// on the way, in order.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FitChoice {
    /// The budget fitted.
    pub budget: u64,
    /// Samples per batch (the data loader's batch, kept).
    pub batch_size: usize,
    /// Samples per forward/backward chosen.
    pub micro_batch: usize,
    /// Activation checkpointing chosen.
    pub checkpointing: bool,
    /// Precision chosen.
    pub precision: Precision,
    /// Where the parameters and the optimizer state live, chosen.
    #[serde(default)]
    pub residence: Residence,
    /// The candidates planned, cheapest first; the last one is the choice.
    pub candidates: Vec<Candidate>,
}

impl fmt::Display for FitChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "fit auto, budget {}: {}",
            Bytes(self.budget),
            describe(
                self.batch_size,
                self.micro_batch,
                self.checkpointing,
                self.precision
            ) + self.residence.suffix()
        )?;
        for c in &self.candidates {
            write!(
                f,
                "  {:<52} planned peak {:>11} in use, {:>11} reserved",
                c.description,
                Bytes(c.planned_peak).to_string(),
                Bytes(c.planned_reserved).to_string(),
            )?;
            if c.residence != Residence::Device {
                write!(
                    f,
                    ", host {:>11}, moved {:>11} per step",
                    Bytes(c.host_bytes).to_string(),
                    Bytes(c.bytes_moved).to_string()
                )?;
            }
            writeln!(f, "  {}", if c.fits { "fits" } else { "does not fit" })?;
        }
        Ok(())
    }
}

/// What [`Trainer::build_fit_auto_variants`](super::Trainer::build_fit_auto_variants) chose:
/// the variants tried with their candidates, in order, and the fitting one's choice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VariantsChoice {
    /// Each variant tried and the candidates planned for it.
    pub tried: Vec<(String, Vec<Candidate>)>,
    /// The index in `tried` of the variant chosen (the last).
    pub chosen: usize,
    /// Its choice.
    pub choice: FitChoice,
}

impl fmt::Display for VariantsChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, _) = &self.tried[self.chosen];
        writeln!(f, "fit auto: {name}")?;
        for (i, (name, candidates)) in self.tried.iter().enumerate() {
            writeln!(f, "{name}:")?;
            if i == self.chosen {
                let text = self.choice.to_string();
                // The chosen variant's own lines, without its header.
                for line in text.lines().skip(1) {
                    writeln!(f, "{line}")?;
                }
                continue;
            }
            for c in candidates {
                writeln!(
                    f,
                    "  {:<52} planned peak {:>11} in use, {:>11} reserved  {}",
                    c.description,
                    Bytes(c.planned_peak).to_string(),
                    Bytes(c.planned_reserved).to_string(),
                    if c.fits { "fits" } else { "does not fit" }
                )?;
            }
        }
        Ok(())
    }
}

/// "micro-batch 16 (4 per batch), checkpointing, mixed".
pub(super) fn describe(
    batch: usize,
    micro: usize,
    checkpointing: bool,
    precision: Precision,
) -> String {
    let split = if micro >= batch {
        format!("micro-batch {micro} (the whole batch)")
    } else {
        format!("micro-batch {micro} ({} per batch)", batch.div_ceil(micro))
    };
    format!(
        "{split}{}, {}",
        if checkpointing { ", checkpointing" } else { "" },
        precision.name()
    )
}
