//! Data-parallel training across processes and machines over MPI (the `mpi` feature; the
//! `mpi` crate over an MPI library such as OpenMPI). One rank per process, each with its own
//! device, trainer, budget and planner; [`attach`](super::attach) with an [`MpiComm`] makes
//! the trainer a replica, and every step's gradients go through one `MPI_Iallreduce` of one
//! flat buffer.
//!
//! No rank ever waits forever: every collective is started non-blocking and polled until it
//! completes or the timeout passes ([`MpiComm::timeout`], `FITGRAD_DIST_TIMEOUT` seconds,
//! [`DEFAULT_TIMEOUT`] by default); then the rank prints which collective did not complete and
//! calls `MPI_Abort`, which stops every rank. A rank that fails with an error should end with
//! [`Mpi::abort`] (see [`Mpi::exit_on_error`]) for the same reason: the others would otherwise
//! wait for it in their next collective.

use super::comm::{check_parts, Communicator};
use crate::{Error, Result};
use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::request::{Request, Scope};
use mpi::topology::{Communicator as _, SimpleCommunicator};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a rank waits in one collective for the others before it aborts every rank, when
/// `FITGRAD_DIST_TIMEOUT` does not say otherwise: under the 30 s in which a stopped rank must
/// stop the others, and far above what ranks of similar speed wait for each other in a step.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);

/// The exit code of a rank that stops every rank.
pub const ABORT_CODE: i32 = 3;

/// The MPI environment, finalized when the last holder ([`Mpi`] and its communicators) drops.
struct Universe(#[allow(dead_code)] mpi::environment::Universe);

// SAFETY: MPI is initialized with at least MPI_THREAD_SERIALIZED (checked in `Mpi::init`), so
// MPI may be called from any thread as long as calls do not overlap; the universe is only
// dropped (finalized) once, by its last holder.
unsafe impl Send for Universe {}
unsafe impl Sync for Universe {}

/// An initialized MPI environment: this process's rank, the number of ranks, and the rank
/// among those on this machine (to pick a GPU).
pub struct Mpi {
    universe: Arc<Universe>,
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    /// The error this rank stops on is every rank's, at the same point ([`Mpi::fail_together`]).
    together: std::sync::atomic::AtomicBool,
}

impl Mpi {
    /// Initializes MPI (once per process) with calls allowed from any thread, one at a time.
    /// An [`Error::Distributed`] when MPI was initialized already or the library offers less.
    pub fn init() -> Result<Mpi> {
        let err = |reason: String| Error::Distributed { rank: 0, reason };
        let (universe, threading) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| err("MPI is initialized already in this process".into()))?;
        if threading < mpi::Threading::Serialized {
            return Err(err(format!(
                "the MPI library offers thread support {threading:?}; fitgrad needs Serialized \
                 (a trainer may move between threads)"
            )));
        }
        let world = universe.world();
        let node = world.split_shared(world.rank());
        Ok(Mpi {
            rank: world.rank() as usize,
            size: world.size() as usize,
            local_rank: node.rank() as usize,
            local_size: node.size() as usize,
            universe: Arc::new(Universe(universe)),
            together: false.into(),
        })
    }

    /// This process's rank, 0-based; rank 0 writes checkpoints and reports.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the job.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This process's rank among the ranks on its machine (to choose one GPU per rank).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Ranks on this machine.
    pub fn local_size(&self) -> usize {
        self.local_size
    }

    /// The communicator for [`attach`](super::attach): the world's ranks, with the timeout of
    /// `FITGRAD_DIST_TIMEOUT` (seconds) or [`DEFAULT_TIMEOUT`].
    pub fn communicator(&self) -> Result<MpiComm> {
        let timeout = match std::env::var("FITGRAD_DIST_TIMEOUT") {
            Ok(v) if !v.is_empty() => match v.parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s),
                _ => {
                    return Err(Error::InvalidArgument {
                        op: "FITGRAD_DIST_TIMEOUT",
                        reason: format!("'{v}' is not a positive number of seconds"),
                    })
                }
            },
            _ => DEFAULT_TIMEOUT,
        };
        Ok(MpiComm {
            world: self.universe.0.world(),
            rank: self.rank,
            size: self.size,
            timeout,
            _universe: self.universe.clone(),
        })
    }

    /// Marks the error this rank is about to stop on as one every rank stops on at the same
    /// point (each knows, through a collective): the rank may end with it normally, without
    /// [`Mpi::abort`], since no other rank waits for it.
    pub fn fail_together(&self) {
        self.together
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether [`Mpi::fail_together`] was called.
    pub fn failing_together(&self) -> bool {
        self.together.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Prints `reason` for this rank and stops every rank of the job (`MPI_Abort`).
    pub fn abort(&self, reason: &str) -> ! {
        eprintln!("fitgrad rank {} of {}: {reason}", self.rank, self.size);
        self.universe.0.world().abort(ABORT_CODE)
    }

    /// `r`'s value, or (on an error) [`Mpi::abort`] with the error's message: a rank that fails
    /// takes the others down with it instead of leaving them waiting.
    pub fn exit_on_error<T>(&self, r: Result<T>) -> T {
        r.unwrap_or_else(|e| self.abort(&format!("error: {e}; stopping every rank")))
    }
}

/// The MPI [`Communicator`]: collectives over the world's ranks, each polled until done or
/// [`MpiComm::timeout`] has passed, then `MPI_Abort` of every rank.
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout: Duration,
    _universe: Arc<Universe>,
}

// SAFETY: see `Universe`: MPI runs with MPI_THREAD_SERIALIZED, and a communicator is used
// through `&mut self` only, so its calls never overlap.
unsafe impl Send for MpiComm {}

impl MpiComm {
    /// How long a collective may wait for the other ranks.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets how long a collective may wait for the other ranks.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Polls `req` until it completes; past the timeout, says which collective hung and
    /// aborts every rank.
    fn wait<'a, R: ?Sized, S: Scope<'a>>(&self, mut req: Request<'a, R, S>, what: &str) {
        let deadline = Instant::now() + self.timeout;
        let mut polls = 0u32;
        loop {
            match req.test() {
                Ok(_) => return,
                Err(r) => req = r,
            }
            if Instant::now() >= deadline {
                eprintln!(
                    "fitgrad rank {} of {}: the {what} did not complete within {:.0} s: another \
                     rank failed, was killed or stopped answering; aborting every rank (set \
                     FITGRAD_DIST_TIMEOUT to wait longer)",
                    self.rank,
                    self.size,
                    self.timeout.as_secs_f64()
                );
                self.world.abort(ABORT_CODE);
            }
            // MPI progresses inside MPI_Test: poll often at first (a step's exchange takes
            // microseconds to milliseconds), then leave the core to the others.
            polls += 1;
            if polls < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        let send = buf.to_vec();
        mpi::request::scope(|scope| {
            let req = self.world.immediate_all_reduce_into(
                scope,
                &send[..],
                &mut buf[..],
                SystemOperation::sum(),
            );
            self.wait(req, "gradient all-reduce (MPI_Iallreduce)");
        });
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [u8]) -> Result<()> {
        let root = self.world.process_at_rank(0);
        mpi::request::scope(|scope| {
            let req = root.immediate_broadcast_into(scope, &mut buf[..]);
            self.wait(req, "broadcast from rank 0 (MPI_Ibcast)");
        });
        Ok(())
    }

    fn all_gather(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        let mut all = vec![0u64; values.len() * self.size];
        mpi::request::scope(|scope| {
            let req = self
                .world
                .immediate_all_gather_into(scope, values, &mut all[..]);
            self.wait(req, "check of step and model across ranks (MPI_Iallgather)");
        });
        Ok(all)
    }

    fn reduce_scatter(&mut self, buf: &[f32], shard: &mut [f32]) -> Result<()> {
        check_parts("reduce_scatter", buf.len(), shard.len(), self.size)?;
        mpi::request::scope(|scope| {
            let req = self.world.immediate_reduce_scatter_block_into(
                scope,
                buf,
                &mut shard[..],
                SystemOperation::sum(),
            );
            self.wait(req, "gradient reduce-scatter (MPI_Ireduce_scatter_block)");
        });
        Ok(())
    }

    fn all_gather_f32(&mut self, shard: &[f32], buf: &mut [f32]) -> Result<()> {
        check_parts("all_gather_f32", buf.len(), shard.len(), self.size)?;
        mpi::request::scope(|scope| {
            let req = self
                .world
                .immediate_all_gather_into(scope, shard, &mut buf[..]);
            self.wait(req, "parameter all-gather (MPI_Iallgather)");
        });
        Ok(())
    }
}
