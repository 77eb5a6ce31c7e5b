//! The memory timeline: an opt-in record of every allocation, free and retag of an arena, each
//! with its bytes, size class, role and the op that caused it, and markers for the training
//! step and its phases (forward, backward, optimizer step, ...).
//!
//! Off (the default), the arena pays one branch per allocation, free and retag, and the device
//! one atomic load per recorded op. The planner records on its planning arena the same way, so
//! a step it has not run yet gets the timeline that step will have.
//!
//! An event belongs to the op recorded *next*: an op allocates its outputs before it is
//! recorded, so an allocation is charged to the op that writes it, a free to the op after the
//! last use (the same rule names the peak's op in [`MemoryStats::peak_op`]).
//!
//! The timeline's data and its analysis are here; record.rs is the recording (the arena's
//! side: what an allocation, free, retag or op adds).
//!
//! [`MemoryStats::peak_op`]: super::MemoryStats::peak_op

mod record;

pub(crate) use record::RecorderSlot;

use super::{ByCategory, Category, SMALL_REQUEST};
use serde::{Deserialize, Serialize};

/// What a block of device memory holds, as the timeline reports it: the arena's [`Category`],
/// with staging (the f32 temporary of a packed-f16 output, alive for one op) told apart from
/// the category it is counted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A model's parameters.
    Parameter,
    /// Parameters' accumulated gradients.
    Gradient,
    /// Optimizer state (momentum buffers, moments).
    OptimizerState,
    /// Activations, saved tensors and their gradients during forward and backward.
    Activation,
    /// Everything else: input batches, targets, scalars.
    Workspace,
    /// f32 temporaries a kernel writes before the cast into a packed-f16 output.
    Staging,
    /// Data-parallel training's flat gradient buffer for the all-reduce.
    Communication,
}

impl Role {
    /// Every role, in report (and chart stacking) order.
    pub const ALL: [Role; 7] = [
        Role::Parameter,
        Role::Gradient,
        Role::OptimizerState,
        Role::Activation,
        Role::Workspace,
        Role::Staging,
        Role::Communication,
    ];

    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Role::Parameter => "parameters",
            Role::Gradient => "gradients",
            Role::OptimizerState => "optimizer state",
            Role::Activation => "activations",
            Role::Workspace => "workspace",
            Role::Staging => "staging",
            Role::Communication => "communication",
        }
    }
}

impl From<Category> for Role {
    fn from(c: Category) -> Role {
        match c {
            Category::Parameters => Role::Parameter,
            Category::Gradients => Role::Gradient,
            Category::OptimizerState => Role::OptimizerState,
            Category::Activations => Role::Activation,
            Category::Workspace => Role::Workspace,
            Category::Communication => Role::Communication,
        }
    }
}

/// Bytes per [`Role`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleBytes {
    /// Parameters.
    pub parameter: u64,
    /// Gradients.
    pub gradient: u64,
    /// Optimizer state.
    pub optimizer_state: u64,
    /// Activations.
    pub activation: u64,
    /// Workspace.
    pub workspace: u64,
    /// Staging.
    pub staging: u64,
    /// The all-reduce buffer (absent in timelines written before it was counted).
    #[serde(default)]
    pub communication: u64,
}

impl RoleBytes {
    /// The bytes held as `role`.
    pub fn get(&self, role: Role) -> u64 {
        match role {
            Role::Parameter => self.parameter,
            Role::Gradient => self.gradient,
            Role::OptimizerState => self.optimizer_state,
            Role::Activation => self.activation,
            Role::Workspace => self.workspace,
            Role::Staging => self.staging,
            Role::Communication => self.communication,
        }
    }

    fn slot(&mut self, role: Role) -> &mut u64 {
        match role {
            Role::Parameter => &mut self.parameter,
            Role::Gradient => &mut self.gradient,
            Role::OptimizerState => &mut self.optimizer_state,
            Role::Activation => &mut self.activation,
            Role::Workspace => &mut self.workspace,
            Role::Staging => &mut self.staging,
            Role::Communication => &mut self.communication,
        }
    }

    /// The sum over all roles.
    pub fn total(&self) -> u64 {
        Role::ALL.iter().map(|&r| self.get(r)).sum()
    }

    /// The arena's bytes by category, as roles (no staging: it is counted in its category).
    pub fn from_categories(c: &ByCategory) -> RoleBytes {
        let mut r = RoleBytes::default();
        for cat in Category::ALL {
            *r.slot(cat.into()) += c.get(cat);
        }
        r
    }

    /// Applies one event (saturating, so a hand-edited timeline cannot panic a report).
    fn apply(&mut self, kind: &EventKind) {
        match *kind {
            EventKind::Alloc { size, role, .. } => *self.slot(role) += size,
            EventKind::Free { size, role } => {
                *self.slot(role) = self.get(role).saturating_sub(size);
            }
            EventKind::Retag { size, from, to } => {
                *self.slot(from) = self.get(from).saturating_sub(size);
                *self.slot(to) += size;
            }
            _ => {}
        }
    }
}

/// Which of the arena's pools a block comes from: requests up to [`SMALL_REQUEST`] share
/// 2 MiB segments, larger ones get segments of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SizeClass {
    /// Up to [`SMALL_REQUEST`] bytes: shared segments.
    Small,
    /// Larger: a segment of its own, rounded up to 64 KiB.
    Large,
}

impl SizeClass {
    /// The class of a block of `size` bytes.
    pub fn of(size: u64) -> SizeClass {
        if size <= SMALL_REQUEST {
            SizeClass::Small
        } else {
            SizeClass::Large
        }
    }
}

/// What happened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventKind {
    /// A block was handed out: `requested` bytes asked for, `size` taken (rounded to 256).
    Alloc {
        /// Bytes the tensor asked for.
        requested: u64,
        /// Bytes of the block.
        size: u64,
        /// The pool it came from.
        class: SizeClass,
        /// What it holds.
        role: Role,
    },
    /// A block was returned.
    Free {
        /// Bytes of the block.
        size: u64,
        /// What it held.
        role: Role,
    },
    /// A live block changed role (a parameter adopted a gradient, a trainer took a model's
    /// parameters).
    Retag {
        /// Bytes of the block.
        size: u64,
        /// What it was counted as.
        from: Role,
        /// What it is counted as now.
        to: Role,
    },
    /// A training step began.
    StepStart,
    /// The training step ended.
    StepEnd,
    /// A phase of the step began ("forward", "backward", "optimizer step", ...).
    PhaseStart {
        /// The phase's name.
        phase: String,
    },
    /// The phase ended.
    PhaseEnd,
}

/// One entry of a [`Timeline`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryEvent {
    /// What happened.
    #[serde(flatten)]
    pub kind: EventKind,
    /// Index into [`Timeline::ops`] of the op recorded next (the op that caused it); `None`
    /// after the last op of the timeline.
    pub op: Option<usize>,
    /// Bytes in use after the event.
    pub in_use: u64,
    /// Bytes the arena held from the driver after the event.
    pub reserved: u64,
}

/// A recorded (or planned) sequence of memory events. See the module docs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    /// Recorded on a planning arena (a step that had not run).
    pub planned: bool,
    /// Bytes in use by role when the timeline begins.
    pub start: RoleBytes,
    /// Bytes reserved when the timeline begins.
    pub start_reserved: u64,
    /// The ops recorded (kernel names, "copy", "clear", "upload", "readback"), in order.
    pub ops: Vec<String>,
    /// The events, in order.
    pub events: Vec<MemoryEvent>,
}

/// The memory at one op of a [`Timeline`] (see [`Timeline::per_op`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpPoint {
    /// Index into [`Timeline::ops`]; `None` for what happened after the last op.
    pub op: Option<usize>,
    /// Bytes in use by role at the highest point between the previous op and this one.
    pub bytes: RoleBytes,
    /// The event of that highest point (`None` when no event happened there).
    pub event: Option<usize>,
}

/// A phase of the step in op coordinates: it began before op `start` and ended before op
/// `end` (`end` = the number of points of [`Timeline::per_op`] when it lasted to the end).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhaseSpan {
    /// The phase's name.
    pub name: String,
    /// The first op of the phase.
    pub start: usize,
    /// The op after its last one.
    pub end: usize,
}

impl Timeline {
    /// Bytes in use when the timeline begins.
    pub fn start_in_use(&self) -> u64 {
        self.start.total()
    }

    /// The most bytes in use at once.
    pub fn peak(&self) -> u64 {
        self.events
            .iter()
            .map(|e| e.in_use)
            .fold(self.start_in_use(), u64::max)
    }

    /// The first event at the peak (`None` when nothing rose above the start).
    pub fn peak_event(&self) -> Option<usize> {
        let peak = self.peak();
        if peak == self.start_in_use() {
            return None;
        }
        self.events.iter().position(|e| e.in_use == peak)
    }

    /// The op that caused event `i`.
    pub fn op_of(&self, i: usize) -> Option<&str> {
        let op = self.events.get(i)?.op?;
        self.ops.get(op).map(String::as_str)
    }

    /// The phase open at event `i`.
    pub fn phase_of(&self, i: usize) -> Option<&str> {
        let mut phase = None;
        for e in self.events.iter().take(i + 1) {
            match &e.kind {
                EventKind::PhaseStart { phase: p } => phase = Some(p.as_str()),
                EventKind::PhaseEnd => phase = None,
                _ => {}
            }
        }
        phase
    }

    /// The op that reached the peak with its phase, written as
    /// [`MemoryStats::peak_op`](super::MemoryStats::peak_op) is
    /// (`"matmul_sg_16x4_f32 (backward)"`).
    pub fn peak_op(&self) -> Option<String> {
        let i = self.peak_event()?;
        let op = self.op_of(i)?;
        Some(match self.phase_of(i) {
            Some(p) => format!("{op} ({p})"),
            None => op.to_string(),
        })
    }

    /// Bytes in use by role after each event, replayed from [`Timeline::start`].
    pub fn replay(&self) -> Vec<RoleBytes> {
        let mut now = self.start;
        self.events
            .iter()
            .map(|e| {
                now.apply(&e.kind);
                now
            })
            .collect()
    }

    /// Whether the roles replayed from the start add up to every event's bytes in use, and
    /// ops are in range and in order (what a timeline from the arena always satisfies).
    pub fn is_consistent(&self) -> bool {
        let mut last_op = 0;
        self.replay()
            .iter()
            .zip(&self.events)
            .all(|(r, e)| r.total() == e.in_use)
            && self.events.iter().all(|e| match e.op {
                Some(op) if op < self.ops.len() && op >= last_op => {
                    last_op = op;
                    true
                }
                Some(_) => false,
                None => true,
            })
    }

    /// Training steps begun in this timeline.
    pub fn steps(&self) -> usize {
        self.events
            .iter()
            .filter(|e| e.kind == EventKind::StepStart)
            .count()
    }

    /// The last training step of the timeline (from its start marker to its end marker), as
    /// a timeline of its own: its start is the memory when the step began, its ops are the
    /// step's, and events after the step's last op have no op. `None` without a step.
    pub fn last_step(&self) -> Option<Timeline> {
        let s = self
            .events
            .iter()
            .rposition(|e| e.kind == EventKind::StepStart)?;
        let e = self.events[s..]
            .iter()
            .position(|e| e.kind == EventKind::StepEnd)
            .map_or(self.events.len() - 1, |k| s + k);
        let start = if s == 0 {
            self.start
        } else {
            self.replay()[s - 1]
        };
        let start_reserved = if s == 0 {
            self.start_reserved
        } else {
            self.events[s - 1].reserved
        };
        let first_op = self.events[s].op.unwrap_or(self.ops.len());
        let end_op = self.events[e].op.unwrap_or(self.ops.len()).max(first_op);
        let events = self.events[s..=e]
            .iter()
            .map(|ev| MemoryEvent {
                op: ev.op.filter(|&o| o < end_op).map(|o| o - first_op),
                ..ev.clone()
            })
            .collect();
        Some(Timeline {
            planned: self.planned,
            start,
            start_reserved,
            ops: self.ops[first_op..end_op].to_vec(),
            events,
        })
    }

    /// One point per op (and one more for events after the last op, when there are any):
    /// the memory by role at the highest point between the previous op and that one, so the
    /// highest point is the peak. The x of a chart over the ops.
    pub fn per_op(&self) -> Vec<OpPoint> {
        let replayed = self.replay();
        let mut points: Vec<OpPoint> = Vec::with_capacity(self.ops.len() + 1);
        let mut now = self.start;
        let mut i = 0;
        let slots = (0..self.ops.len()).map(Some).chain([None]);
        for op in slots {
            let mut best = OpPoint {
                op,
                bytes: now,
                event: None,
            };
            while i < self.events.len() && self.events[i].op == op {
                now = replayed[i];
                if best.event.is_none() || now.total() > best.bytes.total() {
                    best.bytes = now;
                    best.event = Some(i);
                }
                i += 1;
            }
            if op.is_some() || best.event.is_some() {
                points.push(best);
            }
        }
        points
    }

    /// The phases of the timeline in op coordinates (see [`PhaseSpan`]).
    pub fn phases(&self) -> Vec<PhaseSpan> {
        let end = self.per_op().len();
        let at = |e: &MemoryEvent| e.op.unwrap_or(end);
        let mut spans = Vec::new();
        let mut open: Option<PhaseSpan> = None;
        for e in &self.events {
            match &e.kind {
                EventKind::PhaseStart { phase } => {
                    if let Some(mut s) = open.take() {
                        s.end = at(e);
                        spans.push(s);
                    }
                    open = Some(PhaseSpan {
                        name: phase.clone(),
                        start: at(e),
                        end,
                    });
                }
                EventKind::PhaseEnd => {
                    if let Some(mut s) = open.take() {
                        s.end = at(e);
                        spans.push(s);
                    }
                }
                _ => {}
            }
        }
        spans.extend(open);
        spans
    }
}
