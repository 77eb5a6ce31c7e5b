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
//!
//! On request the arena records a [`Timeline`] of its allocations and frees (timeline.rs).

mod report;
mod timeline;

pub use report::{ByCategory, Category, MemoryStats};
pub use timeline::{
    EventKind, MemoryEvent, OpPoint, PhaseSpan, Role, RoleBytes, SizeClass, Timeline,
};

use crate::{Error, Result};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// An arena's layout: each live segment's slot, size and free ranges (offset, length).
pub(crate) type Layout = Vec<(usize, u64, Vec<(u64, u64)>)>;

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
    /// The segment's buffer; `None` for a block handed out while planning (no buffer exists).
    pub buffer: Option<Arc<wgpu::Buffer>>,
    pub segment: usize,
    pub offset: u64,
    pub size: u64,
    /// 0 for a real block; else the number of the plan whose arena made it (freed there,
    /// never bound to a kernel).
    pub plan_id: u32,
    /// Set on the stand-in block of a tensor whose home is elsewhere (a streamed parameter):
    /// the arena block that holds it while it is on the device, if it is. The device resolves
    /// it ([`Block::resolved`]) wherever it binds, copies or transfers.
    pub redirect: Option<Arc<Redirect>>,
}

/// Where a stand-in block's bytes are now: an arena block while the tensor is on the device,
/// `None` while it is not.
#[derive(Debug, Default)]
pub(crate) struct Redirect {
    pub now: std::sync::Mutex<Option<Block>>,
}

impl Block {
    /// Whether both blocks are ranges of one segment (wgpu cannot copy a buffer onto itself).
    pub fn same_segment(&self, other: &Block) -> bool {
        match (self.resolved(), other.resolved()) {
            (Ok(a), Ok(b)) => a.plan_id == b.plan_id && a.segment == b.segment,
            _ => false,
        }
    }

    /// The arena block that holds this block's bytes now: itself, or where its redirect
    /// points. A stand-in whose tensor is not on the device is an [`Error::InvalidArgument`].
    pub fn resolved(&self) -> Result<std::borrow::Cow<'_, Block>> {
        let Some(r) = &self.redirect else {
            return Ok(std::borrow::Cow::Borrowed(self));
        };
        let now = r.now.lock().unwrap_or_else(|e| e.into_inner());
        match now.as_ref() {
            Some(b) => Ok(std::borrow::Cow::Owned(b.clone())),
            None => Err(Error::InvalidArgument {
                op: "device",
                reason: "a streamed parameter was used while it is not on the device: its \
                         unit's forward must fetch it (nn::Unit, Module::units)"
                    .into(),
            }),
        }
    }
}

#[derive(Clone)]
struct Segment {
    /// `None` in a planning arena's own segments.
    buffer: Option<Arc<wgpu::Buffer>>,
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
        match SizeClass::of(size) {
            SizeClass::Small => Pool::Small,
            SizeClass::Large => Pool::Large,
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

#[derive(Clone)]
pub(crate) struct Arena {
    segments: Vec<Option<Segment>>,
    /// Nonzero in a planning arena, which creates no buffers: its segments are bookkeeping
    /// only, and its blocks carry this number.
    plan_id: u32,
    /// The phase of the step being recorded, for naming the peak.
    phase: Option<&'static str>,
    /// Category of every live block, by (segment, offset).
    live: HashMap<(usize, u64), Category>,
    /// What new blocks count as (set by the trainer and the planner around each phase).
    category: Category,
    /// Set when a new in-use peak is reached; the next recorded op names it.
    peak_unnamed: bool,
    budget: Option<u64>,
    /// Largest single buffer the adapter can create.
    max_buffer_size: u64,
    stats: MemoryStats,
    /// Fault injection for tests: the allocation after this many more fails with
    /// `OutOfMemory` (as a driver would).
    fail_after: Option<u64>,
    /// The timeline being recorded, if any (one branch per event when off).
    timeline: timeline::RecorderSlot,
    /// New blocks are staging temporaries (for the timeline's roles only).
    staging: bool,
    /// Segments get no buffer (see [`Arena::create_no_buffers`]).
    no_buffers: bool,
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

impl Arena {
    pub fn new(max_buffer_size: u64, budget: Option<u64>) -> Self {
        Arena {
            segments: Vec::new(),
            plan_id: 0,
            phase: None,
            live: HashMap::new(),
            category: Category::default(),
            peak_unnamed: false,
            budget,
            max_buffer_size,
            stats: MemoryStats {
                budget,
                ..Default::default()
            },
            fail_after: None,
            timeline: Default::default(),
            staging: false,
            no_buffers: false,
        }
    }

    /// A planning copy of this arena: the same segments, free ranges, live blocks, budget and
    /// statistics, but new segments get no buffer. Blocks it hands out carry `plan_id`.
    pub fn planning_copy(&self, plan_id: u32) -> Arena {
        let mut a = self.clone();
        a.plan_id = plan_id;
        a.fail_after = None;
        a.reset_peak();
        a.stats.peak_op = None;
        a
    }

    /// Sets the category of blocks allocated from now on; returns the previous one.
    pub fn set_category(&mut self, cat: Category) -> Category {
        std::mem::replace(&mut self.category, cat)
    }

    /// Counts a live block as `cat` from now on (a gradient that a leaf adopts, a model's
    /// parameters). Blocks this arena does not hold are ignored.
    pub fn retag(&mut self, block: &Block, cat: Category) {
        if !self.owns(block) {
            return;
        }
        if let Some(old) = self.live.get_mut(&(block.segment, block.offset)) {
            let sizes = &mut self.stats.in_use_by_category;
            sizes.sub(*old, block.size);
            sizes.add(cat, block.size);
            let now = sizes.get(cat);
            if let Some(r) = self.timeline.0.as_mut() {
                r.retag(block, *old, cat, &self.stats);
            }
            *old = cat;
            self.stats.category_peaks.raise(cat, now);
        }
    }

    /// Names the current in-use peak after `op` if no op has named it yet (the op being
    /// recorded when the peak's last block was allocated).
    pub fn name_peak(&mut self, op: &str) {
        if self.peak_unnamed {
            self.peak_unnamed = false;
            self.stats.peak_op = Some(match self.phase {
                Some(p) => format!("{op} ({p})"),
                None => op.to_string(),
            });
        }
    }

    /// Sets the phase named with the peak (`"forward"`, `"backward"`, `"optimizer step"`).
    pub fn set_phase(&mut self, phase: Option<&'static str>) {
        if self.timeline.0.is_some() && self.phase != phase {
            self.mark(match phase {
                Some(p) => timeline::EventKind::PhaseStart { phase: p.into() },
                None => timeline::EventKind::PhaseEnd,
            });
        }
        self.phase = phase;
    }

    /// Whether this arena creates no buffers: a planning arena, or the arena of a device that
    /// only plans.
    pub fn is_planning(&self) -> bool {
        self.plan_id != 0 || self.no_buffers
    }

    /// From now on segments get no buffer (a device that only plans; its copies inherit it).
    pub fn create_no_buffers(&mut self) {
        self.no_buffers = true;
    }

    /// Whether this arena handed out `block` (a real arena: real blocks; a planning arena: its
    /// own, and the real ones it was copied with).
    pub fn owns(&self, block: &Block) -> bool {
        block.plan_id == 0 || block.plan_id == self.plan_id
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
        self.stats.peak_by_category = self.stats.in_use_by_category;
        self.stats.category_peaks = self.stats.in_use_by_category;
    }

    /// Bytes a request of `bytes` really takes from a segment.
    pub fn block_size(bytes: u64) -> u64 {
        align_up(bytes.max(4), BLOCK_ALIGN)
    }

    pub fn alloc(&mut self, device: &wgpu::Device, bytes: u64) -> Result<Block> {
        let block = self.alloc_block(device, bytes)?;
        if let Some(r) = self.timeline.0.as_mut() {
            r.alloc(bytes, &block, self.category, self.staging, &self.stats);
        }
        Ok(block)
    }

    fn alloc_block(&mut self, device: &wgpu::Device, bytes: u64) -> Result<Block> {
        let size = Self::block_size(bytes);
        // A block lies in one buffer (kernels bind one past the binding limit as windows).
        if size > self.max_buffer_size {
            return Err(Error::Limit {
                op: "alloc",
                what: "tensor size in bytes",
                value: size,
                limit: self.max_buffer_size,
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
        if !self.owns(block) {
            return;
        }
        let Some(cat) = self.live.remove(&(block.segment, block.offset)) else {
            // A block this arena never handed out: a planned block dropped after its plan
            // ended, or a real block the planning copy already freed.
            return;
        };
        self.stats.in_use_by_category.sub(cat, block.size);
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
        if let Some(r) = self.timeline.0.as_mut() {
            r.free(block, cat, &self.stats);
        }
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
        let buffer = seg.buffer.clone();
        self.live.insert((seg_idx, off), self.category);
        self.stats.in_use_by_category.add(self.category, size);
        let now = self.stats.in_use_by_category.get(self.category);
        self.stats.category_peaks.raise(self.category, now);
        self.stats.bytes_in_use += size;
        if self.stats.bytes_in_use > self.stats.peak_bytes_in_use {
            self.stats.peak_bytes_in_use = self.stats.bytes_in_use;
            self.stats.peak_by_category = self.stats.in_use_by_category;
            self.peak_unnamed = true;
        }
        Block {
            buffer,
            segment: seg_idx,
            offset: off,
            size,
            plan_id: self.plan_id,
            redirect: None,
        }
    }

    /// The arena's layout: each live segment's slot, size and free ranges. Two arenas with the
    /// same layout serve the same sequence of requests with the same blocks and segments, so a
    /// step that ends with the layout it began with repeats itself exactly.
    pub fn layout(&self) -> Layout {
        self.segments
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                s.as_ref()
                    .map(|s| (i, s.size, s.free.iter().map(|(&o, &l)| (o, l)).collect()))
            })
            .collect()
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
        let buffer = if self.is_planning() {
            None
        } else {
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
            Some(Arc::new(buffer))
        };
        let seg = Segment {
            buffer,
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
