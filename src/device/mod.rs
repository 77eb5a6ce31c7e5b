//! The GPU: a [`Device`] and what it holds (limits and features, the arena, planning mode,
//! per-device state of the layers above), opened on an adapter or on an application's wgpu
//! device.
//!
//! The rest of the device's work is split by job: `adapter` chooses and lists adapters,
//! `queue` records ops into the pending encoder and submits them, `transfer` uploads and reads
//! back, `pipelines` compiles and caches kernels, `planning` is planning mode and the scopes that
//! tag allocations, `arena` the device's side of the arena (statistics, reserve, budget,
//! allocation).

mod adapter;
mod arena;
mod pipelines;
mod planning;
mod queue;
mod timeline;
mod transfer;

pub use adapter::{AdapterSummary, DeviceOptions};
pub(crate) use pipelines::Kernel;
pub use planning::{CategoryScope, PhaseScope, PlanScope};
pub use queue::{FLUSH_EVERY, MAX_GROUPS_PER_DIM};
pub use timeline::StepScope;

use crate::memory::Arena;
use crate::{Error, Result};
use adapter::adapter_memory;
use queue::Pending;
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Arc, Mutex, MutexGuard};

/// The buffer and binding size of a device that only plans ([`DeviceOptions::plan_only`]):
/// 2^56 bytes, past any model, with room to add to it without overflow.
pub const PLAN_ONLY_LIMIT: u64 = 1 << 56;

/// The limits that decide what fitgrad can run.
#[derive(Clone, Debug)]
pub struct DeviceLimits {
    /// Largest storage buffer one binding may see, in bytes (bounds a tensor).
    pub max_storage_buffer_binding_size: u64,
    /// Largest buffer, in bytes (bounds an arena segment).
    pub max_buffer_size: u64,
    /// Workgroup memory per workgroup, in bytes (bounds the tiles).
    pub max_compute_workgroup_storage_size: u32,
    /// Invocations per workgroup.
    pub max_compute_invocations_per_workgroup: u32,
    /// Workgroups per dispatch dimension (large dispatches fold into 2-D grids).
    pub max_compute_workgroups_per_dimension: u32,
    /// Storage buffers one kernel may bind.
    pub max_storage_buffers_per_shader_stage: u32,
    /// Alignment of a storage binding's offset, in bytes (arena blocks are aligned to it).
    pub min_storage_buffer_offset_alignment: u32,
    /// Alignment of a uniform binding's offset, in bytes (the parameter ring's slots).
    pub min_uniform_buffer_offset_alignment: u32,
}

/// What [`Device::info`] reports.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// The adapter the device runs on.
    pub adapter: AdapterSummary,
    /// The limits granted to the device.
    pub limits: DeviceLimits,
    /// f16 math runs in f16 (SHADER_F16); otherwise f16 is stored packed and computed in f32.
    pub f16_native: bool,
    /// The subgroup size, where the device has subgroup operations (SUBGROUP) and every
    /// subgroup has the same size (kernels built for that size are then correct).
    pub subgroup_size: Option<u32>,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.limits;
        writeln!(f, "adapter: {}", self.adapter)?;
        writeln!(
            f,
            "limits: storage binding {}, buffer {}, workgroup storage {}, {} invocations per workgroup",
            crate::error::Bytes(l.max_storage_buffer_binding_size),
            crate::error::Bytes(l.max_buffer_size),
            crate::error::Bytes(l.max_compute_workgroup_storage_size as u64),
            l.max_compute_invocations_per_workgroup
        )?;
        writeln!(
            f,
            "f16: {}",
            if self.f16_native {
                "native (SHADER_F16)"
            } else {
                "packed in u32, computed in f32"
            }
        )?;
        match self.subgroup_size {
            Some(n) => write!(f, "subgroups: {n} lanes"),
            None => write!(f, "subgroups: none of fixed size"),
        }
    }
}

/// Everything a [`Device`] shares between its clones.
pub(crate) struct DeviceInner {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    info: DeviceInfo,
    pub arena: Mutex<Arena>,
    /// The planning arena while a [`PlanScope`] is open: every allocation goes there.
    plan: Mutex<Option<Arena>>,
    /// Whether a plan is open, and on which thread (only that thread's work is planned).
    planning: AtomicBool,
    plan_thread: Mutex<Option<std::thread::ThreadId>>,
    /// A device that only plans ([`DeviceOptions::plan_only`]): every thread plans, always.
    plan_only: bool,
    /// Plans opened so far (a planning arena's blocks carry its number).
    plans: AtomicU32,
    /// Arenas (real or planning) recording a memory timeline: ops are named only when > 0.
    recorders: AtomicU32,
    pending: Mutex<Pending>,
    kernels: Mutex<HashMap<String, Arc<Kernel>>>,
    /// State the layers above keep per device, one value per type (see [`Device::with_ext`]).
    ext: Mutex<HashMap<TypeId, Box<dyn Any + Send>>>,
    param_ring: wgpu::Buffer,
    param_align: u64,
    /// Host-visible buffer for readback, grown to the largest read so far.
    staging: Mutex<Option<wgpu::Buffer>>,
    /// First error wgpu reported outside an error scope (its default would panic).
    uncaptured: Arc<Mutex<Option<String>>>,
    lost: Arc<Mutex<Option<String>>>,
}

/// A GPU device. Cloning is cheap and shares everything (arena, caches, pending work).
#[derive(Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.inner.info.adapter)
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// Locks `m`, taking over a poisoned lock.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves data that is still consistent
    // (counters and caches), so a poisoned lock is taken over rather than propagated.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Device {
    /// Opens a device on `adapter`, with its real limits and SHADER_F16 where offered.
    pub fn from_adapter(adapter: &wgpu::Adapter, options: &DeviceOptions) -> Result<Device> {
        let info = adapter.get_info();
        let mut features = wgpu::Features::empty();
        if adapter.features().contains(wgpu::Features::SHADER_F16) {
            features |= wgpu::Features::SHADER_F16;
        }
        // Subgroup operations, for the subgroup matmul and softmax kernels.
        if adapter.features().contains(wgpu::Features::SUBGROUP) {
            features |= wgpu::Features::SUBGROUP;
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("fitgrad"),
            required_features: features,
            required_limits: adapter.limits(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| Error::RequestDevice {
            adapter: info.name.clone(),
            reason: e.to_string(),
        })?;
        Device::build(device, queue, info, adapter_memory(adapter), options, true)
    }

    /// Runs fitgrad on a device and queue that the application already owns. fitgrad records
    /// into its own encoders and submits on `queue`; the application's own work is ordered with
    /// ours by the queue. The application's uncaptured-error and device-lost handlers are left
    /// alone (wgpu has no way to chain them): fitgrad catches its own kernel-compile and
    /// out-of-memory errors with error scopes, and any other wgpu error reaches the
    /// application's handler (wgpu's default one panics, so install yours).
    pub fn from_wgpu(
        device: wgpu::Device,
        queue: wgpu::Queue,
        options: DeviceOptions,
    ) -> Result<Device> {
        let info = device.adapter_info();
        Device::build(device, queue, info, None, &options, false)
    }

    /// The device over an opened wgpu device; `own_handlers` installs fitgrad's error and
    /// device-lost handlers (not on an application's device).
    fn build(
        device: wgpu::Device,
        queue: wgpu::Queue,
        adapter: wgpu::AdapterInfo,
        memory: Option<u64>,
        options: &DeviceOptions,
        own_handlers: bool,
    ) -> Result<Device> {
        let l = device.limits();
        let binding = match options.max_binding_size {
            Some(cap) if cap < 256 => {
                return Err(Error::InvalidArgument {
                    op: "DeviceOptions::max_binding_size",
                    reason: format!(
                        "a binding of {cap} bytes holds no aligned window; give at least 256"
                    ),
                })
            }
            Some(cap) => cap.min(l.max_storage_buffer_binding_size),
            None => l.max_storage_buffer_binding_size,
        };
        // A device that only plans binds and creates nothing: what an adapter's buffers and
        // bindings could hold does not bound what it plans (any size plans on any adapter; a
        // real run is refused by the same checks on the real limits). Every tensor binds as
        // one window there, so no kernel passes the binding count. A binding cap a caller
        // asked for stays.
        let unbounded = |real: u64| {
            if options.plan_only {
                PLAN_ONLY_LIMIT
            } else {
                real
            }
        };
        let binding = match options.max_binding_size {
            Some(_) => binding,
            None => unbounded(binding),
        };
        let limits = DeviceLimits {
            max_storage_buffer_binding_size: binding,
            max_buffer_size: unbounded(l.max_buffer_size),
            max_compute_workgroup_storage_size: l.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
            max_compute_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
            // Kept: kernels are chosen by it, and with one window per tensor no kernel binds
            // more than its tensors.
            max_storage_buffers_per_shader_stage: l.max_storage_buffers_per_shader_stage,
            min_storage_buffer_offset_alignment: l.min_storage_buffer_offset_alignment,
            min_uniform_buffer_offset_alignment: l.min_uniform_buffer_offset_alignment,
        };
        let info = DeviceInfo {
            adapter: AdapterSummary {
                memory,
                ..AdapterSummary::from_info(&adapter)
            },
            f16_native: device.features().contains(wgpu::Features::SHADER_F16)
                && !options.force_packed_f16,
            subgroup_size: (device.features().contains(wgpu::Features::SUBGROUP)
                && adapter.subgroup_min_size == adapter.subgroup_max_size)
                .then_some(adapter.subgroup_min_size),
            limits,
        };
        let uncaptured = Arc::new(Mutex::new(None::<String>));
        let lost = Arc::new(Mutex::new(None::<String>));
        if own_handlers {
            // The device is ours: its errors become `Error::Gpu` / `Error::DeviceLost` at the
            // next submit instead of wgpu's default panic.
            let sink = uncaptured.clone();
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                let mut slot = lock(&sink);
                if slot.is_none() {
                    *slot = Some(e.to_string());
                }
            }));
            let lost_sink = lost.clone();
            device.set_device_lost_callback(move |reason, msg| {
                *lock(&lost_sink) = Some(format!("{reason:?}: {msg}"));
            });
        }
        arena::check_budget(options.memory_budget, &info.adapter, options.plan_only)?;
        let param_ring = queue::param_ring(&device);
        let mut arena = Arena::new(info.limits.max_buffer_size, options.memory_budget);
        if options.plan_only {
            arena.create_no_buffers();
        }
        Ok(Device {
            inner: Arc::new(DeviceInner {
                param_align: (info.limits.min_uniform_buffer_offset_alignment as u64).max(16),
                device,
                queue,
                info,
                arena: Mutex::new(arena),
                plan: Mutex::new(None),
                planning: AtomicBool::new(false),
                plan_thread: Mutex::new(None),
                plan_only: options.plan_only,
                plans: AtomicU32::new(0),
                recorders: AtomicU32::new(0),
                pending: Mutex::new(Pending::new()),
                kernels: Mutex::new(HashMap::new()),
                ext: Mutex::new(HashMap::new()),
                param_ring,
                staging: Mutex::new(None),
                uncaptured,
                lost,
            }),
        })
    }

    /// The limits, features and adapter of this device.
    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// The wgpu device, for applications that mix their own work with fitgrad's.
    pub fn wgpu_device(&self) -> &wgpu::Device {
        &self.inner.device
    }

    /// The wgpu queue fitgrad submits on.
    pub fn wgpu_queue(&self) -> &wgpu::Queue {
        &self.inner.queue
    }

    pub(crate) fn f16_native(&self) -> bool {
        self.inner.info.f16_native
    }

    /// Runs `f` on this device's value of type `T`, made with `T::default()` on first use.
    /// The layers above keep per-device state here (the matmul autotuner its winners) without
    /// the device knowing their types. The slots stay locked while `f` runs, so `f` must not
    /// call `with_ext` again.
    pub(crate) fn with_ext<T: Any + Send + Default, R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let mut slots = lock(&self.inner.ext);
        let slot = slots
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Box::new(T::default()));
        f(slot
            .downcast_mut::<T>()
            .expect("the slot of a type holds that type"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Counter(u32);

    #[derive(Default)]
    struct Name(String);

    /// Each type has its own slot, made on first use and kept; clones share it, other devices
    /// do not.
    #[test]
    fn extension_slots_are_per_type_and_per_device() {
        let dev = match Device::new() {
            Ok(d) => d,
            // Under CI=true a missing adapter is a failure, as in tests/it/common.
            Err(e) if std::env::var("CI").as_deref() != Ok("true") => {
                eprintln!("*** no GPU adapter ({e}): extension slots not tested ***");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(dev.with_ext(|c: &mut Counter| c.0), 0);
        dev.with_ext(|c: &mut Counter| c.0 += 2);
        dev.with_ext(|n: &mut Name| n.0.push_str("tuned"));
        let clone = dev.clone();
        assert_eq!(clone.with_ext(|c: &mut Counter| c.0), 2);
        assert_eq!(clone.with_ext(|n: &mut Name| n.0.clone()), "tuned");
        let other = Device::new().unwrap();
        assert_eq!(other.with_ext(|c: &mut Counter| c.0), 0);
    }
}
