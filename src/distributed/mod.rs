//! Data-parallel training: replicas of one model on several devices, each running a share of
//! every batch, their gradients summed before every update so they stay identical.
//!
//! - In one process: [`DataParallel`] over several [`Device`](crate::Device)s (GPUs, or logical
//!   devices of one adapter), replicas on threads exchanging through a [`LocalGroup`].
//! - Across processes and machines: MPI (`mpi` module, the `mpi` cargo feature), one rank per
//!   process, each a [`Trainer`](crate::train::Trainer) made a replica by [`attach`].
//!
//! Both plug into the trainer through [`GradientSync`](crate::train::GradientSync), so each
//! replica keeps the trainer's micro-batching, budget, planner and out-of-memory retry, and
//! the all-reduce buffer is counted by the arena and the plan.

mod allreduce;
mod comm;
mod data_parallel;
mod fit_stage;
mod job;
#[cfg(feature = "mpi")]
pub mod mpi;
mod settings;
pub mod zero;

pub use allreduce::{attach, AllReduceStats, GradientAllReduce};
pub use comm::{share_of, Communicator, LocalComm, LocalGroup, LOCAL_TIMEOUT};
pub use data_parallel::DataParallel;
pub use fit_stage::StageChoice;
pub use job::Job;
pub use settings::{agree_settings, first_difference, setting_hash, settings_hash};
pub use zero::checkpoint::load_checkpoint;
pub use zero::{attach_zero, Zero};
