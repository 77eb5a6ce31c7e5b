//! The collectives data-parallel training needs, as a trait ([`Communicator`]) with two
//! implementations: [`LocalGroup`] for replicas on threads of one process (several devices),
//! and MPI (`mpi.rs`, behind the `mpi` feature) for ranks in several processes or machines.
//!
//! Every collective is called by all members in the same order; a member that fails or stops
//! answering turns every other member's call into an [`Error::Distributed`], never a hang.

use crate::device::lock;
use crate::{Error, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A group of replicas that exchange host buffers. Each member holds one; every member calls
/// the same collectives in the same order with buffers of the same length.
pub trait Communicator: Send {
    /// This member's index, 0-based. Rank 0 writes checkpoints and reports.
    fn rank(&self) -> usize;
    /// Members in the group.
    fn size(&self) -> usize;
    /// Replaces `buf` by its elementwise sum over the members, the same values on every member.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()>;
    /// Replaces `buf` by rank 0's `buf` (same length on every member).
    fn broadcast(&mut self, buf: &mut [u8]) -> Result<()>;
    /// Every member's `values` (same length on each), rank after rank.
    fn all_gather(&mut self, values: &[u64]) -> Result<Vec<u64>>;
    /// Sets `shard` to this member's part of the elementwise sum of every member's `buf`:
    /// `buf` is `size()` equal parts (`buf.len() == size() * shard.len()`), part `r` summed
    /// lands on member `r`. Each part is summed as [`Communicator::all_reduce_sum`] would.
    fn reduce_scatter(&mut self, buf: &[f32], shard: &mut [f32]) -> Result<()>;
    /// Sets `buf` to every member's `shard` (same length on each), rank after rank
    /// (`buf.len() == size() * shard.len()`): the same bits on every member.
    fn all_gather_f32(&mut self, shard: &[f32], buf: &mut [f32]) -> Result<()>;
}

/// `Err` unless `buf` is `size` parts of `shard`'s length (what both flat collectives need).
pub(crate) fn check_parts(op: &'static str, buf: usize, shard: usize, size: usize) -> Result<()> {
    if shard.checked_mul(size) == Some(buf) {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        op,
        reason: format!(
            "the flat buffer holds {buf} values, not {size} parts of the shard's {shard}"
        ),
    })
}

/// The positions of member `rank`'s share of a batch of `n` samples split over `size` members:
/// contiguous pieces in rank order, the first `n % size` members one sample longer.
pub fn share_of(n: usize, rank: usize, size: usize) -> std::ops::Range<usize> {
    let (base, extra) = (n / size.max(1), n % size.max(1));
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// How long a member of an in-process group waits for the others in one collective by default.
/// Replicas that fail say so at once ([`LocalGroup::fail`]); the timeout only catches a replica
/// that stops without failing.
pub const LOCAL_TIMEOUT: Duration = Duration::from_secs(600);

/// What one member brings to a collective and what the collective gives back.
#[derive(Clone)]
enum Payload {
    F32(Vec<f32>),
    Bytes(Vec<u8>),
    U64(Vec<u64>),
}

impl Payload {
    fn len(&self) -> usize {
        match self {
            Payload::F32(v) => v.len(),
            Payload::Bytes(v) => v.len(),
            Payload::U64(v) => v.len(),
        }
    }
}

/// The collective under way, the members' inputs, and the last collective's result.
struct Round {
    /// Completed collectives; a member waits until this moves past the one it joined.
    generation: u64,
    /// The kind and length every member must bring, set by the first to arrive.
    op: Option<(&'static str, usize)>,
    inputs: Vec<Option<Payload>>,
    result: Option<Arc<Payload>>,
    /// Set once, by the first member that fails or times out; every later call errors.
    failed: Option<(usize, String)>,
}

struct Shared {
    size: usize,
    timeout: Duration,
    round: Mutex<Round>,
    wake: Condvar,
}

/// An in-process group of `size` members (one per replica thread), built with
/// [`LocalGroup::new`] together with the members' communicators. The sum
/// of an all-reduce is computed once, by the last member to arrive, in rank order, so every
/// member gets the same bits, run after run.
#[derive(Clone)]
pub struct LocalGroup {
    shared: Arc<Shared>,
}

/// One member of a [`LocalGroup`].
pub struct LocalComm {
    shared: Arc<Shared>,
    rank: usize,
}

impl LocalGroup {
    /// A group of `size` members (at least 1) whose collectives wait at most `timeout` for
    /// every member, and the members' communicators, rank 0 first.
    pub fn new(size: usize, timeout: Duration) -> Result<(LocalGroup, Vec<LocalComm>)> {
        if size == 0 {
            return Err(Error::InvalidArgument {
                op: "LocalGroup::new",
                reason: "a group needs at least one member".into(),
            });
        }
        let group = LocalGroup {
            shared: Arc::new(Shared {
                size,
                timeout,
                round: Mutex::new(Round {
                    generation: 0,
                    op: None,
                    inputs: vec![None; size],
                    result: None,
                    failed: None,
                }),
                wake: Condvar::new(),
            }),
        };
        let members = (0..size)
            .map(|rank| LocalComm {
                shared: group.shared.clone(),
                rank,
            })
            .collect();
        Ok((group, members))
    }

    /// Marks member `rank` as failed with `reason`: every member waiting in a collective, and
    /// every later collective, returns an [`Error::Distributed`] naming it. The first failure
    /// is kept.
    pub fn fail(&self, rank: usize, reason: &str) {
        let mut round = lock(&self.shared.round);
        if round.failed.is_none() {
            round.failed = Some((rank, reason.to_string()));
        }
        self.shared.wake.notify_all();
    }

    /// The first failure: the member and its reason.
    pub fn failure(&self) -> Option<(usize, String)> {
        lock(&self.shared.round).failed.clone()
    }
}

impl LocalComm {
    fn error(&self, reason: String) -> Error {
        Error::Distributed {
            rank: self.rank,
            reason,
        }
    }

    fn failed_error(&self, failed: &(usize, String)) -> Error {
        if failed.0 == self.rank {
            self.error(format!(
                "replica {} (this one) failed earlier: {}",
                self.rank, failed.1
            ))
        } else {
            self.error(format!("replica {} failed: {}", failed.0, failed.1))
        }
    }

    /// Brings `input` to the collective `kind` and returns its result once every member has
    /// brought theirs (computed by the last to arrive with `combine`).
    fn exchange(
        &self,
        kind: &'static str,
        input: Payload,
        combine: fn(&[Option<Payload>]) -> Payload,
    ) -> Result<Arc<Payload>> {
        let sh = &*self.shared;
        let mut round = lock(&sh.round);
        if let Some(f) = &round.failed {
            return Err(self.failed_error(f));
        }
        let this = (kind, input.len());
        match round.op {
            None => round.op = Some(this),
            Some(op) if op != this => {
                let reason = format!(
                    "replica {} called {kind} with {} values while the others are in {} with {}",
                    self.rank, this.1, op.0, op.1
                );
                round.failed = Some((self.rank, reason.clone()));
                sh.wake.notify_all();
                return Err(self.error(reason));
            }
            Some(_) => {}
        }
        // Each rank's communicator exists once (`LocalGroup::new` hands them out) and a call
        // holds it mutably, so a rank cannot be here twice.
        round.inputs[self.rank] = Some(input);
        let generation = round.generation;
        if round.inputs.iter().all(Option::is_some) {
            let result = Arc::new(combine(&round.inputs));
            round.inputs.iter_mut().for_each(|i| *i = None);
            round.op = None;
            round.result = Some(result.clone());
            round.generation += 1;
            sh.wake.notify_all();
            return Ok(result);
        }
        let deadline = Instant::now() + sh.timeout;
        loop {
            if round.generation != generation {
                return Ok(round.result.clone().expect("set when the round completed"));
            }
            if let Some(f) = &round.failed {
                return Err(self.failed_error(f));
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..sh.size)
                    .filter(|&r| round.inputs[r].is_none())
                    .collect();
                let reason = format!(
                    "replicas {missing:?} did not join the {kind} within {} s",
                    sh.timeout.as_secs_f64()
                );
                round.failed = Some((self.rank, reason.clone()));
                sh.wake.notify_all();
                return Err(self.error(reason));
            }
            round = sh
                .wake
                .wait_timeout(round, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// The elementwise sum of the members' f32 inputs, in rank order (one pass per member): the
/// same additions every run, for the all-reduce and the reduce-scatter alike.
fn sum_in_rank_order(inputs: &[Option<Payload>]) -> Payload {
    let mut it = inputs.iter().flatten();
    let Some(Payload::F32(first)) = it.next() else {
        unreachable!("sum inputs are f32")
    };
    let mut sum = first.clone();
    for p in it {
        if let Payload::F32(v) = p {
            sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
        }
    }
    Payload::F32(sum)
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        let result = self.exchange("all-reduce", Payload::F32(buf.to_vec()), sum_in_rank_order)?;
        if let Payload::F32(v) = &*result {
            buf.copy_from_slice(v);
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [u8]) -> Result<()> {
        let result = self.exchange("broadcast", Payload::Bytes(buf.to_vec()), |inputs| {
            inputs[0].clone().expect("every member arrived")
        })?;
        if let Payload::Bytes(v) = &*result {
            buf.copy_from_slice(v);
        }
        Ok(())
    }

    fn all_gather(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        let result = self.exchange("all-gather", Payload::U64(values.to_vec()), |inputs| {
            let mut all = Vec::new();
            for p in inputs.iter().flatten() {
                if let Payload::U64(v) = p {
                    all.extend_from_slice(v);
                }
            }
            Payload::U64(all)
        })?;
        match &*result {
            Payload::U64(v) => Ok(v.clone()),
            _ => unreachable!("all-gather results are u64"),
        }
    }

    fn reduce_scatter(&mut self, buf: &[f32], shard: &mut [f32]) -> Result<()> {
        check_parts("reduce_scatter", buf.len(), shard.len(), self.size())?;
        let result = self.exchange(
            "reduce-scatter",
            Payload::F32(buf.to_vec()),
            sum_in_rank_order,
        )?;
        if let Payload::F32(v) = &*result {
            let n = shard.len();
            shard.copy_from_slice(&v[self.rank * n..(self.rank + 1) * n]);
        }
        Ok(())
    }

    fn all_gather_f32(&mut self, shard: &[f32], buf: &mut [f32]) -> Result<()> {
        check_parts("all_gather_f32", buf.len(), shard.len(), self.size())?;
        let result = self.exchange("all-gather (f32)", Payload::F32(shard.to_vec()), |inputs| {
            let mut all = Vec::new();
            for p in inputs.iter().flatten() {
                if let Payload::F32(v) = p {
                    all.extend_from_slice(v);
                }
            }
            Payload::F32(all)
        })?;
        if let Payload::F32(v) = &*result {
            buf.copy_from_slice(v);
        }
        Ok(())
    }
}
