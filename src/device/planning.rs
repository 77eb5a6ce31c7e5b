//! Planning mode (see [`Device::planning`]): a copy of the arena per plan that creates no
//! buffer, the arena allocations go to now ([`Device::is_planning`]), and the scopes that tag
//! allocations with a category or a step's phase.

use super::{lock, Device};
use crate::memory::{Arena, Block, Category, MemoryStats};
use crate::{Error, Result};
use std::sync::atomic::Ordering;

impl Device {
    /// Whether this device is in planning mode (see `Device::planning`): allocations are
    /// counted but nothing runs, and readbacks return zeros. Code with host-side state that a
    /// step advances (a dropout call counter) leaves it alone while planning.
    pub fn is_planning(&self) -> bool {
        self.inner.plan_only
            || self.inner.planning.load(Ordering::Acquire)
                && *lock(&self.inner.plan_thread) == Some(std::thread::current().id())
    }

    /// Opens planning mode: until the scope drops, every allocation goes through a copy of the
    /// arena (same segments, free ranges, rounding, reuse and budget) that creates no buffer;
    /// no kernel is compiled or recorded, nothing is uploaded, readbacks return zeros, and
    /// matmuls are not autotuned. Running a step inside it gives that step's exact peak.
    /// Planning applies to the calling thread only: other threads' work runs as usual (their
    /// frees reach the plan too; their allocations do not).
    pub fn planning(&self) -> Result<PlanScope> {
        self.flush()?;
        let mut plan = lock(&self.inner.plan);
        if plan.is_some() {
            return Err(Error::InvalidArgument {
                op: "Device::planning",
                reason: "this device is already planning".into(),
            });
        }
        let id = self.inner.plans.fetch_add(1, Ordering::AcqRel) + 1;
        *plan = Some(lock(&self.inner.arena).planning_copy(id));
        *lock(&self.inner.plan_thread) = Some(std::thread::current().id());
        self.inner.planning.store(true, Ordering::Release);
        Ok(PlanScope {
            device: self.clone(),
        })
    }

    /// Runs `f` on the arena allocations go to now: the planning one inside a plan.
    pub(super) fn with_arena<R>(&self, f: impl FnOnce(&mut Arena) -> R) -> R {
        if self.is_planning() {
            if let Some(a) = lock(&self.inner.plan).as_mut() {
                return f(a);
            }
        }
        f(&mut lock(&self.inner.arena))
    }

    /// Sets what new allocations count as ([`MemoryStats::in_use_by_category`]) until the
    /// guard drops.
    pub fn category_scope(&self, cat: Category) -> CategoryScope {
        let prev = self.with_arena(|a| a.set_category(cat));
        CategoryScope {
            device: self.clone(),
            prev,
        }
    }

    /// Counts `block`'s memory as `cat` from now on (see `Device::retag`, which takes the
    /// tensor).
    pub(crate) fn retag_block(&self, block: &Block, cat: Category) {
        lock(&self.inner.arena).retag(block, cat);
        if let Some(a) = lock(&self.inner.plan).as_mut() {
            a.retag(block, cat);
        }
    }

    /// Names the phase of a step (`"forward"`, `"backward"`, ...) that the peak's op is
    /// reported with, until the guard drops.
    pub fn phase_scope(&self, phase: &'static str) -> PhaseScope {
        self.with_arena(|a| a.set_phase(Some(phase)));
        PhaseScope {
            device: self.clone(),
        }
    }

    /// While planning: the op now being recorded names a pending peak, and nothing runs.
    pub(super) fn planned_op(&self, name: &str) -> bool {
        self.note_op(name);
        if !self.is_planning() {
            return false;
        }
        if let Some(a) = lock(&self.inner.plan).as_mut() {
            a.name_peak(name);
        }
        true
    }
}

/// The error for a tensor made while planning that is used for real after the plan ended.
pub(super) fn planned_outside_plan() -> Error {
    Error::InvalidArgument {
        op: "device",
        reason:
            "a tensor created while planning has no device memory and cannot be used after the plan"
                .into(),
    }
}

/// Planning mode of a [`Device`] (see [`Device::planning`]); it ends when this drops.
pub struct PlanScope {
    device: Device,
}

impl PlanScope {
    /// The planning arena's statistics: peaks since the plan began (in use, reserved, by
    /// category, the peak's op), allocations, the segments it would have created.
    pub fn stats(&self) -> MemoryStats {
        lock(&self.device.inner.plan)
            .as_ref()
            .map(Arena::stats)
            .unwrap_or_default()
    }

    /// Makes the plan's peaks start from what is in use now.
    pub fn reset_peak(&self) {
        if let Some(a) = lock(&self.device.inner.plan).as_mut() {
            a.reset_peak();
            a.set_phase(None);
        }
    }

    /// Leaves `block` out of the plan (see `PlanScope::forget`, which takes the tensor).
    pub(crate) fn forget_block(&self, block: &Block) {
        if let Some(a) = lock(&self.device.inner.plan).as_mut() {
            a.free(block);
        }
    }

    /// Sets the budget the planning arena enforces (it starts with the device's).
    pub fn set_budget(&self, budget: Option<u64>) {
        if let Some(a) = lock(&self.device.inner.plan).as_mut() {
            a.set_budget(budget);
        }
    }
}

impl Drop for PlanScope {
    fn drop(&mut self) {
        self.device.inner.planning.store(false, Ordering::Release);
        *lock(&self.device.inner.plan_thread) = None;
        let plan = lock(&self.device.inner.plan).take();
        if plan.is_some_and(|a| a.is_recording()) {
            self.device.inner.recorders.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Restores the previous allocation category when dropped (see [`Device::category_scope`]).
#[must_use = "the category applies only while the guard lives"]
pub struct CategoryScope {
    device: Device,
    prev: Category,
}

impl Drop for CategoryScope {
    fn drop(&mut self) {
        self.device.with_arena(|a| a.set_category(self.prev));
    }
}

/// Clears the phase when dropped (see [`Device::phase_scope`]).
#[must_use = "the phase applies only while the guard lives"]
pub struct PhaseScope {
    device: Device,
}

impl Drop for PhaseScope {
    fn drop(&mut self) {
        self.device.with_arena(|a| a.set_phase(None));
    }
}
