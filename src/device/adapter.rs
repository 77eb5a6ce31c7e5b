//! Adapter choice: which adapters wgpu finds, how they rank (GPUs first, then device memory,
//! then native APIs before GL), the options and environment variables that pick one, and
//! opening the best one.

use super::Device;
use crate::{Error, Result};
use std::fmt;

/// What to ask of [`Device::with_options`]. Where a field is `None`, the environment fills it:
/// `FITGRAD_BACKEND` (vulkan, gl, metal, dx12; a comma list is allowed) and `FITGRAD_ADAPTER`
/// (a case-insensitive substring of the adapter name). An explicit option beats the variable.
///
/// Built from [`Default`] with the chained setters (new options may be added):
///
/// ```no_run
/// use fitgrad::{Device, DeviceOptions};
/// let opts = DeviceOptions::default().backend("vulkan").memory_budget(64 << 20);
/// let dev = Device::with_options(opts)?;
/// # Ok::<(), fitgrad::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
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
    /// Caps the storage-binding size below the adapter's: tensors past it are bound as several
    /// windows of their buffer, as tensors past the adapter's own limit are (tests run that
    /// path at small sizes this way).
    pub max_binding_size: Option<u64>,
    /// A device that only plans: memory is counted as on the adapter (its rounding, kernels
    /// and budget) but no buffer is ever created and nothing runs, as inside
    /// `Device::planning`, for as long as the device lives. Any model, of any size, can be
    /// built on it and its steps planned: the adapter's buffer and binding sizes do not apply
    /// (both are [`PLAN_ONLY_LIMIT`](crate::device::PLAN_ONLY_LIMIT), so every tensor binds as
    /// one window; a cap of `max_binding_size` stays). No value can be read back (readbacks
    /// are zeros). The budget may exceed the adapter's memory (asking whether a model fits a
    /// larger GPU).
    pub plan_only: bool,
}

impl DeviceOptions {
    /// Sets the backends to consider, a comma list ("vulkan", "gl,vulkan"; checked when the
    /// device opens).
    pub fn backend(mut self, backend: impl Into<String>) -> Self {
        self.backend = Some(backend.into());
        self
    }

    /// Sets the case-insensitive substring the adapter name must contain.
    pub fn adapter(mut self, adapter: impl Into<String>) -> Self {
        self.adapter = Some(adapter.into());
        self
    }

    /// Sets the hard limit on the bytes the arena may hold from the driver.
    pub fn memory_budget(mut self, bytes: u64) -> Self {
        self.memory_budget = Some(bytes);
        self
    }

    /// Stores f16 packed in u32 and computes in f32 even where the adapter has SHADER_F16.
    pub fn force_packed_f16(mut self, force: bool) -> Self {
        self.force_packed_f16 = force;
        self
    }

    /// Caps the storage-binding size at `bytes` (at least 256; see `max_binding_size`).
    pub fn max_binding_size(mut self, bytes: u64) -> Self {
        self.max_binding_size = Some(bytes);
        self
    }

    /// Makes the device plan only (see `plan_only`).
    pub fn plan_only(mut self, plan_only: bool) -> Self {
        self.plan_only = plan_only;
        self
    }

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
    /// The adapter's name as the driver reports it (what `--adapter` matches).
    pub name: String,
    /// The PCI vendor id (0 where the backend has none).
    pub vendor: u32,
    /// The vendor's name, from the id ("NVIDIA", "AMD", ...).
    pub vendor_name: &'static str,
    /// The wgpu backend: "vulkan", "metal", "dx12" or "gl".
    pub backend: String,
    /// Discrete, integrated, virtual or CPU (a software rasterizer such as lavapipe), for
    /// display; code decides on [`AdapterSummary::kind`].
    pub device_type: String,
    /// The backend, typed (what code compares; `backend` is its display form).
    pub wgpu_backend: wgpu::Backend,
    /// The kind of device, typed.
    pub kind: wgpu::DeviceType,
    /// The driver's name.
    pub driver: String,
    /// The driver's version text.
    pub driver_info: String,
    /// Device-local memory in bytes where the backend reports it (Vulkan memory heaps); `None`
    /// elsewhere (wgpu has no portable query).
    pub memory: Option<u64>,
}

impl AdapterSummary {
    /// A CPU adapter (lavapipe, llvmpipe, WARP): kernels compile for seconds and run on the
    /// host's cores, which changes the kernel choices.
    pub fn is_cpu(&self) -> bool {
        self.kind == wgpu::DeviceType::Cpu
    }

    fn from_adapter(adapter: &wgpu::Adapter) -> Self {
        AdapterSummary {
            memory: adapter_memory(adapter),
            ..AdapterSummary::from_info(&adapter.get_info())
        }
    }

    pub(super) fn from_info(info: &wgpu::AdapterInfo) -> Self {
        AdapterSummary {
            memory: None,
            name: info.name.clone(),
            vendor: info.vendor,
            vendor_name: vendor_name(info.vendor),
            backend: format!("{:?}", info.backend).to_lowercase(),
            device_type: format!("{:?}", info.device_type),
            wgpu_backend: info.backend,
            kind: info.device_type,
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
        0x1ae0 => "Google",
        _ => "unknown vendor",
    }
}

/// Device-local memory of a Vulkan adapter: the sum of its DEVICE_LOCAL heaps, read through
/// wgpu-hal. Other backends report nothing wgpu can reach.
pub(super) fn adapter_memory(adapter: &wgpu::Adapter) -> Option<u64> {
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
/// APIs before GL, then SwiftShader after any other adapter it ties with.
fn adapter_key(
    a: &wgpu::Adapter,
    memory: Option<u64>,
) -> ((u32, std::cmp::Reverse<u64>, u32), bool) {
    let i = a.get_info();
    (
        rank(i.device_type, i.backend, memory),
        is_swiftshader(&i.name),
    )
}

/// Google's SwiftShader (Chromium's software Vulkan driver): where it is installed beside
/// lavapipe (VK_ADD_DRIVER_FILES; the test suite does this), both are CPU adapters with the
/// same 2 GiB heap, and SwiftShader is several times slower, so lavapipe wins the tie. Chosen
/// alone (VK_ICD_FILENAMES) or by name (FITGRAD_ADAPTER=swiftshader) it is used as any other.
fn is_swiftshader(name: &str) -> bool {
    name.to_ascii_lowercase().contains("swiftshader")
}

/// The sort key of an adapter; lower is better: discrete, integrated, virtual, then software.
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

/// A wgpu instance over `backends`.
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

    /// The best adapter that `options` (filled from the environment) allow.
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
}
