//! Tensors whose home is host memory (streamed parameters). A streamed tensor keeps its
//! identity — the model, the optimizer and checkpointed closures hold the same `Tensor` — but
//! its block becomes a stand-in whose [`Redirect`] points at an arena block only while the
//! tensor is on the device. The f32 values on the host are the truth: reads come from them,
//! writes go to them (and to the device copy when there is one). Gradients reach the host the
//! same way: the residency layer (src/residency/) adds each device gradient into
//! [`Tensor::host_grad`] and drops it.
//!
//! Only the mechanism lives here; when a tensor moves is the residency layer's decision.

use super::{Allocation, Tensor};
use crate::memory::{Block, Redirect};
use crate::{DType, Error, Result};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Stand-in blocks are told apart by offset in a segment no arena has.
const STAND_IN_SEGMENT: usize = usize::MAX;
static NEXT_STAND_IN: AtomicU64 = AtomicU64::new(1);

/// The host side of a streamed tensor.
#[derive(Default)]
pub(crate) struct HostSide {
    /// The values, row-major f32 (the tensor's truth).
    pub values: Vec<f32>,
    /// The gradient summed on the host since the last `zero_grad`.
    pub grad: Option<Vec<f32>>,
}

/// What a streamed tensor's [`Allocation`] holds besides its (freed) original block.
pub(crate) struct Streamed {
    /// The stand-in every `block()` returns from now on.
    pub block: Block,
    redirect: Arc<Redirect>,
    host: Mutex<HostSide>,
    /// The residency layer's number for the unit this tensor belongs to ([`UNASSIGNED`] for a
    /// parameter made in host memory before streaming starts).
    unit: AtomicUsize,
}

/// The unit number of a streamed tensor that no streaming has numbered yet.
pub(crate) const UNASSIGNED: usize = usize::MAX;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Allocation {
    /// Frees what the allocation holds on the device: its block, or a streamed tensor's
    /// device copy.
    pub(super) fn release(&self) {
        match self.streamed.get() {
            Some(s) => {
                if let Some(b) = lock(&s.redirect.now).take() {
                    self.device.free(&b);
                }
            }
            None => self.device.free(&self.block),
        }
    }
}

impl Tensor {
    fn streamed(&self) -> Option<&Streamed> {
        self.alloc.streamed.get()
    }

    /// Whether this tensor's home is host memory.
    pub(crate) fn is_streamed(&self) -> bool {
        self.streamed().is_some()
    }

    /// The residency layer's unit number of a streamed tensor ([`UNASSIGNED`] before
    /// streaming numbers it).
    pub(crate) fn stream_unit(&self) -> Option<usize> {
        self.streamed().map(|s| s.unit.load(Ordering::Relaxed))
    }

    /// Moves this tensor's home to host memory, as part of unit `unit`: its values are read
    /// back, its device block is freed, and from now on it is on the device only between
    /// [`Tensor::stream_in`] and [`Tensor::stream_out`]. f32 only (the host copy is the f32
    /// truth an offloaded optimizer updates). Not while planning.
    /// A tensor already in host memory under [`UNASSIGNED`] takes `unit` as its number.
    pub(crate) fn stream_to_host(&self, unit: usize) -> Result<()> {
        if let Some(s) = self.streamed() {
            let _ = s
                .unit
                .compare_exchange(UNASSIGNED, unit, Ordering::Relaxed, Ordering::Relaxed);
            return Ok(());
        }
        if self.dtype != DType::F32 {
            return Err(Error::InvalidArgument {
                op: "offload parameters",
                reason: format!(
                    "streamed parameters are f32 on the host; {self:?} is {} (use mixed \
                     precision: f32 parameters, f16 compute)",
                    self.dtype
                ),
            });
        }
        let values = self.to_vec::<f32>()?;
        let redirect = Arc::new(Redirect::default());
        let block = Block {
            buffer: None,
            segment: STAND_IN_SEGMENT,
            offset: NEXT_STAND_IN.fetch_add(1, Ordering::Relaxed) * 256,
            size: self.alloc.block.size,
            plan_id: 0,
            redirect: Some(redirect.clone()),
        };
        let s = Streamed {
            block,
            redirect,
            host: Mutex::new(HostSide { values, grad: None }),
            unit: AtomicUsize::new(unit),
        };
        if self.alloc.streamed.set(s).is_err() {
            return Ok(()); // another clone got there first
        }
        self.alloc.device.free(&self.alloc.block);
        Ok(())
    }

    /// Gives a streamed tensor a device copy: an arena block of its size, filled from the host
    /// (nothing is written while planning, the block is only counted). Returns the bytes
    /// uploaded (0 when it was already there or is not streamed).
    pub(crate) fn stream_in(&self) -> Result<u64> {
        let Some(s) = self.streamed() else {
            return Ok(0);
        };
        if lock(&s.redirect.now).is_some() {
            return Ok(0);
        }
        let dev = self.device();
        let b = dev.alloc(s.block.size)?;
        {
            let host = lock(&s.host);
            if let Err(e) = dev.upload(&b, bytemuck::cast_slice(&host.values)) {
                drop(host);
                dev.free(&b);
                return Err(e);
            }
        }
        *lock(&s.redirect.now) = Some(b);
        Ok((self.numel() * 4) as u64)
    }

    /// Drops a streamed tensor's device copy (the host values stay the truth).
    pub(crate) fn stream_out(&self) {
        if let Some(s) = self.streamed() {
            if let Some(b) = lock(&s.redirect.now).take() {
                self.device().free(&b);
            }
        }
    }

    /// Runs `f` on a streamed tensor's host side.
    pub(crate) fn with_host<R>(&self, f: impl FnOnce(&mut HostSide) -> R) -> Option<R> {
        self.streamed().map(|s| f(&mut lock(&s.host)))
    }

    /// The host gradient of a streamed tensor, taken (the next backward starts from zero).
    pub(crate) fn take_host_grad(&self) -> Option<Vec<f32>> {
        self.with_host(|h| h.grad.take()).flatten()
    }

    /// The tensor's bytes as stored: from the host for a streamed tensor, else read back.
    pub(crate) fn read_bytes(&self) -> Result<Vec<u8>> {
        if let Some(v) = self.with_host(|h| bytemuck::cast_slice(&h.values).to_vec()) {
            return Ok(v);
        }
        self.device()
            .download(self.block(), (self.numel() * self.dtype.size()) as u64)
    }

    /// Writes all of the tensor's bytes (as stored; a checkpoint's values).
    pub(crate) fn write_bytes(&self, bytes: &[u8]) -> Result<()> {
        if let Some(s) = self.streamed() {
            let values: Vec<f32> = bytemuck::pod_collect_to_vec(bytes);
            if values.len() != self.numel() {
                return Err(Error::InvalidArgument {
                    op: "write_bytes",
                    reason: format!("{} values for {} elements", values.len(), self.numel()),
                });
            }
            lock(&s.host).values = values;
            if let Some(b) = lock(&s.redirect.now).as_ref() {
                self.device().upload(b, bytes)?;
            }
            return Ok(());
        }
        self.device().upload(self.block(), bytes)
    }

    /// A streamed tensor's elements `start..end` from the host.
    pub(super) fn host_range(&self, start: usize, end: usize) -> Option<Vec<f32>> {
        self.with_host(|h| h.values[start..end].to_vec())
    }

    /// Writes a streamed tensor's elements `start..` on the host (and on its device copy, if it
    /// has one); `false` for other tensors.
    pub(super) fn write_host_range(&self, start: usize, values: &[f32]) -> Result<bool> {
        let Some(s) = self.streamed() else {
            return Ok(false);
        };
        lock(&s.host).values[start..start + values.len()].copy_from_slice(values);
        if let Some(b) = lock(&s.redirect.now).as_ref() {
            self.device()
                .upload_at(b, (start * 4) as u64, bytemuck::cast_slice(values))?;
        }
        Ok(true)
    }
}
