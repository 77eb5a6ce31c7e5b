//! What the trainer turns on for a model made in host memory ([`BornOnHost`]), and the error
//! for what streamed parameters cannot serve yet. The trainer's side of streaming itself is
//! src/train/stream.rs.

use crate::residency;
use crate::{Error, Result, Tensor};

/// The error for a feature streaming cannot serve yet (data-parallel training).
pub(super) fn not_with_streaming(feature: &str) -> Error {
    Error::InvalidArgument {
        op: "offload parameters",
        reason: format!(
            "{feature} does not combine with streamed parameters yet (their gradients are \
             summed in host memory); turn one of them off"
        ),
    }
}

/// What a model's birth in host memory ([`residency::born_on_host`]) turned on in its trainer
/// that the configuration did not ask for: streaming from host memory, and the optimizer's
/// state in host memory (which streamed units need: their gradients are summed there). An
/// optimizer that cannot keep its state there (SGD) stays on the device, and the trainer takes
/// no step until the streaming ends (ZeRO stage 3 ends it: the ranks' shards become the home).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct BornOnHost {
    /// Streaming the birth turned on (the configuration did not ask for it).
    pub(super) streaming: bool,
    /// The optimizer's state moved to host memory for the birth alone.
    pub(super) optimizer_offload: bool,
    /// The optimizer keeps its state on the device: no step until the streaming ends.
    device_optimizer: bool,
}

impl BornOnHost {
    /// What `Trainer::new` turns on for a model with `params` under `config` (as asked).
    pub(super) fn of(params: &[Tensor], config: &super::TrainerConfig) -> BornOnHost {
        let born = residency::made_on_host(params);
        BornOnHost {
            streaming: born && !config.offload_parameters,
            optimizer_offload: born && !config.offload_optimizer && !config.offload_parameters,
            device_optimizer: false,
        }
    }

    /// Moves the optimizer's state to host memory as the birth needs, or, where only the birth
    /// asked for it and the optimizer keeps its state on the device, leaves it there and
    /// remembers that steps wait for the streaming to end.
    pub(super) fn offload(
        &mut self,
        optimizer: &mut dyn crate::optim::Optimizer,
        config: &mut super::TrainerConfig,
    ) -> Result<()> {
        if !optimizer.can_offload() && self.optimizer_offload && self.streaming {
            self.optimizer_offload = false;
            self.device_optimizer = true;
            config.offload_optimizer = false;
            return Ok(());
        }
        optimizer.offload_to_host()
    }

    /// `Err` while the streamed model's optimizer keeps its state on the device (see above):
    /// what a real step checks. A plan may run (a stage 3 rank plans the whole batch before it
    /// joins).
    pub(super) fn check_step(&self, optimizer: &str) -> Result<()> {
        if !self.device_optimizer {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            op: "Trainer::step",
            reason: format!(
                "the model was made in host memory (born_on_host) and the {optimizer} optimizer \
                 keeps its state on the device, so it cannot update the streamed units; make \
                 the trainer a ZeRO stage 3 replica (its units then live in the ranks' shards), \
                 or use AdamW, whose state can live in host memory"
            ),
        })
    }
}
