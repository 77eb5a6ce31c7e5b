//! The device's side of the arena: statistics and report, reserve and budget, the size checks
//! of a tensor and the binding windows of large blocks, and every allocation and free.

use super::{lock, AdapterSummary, Device};
use crate::memory::{Arena, Block, MemoryStats};
use crate::{Bytes, Error, Result};

impl Device {
    /// The arena's statistics (the real arena's, even while planning).
    pub fn memory_stats(&self) -> MemoryStats {
        lock(&self.inner.arena).stats()
    }

    /// The layout (segments and their free ranges) of the arena allocations go to now: the
    /// planning one inside a plan. Equal at the end of two steps means every later step
    /// repeats the last one.
    pub(crate) fn arena_layout(&self) -> crate::memory::Layout {
        self.with_arena(|a| a.layout())
    }

    /// A readable table of the arena's state.
    pub fn memory_report(&self) -> String {
        format!(
            "fitgrad memory on {}\n{}",
            self.inner.info.adapter.name,
            self.memory_stats()
        )
    }

    /// (size, bytes in use) of each of the arena's segments (wgpu buffers), for reports and
    /// tests of fragmentation.
    pub fn memory_segments(&self) -> Vec<(u64, u64)> {
        lock(&self.inner.arena).segments()
    }

    /// Fault injection for tests: the allocation after `n` more fails with
    /// [`Error::OutOfMemory`], once, as if the driver had run out.
    #[doc(hidden)]
    pub fn inject_oom_after(&self, n: u64) {
        lock(&self.inner.arena).inject_oom_after(n);
    }

    /// Makes the next peaks start from the current usage.
    pub fn reset_peak(&self) {
        lock(&self.inner.arena).reset_peak();
    }

    /// Returns every segment that holds no tensor to the driver. (Recorded commands keep their
    /// own references, so dropping a segment they name is safe.)
    pub fn empty_cache(&self) {
        lock(&self.inner.arena).release_free_segments();
    }

    /// Preallocates `bytes` so allocations up to that total create no buffers. Over the budget
    /// it is an [`Error::OutOfMemory`]; past the device memory the adapter reports (where it
    /// reports one), an [`Error::InvalidArgument`] before anything is allocated.
    pub fn reserve(&self, bytes: u64) -> Result<()> {
        if let Some(memory) = self.inner.info.adapter.memory {
            let total = self.memory_stats().bytes_reserved.saturating_add(bytes);
            if total > memory {
                return Err(Error::InvalidArgument {
                    op: "Device::reserve",
                    reason: format!(
                        "reserving {} (on top of {} held) passes the {} of device memory that \
                         '{}' reports; reserve less, or use a smaller batch or model",
                        Bytes(bytes),
                        Bytes(total - bytes),
                        Bytes(memory),
                        self.inner.info.adapter.name
                    ),
                });
            }
        }
        let dev = &self.inner.device;
        self.with_arena(|a| a.reserve(dev, bytes))
    }

    /// Sets or clears the hard memory budget. Lowering it below what is reserved frees cached
    /// segments at the next allocation that needs room. A budget of 0, or one above the device
    /// memory the adapter reports, is an [`Error::InvalidArgument`] (and changes nothing).
    pub fn set_memory_budget(&self, budget: Option<u64>) -> Result<()> {
        check_budget(budget, &self.inner.info.adapter, self.inner.plan_only)?;
        lock(&self.inner.arena).set_budget(budget);
        Ok(())
    }

    /// Whether a tensor of `bytes` bytes could exist on this device (one buffer holds it, and
    /// it is not by itself over the budget), checked before any host work.
    pub(crate) fn check_tensor_bytes(&self, op: &'static str, bytes: u64) -> Result<()> {
        let size = Arena::block_size(bytes);
        let limit = self.inner.info.limits.max_buffer_size;
        if size > limit {
            return Err(Error::Limit {
                op,
                what: "tensor size in bytes",
                value: size,
                limit,
            });
        }
        let budget = self.with_arena(|a| a.stats().budget);
        match budget {
            Some(b) if size > b => Err(Error::OutOfMemory {
                requested: size,
                in_use: self.memory_stats().bytes_in_use,
                reserved: self.memory_stats().bytes_reserved,
                budget,
            }),
            _ => Ok(()),
        }
    }

    /// The first of a model's tensors (name, element count, element bytes) that no buffer of
    /// this adapter holds, as [`Error::TensorLimit`] naming it: checked by a model's
    /// constructor before any device work, so a model too large for the adapter is refused by
    /// the tensor's name rather than by the op that would make it.
    pub fn check_model_tensors(&self, tensors: &[(String, usize, usize)]) -> Result<()> {
        let limit = self.inner.info.limits.max_buffer_size;
        for (name, numel, size) in tensors {
            let bytes = (*numel as u64).saturating_mul(*size as u64);
            if Arena::block_size(bytes) > limit {
                return Err(Error::TensorLimit {
                    tensor: name.clone(),
                    bytes,
                    limit,
                });
            }
        }
        Ok(())
    }

    /// Bytes of each window but the last of a block bound as several (the binding limit
    /// rounded down to the arena's alignment).
    pub(crate) fn window_bytes(&self) -> u64 {
        self.inner.info.limits.max_storage_buffer_binding_size / crate::memory::BLOCK_ALIGN
            * crate::memory::BLOCK_ALIGN
    }

    /// Windows a block of `bytes` bytes is bound as: 1 within the binding limit, else enough
    /// windows of [`Device::window_bytes`].
    pub(crate) fn binding_windows(&self, bytes: u64) -> u32 {
        if bytes <= self.inner.info.limits.max_storage_buffer_binding_size {
            1
        } else {
            bytes.div_ceil(self.window_bytes()) as u32
        }
    }

    /// A block of at least `bytes` bytes from the arena allocations go to now.
    pub(crate) fn alloc(&self, bytes: u64) -> Result<Block> {
        let dev = &self.inner.device;
        self.with_arena(|a| a.alloc(dev, bytes))
    }

    /// Returns `block` to its arena.
    pub(crate) fn free(&self, block: &Block) {
        // A real block freed while planning leaves both arenas; a planned one only its own.
        if block.plan_id == 0 {
            lock(&self.inner.arena).free(block);
        }
        if let Some(a) = lock(&self.inner.plan).as_mut() {
            a.free(block);
        }
    }
}

/// A budget must be positive and, where the adapter reports its device memory, no larger than
/// it: a bigger one would promise what the driver cannot give and fail later as a driver error.
pub(super) fn check_budget(
    budget: Option<u64>,
    adapter: &AdapterSummary,
    plan_only: bool,
) -> Result<()> {
    match (budget, adapter.memory.filter(|_| !plan_only)) {
        (Some(0), _) => Err(Error::InvalidArgument {
            op: "memory budget",
            reason: "a budget of 0 bytes leaves no room for any tensor; give a positive size \
                     (e.g. 512MiB), or none for no limit"
                .into(),
        }),
        (Some(b), Some(m)) if b > m => Err(Error::InvalidArgument {
            op: "memory budget",
            reason: format!(
                "a budget of {} is more than the {} of device memory that '{}' reports; give at \
                 most {}, or none to use what the driver allows",
                Bytes(b),
                Bytes(m),
                adapter.name,
                Bytes(m)
            ),
        }),
        _ => Ok(()),
    }
}
