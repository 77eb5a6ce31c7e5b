//! The GPU: adapter choice, limits and features, the pending command encoder that ops record
//! into, pipeline cache, uploads and readback.
//!
//! Ops never submit on their own. Each records a compute pass into one pending encoder; the
//! encoder is submitted on readback, on [`Device::sync`], or once [`FLUSH_EVERY`] dispatches (or
//! a full parameter ring) have piled up. Kernel parameters (shapes, scalars) are packed into one
//! uniform *ring* buffer: each dispatch appends its words to a host-side vector, and the whole
//! vector is written with one `write_buffer` just before the submit, so a batch of a few hundred
//! ops costs one upload and one submit.

use crate::memory::{Arena, Block, Category, MemoryStats};
use crate::{Error, Result};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Dispatches recorded before the pending encoder is submitted on its own. Large enough that
/// submit overhead disappears, small enough that the GPU starts before a long graph is recorded.
pub const FLUSH_EVERY: u32 = 256;
/// Bytes in the kernel-parameter ring (one batch's parameters).
const PARAM_RING_BYTES: u64 = 256 << 10;
/// Workgroups per dispatch dimension that every adapter accepts.
pub const MAX_GROUPS_PER_DIM: u32 = 65535;

/// What to ask of [`Device::with_options`]. Where a field is `None`, the environment fills it:
/// `FITGRAD_BACKEND` (vulkan, gl, metal, dx12; a comma list is allowed) and `FITGRAD_ADAPTER`
/// (a case-insensitive substring of the adapter name). An explicit option beats the variable.
#[derive(Clone, Debug, Default)]
pub struct DeviceOptions {
    /// Backends to consider, as a comma list ("vulkan", "gl", ...); `None` means all.
    pub backend: Option<String>,
    /// Case-insensitive substring the adapter name must contain.
    pub adapter: Option<String>,
    /// Hard limit on the bytes the arena may hold from the driver.
    pub memory_budget: Option<u64>,
    /// Store f16 packed in u32 and compute in f32 even where the adapter has SHADER_F16
    /// (tests use this to run the path that GL and some DX12 adapters need).
    pub force_packed_f16: bool,
}

impl DeviceOptions {
    fn with_env(mut self) -> Self {
        let var = |name| std::env::var(name).ok().filter(|s: &String| !s.is_empty());
        if self.backend.is_none() {
            self.backend = var("FITGRAD_BACKEND");
        }
        if self.adapter.is_none() {
            self.adapter = var("FITGRAD_ADAPTER");
        }
        self
    }
}

/// Parses a comma list of backend names.
fn parse_backends(list: &str) -> Result<wgpu::Backends> {
    let mut out = wgpu::Backends::empty();
    for name in list.split(',').map(|s| s.trim().to_ascii_lowercase()) {
        out |= match name.as_str() {
            "vulkan" | "vk" => wgpu::Backends::VULKAN,
            "gl" | "gles" | "opengl" => wgpu::Backends::GL,
            "metal" | "mtl" => wgpu::Backends::METAL,
            "dx12" | "d3d12" => wgpu::Backends::DX12,
            "" => continue,
            _ => {
                return Err(Error::InvalidArgument {
                    op: "FITGRAD_BACKEND",
                    reason: format!("unknown backend '{name}' (use vulkan, gl, metal or dx12)"),
                })
            }
        };
    }
    Ok(out)
}

/// One adapter as the user sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterSummary {
    pub name: String,
    pub vendor: u32,
    pub vendor_name: &'static str,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub driver_info: String,
    /// Device-local memory in bytes where the backend reports it (Vulkan memory heaps); `None`
    /// elsewhere (wgpu has no portable query).
    pub memory: Option<u64>,
}

impl AdapterSummary {
    fn from_adapter(adapter: &wgpu::Adapter) -> Self {
        AdapterSummary {
            memory: adapter_memory(adapter),
            ..AdapterSummary::from_info(&adapter.get_info())
        }
    }

    fn from_info(info: &wgpu::AdapterInfo) -> Self {
        AdapterSummary {
            memory: None,
            name: info.name.clone(),
            vendor: info.vendor,
            vendor_name: vendor_name(info.vendor),
            backend: format!("{:?}", info.backend).to_lowercase(),
            device_type: format!("{:?}", info.device_type),
            driver: info.driver.clone(),
            driver_info: info.driver_info.clone(),
        }
    }
}

impl fmt::Display for AdapterSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, {}, {}",
            self.name, self.vendor_name, self.backend, self.device_type
        )?;
        if let Some(m) = self.memory {
            write!(f, ", {} device memory", crate::error::Bytes(m))?;
        }
        if !self.driver.is_empty() {
            write!(f, ", {} {}", self.driver, self.driver_info)?;
        }
        write!(f, ")")
    }
}

fn vendor_name(id: u32) -> &'static str {
    match id {
        0x10de => "NVIDIA",
        0x1002 | 0x1022 => "AMD",
        0x8086 => "Intel",
        0x106b => "Apple",
        0x13b5 => "ARM",
        0x5143 => "Qualcomm",
        0x1414 => "Microsoft",
        0x10005 => "Mesa",
        _ => "unknown vendor",
    }
}

/// Lower is better: discrete, integrated, virtual, then software.
/// Device-local memory of a Vulkan adapter: the sum of its DEVICE_LOCAL heaps, read through
/// wgpu-hal. Other backends report nothing wgpu can reach.
fn adapter_memory(adapter: &wgpu::Adapter) -> Option<u64> {
    #[cfg(any(target_os = "linux", target_os = "windows", target_os = "android"))]
    {
        if adapter.get_info().backend != wgpu::Backend::Vulkan {
            return None;
        }
        // SAFETY: only reads properties of the physical device; nothing is created or destroyed.
        let hal = unsafe { adapter.as_hal::<wgpu::hal::api::Vulkan>() }?;
        let instance = hal.shared_instance().raw_instance();
        let props =
            unsafe { instance.get_physical_device_memory_properties(hal.raw_physical_device()) };
        let heaps = &props.memory_heaps[..props.memory_heap_count as usize];
        let local: u64 = heaps
            .iter()
            .filter(|h| h.flags.contains(ash::vk::MemoryHeapFlags::DEVICE_LOCAL))
            .map(|h| h.size)
            .sum();
        Some(local)
    }
    #[cfg(not(any(target_os = "linux", target_os = "windows", target_os = "android")))]
    {
        let _ = adapter;
        None
    }
}

/// The order adapters are preferred in: GPUs before CPU adapters (discrete, then integrated and
/// virtual), within a class the most device memory first (unreported memory last), then native
/// APIs before GL.
fn adapter_key(a: &wgpu::Adapter, memory: Option<u64>) -> (u32, std::cmp::Reverse<u64>, u32) {
    let i = a.get_info();
    rank(i.device_type, i.backend, memory)
}

fn rank(
    device_type: wgpu::DeviceType,
    backend: wgpu::Backend,
    memory: Option<u64>,
) -> (u32, std::cmp::Reverse<u64>, u32) {
    let class = match device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::VirtualGpu => 1,
        wgpu::DeviceType::Other => 2,
        wgpu::DeviceType::Cpu => 3,
    };
    (
        class,
        std::cmp::Reverse(memory.unwrap_or(0)),
        backend_rank(backend),
    )
}

/// Native APIs before GL, whose compute support is the most limited.
fn backend_rank(b: wgpu::Backend) -> u32 {
    match b {
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        _ => 1,
    }
}

/// The limits that decide what fitgrad can run.
#[derive(Clone, Debug)]
pub struct DeviceLimits {
    pub max_storage_buffer_binding_size: u64,
    pub max_buffer_size: u64,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_invocations_per_workgroup: u32,
    pub max_compute_workgroups_per_dimension: u32,
    pub max_storage_buffers_per_shader_stage: u32,
    pub min_storage_buffer_offset_alignment: u32,
    pub min_uniform_buffer_offset_alignment: u32,
}

/// What [`Device::info`] reports.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub adapter: AdapterSummary,
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

/// Work recorded but not yet submitted.
struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    dispatches: u32,
    /// Kernel parameters of this batch, written to the ring before the submit.
    params: Vec<u8>,
}

/// A compiled kernel and the layout of its bind group (binding 0 = parameters, then tensors).
/// While planning, kernels that were never compiled are stand-ins with only a name.
pub(crate) struct Kernel {
    pub name: String,
    pub compiled: Option<(wgpu::ComputePipeline, wgpu::BindGroupLayout)>,
}

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
    /// Plans opened so far (a planning arena's blocks carry its number).
    plans: AtomicU32,
    pending: Mutex<Pending>,
    kernels: Mutex<HashMap<String, Arc<Kernel>>>,
    /// Matmul autotuner winners for this adapter.
    pub(crate) tune: Mutex<crate::kernels::autotune::TuneCache>,
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

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves data that is still consistent
    // (counters and caches), so a poisoned lock is taken over rather than propagated.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn instance(backends: wgpu::Backends) -> wgpu::Instance {
    // Mesa's implicit Vulkan device-select layer connects to a Wayland display to order the
    // devices, and without XDG_RUNTIME_DIR (a headless machine, CI) libwayland prints
    // "XDG_RUNTIME_DIR is invalid" for every instance. fitgrad orders adapters itself, so the
    // layer is turned off there (its own switch, read when the instance is created).
    if std::env::var_os("XDG_RUNTIME_DIR").is_none()
        && std::env::var_os("NODEVICE_SELECT").is_none()
    {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    desc.backends = backends;
    wgpu::Instance::new(desc)
}

impl Device {
    /// The best adapter: discrete GPU, then integrated, virtual, software.
    pub fn new() -> Result<Device> {
        Device::with_options(DeviceOptions::default())
    }

    pub fn with_options(options: DeviceOptions) -> Result<Device> {
        let options = options.with_env();
        let backends = match &options.backend {
            Some(list) => parse_backends(list)?,
            None => wgpu::Backends::all(),
        };
        let adapters = pollster::block_on(instance(backends).enumerate_adapters(backends));
        let wanted = match (&options.backend, &options.adapter) {
            (Some(b), Some(a)) => format!("backend {b}, adapter '{a}'"),
            (Some(b), None) => format!("backend {b}"),
            (None, Some(a)) => format!("adapter '{a}'"),
            (None, None) => String::new(),
        };
        let seen: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
        let best = adapters
            .into_iter()
            .filter(|a| {
                options.adapter.as_ref().is_none_or(|want| {
                    a.get_info()
                        .name
                        .to_lowercase()
                        .contains(&want.to_lowercase())
                })
            })
            .min_by_key(|a| adapter_key(a, adapter_memory(a)))
            .ok_or_else(|| {
                if seen.is_empty() {
                    Error::NoAdapter {
                        wanted,
                        reason: "wgpu found no adapter at all".into(),
                        hint: "Install a GPU driver, or Mesa's software Vulkan driver \
                               (apt-get install mesa-vulkan-drivers); check FITGRAD_BACKEND"
                            .into(),
                    }
                } else {
                    Error::NoAdapter {
                        wanted,
                        reason: format!("the adapters found were {seen:?}"),
                        hint: "Pick one of these names (a case-insensitive substring), with \
                               --adapter or FITGRAD_ADAPTER, or leave the name out"
                            .into(),
                    }
                }
            })?;
        Device::from_adapter(&best, &options)
    }

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

    fn build(
        device: wgpu::Device,
        queue: wgpu::Queue,
        adapter: wgpu::AdapterInfo,
        memory: Option<u64>,
        options: &DeviceOptions,
        own_handlers: bool,
    ) -> Result<Device> {
        let l = device.limits();
        let limits = DeviceLimits {
            max_storage_buffer_binding_size: l.max_storage_buffer_binding_size,
            max_buffer_size: l.max_buffer_size,
            max_compute_workgroup_storage_size: l.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
            max_compute_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
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
        let param_ring = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("fitgrad kernel parameters"),
            size: PARAM_RING_BYTES,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let arena = Arena::new(
            info.limits.max_buffer_size,
            info.limits.max_storage_buffer_binding_size,
            options.memory_budget,
        );
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
                plans: AtomicU32::new(0),
                pending: Mutex::new(Pending {
                    encoder: None,
                    dispatches: 0,
                    params: Vec::new(),
                }),
                kernels: Mutex::new(HashMap::new()),
                tune: Mutex::new(Default::default()),
                param_ring,
                staging: Mutex::new(None),
                uncaptured,
                lost,
            }),
        })
    }

    /// Every adapter wgpu finds on this machine, best first.
    pub fn adapters() -> Vec<AdapterSummary> {
        let all = wgpu::Backends::all();
        let mut list: Vec<(wgpu::Adapter, AdapterSummary)> =
            pollster::block_on(instance(all).enumerate_adapters(all))
                .into_iter()
                .map(|a| {
                    let s = AdapterSummary::from_adapter(&a);
                    (a, s)
                })
                .collect();
        list.sort_by_key(|(a, s)| adapter_key(a, s.memory));
        list.into_iter().map(|(_, s)| s).collect()
    }

    /// Whether this device is in planning mode (see `Device::planning`): allocations are
    /// counted but nothing runs, and readbacks return zeros. Code with host-side state that a
    /// step advances (a dropout call counter) leaves it alone while planning.
    pub fn is_planning(&self) -> bool {
        self.inner.planning.load(Ordering::Acquire)
            && *lock(&self.inner.plan_thread) == Some(std::thread::current().id())
    }

    /// Opens planning mode: until the scope drops, every allocation goes through a copy of the
    /// arena (same segments, free ranges, rounding, reuse and budget) that creates no buffer;
    /// no kernel is compiled or recorded, nothing is uploaded, readbacks return zeros, and
    /// matmuls are not autotuned. Running a step inside it gives that step's exact peak.
    /// Planning applies to the calling thread only: other threads' work runs as usual (their
    /// frees reach the plan too; their allocations do not).
    pub fn planning(&self) -> Result<PlanScope> {
        self.flush()?;
        let mut plan = lock(&self.inner.plan);
        if plan.is_some() {
            return Err(Error::InvalidArgument {
                op: "Device::planning",
                reason: "this device is already planning".into(),
            });
        }
        let id = self.inner.plans.fetch_add(1, Ordering::AcqRel) + 1;
        *plan = Some(lock(&self.inner.arena).planning_copy(id));
        *lock(&self.inner.plan_thread) = Some(std::thread::current().id());
        self.inner.planning.store(true, Ordering::Release);
        Ok(PlanScope {
            device: self.clone(),
        })
    }

    /// Runs `f` on the arena allocations go to now: the planning one inside a plan.
    fn with_arena<R>(&self, f: impl FnOnce(&mut Arena) -> R) -> R {
        if self.is_planning() {
            if let Some(a) = lock(&self.inner.plan).as_mut() {
                return f(a);
            }
        }
        f(&mut lock(&self.inner.arena))
    }

    /// Sets what new allocations count as ([`MemoryStats::in_use_by_category`]) until the
    /// guard drops.
    pub fn category_scope(&self, cat: Category) -> CategoryScope {
        let prev = self.with_arena(|a| a.set_category(cat));
        CategoryScope {
            device: self.clone(),
            prev,
        }
    }

    /// Counts `tensor`'s memory as `cat` from now on.
    pub fn retag(&self, tensor: &crate::Tensor, cat: Category) {
        let block = tensor.block();
        lock(&self.inner.arena).retag(block, cat);
        if let Some(a) = lock(&self.inner.plan).as_mut() {
            a.retag(block, cat);
        }
    }

    /// Names the phase of a step (`"forward"`, `"backward"`, ...) that the peak's op is
    /// reported with, until the guard drops.
    pub fn phase_scope(&self, phase: &'static str) -> PhaseScope {
        self.with_arena(|a| a.set_phase(Some(phase)));
        PhaseScope {
            device: self.clone(),
        }
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// The wgpu device, for applications that mix their own work with fitgrad's.
    pub fn wgpu_device(&self) -> &wgpu::Device {
        &self.inner.device
    }

    pub fn wgpu_queue(&self) -> &wgpu::Queue {
        &self.inner.queue
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

    // ---- memory ----

    /// The arena's statistics (the real arena's, even while planning).
    pub fn memory_stats(&self) -> MemoryStats {
        lock(&self.inner.arena).stats()
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

    /// Preallocates `bytes` so allocations up to that total create no buffers.
    pub fn reserve(&self, bytes: u64) -> Result<()> {
        let dev = &self.inner.device;
        self.with_arena(|a| a.reserve(dev, bytes))
    }

    /// Sets or clears the hard memory budget. Lowering it below what is reserved frees cached
    /// segments at the next allocation that needs room.
    pub fn set_memory_budget(&self, budget: Option<u64>) {
        lock(&self.inner.arena).set_budget(budget);
    }

    /// Whether a tensor of `bytes` bytes could exist on this device (one storage binding
    /// holds it, and it is not by itself over the budget), checked before any host work.
    pub(crate) fn check_tensor_bytes(&self, op: &'static str, bytes: u64) -> Result<()> {
        let size = Arena::block_size(bytes);
        let limit = self
            .inner
            .info
            .limits
            .max_storage_buffer_binding_size
            .min(self.inner.info.limits.max_buffer_size);
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

    pub(crate) fn alloc(&self, bytes: u64) -> Result<Block> {
        let dev = &self.inner.device;
        self.with_arena(|a| a.alloc(dev, bytes))
    }

    pub(crate) fn free(&self, block: &Block) {
        // A real block freed while planning leaves both arenas; a planned one only its own.
        if block.plan_id == 0 {
            lock(&self.inner.arena).free(block);
        }
        if let Some(a) = lock(&self.inner.plan).as_mut() {
            a.free(block);
        }
    }

    /// While planning: the op now being recorded names a pending peak, and nothing runs.
    fn planned_op(&self, name: &str) -> bool {
        if !self.is_planning() {
            return false;
        }
        if let Some(a) = lock(&self.inner.plan).as_mut() {
            a.name_peak(name);
        }
        true
    }

    // ---- kernels ----

    /// The compiled kernel cached under `key`, compiling `source()` on first use with the
    /// given values for its `override` constants (which must be part of `key`). Shader compile
    /// errors come back as [`Error::Gpu`] rather than a panic. `bounds_proven` drops wgpu's
    /// runtime bounds checks: only for kernels that keep every access in range themselves.
    pub(crate) fn kernel(
        &self,
        key: &str,
        constants: &[(&str, f64)],
        bounds_proven: bool,
        source: impl FnOnce() -> String,
    ) -> Result<Arc<Kernel>> {
        if let Some(k) = lock(&self.inner.kernels).get(key) {
            return Ok(k.clone());
        }
        if self.is_planning() {
            // A stand-in, not cached: the real run compiles it.
            return Ok(Arc::new(Kernel {
                name: key.to_string(),
                compiled: None,
            }));
        }
        let dev = &self.inner.device;
        let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(key),
            source: wgpu::ShaderSource::Wgsl(source().into()),
        };
        let module = if bounds_proven {
            // SAFETY: the caller's kernel clamps or guards every index it reads and writes
            // against the shapes it is dispatched with, and its tests cover the edges; wgpu's
            // per-access bounds checks cost about a quarter of matmul time on lavapipe.
            unsafe {
                dev.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        } else {
            dev.create_shader_module(desc)
        };
        let pipeline = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(key),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                // Every kernel writes workgroup memory before reading it.
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(Error::Gpu(format!("kernel {key}: {e}")));
        }
        let layout = pipeline.get_bind_group_layout(0);
        let k = Arc::new(Kernel {
            name: key.to_string(),
            compiled: Some((pipeline, layout)),
        });
        lock(&self.inner.kernels).insert(key.to_string(), k.clone());
        Ok(k)
    }

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
        if groups.contains(&0) || self.planned_op(&kernel.name) {
            return Ok(());
        }
        let (Some((pipeline, layout)), Some(buffers)) = (
            kernel.compiled.as_ref(),
            tensors
                .iter()
                .map(|b| b.buffer.as_ref())
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
        for (i, (b, buffer)) in tensors.iter().zip(&buffers).enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset: b.offset,
                    size: wgpu::BufferSize::new(b.size),
                }),
            });
        }
        let bind_group = inner.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout,
            entries: &entries,
        });
        let encoder = pending.encoder.get_or_insert_with(|| {
            inner
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("fitgrad ops"),
                })
        });
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

    /// Records a copy of `bytes` bytes (a multiple of 4) between blocks.
    pub(crate) fn copy(&self, src: &Block, dst: &Block, bytes: u64) -> Result<()> {
        if self.planned_op("copy") {
            return Ok(());
        }
        let (Some(sb), Some(db)) = (&src.buffer, &dst.buffer) else {
            return Err(planned_outside_plan());
        };
        let mut pending = lock(&self.inner.pending);
        let dev = &self.inner.device;
        pending
            .encoder
            .get_or_insert_with(|| {
                dev.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("fitgrad ops"),
                })
            })
            .copy_buffer_to_buffer(sb, src.offset, db, dst.offset, bytes);
        Ok(())
    }

    /// Records a zero fill of a block.
    pub(crate) fn clear(&self, block: &Block) -> Result<()> {
        if self.planned_op("clear") {
            return Ok(());
        }
        let Some(buffer) = &block.buffer else {
            return Err(planned_outside_plan());
        };
        let mut pending = lock(&self.inner.pending);
        let dev = &self.inner.device;
        pending
            .encoder
            .get_or_insert_with(|| {
                dev.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("fitgrad ops"),
                })
            })
            .clear_buffer(buffer, block.offset, Some(block.size));
        Ok(())
    }

    /// Submits everything recorded so far (without waiting).
    pub fn flush(&self) -> Result<()> {
        let mut pending = lock(&self.inner.pending);
        self.submit(&mut pending)
    }

    fn submit(&self, pending: &mut Pending) -> Result<()> {
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

    fn check_errors(&self) -> Result<()> {
        if let Some(msg) = lock(&self.inner.lost).clone() {
            return Err(Error::DeviceLost(msg));
        }
        if let Some(msg) = lock(&self.inner.uncaptured).take() {
            return Err(Error::Gpu(msg));
        }
        Ok(())
    }

    /// Writes host bytes into a block.
    pub(crate) fn upload(&self, block: &Block, data: &[u8]) -> Result<()> {
        if self.planned_op("upload") {
            return Ok(());
        }
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
                .write_buffer(buffer, block.offset, &data[..len]);
        }
        if len < data.len() {
            // wgpu writes whole 4-byte words; pad the tail (an odd count of f16).
            let mut tail = [0u8; 4];
            tail[..data.len() - len].copy_from_slice(&data[len..]);
            self.inner
                .queue
                .write_buffer(buffer, block.offset + len as u64, &tail);
        }
        Ok(())
    }

    /// Reads `bytes` bytes from the start of a block, after all recorded work.
    pub(crate) fn download(&self, block: &Block, bytes: u64) -> Result<Vec<u8>> {
        if bytes == 0 {
            return Ok(Vec::new());
        }
        if self.planned_op("readback") {
            return Ok(vec![0; bytes as usize]);
        }
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
            let dev = &inner.device;
            pending
                .encoder
                .get_or_insert_with(|| {
                    dev.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                        label: Some("fitgrad ops"),
                    })
                })
                .copy_buffer_to_buffer(buffer, block.offset, staging, 0, size);
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

    pub(crate) fn f16_native(&self) -> bool {
        self.inner.info.f16_native
    }
}

/// The error for a tensor made while planning that is used for real after the plan ended.
fn planned_outside_plan() -> Error {
    Error::InvalidArgument {
        op: "device",
        reason:
            "a tensor created while planning has no device memory and cannot be used after the plan"
                .into(),
    }
}

/// Planning mode of a [`Device`] (see [`Device::planning`]); it ends when this drops.
pub struct PlanScope {
    device: Device,
}

impl PlanScope {
    /// The planning arena's statistics: peaks since the plan began (in use, reserved, by
    /// category, the peak's op), allocations, the segments it would have created.
    pub fn stats(&self) -> MemoryStats {
        lock(&self.device.inner.plan)
            .as_ref()
            .map(Arena::stats)
            .unwrap_or_default()
    }

    /// Makes the plan's peaks start from what is in use now.
    pub fn reset_peak(&self) {
        if let Some(a) = lock(&self.device.inner.plan).as_mut() {
            a.reset_peak();
            a.set_phase(None);
        }
    }

    /// Leaves `tensor` out of the plan: the planning arena frees its block (the real tensor
    /// lives on). The planner sets the optimizer's real state aside this way.
    pub fn forget(&self, tensor: &crate::Tensor) {
        if let Some(a) = lock(&self.device.inner.plan).as_mut() {
            a.free(tensor.block());
        }
    }

    /// Sets the budget the planning arena enforces (it starts with the device's).
    pub fn set_budget(&self, budget: Option<u64>) {
        if let Some(a) = lock(&self.device.inner.plan).as_mut() {
            a.set_budget(budget);
        }
    }
}

impl Drop for PlanScope {
    fn drop(&mut self) {
        self.device.inner.planning.store(false, Ordering::Release);
        *lock(&self.device.inner.plan_thread) = None;
        *lock(&self.device.inner.plan) = None;
    }
}

/// Restores the previous allocation category when dropped (see [`Device::category_scope`]).
#[must_use = "the category applies only while the guard lives"]
pub struct CategoryScope {
    device: Device,
    prev: Category,
}

impl Drop for CategoryScope {
    fn drop(&mut self) {
        self.device.with_arena(|a| a.set_category(self.prev));
    }
}

/// Clears the phase when dropped (see [`Device::phase_scope`]).
#[must_use = "the phase applies only while the guard lives"]
pub struct PhaseScope {
    device: Device,
}

impl Drop for PhaseScope {
    fn drop(&mut self) {
        self.device.with_arena(|a| a.set_phase(None));
    }
}

/// Splits a workgroup count into a grid no dimension of which passes 65,535.
pub(crate) fn grid(groups: u32) -> (u32, u32) {
    if groups <= MAX_GROUPS_PER_DIM {
        (groups, 1)
    } else {
        let y = groups.div_ceil(MAX_GROUPS_PER_DIM);
        (groups.div_ceil(y), y)
    }
}

#[cfg(test)]
mod tests {
    use wgpu::{Backend, DeviceType};

    /// GPUs before CPU adapters; the most memory first within a class; unreported memory last;
    /// native APIs before GL on the same adapter.
    #[test]
    fn adapters_rank_by_class_then_memory() {
        const GIB: u64 = 1 << 30;
        let mut v = [
            (
                "cpu",
                rank(DeviceType::Cpu, Backend::Vulkan, Some(64 * GIB)),
            ),
            (
                "small",
                rank(DeviceType::DiscreteGpu, Backend::Vulkan, Some(8 * GIB)),
            ),
            (
                "big",
                rank(DeviceType::DiscreteGpu, Backend::Vulkan, Some(80 * GIB)),
            ),
            (
                "unknown",
                rank(DeviceType::DiscreteGpu, Backend::Dx12, None),
            ),
            (
                "igpu",
                rank(DeviceType::IntegratedGpu, Backend::Vulkan, Some(16 * GIB)),
            ),
            (
                "big-gl",
                rank(DeviceType::DiscreteGpu, Backend::Gl, Some(80 * GIB)),
            ),
        ];
        v.sort_by_key(|e| e.1);
        let order: Vec<&str> = v.iter().map(|e| e.0).collect();
        assert_eq!(order, ["big", "big-gl", "small", "unknown", "igpu", "cpu"]);
    }

    use super::*;

    #[test]
    fn backend_names() {
        assert_eq!(parse_backends("vulkan").unwrap(), wgpu::Backends::VULKAN);
        assert_eq!(
            parse_backends("GL, vulkan").unwrap(),
            wgpu::Backends::GL | wgpu::Backends::VULKAN
        );
        assert!(matches!(
            parse_backends("cuda"),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn grid_covers_every_group() {
        for g in [1, 65535, 65536, 200_000, u32::MAX / 2] {
            let (x, y) = grid(g);
            assert!(x <= MAX_GROUPS_PER_DIM && x as u64 * y as u64 >= g as u64);
        }
    }
}
