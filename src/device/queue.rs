//! The pending command encoder that ops record into, the kernel-parameter ring, and the
//! submits: dispatches, copies and fills are recorded, and submitted in batches.
//!
//! Ops never submit on their own. Each records a compute pass into one pending encoder; the
//! encoder is submitted on readback, on [`Device::sync`], or once [`FLUSH_EVERY`] dispatches (or
//! a full parameter ring) have piled up. Kernel parameters (shapes, scalars) are packed into one
//! uniform *ring* buffer: each dispatch appends its words to a host-side vector, and the whole
//! vector is written with one `write_buffer` just before the submit, so a batch of a few hundred
//! ops costs one upload and one submit.

use super::planning::planned_outside_plan;
use super::{lock, Device, Kernel};
use crate::memory::Block;
use crate::{Error, Result};

/// Dispatches recorded before the pending encoder is submitted on its own. Large enough that
/// submit overhead disappears, small enough that the GPU starts before a long graph is recorded.
pub const FLUSH_EVERY: u32 = 256;
/// Bytes in the kernel-parameter ring (one batch's parameters).
const PARAM_RING_BYTES: u64 = 256 << 10;
/// Workgroups per dispatch dimension that every adapter accepts.
pub const MAX_GROUPS_PER_DIM: u32 = 65535;

/// Work recorded but not yet submitted.
pub(super) struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    dispatches: u32,
    /// Kernel parameters of this batch, written to the ring before the submit.
    params: Vec<u8>,
}

impl Pending {
    pub(super) fn new() -> Pending {
        Pending {
            encoder: None,
            dispatches: 0,
            params: Vec::new(),
        }
    }

    /// The encoder of this batch, begun on first use.
    pub(super) fn encoder(&mut self, dev: &wgpu::Device) -> &mut wgpu::CommandEncoder {
        self.encoder.get_or_insert_with(|| {
            dev.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("fitgrad ops"),
            })
        })
    }
}

/// The uniform buffer the batches' kernel parameters are written to.
pub(super) fn param_ring(device: &wgpu::Device) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("fitgrad kernel parameters"),
        size: PARAM_RING_BYTES,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

impl Device {
    /// Records one dispatch of `kernel` over `groups` workgroups (split into a 2-D grid when
    /// past 65,535; kernels rebuild the linear index from `num_workgroups`). `params` are the
    /// kernel's uniform words; `tensors` are bound in order from binding 1.
    pub(crate) fn dispatch(
        &self,
        kernel: &Kernel,
        params: &[u32],
        tensors: &[&Block],
        groups: u32,
    ) -> Result<()> {
        let (gx, gy) = grid(groups);
        if gy > MAX_GROUPS_PER_DIM {
            return Err(Error::Limit {
                op: "dispatch",
                what: "workgroup count",
                value: groups as u64,
                limit: MAX_GROUPS_PER_DIM as u64 * MAX_GROUPS_PER_DIM as u64,
            });
        }
        self.dispatch3(kernel, params, tensors, [gx, gy, 1])
    }

    /// Records one dispatch over an explicit 3-D grid of workgroups.
    pub(crate) fn dispatch3(
        &self,
        kernel: &Kernel,
        params: &[u32],
        tensors: &[&Block],
        groups: [u32; 3],
    ) -> Result<()> {
        // The limits hold while planning too.
        self.windows(kernel, tensors)?;
        if groups.contains(&0) || self.planned_op(&kernel.name) {
            return Ok(());
        }
        // Streamed parameters bind the block they are resident in now.
        let resolved = tensors
            .iter()
            .map(|b| b.resolved())
            .collect::<Result<Vec<_>>>()?;
        let resolved: Vec<&Block> = resolved.iter().map(|b| b.as_ref()).collect();
        let windows = self.windows(kernel, &resolved)?;
        let (Some((pipeline, layout)), Some(buffers)) = (
            kernel.compiled.as_ref(),
            windows
                .iter()
                .map(|w| w.0.buffer.as_ref())
                .collect::<Option<Vec<_>>>(),
        ) else {
            return Err(planned_outside_plan());
        };
        if let Some(&g) = groups.iter().find(|&&g| g > MAX_GROUPS_PER_DIM) {
            return Err(Error::Limit {
                op: "dispatch",
                what: "workgroups in one dimension",
                value: g as u64,
                limit: MAX_GROUPS_PER_DIM as u64,
            });
        }
        let inner = &*self.inner;
        let param_bytes: &[u8] = bytemuck::cast_slice(params);
        // Uniform structs are sized in multiples of 16 bytes.
        let binding_size = (param_bytes.len() as u64).div_ceil(16).max(1) * 16;
        let mut pending = lock(&inner.pending);
        let mut offset =
            (pending.params.len() as u64).div_ceil(inner.param_align) * inner.param_align;
        if offset + binding_size > PARAM_RING_BYTES {
            self.submit(&mut pending)?;
            offset = 0;
        }
        pending.params.resize(offset as usize, 0);
        pending.params.extend_from_slice(param_bytes);
        pending.params.resize((offset + binding_size) as usize, 0);

        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &inner.param_ring,
                offset,
                size: wgpu::BufferSize::new(binding_size),
            }),
        }];
        for (i, ((b, offset, size), buffer)) in windows.iter().zip(&buffers).enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset: b.offset + offset,
                    size: wgpu::BufferSize::new(*size),
                }),
            });
        }
        let bind_group = inner.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout,
            entries: &entries,
        });
        let encoder = pending.encoder(&inner.device);
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: None,
                timestamp_writes: None,
            });
            pass.set_pipeline(pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        }
        pending.dispatches += 1;
        if pending.dispatches >= FLUSH_EVERY {
            self.submit(&mut pending)?;
        }
        Ok(())
    }

    /// The storage bindings of one dispatch in binding order, each (block, offset in it, size):
    /// every block's first window, then the further windows of the blocks past the binding
    /// limit, block by block (the order `kernels::assemble` numbers them in). A kernel built
    /// without those windows binds fewer than that and is refused with an [`Error::Limit`]
    /// (as is one past the adapter's storage bindings per kernel), also while planning.
    fn windows<'a>(
        &self,
        kernel: &Kernel,
        tensors: &[&'a Block],
    ) -> Result<Vec<(&'a Block, u64, u64)>> {
        let step = self.window_bytes();
        let mut first = Vec::with_capacity(tensors.len());
        let mut rest = Vec::new();
        for &b in tensors {
            let n = self.binding_windows(b.size) as u64;
            let len = |w: u64| {
                if n == 1 {
                    b.size
                } else {
                    step.min(b.size - w * step)
                }
            };
            first.push((b, 0, len(0)));
            rest.extend((1..n).map(|w| (b, w * step, len(w))));
        }
        if rest.len() + first.len() != kernel.tensor_bindings {
            let largest = tensors.iter().map(|b| b.size).max().unwrap_or(0);
            return Err(Error::Limit {
                op: "dispatch",
                what: "bytes of a tensor that this kernel binds whole",
                value: largest,
                limit: self.inner.info.limits.max_storage_buffer_binding_size,
            });
        }
        first.extend(rest);
        self.check_storage_bindings(first.len() as u64)?;
        Ok(first)
    }

    /// Refuses a kernel of more storage bindings (windows of large tensors included) than
    /// the adapter allows, before its pipeline is made.
    pub(crate) fn check_storage_bindings(&self, count: u64) -> Result<()> {
        let most = self.inner.info.limits.max_storage_buffers_per_shader_stage as u64;
        if count > most {
            return Err(Error::Limit {
                op: "dispatch",
                what: "storage bindings of one kernel (windows of large tensors included)",
                value: count,
                limit: most,
            });
        }
        Ok(())
    }

    /// Records a copy of `bytes` bytes (a multiple of 4) between blocks.
    pub(crate) fn copy(&self, src: &Block, dst: &Block, bytes: u64) -> Result<()> {
        if self.planned_op("copy") {
            return Ok(());
        }
        let (src, dst) = (src.resolved()?, dst.resolved()?);
        let (Some(sb), Some(db)) = (&src.buffer, &dst.buffer) else {
            return Err(planned_outside_plan());
        };
        lock(&self.inner.pending)
            .encoder(&self.inner.device)
            .copy_buffer_to_buffer(sb, src.offset, db, dst.offset, bytes);
        Ok(())
    }

    /// Records a zero fill of a block.
    pub(crate) fn clear(&self, block: &Block) -> Result<()> {
        if self.planned_op("clear") {
            return Ok(());
        }
        let block = block.resolved()?;
        let Some(buffer) = &block.buffer else {
            return Err(planned_outside_plan());
        };
        lock(&self.inner.pending)
            .encoder(&self.inner.device)
            .clear_buffer(buffer, block.offset, Some(block.size));
        Ok(())
    }

    /// Whether work is recorded and not yet submitted ([`Device::flush`] submits it): what
    /// a host-side wait (a collective, a read) would hold back from the device meanwhile.
    pub fn has_unsubmitted_work(&self) -> bool {
        lock(&self.inner.pending).encoder.is_some()
    }

    /// Submits everything recorded so far (without waiting).
    pub fn flush(&self) -> Result<()> {
        let mut pending = lock(&self.inner.pending);
        self.submit(&mut pending)
    }

    /// Writes the batch's parameters to the ring and submits its encoder.
    pub(super) fn submit(&self, pending: &mut Pending) -> Result<()> {
        if let Some(encoder) = pending.encoder.take() {
            if !pending.params.is_empty() {
                self.inner
                    .queue
                    .write_buffer(&self.inner.param_ring, 0, &pending.params);
            }
            self.inner.queue.submit([encoder.finish()]);
        }
        pending.params.clear();
        pending.dispatches = 0;
        self.check_errors()
    }

    /// The first error wgpu reported outside an error scope, or the device's loss.
    pub(super) fn check_errors(&self) -> Result<()> {
        if let Some(msg) = lock(&self.inner.lost).clone() {
            return Err(Error::DeviceLost(msg));
        }
        if let Some(msg) = lock(&self.inner.uncaptured).take() {
            return Err(Error::Gpu(msg));
        }
        Ok(())
    }

    /// Submits recorded work and waits until the GPU has finished it.
    pub fn sync(&self) -> Result<()> {
        self.flush()?;
        self.inner
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Gpu(e.to_string()))?;
        self.check_errors()
    }
}

/// Splits a workgroup count into a grid no dimension of which passes 65,535.
fn grid(groups: u32) -> (u32, u32) {
    if groups <= MAX_GROUPS_PER_DIM {
        (groups, 1)
    } else {
        let y = groups.div_ceil(MAX_GROUPS_PER_DIM);
        (groups.div_ceil(y), y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_covers_every_group() {
        for g in [1, 65535, 65536, 200_000, u32::MAX / 2] {
            let (x, y) = grid(g);
            assert!(x <= MAX_GROUPS_PER_DIM && x as u64 * y as u64 >= g as u64);
        }
    }
}
