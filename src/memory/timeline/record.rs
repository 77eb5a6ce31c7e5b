//! Recording a [`Timeline`]: the [`Recorder`] an arena holds while a timeline is on, and the
//! arena's side of it (start, take, ops, markers, staging).

use super::{EventKind, MemoryEvent, Role, RoleBytes, SizeClass, Timeline};
use crate::memory::{Arena, Block, Category, MemoryStats};
use std::collections::HashSet;

/// What an arena records while a timeline is on.
pub(crate) struct Recorder {
    timeline: Timeline,
    /// The first event not yet charged to an op.
    pending: usize,
    /// Live staging blocks, by (segment, offset).
    staging: HashSet<(usize, u64)>,
}

/// An arena's recorder, if it records. A copy of an arena (a plan's) records nothing of its
/// own: cloning gives an empty slot, so a plan never copies a recording.
#[derive(Default)]
pub(crate) struct RecorderSlot(pub(crate) Option<Box<Recorder>>);

impl Clone for RecorderSlot {
    fn clone(&self) -> Self {
        RecorderSlot(None)
    }
}

impl Recorder {
    fn push(&mut self, kind: EventKind, stats: &MemoryStats) {
        self.timeline.events.push(MemoryEvent {
            kind,
            op: None,
            in_use: stats.bytes_in_use,
            reserved: stats.bytes_reserved,
        });
    }

    fn role(&self, block: &Block, cat: Category) -> Role {
        if self.staging.contains(&(block.segment, block.offset)) {
            Role::Staging
        } else {
            cat.into()
        }
    }

    pub(crate) fn alloc(
        &mut self,
        requested: u64,
        block: &Block,
        cat: Category,
        staging: bool,
        stats: &MemoryStats,
    ) {
        if staging {
            self.staging.insert((block.segment, block.offset));
        }
        let kind = EventKind::Alloc {
            requested,
            size: block.size,
            class: SizeClass::of(block.size),
            role: self.role(block, cat),
        };
        self.push(kind, stats);
    }

    pub(crate) fn free(&mut self, block: &Block, cat: Category, stats: &MemoryStats) {
        let role = self.role(block, cat);
        self.staging.remove(&(block.segment, block.offset));
        let size = block.size;
        self.push(EventKind::Free { size, role }, stats);
    }

    pub(crate) fn retag(&mut self, block: &Block, from: Category, to: Category, s: &MemoryStats) {
        let (from, to) = (self.role(block, from), Role::from(to));
        if from != to {
            self.push(
                EventKind::Retag {
                    size: block.size,
                    from,
                    to,
                },
                s,
            );
        }
    }

    pub(crate) fn mark(&mut self, kind: EventKind, stats: &MemoryStats) {
        self.push(kind, stats);
    }
}

/// The arena's side of recording.
impl Arena {
    /// Starts recording from the arena's state now; `false` when it records already.
    pub fn start_timeline(&mut self) -> bool {
        if self.timeline.0.is_some() {
            return false;
        }
        self.timeline.0 = Some(Box::new(Recorder {
            timeline: Timeline {
                planned: self.is_planning(),
                start: RoleBytes::from_categories(&self.stats.in_use_by_category),
                start_reserved: self.stats.bytes_reserved,
                ops: Vec::new(),
                events: Vec::new(),
            },
            pending: 0,
            staging: HashSet::new(),
        }));
        true
    }

    /// Stops recording and returns what was recorded.
    pub fn take_timeline(&mut self) -> Option<Timeline> {
        self.timeline.0.take().map(|r| r.timeline)
    }

    /// Whether a timeline is being recorded.
    pub fn is_recording(&self) -> bool {
        self.timeline.0.is_some()
    }

    /// An op was recorded: the events since the previous one are its.
    pub fn note_op(&mut self, name: &str) {
        if let Some(r) = self.timeline.0.as_mut() {
            let op = r.timeline.ops.len();
            for e in &mut r.timeline.events[r.pending..] {
                e.op = Some(op);
            }
            r.pending = r.timeline.events.len();
            r.timeline.ops.push(name.to_string());
        }
    }

    /// Adds a marker to the timeline, if one is recorded.
    pub fn mark(&mut self, kind: EventKind) {
        if let Some(r) = self.timeline.0.as_mut() {
            r.mark(kind, &self.stats);
        }
    }

    /// Counts the blocks allocated from now on as staging in the timeline; returns the
    /// previous setting.
    pub fn set_staging(&mut self, staging: bool) -> bool {
        std::mem::replace(&mut self.staging, staging)
    }
}
