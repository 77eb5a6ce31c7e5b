//! Where a parameter lives, and when it moves: parameters streamed unit by unit.
//!
//! A model names its *units* ([`Module::units`](crate::nn::Module::units): each GPT block,
//! each element of a `Vec` of [`Unit`](crate::nn::Unit)s — FSDP's units). With streaming on
//! ([`Streaming::start`], the trainer's `offload_parameters`), a unit's parameters live in
//! host memory (src/tensor/streamed.rs) and are on the device only around the unit's work:
//!
//! - the model calls [`within`] around each unit's forward: the unit is fetched first (unless
//!   it is there already) and, once its forward is recorded, the *next* unit's fetch starts, so
//!   its upload is staged while the device computes this one (uploads submit the recorded work
//!   first); in a checkpointed recomputation the next unit is the one before;
//! - at most [`MAX_RESIDENT`] units are on the device at once: fetching another evicts the
//!   one used least recently, and an evicted unit's gradients are read back, added to their
//!   host sums (so micro-batches add up on the host) and freed;
//! - training runs every unit under checkpointing, so the forward keeps no reference to a
//!   unit's weights and the backward fetches each unit again for its recomputation;
//! - [`finish`] ends a step: every unit's gradients go to the host and no unit stays.
//!
//! A model built inside [`born_on_host`] has its units in host memory from the start (never
//! whole on the device); streaming numbers them when it starts.
//!
//! Where a unit's data comes from is a [`UnitSource`]: host memory here ([`HostSource`]), or
//! the ranks of a data-parallel group ([`Streaming::start_with`] with ZeRO stage 3's source,
//! src/distributed/zero/stage3.rs, which all-gathers a unit's shards into the host copy before
//! the upload and reduce-scatters its gradients when it is retired). A source prepares a unit
//! ([`UnitSource::prepare`]) before the evictions that make room for it, since retiring a
//! victim's gradients waits for the device: stage 3's gather of the next unit runs while the
//! device computes the unit before it.
//!
//! Everything runs the same while planning (the device's planning mode): fetches allocate from
//! the planning arena and count their bytes, nothing is transferred, so the planner's device
//! peak and bytes moved are those of the real step.

use crate::memory::Category;
use crate::{Device, Error, Result, Tensor};
use std::sync::{Arc, Mutex, MutexGuard};

mod birth;
pub use birth::{born, born_on_host, made_on_host};

/// Units on the device at once: the one computing and the next one's upload.
pub const MAX_RESIDENT: usize = 2;

/// Host bytes per streamed element besides the optimizer's: the f32 value and its f32
/// gradient sum.
pub const HOST_BYTES_PER_ELEMENT: u64 = 8;

/// Where a unit's parameters come from and where its gradients go.
pub trait UnitSource: Send {
    /// Readies the unit's values off the device, before the evictions that make room for it
    /// (ZeRO stage 3 all-gathers them from the ranks here, while the device computes the work
    /// recorded so far); [`UnitSource::fetch`] follows. Nothing by default.
    fn prepare(&mut self, _params: &[Tensor]) -> Result<()> {
        Ok(())
    }
    /// Puts every parameter of the unit on the device; returns the bytes moved there.
    fn fetch(&mut self, params: &[Tensor]) -> Result<u64>;
    /// Takes the unit's gradients off the device (each summed where the source keeps it) and
    /// frees them; returns the bytes moved back. While planning nothing is read.
    fn retire_grads(&mut self, params: &[Tensor], planning: bool) -> Result<u64>;
    /// Frees the unit's parameters on the device.
    fn release(&mut self, params: &[Tensor]);
}

/// Units whose home is host memory: uploaded from there, gradients summed there.
pub struct HostSource;

impl UnitSource for HostSource {
    fn fetch(&mut self, params: &[Tensor]) -> Result<u64> {
        let mut moved = 0;
        for p in params {
            match p.stream_in() {
                Ok(b) => moved += b,
                Err(e) => {
                    self.release(params);
                    return Err(e);
                }
            }
        }
        Ok(moved)
    }

    fn retire_grads(&mut self, params: &[Tensor], planning: bool) -> Result<u64> {
        let mut moved = 0;
        for p in params {
            let Some(g) = p.grad() else {
                continue;
            };
            if !planning {
                let values = g.to_vec_f32()?;
                p.with_host(|h| match &mut h.grad {
                    // The same f32 addition the device's in-place accumulation makes.
                    Some(sum) => sum.iter_mut().zip(&values).for_each(|(s, v)| *s += v),
                    None => h.grad = Some(values),
                });
            }
            moved += (g.numel() * g.dtype().size()) as u64;
            p.set_grad(None)?;
        }
        Ok(moved)
    }

    fn release(&mut self, params: &[Tensor]) {
        for p in params {
            p.stream_out();
        }
    }
}

/// Bytes a step moved between host and device for streamed units.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Moved {
    /// Parameters uploaded.
    pub to_device: u64,
    /// Gradients read back.
    pub to_host: u64,
    /// Unit fetches.
    pub fetches: u64,
}

impl Moved {
    /// Both directions.
    pub fn total(&self) -> u64 {
        self.to_device + self.to_host
    }

    /// What was moved after `earlier` was taken.
    pub fn since(&self, earlier: Moved) -> Moved {
        Moved {
            to_device: self.to_device - earlier.to_device,
            to_host: self.to_host - earlier.to_host,
            fetches: self.fetches - earlier.fetches,
        }
    }

    /// `n` times this.
    pub fn times(&self, n: u64) -> Moved {
        Moved {
            to_device: self.to_device * n,
            to_host: self.to_host * n,
            fetches: self.fetches * n,
        }
    }
}

/// One device's streamed units.
struct Units {
    /// Each unit's name and parameters, by unit number.
    units: Vec<(String, Vec<Tensor>)>,
    /// Resident units, least recently used first.
    resident: Vec<usize>,
    source: Box<dyn UnitSource>,
    moved: Moved,
}

#[derive(Default)]
struct Slot(Option<Arc<Mutex<Units>>>);

fn lock(m: &Mutex<Units>) -> MutexGuard<'_, Units> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn units_of(dev: &Device) -> Option<Arc<Mutex<Units>>> {
    dev.with_ext(|s: &mut Slot| s.0.clone())
}

/// Streaming on one device: made by [`Streaming::start`], ended when dropped (the units stay
/// in host memory; only the bookkeeping goes).
pub struct Streaming {
    device: Device,
    params: u64,
}

impl Streaming {
    /// Moves the parameters of every unit to host memory and streams them from now on.
    /// `units` are (name, parameters) as [`Module::units`](crate::nn::Module::units) lists
    /// them; an empty list is an [`Error::InvalidArgument`] that says how to mark units.
    pub fn start(device: &Device, units: Vec<(String, Vec<Tensor>)>) -> Result<Streaming> {
        Streaming::start_with(device, units, Box::new(HostSource))
    }

    /// As [`Streaming::start`], with `source` fetching each unit and retiring its gradients
    /// (a unit's number is its position in `units`).
    pub fn start_with(
        device: &Device,
        units: Vec<(String, Vec<Tensor>)>,
        source: Box<dyn UnitSource>,
    ) -> Result<Streaming> {
        if units.iter().all(|(_, p)| p.is_empty()) {
            return Err(no_units());
        }
        if units_of(device).is_some() {
            return Err(Error::InvalidArgument {
                op: "offload parameters",
                reason: "this device already streams another model's units".into(),
            });
        }
        let mut params = 0;
        for (i, (_, ps)) in units.iter().enumerate() {
            for p in ps {
                p.stream_to_host(i)?;
                params += p.numel() as u64;
            }
        }
        let u = Units {
            units,
            resident: Vec::new(),
            source,
            moved: Moved::default(),
        };
        device.with_ext(|s: &mut Slot| s.0 = Some(Arc::new(Mutex::new(u))));
        Ok(Streaming {
            device: device.clone(),
            params,
        })
    }

    /// Elements streamed.
    pub fn elements(&self) -> u64 {
        self.params
    }

    /// The units' names and element counts.
    pub fn unit_sizes(&self) -> Vec<(String, u64)> {
        units_of(&self.device).map_or_else(Vec::new, |u| {
            lock(&u)
                .units
                .iter()
                .map(|(n, p)| (n.clone(), p.iter().map(|t| t.numel() as u64).sum()))
                .collect()
        })
    }

    /// Bytes moved since the last call, reset.
    pub fn take_moved(&self) -> Moved {
        units_of(&self.device).map_or_else(Moved::default, |u| std::mem::take(&mut lock(&u).moved))
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        if let Some(u) = units_of(&self.device) {
            let mut u = lock(&u);
            let all: Vec<usize> = std::mem::take(&mut u.resident);
            for i in all {
                let params = u.units[i].1.clone();
                u.source.release(&params);
            }
        }
        self.device.with_ext(|s: &mut Slot| s.0 = None);
    }
}

/// What a model that names no units is told.
pub const HOW_TO_MARK_UNITS: &str = "the model names no units to stream: wrap each block in \
     nn::Unit (a Vec<Unit<M>> makes each element one), or return them from Module::units; Gpt \
     names its blocks";

/// The error for streaming asked of a model that names no units.
pub fn no_units() -> Error {
    Error::InvalidArgument {
        op: "offload parameters",
        reason: HOW_TO_MARK_UNITS.into(),
    }
}

/// Makes unit `i` resident, evicting the least recently used others past [`MAX_RESIDENT`]
/// (their gradients first go to the host).
fn make_resident(dev: &Device, u: &mut Units, i: usize) -> Result<()> {
    if let Some(at) = u.resident.iter().position(|&r| r == i) {
        u.resident.remove(at);
        u.resident.push(i);
        return Ok(());
    }
    let planning = dev.is_planning();
    let params = u.units[i].1.clone();
    // Before the evictions: retiring a victim's gradients waits for the device, and the
    // source's preparation (a gather from the ranks) can run while the device computes.
    u.source.prepare(&params)?;
    while u.resident.len() >= MAX_RESIDENT {
        let victim = u.resident.remove(0);
        let params = u.units[victim].1.clone();
        let back = u.source.retire_grads(&params, planning)?;
        u.moved.to_host += back;
        u.source.release(&params);
    }
    let _c = dev.category_scope(Category::Parameters);
    let up = u.source.fetch(&params)?;
    u.moved.to_device += up;
    u.moved.fetches += 1;
    u.resident.push(i);
    Ok(())
}

/// Runs `f` (a unit's forward, or its recomputation) with the unit that `any_param` belongs to
/// on the device, then starts fetching the next one. A parameter that is not streamed runs `f`
/// alone.
pub fn within<R>(any_param: &Tensor, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let Some(i) = any_param.stream_unit() else {
        return f();
    };
    let dev = any_param.device().clone();
    let Some(units) = units_of(&dev) else {
        return f();
    };
    make_resident(&dev, &mut lock(&units), i)?;
    let out = f()?;
    // Backward recomputes the units last to first.
    let next = if crate::tensor::autograd::recomputing() {
        i.checked_sub(1)
    } else {
        Some(i + 1)
    };
    let mut u = lock(&units);
    if let Some(n) = next.filter(|&n| n < u.units.len()) {
        make_resident(&dev, &mut u, n)?;
        // The unit computing stays the most recent: the next fetch evicts the older one.
        if let Some(at) = u.resident.iter().position(|&r| r == i) {
            u.resident.remove(at);
            u.resident.push(i);
        }
    }
    Ok(out)
}

/// Ends a step on `dev`: with `keep_grads`, every resident unit's gradients go to the host;
/// then no unit stays on the device. Without, device gradients are dropped (a failed step).
pub fn finish(dev: &Device, keep_grads: bool) -> Result<()> {
    let Some(units) = units_of(dev) else {
        return Ok(());
    };
    let mut u = lock(&units);
    let planning = dev.is_planning();
    let all = std::mem::take(&mut u.resident);
    let mut result = Ok(());
    for i in all {
        let params = u.units[i].1.clone();
        if keep_grads && result.is_ok() {
            match u.source.retire_grads(&params, planning) {
                Ok(b) => u.moved.to_host += b,
                Err(e) => result = Err(e),
            }
        }
        for p in &params {
            let _ = p.set_grad(None);
        }
        u.source.release(&params);
    }
    result
}

/// Bytes moved on `dev` since the counters were last taken (zeros without streaming).
pub fn moved(dev: &Device) -> Moved {
    units_of(dev).map_or_else(Moved::default, |u| lock(&u).moved)
}

/// Counts `m` as moved on `dev` (the planner's stand-in for micro-batches it skips).
pub fn add_moved(dev: &Device, m: Moved) {
    if let Some(u) = units_of(dev) {
        let mut u = lock(&u);
        u.moved.to_device += m.to_device;
        u.moved.to_host += m.to_host;
        u.moved.fetches += m.fetches;
    }
}

/// Whether `dev` streams units now.
pub fn active(dev: &Device) -> bool {
    units_of(dev).is_some()
}
