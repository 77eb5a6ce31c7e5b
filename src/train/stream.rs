//! The trainer's side of streamed parameters (`TrainerConfig::offload_parameters`; the
//! mechanism is src/residency/): starting it, the checks it needs, and the parts of a step that
//! meet gradients summed in host memory (loss-scale unscaling, the finite check).

use super::born::BornOnHost;
use super::Trainer;
use crate::nn::Module;
use crate::optim::offload::{check_host_memory, HOST_BYTES_PER_ELEMENT as OPTIM_BYTES};
use crate::residency::{self, Streaming, HOST_BYTES_PER_ELEMENT};
use crate::{Error, Result, Tensor};

/// Host bytes a run keeps with `streamed` of `total` parameter elements streamed and the
/// optimizer offloaded: the optimizer's 12 per element, 8 more per streamed one.
pub(super) fn host_bytes_needed(total: u64, streamed: u64) -> u64 {
    total * OPTIM_BYTES + streamed * HOST_BYTES_PER_ELEMENT
}

impl<M: Module> Trainer<M> {
    /// Moves the model's units to host memory and streams them (called by `Trainer::new`).
    pub(super) fn start_streaming(model: &M, device: &crate::Device) -> Result<Streaming> {
        let units = model.units();
        if units.iter().all(|(_, p)| p.is_empty()) {
            return Err(residency::no_units());
        }
        let total: u64 = model.parameters().iter().map(|p| p.numel() as u64).sum();
        let streamed: u64 = units
            .iter()
            .flat_map(|(_, p)| p.iter())
            .map(|p| p.numel() as u64)
            .sum();
        check_host_memory(
            "streamed parameters (f32 values and gradient sums) with the optimizer offloaded",
            host_bytes_needed(total, streamed),
        )?;
        Streaming::start(device, units)
    }

    /// Host bytes the streamed units keep (values and gradient sums), 0 without streaming.
    pub(super) fn streamed_host_bytes(&self) -> u64 {
        self.streaming
            .as_ref()
            .map_or(0, |s| s.elements() * HOST_BYTES_PER_ELEMENT)
    }

    /// The parameters whose gradients are summed in host memory.
    fn streamed_params(&self) -> Vec<Tensor> {
        if self.streaming.is_none() {
            return Vec::new();
        }
        let params = self.model.parameters();
        params.into_iter().filter(Tensor::is_streamed).collect()
    }

    /// Unscales the host gradient sums by `1 / scale` (the same f32 product the device's
    /// unscale kernel computes) and says whether any is not finite.
    pub(super) fn unscale_host(&self, scale: f32) -> bool {
        let inv = 1.0 / scale;
        let mut nonfinite = false;
        for p in self.streamed_params() {
            p.with_host(|h| {
                if let Some(g) = &mut h.grad {
                    for v in g.iter_mut() {
                        *v *= inv;
                        nonfinite |= !v.is_finite();
                    }
                }
            });
        }
        nonfinite
    }

    /// Gradient clipping with the streamed units' gradients summed in host memory: the norm
    /// from the clipping kernels over every gradient in the parameters' order, each host sum
    /// uploaded in its turn and dropped after its squares (the same bits as the on-device
    /// run's norm), read back; device gradients scaled by the scale kernel, host sums by the
    /// same f32 factor. While planning nothing is read, and an upload stands for each sum.
    pub(super) fn clip_streamed(&self, max_norm: f32) -> Result<()> {
        let dev = &self.device;
        let planning = dev.is_planning();
        let with_grad: Vec<Tensor> = self
            .model
            .parameters()
            .into_iter()
            .filter(|p| {
                if p.is_streamed() {
                    planning || p.with_host(|h| h.grad.is_some()).unwrap_or(false)
                } else {
                    p.grad().is_some()
                }
            })
            .collect();
        if with_grad.is_empty() {
            return Ok(());
        }
        let numels: Vec<usize> = with_grad.iter().map(Tensor::numel).collect();
        let norm = crate::optim::global_norm_of(dev, &numels, |i| {
            let p = &with_grad[i];
            if !p.is_streamed() {
                return Ok(p.grad().expect("filtered above"));
            }
            if planning {
                return Tensor::uninit(dev, crate::Shape::new(p.dims())?, crate::DType::F32);
            }
            let sum = p.with_host(|h| h.grad.clone()).flatten();
            Tensor::from_slice(dev, &sum.expect("filtered above"), p.dims())
        })?;
        let device_grads: Vec<Tensor> = with_grad.iter().filter_map(Tensor::grad).collect();
        crate::optim::scale_by_norm(&device_grads, &norm, max_norm)?;
        if planning {
            return Ok(());
        }
        if let Some(f) = crate::optim::clip_factor(norm.item()?, max_norm) {
            for p in with_grad.iter().filter(|p| p.is_streamed()) {
                p.with_host(|h| h.grad.iter_mut().flatten().for_each(|v| *v *= f));
            }
        }
        Ok(())
    }

    /// Whether a host gradient sum holds NaN or infinity.
    pub(super) fn host_grads_nonfinite(&self) -> bool {
        self.streamed_params().iter().any(|p| {
            p.with_host(|h| {
                h.grad
                    .as_ref()
                    .is_some_and(|g| g.iter().any(|v| !v.is_finite()))
            })
            .unwrap_or(false)
        })
    }

    /// Whether a streamed parameter's host value holds NaN or infinity.
    pub(super) fn host_params_nonfinite(&self) -> bool {
        self.streamed_params().iter().any(|p| {
            p.with_host(|h| h.values.iter().any(|v| !v.is_finite()))
                .unwrap_or(false)
        })
    }

    /// The parameters on the device all the time (all of them without streaming).
    pub(super) fn device_params(&self) -> Vec<Tensor> {
        let params = self.model.parameters();
        params.into_iter().filter(|p| !p.is_streamed()).collect()
    }

    /// Bytes an offloaded optimizer moves in one step: each device-resident parameter's f32
    /// gradient read back and its f32 value uploaded (streamed ones are updated in host
    /// memory, where their gradients already are); 0 without offload.
    pub(crate) fn offload_bytes_moved(&self) -> u64 {
        if !self.optimizer.state_on_host() {
            return 0;
        }
        let p = self.device_params();
        p.iter().map(|p| p.numel() as u64 * 8).sum()
    }

    /// Whether parameters stream from host memory.
    pub fn streams_parameters(&self) -> bool {
        self.streaming.is_some()
    }

    /// Ends the streaming from host memory that the model's birth there turned on, so its
    /// units can stream from another source (ZeRO stage 3's ranks): the units stay in host
    /// memory, and the optimizer's state comes back to the device if only the birth sent it
    /// there (before the first step, when it has none). Nothing happens without streaming.
    /// Streaming the configuration asked for (`offload_parameters`) is refused with an
    /// [`Error::InvalidArgument`] of `op`: that run's parameters are meant to live on the host.
    pub(crate) fn end_born_streaming(&mut self, op: &'static str) -> Result<()> {
        if self.streaming.is_none() {
            return Ok(());
        }
        if !self.born.streaming {
            return Err(Error::InvalidArgument {
                op,
                reason: "the trainer streams its units from host memory as its configuration \
                         asks (offload_parameters); ZeRO stage 3 streams them from the ranks \
                         (turn parameter offload off; a model made inside born_on_host needs no \
                         offload for it)"
                    .into(),
            });
        }
        if self.born.optimizer_offload {
            self.optimizer.set_state_kind(false, false)?;
            self.config.offload_optimizer = false;
        }
        self.streaming = None;
        self.config.offload_parameters = false;
        self.born = BornOnHost::default();
        Ok(())
    }

    /// Bytes streaming moved between host and device since the last call (parameters up,
    /// gradients back), reset; zeros without streaming.
    pub fn take_bytes_moved(&self) -> residency::Moved {
        self.streaming
            .as_ref()
            .map_or_else(Default::default, Streaming::take_moved)
    }
}
