//! [`Job`]: how a process takes part in training, alone or as one rank of an MPI job, as a
//! `--distributed` flag chooses it; what the examples share so that each needs a few lines.

use super::allreduce::AllReduceStats;
use crate::nn::Module;
use crate::train::Trainer;
use crate::{Error, Result};
use std::sync::{Arc, Mutex};

/// This process's part in a training run.
#[non_exhaustive]
pub enum Job {
    /// The only process.
    Single,
    /// One rank of an MPI job (the `mpi` feature).
    #[cfg(feature = "mpi")]
    Mpi(super::mpi::Mpi),
}

impl Job {
    /// The job a `--distributed` flag names: none (or "none") for one process, "mpi" for an
    /// MPI rank (initializes MPI; without the `mpi` feature an error says how to build it).
    pub fn from_flag(flag: Option<&str>) -> Result<Job> {
        match flag {
            None | Some("none") => Ok(Job::Single),
            #[cfg(feature = "mpi")]
            Some("mpi") => Ok(Job::Mpi(super::mpi::Mpi::init()?)),
            #[cfg(not(feature = "mpi"))]
            Some("mpi") => Err(Error::InvalidArgument {
                op: "--distributed",
                reason: "this program was built without MPI; build it with `--features mpi` \
                         (e.g. cargo build --release --features mpi --example train_mlp)"
                    .into(),
            }),
            Some(other) => Err(Error::InvalidArgument {
                op: "--distributed",
                reason: format!("unknown mode '{other}' (mpi, or none)"),
            }),
        }
    }

    /// This process's rank (0 alone); rank 0 prints, evaluates and writes checkpoints.
    pub fn rank(&self) -> usize {
        match self {
            Job::Single => 0,
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => m.rank(),
        }
    }

    /// Processes in the job.
    pub fn size(&self) -> usize {
        match self {
            Job::Single => 1,
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => m.size(),
        }
    }

    /// Whether this process reports (rank 0).
    pub fn is_root(&self) -> bool {
        self.rank() == 0
    }

    /// Makes `trainer` this rank's replica ([`attach`](super::attach)) and returns its all-reduce statistics;
    /// nothing for one process.
    pub fn attach<M: Module>(
        &self,
        trainer: &mut Trainer<M>,
    ) -> Result<Option<Arc<Mutex<AllReduceStats>>>> {
        match self {
            Job::Single => {
                let _ = trainer;
                Ok(None)
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => Ok(Some(super::attach(trainer, m.communicator()?)?)),
        }
    }

    /// What a process does with the error it stops on: an MPI rank stops every rank with its
    /// message (the others would wait for it); one process returns and reports it itself.
    pub fn fail(&self, error: &Error) {
        match self {
            Job::Single => {
                let _ = error;
            }
            #[cfg(feature = "mpi")]
            Job::Mpi(m) => m.abort(&format!("error: {error}; stopping every rank")),
        }
    }
}
