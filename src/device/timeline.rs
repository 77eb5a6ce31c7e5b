//! The device's side of the memory timeline (memory/timeline.rs): starting and taking it,
//! naming the op each event belongs to, and the step and staging markers.
//!
//! The timeline is recorded by the arena allocations go to now: the real one, or inside
//! [`Device::planning`] the planning one, so a plan records the timeline of a step that has
//! not run. Off, each recorded op costs one atomic load here.

use super::Device;
use crate::memory::{EventKind, Timeline};
use crate::{Error, Result};
use std::sync::atomic::Ordering;

impl Device {
    /// Starts recording every allocation, free and retag of the arena allocations go to now
    /// (the planning arena inside [`Device::planning`]), with the op each belongs to and the
    /// markers of steps and their phases, until [`Device::take_timeline`]. Recording twice on
    /// one arena is an [`Error::InvalidArgument`].
    pub fn start_timeline(&self) -> Result<()> {
        if !self.with_arena(|a| a.start_timeline()) {
            return Err(Error::InvalidArgument {
                op: "Device::start_timeline",
                reason: "a timeline is being recorded already; take it first".into(),
            });
        }
        self.inner.recorders.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Stops recording and returns the timeline; `None` when none was being recorded.
    pub fn take_timeline(&self) -> Option<Timeline> {
        let t = self.with_arena(|a| a.take_timeline());
        if t.is_some() {
            self.inner.recorders.fetch_sub(1, Ordering::AcqRel);
        }
        t
    }

    /// Marks a training step in the timeline being recorded, from now until the guard drops
    /// (the trainer wraps each step in one). Does nothing when no timeline is recorded.
    pub fn step_scope(&self) -> StepScope {
        let marked = self.mark(EventKind::StepStart);
        StepScope {
            device: marked.then(|| self.clone()),
        }
    }

    /// Blocks allocated until the guard drops are staging temporaries in the timeline.
    pub(crate) fn staging_scope(&self) -> StagingScope {
        let on = self.recording() && !self.with_arena(|a| a.set_staging(true));
        StagingScope {
            device: on.then(|| self.clone()),
        }
    }

    /// An op is being recorded: the timeline's pending events are its.
    pub(super) fn note_op(&self, name: &str) {
        if self.recording() {
            self.with_arena(|a| a.note_op(name));
        }
    }

    fn recording(&self) -> bool {
        self.inner.recorders.load(Ordering::Acquire) > 0
    }

    /// Adds `kind` to the timeline; whether one is recorded.
    fn mark(&self, kind: EventKind) -> bool {
        self.recording()
            && self.with_arena(|a| {
                let on = a.is_recording();
                a.mark(kind);
                on
            })
    }
}

/// Ends the step's span in the timeline when dropped (see [`Device::step_scope`]).
#[must_use = "the step lasts only while the guard lives"]
pub struct StepScope {
    device: Option<Device>,
}

impl Drop for StepScope {
    fn drop(&mut self) {
        if let Some(d) = &self.device {
            d.mark(EventKind::StepEnd);
        }
    }
}

/// Ends staging when dropped (see `Device::staging_scope`).
pub(crate) struct StagingScope {
    device: Option<Device>,
}

impl Drop for StagingScope {
    fn drop(&mut self) {
        if let Some(d) = &self.device {
            d.with_arena(|a| a.set_staging(false));
        }
    }
}
