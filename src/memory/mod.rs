//! The arena: every tensor's device memory comes from here.
//!
//! Memory is held in *segments* (one wgpu buffer each). A tensor gets a *block*: a range of a
//! segment at a 256-byte aligned offset (`min_storage_buffer_offset_alignment` is at most 256 on
//! every adapter). Freed blocks return to their segment's free list and merge with their
//! neighbours; the next allocation takes the best-fitting free range across all segments, so a
//! steady training loop stops creating buffers after its first step. Reuse needs no fence: wgpu
//! executes one queue's commands in order, so work recorded after a free sees the new owner's data.
//!
//! Segment sizes: requests up to [`SMALL_REQUEST`] share [`SMALL_SEGMENT`]-byte segments (many
//! biases and scalars in one buffer); larger requests get a segment of their own rounded up to
//! [`LARGE_ROUND`], which later large requests of any smaller size may share once it is free.
//! Small and large requests use separate segments (see `Pool`).
//!
//! The optional budget is checked *before* the driver is asked: when a new segment would pass it,
//! the arena first drops its fully free segments, then returns [`Error::OutOfMemory`].

pub mod plan;
mod report;

pub use report::MemoryStats;

use crate::{Error, Result};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Offsets and sizes of blocks are multiples of this (wgpu's maximum storage offset alignment).
pub const BLOCK_ALIGN: u64 = 256;
/// Requests up to this size share segments.
pub const SMALL_REQUEST: u64 = 256 << 10;
/// Size of a shared segment for small requests.
pub const SMALL_SEGMENT: u64 = 2 << 20;
/// Dedicated segments are rounded up to this, so slightly different sizes reuse them.
pub const LARGE_ROUND: u64 = 64 << 10;

/// A range of a segment owned by one tensor.
#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub buffer: Arc<wgpu::Buffer>,
    pub segment: usize,
    pub offset: u64,
    pub size: u64,
}

struct Segment {
    buffer: Arc<wgpu::Buffer>,
    size: u64,
    /// Free ranges: offset -> length, never adjacent (merged on free).
    free: BTreeMap<u64, u64>,
    used: u64,
    pool: Pool,
}

/// Which requests a segment serves first. Keeping small tensors out of large segments stops a
/// scalar from landing in the middle of a freed activation's segment and forcing a new buffer
/// for the next activation of that size (the caching allocators of torch split pools the same
/// way). Under a budget either pool may lend to the other rather than fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pool {
    Small,
    Large,
    /// Made by `reserve`: serves both.
    Any,
}

impl Pool {
    fn of(size: u64) -> Pool {
        if size <= SMALL_REQUEST {
            Pool::Small
        } else {
            Pool::Large
        }
    }

    fn serves(self, want: Option<Pool>) -> bool {
        want.is_none_or(|w| self == Pool::Any || self == w)
    }
}

impl Segment {
    /// The smallest free range that holds `size` bytes: (offset, length).
    fn best_fit(&self, size: u64) -> Option<(u64, u64)> {
        self.free
            .iter()
            .filter(|(_, &len)| len >= size)
            .min_by_key(|(_, &len)| len)
            .map(|(&o, &l)| (o, l))
    }

    fn largest_free(&self) -> u64 {
        self.free.values().copied().max().unwrap_or(0)
    }
}

pub(crate) struct Arena {
    segments: Vec<Option<Segment>>,
    budget: Option<u64>,
    /// Largest single buffer the adapter can create.
    max_buffer_size: u64,
    /// Largest range one storage binding may cover.
    max_binding_size: u64,
    stats: MemoryStats,
    /// Fault injection for tests: the allocation after this many more fails with
    /// `OutOfMemory` (as a driver would).
    fail_after: Option<u64>,
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

impl Arena {
    pub fn new(max_buffer_size: u64, max_binding_size: u64, budget: Option<u64>) -> Self {
        Arena {
            segments: Vec::new(),
            budget,
            max_buffer_size,
            max_binding_size: max_binding_size.min(max_buffer_size),
            stats: MemoryStats {
                budget,
                ..Default::default()
            },
            fail_after: None,
        }
    }

    /// Makes the allocation after `n` more fail with `OutOfMemory`, once.
    pub fn inject_oom_after(&mut self, n: u64) {
        self.fail_after = Some(n);
    }

    pub fn stats(&self) -> MemoryStats {
        let mut s = self.stats.clone();
        s.segments = self.segments.iter().flatten().count();
        s.largest_free_block = self
            .segments
            .iter()
            .flatten()
            .map(Segment::largest_free)
            .max()
            .unwrap_or(0);
        s
    }

    pub fn set_budget(&mut self, budget: Option<u64>) {
        self.budget = budget;
        self.stats.budget = budget;
    }

    pub fn reset_peak(&mut self) {
        self.stats.peak_bytes_in_use = self.stats.bytes_in_use;
        self.stats.peak_bytes_reserved = self.stats.bytes_reserved;
    }

    /// Bytes a request of `bytes` really takes from a segment.
    pub fn block_size(bytes: u64) -> u64 {
        align_up(bytes.max(4), BLOCK_ALIGN)
    }

    pub fn alloc(&mut self, device: &wgpu::Device, bytes: u64) -> Result<Block> {
        let size = Self::block_size(bytes);
        // Kernels bind a tensor's whole block, so it must fit one binding.
        if size > self.max_binding_size {
            return Err(Error::Limit {
                op: "alloc",
                what: "tensor size in bytes",
                value: size,
                limit: self.max_binding_size,
            });
        }
        match self.fail_after {
            Some(0) => {
                self.fail_after = None;
                self.stats.oom_errors += 1;
                return Err(self.oom(bytes));
            }
            Some(n) => self.fail_after = Some(n - 1),
            None => {}
        }
        self.stats.allocations += 1;
        let pool = Pool::of(size);
        if let Some(block) = self.take_free(size, Some(pool)) {
            self.stats.reuse_hits += 1;
            return Ok(block);
        }
        let preferred = if pool == Pool::Small {
            SMALL_SEGMENT.max(size)
        } else {
            align_up(size, LARGE_ROUND)
        }
        .min(self.max_buffer_size);
        // Under a tight budget a shared segment may not fit where the request alone does.
        let seg_size = if self.fits_budget(preferred) {
            preferred
        } else {
            size
        };
        if !self.fits_budget(seg_size) {
            // Borrow from the other pool before giving segments back.
            if let Some(block) = self.take_free(size, None) {
                self.stats.reuse_hits += 1;
                return Ok(block);
            }
            self.release_free_segments();
        }
        if !self.fits_budget(seg_size) {
            self.stats.allocations -= 1;
            self.stats.oom_errors += 1;
            return Err(self.oom(bytes));
        }
        let seg = self
            .create_segment(device, seg_size, pool)
            .inspect_err(|_| self.stats.allocations -= 1)?;
        Ok(self.take_from(seg, 0, seg_size, size))
    }

    /// Preallocates `bytes` (in segments no larger than the adapter allows) so later allocations
    /// up to that total need no new buffers.
    pub fn reserve(&mut self, device: &wgpu::Device, bytes: u64) -> Result<()> {
        let mut left = align_up(bytes, BLOCK_ALIGN);
        while left > 0 {
            let seg_size = left.min(self.max_buffer_size / BLOCK_ALIGN * BLOCK_ALIGN);
            if !self.fits_budget(seg_size) {
                self.release_free_segments();
                if !self.fits_budget(seg_size) {
                    self.stats.oom_errors += 1;
                    return Err(self.oom(seg_size));
                }
            }
            self.create_segment(device, seg_size, Pool::Any)?;
            left = left.saturating_sub(seg_size);
        }
        Ok(())
    }

    pub fn free(&mut self, block: &Block) {
        let seg = self.segments[block.segment]
            .as_mut()
            .expect("a block outlived its segment");
        seg.used -= block.size;
        self.stats.bytes_in_use -= block.size;
        self.stats.frees += 1;
        let mut offset = block.offset;
        let mut len = block.size;
        // Merge with the free range that ends where this block starts.
        if let Some((&prev_off, &prev_len)) = seg.free.range(..offset).next_back() {
            if prev_off + prev_len == offset {
                seg.free.remove(&prev_off);
                offset = prev_off;
                len += prev_len;
            }
        }
        // ... and with the one that starts where it ends.
        if let Some(next_len) = seg.free.remove(&(offset + len)) {
            len += next_len;
        }
        seg.free.insert(offset, len);
    }

    /// Drops every segment that holds no block. Dropping (never `destroy()`) is safe while
    /// recorded commands still name the buffer: wgpu keeps it alive until the GPU is done.
    pub fn release_free_segments(&mut self) {
        for slot in self.segments.iter_mut() {
            if slot.as_ref().is_some_and(|s| s.used == 0) {
                let seg = slot.take().expect("checked above");
                self.stats.bytes_reserved -= seg.size;
                self.stats.buffers_released += 1;
            }
        }
    }

    fn fits_budget(&self, new_bytes: u64) -> bool {
        self.budget
            .is_none_or(|b| self.stats.bytes_reserved + new_bytes <= b)
    }

    pub fn oom(&self, requested: u64) -> Error {
        Error::OutOfMemory {
            requested,
            in_use: self.stats.bytes_in_use,
            reserved: self.stats.bytes_reserved,
            budget: self.budget,
        }
    }

    /// The best fit among segments serving `pool` (`None`: every segment).
    fn take_free(&mut self, size: u64, pool: Option<Pool>) -> Option<Block> {
        let (seg, off, len) = self
            .segments
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .filter(|s| s.pool.serves(pool))
                    .and_then(|s| s.best_fit(size))
                    .map(|(o, l)| (i, o, l))
            })
            .min_by_key(|&(_, _, l)| l)?;
        Some(self.take_from(seg, off, len, size))
    }

    /// Cuts `size` bytes from the front of free range (`off`, `len`) of segment `seg`.
    fn take_from(&mut self, seg_idx: usize, off: u64, len: u64, size: u64) -> Block {
        let seg = self.segments[seg_idx].as_mut().expect("live segment");
        seg.free.remove(&off);
        if len > size {
            seg.free.insert(off + size, len - size);
        }
        seg.used += size;
        self.stats.bytes_in_use += size;
        self.stats.peak_bytes_in_use = self.stats.peak_bytes_in_use.max(self.stats.bytes_in_use);
        Block {
            buffer: seg.buffer.clone(),
            segment: seg_idx,
            offset: off,
            size,
        }
    }

    /// (size, bytes in use) of every live segment.
    pub fn segments(&self) -> Vec<(u64, u64)> {
        self.segments
            .iter()
            .flatten()
            .map(|s| (s.size, s.used))
            .collect()
    }

    /// Creates a segment, turning a driver out-of-memory into [`Error::OutOfMemory`].
    fn create_segment(&mut self, device: &wgpu::Device, size: u64, pool: Pool) -> Result<usize> {
        let scope = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("fitgrad arena segment"),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if pollster::block_on(scope.pop()).is_some() {
            self.stats.oom_errors += 1;
            return Err(self.oom(size));
        }
        let seg = Segment {
            buffer: Arc::new(buffer),
            size,
            free: BTreeMap::from([(0, size)]),
            used: 0,
            pool,
        };
        self.stats.buffers_created += 1;
        self.stats.bytes_reserved += size;
        self.stats.peak_bytes_reserved = self
            .stats
            .peak_bytes_reserved
            .max(self.stats.bytes_reserved);
        let idx = match self.segments.iter().position(Option::is_none) {
            Some(i) => {
                self.segments[i] = Some(seg);
                i
            }
            None => {
                self.segments.push(Some(seg));
                self.segments.len() - 1
            }
        };
        Ok(idx)
    }
}
