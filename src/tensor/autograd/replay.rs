//! The seed tape that makes gradient checkpointing exact with dropout: a checkpointed segment's
//! recomputation draws the same random seeds (dropout masks) as its first forward.
//!
//! [`checkpoint`](super::checkpoint) opens a *recording* frame on this thread's tape around the
//! segment's first forward; every [`replayable_seed`] call inside draws its seed as usual (a
//! `Dropout` advances its call counter) and pushes it. The backward pass reopens the recorded
//! seeds as a *replaying* frame around the recomputation, where each call takes the next
//! recorded seed instead of drawing (the counter does not move again). So a layer's counter
//! advances once per forward whether or not it is checkpointed, and both runs see the same masks.
//!
//! Nested segments work: a recording frame inside a recording one hands its seeds to the outer
//! frame when it closes (the outer recomputation replays them), and a recording frame inside a
//! replaying one takes its seeds from that replay (the inner segment's first forward, rerun by
//! the outer recomputation, must see the outer first forward's seeds).

use crate::{Error, Result};
use std::cell::RefCell;

enum Frame {
    /// A segment's first forward: the seeds drawn so far, in call order.
    Record(Vec<u64>),
    /// A segment's recomputation: the recorded seeds and the next one to hand out.
    Replay { seeds: Vec<u64>, next: usize },
}

thread_local! {
    static TAPE: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// A random seed that a checkpointed recomputation reproduces: `draw()` outside any checkpointed
/// segment and in a segment's first forward (recorded there), the recorded seed of the same
/// position during its recomputation (`draw` is not called). Layers that draw randomness per
/// call (`nn::Dropout`) take their seeds through this.
///
/// Errors: [`Error::Autograd`] when a recomputation asks for more seeds than its first forward
/// drew (a segment whose code depends on something that changed in between, such as the
/// training mode).
pub fn replayable_seed(draw: impl FnOnce() -> u64) -> Result<u64> {
    // The tape's borrow is never held across `draw` (which may run arbitrary code).
    let taken = TAPE.with(|t| -> Result<Option<Option<u64>>> {
        let mut t = t.borrow_mut();
        if t.is_empty() {
            return Ok(None);
        }
        // The nearest replay below the top (or the top itself) supplies the seed; every frame
        // above it is a recording one.
        let replay = t.iter_mut().rev().find_map(|f| match f {
            Frame::Replay { seeds, next } => Some((seeds, next)),
            Frame::Record(_) => None,
        });
        match replay {
            Some((seeds, next)) => {
                let s = *seeds.get(*next).ok_or_else(|| {
                    Error::Autograd(format!(
                        "checkpoint: the recomputation asked for more random seeds (dropout \
                         masks) than the first forward drew ({}); a checkpointed segment must \
                         run the same layers in the same mode both times",
                        seeds.len()
                    ))
                })?;
                *next += 1;
                Ok(Some(Some(s)))
            }
            None => Ok(Some(None)),
        }
    })?;
    let seed = match taken {
        None => return Ok(draw()),
        Some(Some(s)) => s,
        Some(None) => draw(),
    };
    TAPE.with(|t| {
        if let Some(Frame::Record(seeds)) = t.borrow_mut().last_mut() {
            seeds.push(seed);
        }
    });
    Ok(seed)
}

/// Whether a checkpointed segment is being recomputed on this thread (a replaying frame is
/// open): layers with effects beyond their output (batch norm's running statistics) skip them
/// there, so those move once per forward with or without checkpointing.
pub fn recomputing() -> bool {
    TAPE.with(|t| t.borrow().iter().any(|f| matches!(f, Frame::Replay { .. })))
}

/// A frame open on this thread's tape; dropping it unfinished (an error in the segment) pops
/// it and everything above it.
struct Open {
    depth: usize,
}

impl Open {
    fn push(frame: Frame) -> Open {
        TAPE.with(|t| {
            let mut t = t.borrow_mut();
            t.push(frame);
            Open { depth: t.len() }
        })
    }

    /// Pops this frame (and any frame a failed inner segment left above it).
    fn pop(&self) -> Option<Frame> {
        TAPE.with(|t| {
            let mut t = t.borrow_mut();
            t.truncate(self.depth);
            t.pop()
        })
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        TAPE.with(|t| t.borrow_mut().truncate(self.depth - 1));
    }
}

/// The recording frame around a segment's first forward.
pub(crate) struct Recording(Open);

/// Opens a recording frame: [`replayable_seed`] calls on this thread are recorded until
/// [`Recording::finish`].
pub(crate) fn record_seeds() -> Recording {
    Recording(Open::push(Frame::Record(Vec::new())))
}

impl Recording {
    /// Closes the frame and returns its seeds in call order; an enclosing recording frame gets
    /// them too, so its own recomputation replays them.
    pub(crate) fn finish(self) -> Vec<u64> {
        let seeds = match self.0.pop() {
            Some(Frame::Record(s)) => s,
            _ => unreachable!("the seed tape's top frame is the recording opened last"),
        };
        TAPE.with(|t| {
            if let Some(Frame::Record(outer)) = t.borrow_mut().last_mut() {
                outer.extend_from_slice(&seeds);
            }
        });
        seeds
    }
}

/// The replaying frame around a segment's recomputation.
pub(crate) struct Replaying(Open);

/// Opens a replaying frame: [`replayable_seed`] calls on this thread take `seeds` in order until
/// [`Replaying::finish`].
pub(crate) fn replay_seeds(seeds: Vec<u64>) -> Replaying {
    Replaying(Open::push(Frame::Replay { seeds, next: 0 }))
}

impl Replaying {
    /// Closes the frame. Errors: [`Error::Autograd`] when the recomputation used fewer seeds than
    /// were recorded (its masks would not be the first forward's).
    pub(crate) fn finish(self) -> Result<()> {
        match self.0.pop() {
            Some(Frame::Replay { seeds, next }) if next == seeds.len() => Ok(()),
            Some(Frame::Replay { seeds, next }) => Err(Error::Autograd(format!(
                "checkpoint: the recomputation used {next} of the {} random seeds (dropout \
                 masks) its first forward drew; a checkpointed segment must run the same layers \
                 in the same mode both times",
                seeds.len()
            ))),
            _ => unreachable!("the seed tape's top frame is the replay opened last"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A counter standing in for a Dropout layer's.
    fn drawer(c: &std::cell::Cell<u64>) -> impl FnOnce() -> u64 + '_ {
        move || {
            c.set(c.get() + 1);
            c.get() * 10
        }
    }

    #[test]
    fn outside_a_segment_draws() {
        let c = std::cell::Cell::new(0);
        assert_eq!(replayable_seed(drawer(&c)).unwrap(), 10);
        assert_eq!(replayable_seed(drawer(&c)).unwrap(), 20);
    }

    #[test]
    fn replay_returns_the_recorded_seeds_without_drawing() {
        let c = std::cell::Cell::new(0);
        let rec = record_seeds();
        let a = replayable_seed(drawer(&c)).unwrap();
        let b = replayable_seed(drawer(&c)).unwrap();
        let seeds = rec.finish();
        assert_eq!(seeds, vec![a, b]);
        let rep = replay_seeds(seeds.clone());
        assert_eq!(replayable_seed(drawer(&c)).unwrap(), a);
        assert_eq!(replayable_seed(drawer(&c)).unwrap(), b);
        assert!(
            replayable_seed(drawer(&c)).is_err(),
            "a third seed was never recorded"
        );
        assert_eq!(c.get(), 2, "replay does not draw");
        drop(rep);
        let rep = replay_seeds(seeds);
        replayable_seed(drawer(&c)).unwrap();
        assert!(rep.finish().is_err(), "one of two seeds left unused");
    }

    #[test]
    fn nested_segments_replay_through_the_outer_one() {
        let c = std::cell::Cell::new(0);
        // First forward: outer draws one, the inner segment one, then outer one more.
        let outer = record_seeds();
        let s1 = replayable_seed(drawer(&c)).unwrap();
        let inner = record_seeds();
        let s2 = replayable_seed(drawer(&c)).unwrap();
        assert_eq!(inner.finish(), vec![s2]);
        let s3 = replayable_seed(drawer(&c)).unwrap();
        let outer_seeds = outer.finish();
        assert_eq!(outer_seeds, vec![s1, s2, s3]);
        // The outer recomputation reruns the inner segment's first forward from the replay.
        let rep = replay_seeds(outer_seeds);
        assert_eq!(replayable_seed(drawer(&c)).unwrap(), s1);
        let inner = record_seeds();
        assert_eq!(replayable_seed(drawer(&c)).unwrap(), s2);
        assert_eq!(inner.finish(), vec![s2]);
        assert_eq!(replayable_seed(drawer(&c)).unwrap(), s3);
        rep.finish().unwrap();
        assert_eq!(c.get(), 3, "only the first forward drew");
    }

    #[test]
    fn an_abandoned_frame_is_popped() {
        let c = std::cell::Cell::new(0);
        {
            let _rec = record_seeds();
            let _inner = replay_seeds(vec![]);
        }
        assert_eq!(
            replayable_seed(drawer(&c)).unwrap(),
            10,
            "no frame is left open"
        );
    }
}
