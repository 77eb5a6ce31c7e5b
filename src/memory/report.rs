//! Memory statistics and the readable report.

use crate::error::Bytes;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A snapshot of the arena. "In use" is what live tensors hold; "reserved" is what the arena holds
/// from the driver (in use + cached free blocks). Peaks are since creation or `reset_peak()`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Bytes held by live tensors.
    pub bytes_in_use: u64,
    /// The most bytes held by live tensors at once.
    pub peak_bytes_in_use: u64,
    /// Bytes of the segments the arena holds from the driver (in use + cached).
    pub bytes_reserved: u64,
    /// The most bytes reserved at once.
    pub peak_bytes_reserved: u64,
    /// Blocks handed out.
    pub allocations: u64,
    /// Blocks returned.
    pub frees: u64,
    /// wgpu buffers (segments) created.
    pub buffers_created: u64,
    /// Segments given back to the driver (`empty_cache`, or to make room under the budget).
    pub buffers_released: u64,
    /// Allocations served from memory the arena already held.
    pub reuse_hits: u64,
    /// Allocations refused (budget or driver).
    pub oom_errors: u64,
    /// Live segments.
    pub segments: usize,
    /// The largest free range in any segment (what one more tensor could get without a new buffer).
    pub largest_free_block: u64,
    /// The hard budget on reserved bytes, if one is set.
    pub budget: Option<u64>,
    /// Bytes in use now, by what they hold.
    pub in_use_by_category: ByCategory,
    /// What the bytes in use held at the in-use peak.
    pub peak_by_category: ByCategory,
    /// The most bytes each category held at once, each at its own peak (a buffer that lives
    /// only after the in-use peak, such as the all-reduce buffer, shows here).
    pub category_peaks: ByCategory,
    /// The kernel (or copy) being recorded when the in-use peak was reached, with the phase
    /// of the step where one was set (`"matmul_reg_f32_f32_f32_f32 (backward)"`).
    pub peak_op: Option<String>,
}

/// What a block of device memory holds. The trainer and the planner set it around each phase
/// of a step; a gradient is counted as one once a parameter adopts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Category {
    /// A model's parameters.
    Parameters,
    /// Parameters' accumulated gradients.
    Gradients,
    /// Optimizer state (momentum buffers, moments).
    OptimizerState,
    /// What a forward and backward pass allocates: activations, saved tensors, their
    /// gradients.
    Activations,
    /// Everything else: input batches, targets, scalars, tensors made outside a step.
    #[default]
    Workspace,
    /// Data-parallel training's flat gradient buffer, read back once per step for the
    /// all-reduce (src/distributed).
    Communication,
}

impl Category {
    /// Every category, in report order.
    pub const ALL: [Category; 6] = [
        Category::Parameters,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
        Category::Workspace,
        Category::Communication,
    ];

    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer state",
            Category::Activations => "activations",
            Category::Workspace => "workspace",
            Category::Communication => "communication",
        }
    }
}

/// Bytes per [`Category`]. In JSON an object with one field per category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "NamedCategories", from = "NamedCategories")]
pub struct ByCategory(pub [u64; 6]);

/// [`ByCategory`] with named fields, for JSON.
#[derive(Serialize, Deserialize)]
struct NamedCategories {
    parameters: u64,
    gradients: u64,
    optimizer_state: u64,
    activations: u64,
    workspace: u64,
    /// Absent in reports written before data-parallel training counted it.
    #[serde(default)]
    communication: u64,
}

impl From<ByCategory> for NamedCategories {
    fn from(b: ByCategory) -> Self {
        let [parameters, gradients, optimizer_state, activations, workspace, communication] = b.0;
        NamedCategories {
            parameters,
            gradients,
            optimizer_state,
            activations,
            workspace,
            communication,
        }
    }
}

impl From<NamedCategories> for ByCategory {
    fn from(n: NamedCategories) -> Self {
        ByCategory([
            n.parameters,
            n.gradients,
            n.optimizer_state,
            n.activations,
            n.workspace,
            n.communication,
        ])
    }
}

impl ByCategory {
    /// The bytes counted as `cat`.
    pub fn get(&self, cat: Category) -> u64 {
        self.0[cat as usize]
    }

    /// The sum over all categories.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    pub(crate) fn add(&mut self, cat: Category, bytes: u64) {
        self.0[cat as usize] += bytes;
    }

    pub(crate) fn sub(&mut self, cat: Category, bytes: u64) {
        self.0[cat as usize] -= bytes;
    }

    /// Raises the count of `cat` to `bytes` if it is lower (a per-category peak).
    pub(crate) fn raise(&mut self, cat: Category, bytes: u64) {
        let slot = &mut self.0[cat as usize];
        *slot = (*slot).max(bytes);
    }
}

impl MemoryStats {
    /// Reserved bytes that no tensor holds.
    pub fn bytes_cached(&self) -> u64 {
        self.bytes_reserved - self.bytes_in_use
    }
}

impl fmt::Display for MemoryStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "| memory          |      current |         peak |")?;
        writeln!(f, "|-----------------|--------------|--------------|")?;
        let row = |f: &mut fmt::Formatter<'_>, name: &str, cur: String, peak: String| {
            writeln!(f, "| {name:<15} | {cur:>12} | {peak:>12} |")
        };
        row(
            f,
            "in use",
            Bytes(self.bytes_in_use).to_string(),
            Bytes(self.peak_bytes_in_use).to_string(),
        )?;
        row(
            f,
            "reserved",
            Bytes(self.bytes_reserved).to_string(),
            Bytes(self.peak_bytes_reserved).to_string(),
        )?;
        row(
            f,
            "cached (free)",
            Bytes(self.bytes_cached()).to_string(),
            String::new(),
        )?;
        row(
            f,
            "budget",
            self.budget.map_or("none".into(), |b| Bytes(b).to_string()),
            String::new(),
        )?;
        writeln!(
            f,
            "allocations {}, frees {}, reuse hits {}, buffers created {}, released {}, live segments {}, largest free block {}, refused {}",
            self.allocations,
            self.frees,
            self.reuse_hits,
            self.buffers_created,
            self.buffers_released,
            self.segments,
            Bytes(self.largest_free_block),
            self.oom_errors
        )
    }
}
