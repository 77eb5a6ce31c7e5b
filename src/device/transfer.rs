//! Host transfers: uploads through the queue (after the pending work that may still read the
//! block's previous contents), and readback through a staging buffer.

use super::planning::planned_outside_plan;
use super::{lock, Device};
use crate::memory::Block;
use crate::{Error, Result};

impl Device {
    /// Writes host bytes into a block.
    pub(crate) fn upload(&self, block: &Block, data: &[u8]) -> Result<()> {
        self.upload_at(block, 0, data)
    }

    /// Writes host bytes into a block from byte `at` on (a multiple of 4).
    pub(crate) fn upload_at(&self, block: &Block, at: u64, data: &[u8]) -> Result<()> {
        debug_assert!(at.is_multiple_of(4), "wgpu writes at 4-byte offsets");
        if self.planned_op("upload") {
            return Ok(());
        }
        let block = block.resolved()?;
        let Some(buffer) = &block.buffer else {
            return Err(planned_outside_plan());
        };
        // `write_buffer` lands before the *next* submit. Pending work recorded earlier may read
        // the previous owner of this block, so that work must be submitted first.
        self.flush()?;
        let len = data.len() & !3;
        if len > 0 {
            self.inner
                .queue
                .write_buffer(buffer, block.offset + at, &data[..len]);
        }
        if len < data.len() {
            // wgpu writes whole 4-byte words; pad the tail (an odd count of f16).
            let mut tail = [0u8; 4];
            tail[..data.len() - len].copy_from_slice(&data[len..]);
            self.inner
                .queue
                .write_buffer(buffer, block.offset + at + len as u64, &tail);
        }
        Ok(())
    }

    /// Reads `bytes` bytes from the start of a block, after all recorded work.
    pub(crate) fn download(&self, block: &Block, bytes: u64) -> Result<Vec<u8>> {
        self.download_at(block, 0, bytes)
    }

    /// Reads `bytes` bytes of a block from byte `at` on (a multiple of 4), after all recorded
    /// work.
    pub(crate) fn download_at(&self, block: &Block, at: u64, bytes: u64) -> Result<Vec<u8>> {
        debug_assert!(at.is_multiple_of(4), "wgpu copies at 4-byte offsets");
        if bytes == 0 {
            return Ok(Vec::new());
        }
        if self.planned_op("readback") {
            return Ok(vec![0; bytes as usize]);
        }
        let block = block.resolved()?;
        let Some(buffer) = &block.buffer else {
            return Err(planned_outside_plan());
        };
        let size = bytes.div_ceil(4) * 4;
        let inner = &*self.inner;
        let mut staging = lock(&inner.staging);
        if staging.as_ref().is_none_or(|s| s.size() < size) {
            *staging = Some(inner.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("fitgrad readback"),
                size: size.next_power_of_two(),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        let staging = staging.as_ref().expect("created above");
        {
            let mut pending = lock(&inner.pending);
            pending.encoder(&inner.device).copy_buffer_to_buffer(
                buffer,
                block.offset + at,
                staging,
                0,
                size,
            );
            self.submit(&mut pending)?;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, ..size, move |r| {
            let _ = tx.send(r);
        });
        inner
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| Error::Readback(e.to_string()))?;
        rx.recv()
            .map_err(|e| Error::Readback(e.to_string()))?
            .map_err(|e| Error::Readback(e.to_string()))?;
        let out = {
            let view = staging
                .get_mapped_range(..size)
                .map_err(|e| Error::Readback(e.to_string()))?;
            view[..bytes as usize].to_vec()
        };
        staging.unmap();
        self.check_errors()?;
        Ok(out)
    }
}
