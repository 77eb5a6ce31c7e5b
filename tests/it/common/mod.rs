//! Shared helpers of the integration tests: the devices to run on, plain-loop CPU references,
//! host data generation and tolerant comparison.
//!
//! The test binary (tests/it) declares this module once; each area uses a different part of it,
//! hence the `dead_code` allowance.
#![allow(dead_code)]

pub mod budget_figure;
pub mod gradcheck;
pub mod kill;
pub mod lora;
pub mod report_run;

use fitgrad::{DType, Device, DeviceOptions, Tensor};
use half::f16;
use std::io::Write;
use std::sync::OnceLock;

// ---------------------------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------------------------

/// Backends tried when FITGRAD_BACKEND is not set.
const BACKENDS: [&str; 4] = ["vulkan", "gl", "metal", "dx12"];

fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Writes to the process's stderr directly: `eprintln!` inside a test is captured by the test
/// harness and only shown when the test fails, and these lines must reach the CI log.
fn log(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{msg}");
}

fn no_device_message(detail: &str) -> String {
    format!(
        "no GPU adapter found under CI=true; install mesa-vulkan-drivers \
         (apt-get install mesa-vulkan-drivers libegl1 libegl-mesa0 libgl1-mesa-dri). {detail}"
    )
}

/// What to do when no adapter was found: fail under CI, skip loudly elsewhere.
fn no_device(detail: &str) {
    if under_ci() {
        panic!("{}", no_device_message(detail));
    }
    log(&format!(
        "\n*** SKIPPED: no GPU adapter found ({detail}). Install mesa-vulkan-drivers to run the \
         GPU tests; under CI=true this is a failure. ***\n"
    ));
}

/// Mesa's CPU drivers (lavapipe, llvmpipe) compile every pipeline with LLVM, and on a machine
/// whose shader cache is still empty (a fresh CI machine) that compile is most of the tests'
/// time. The tests' shapes are small, so LLVM's optimization passes cost far more than they
/// save; `GALLIVM_PERF=nopt` skips them (the same WGSL, naga
/// output and driver path, unoptimized machine code; docs/design-notes.md has the figures). Set here,
/// before the first adapter is opened (Mesa reads it then), in the test processes only: examples
/// and benchmarks run optimized. A `GALLIVM_PERF` already set (even empty) is left as it is.
fn quick_driver_compiles() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("GALLIVM_PERF").is_none() {
            std::env::set_var("GALLIVM_PERF", "nopt");
        }
    });
    add_swiftshader();
}

/// Google's SwiftShader, a second Vulkan driver with a compiler of its own (Debian's `chromium`
/// package ships it); the suite runs on it as `::vulkan_swiftshader` under
/// FITGRAD_TEST_SWIFTSHADER=1 (it is several times slower than lavapipe, so the README's plain
/// `cargo test` leaves it out; CI runs it in a step of its own).
pub const SWIFTSHADER_ICD: &str = "/usr/lib/chromium/vk_swiftshader_icd.json";

/// Whether this run asked for SwiftShader as one more adapter: FITGRAD_TEST_SWIFTSHADER=1, and
/// no FITGRAD_BACKEND or Vulkan driver list of the user's (VK_ICD_FILENAMES, VK_DRIVER_FILES),
/// which choose the adapters themselves.
fn swiftshader_wanted() -> bool {
    let set = |v: &str| std::env::var_os(v).is_some_and(|s| !s.is_empty());
    std::env::var("FITGRAD_TEST_SWIFTSHADER").is_ok_and(|v| v == "1")
        && !set("FITGRAD_BACKEND")
        && !set("VK_ICD_FILENAMES")
        && !set("VK_DRIVER_FILES")
}

/// Adds SwiftShader's ICD to the drivers the Vulkan loader loads (VK_ADD_DRIVER_FILES, read when
/// an instance is created), once, before the first adapter is opened, when it is wanted and
/// installed. Every instance of the process then sees it beside lavapipe; the crate ranks it
/// after an adapter it ties with, so `Device::new()` keeps choosing lavapipe (or the GPU) and
/// only the `vulkan_swiftshader` device, chosen by name, runs on it.
fn add_swiftshader() -> bool {
    static ADDED: OnceLock<bool> = OnceLock::new();
    *ADDED.get_or_init(|| {
        if !swiftshader_wanted() || !std::path::Path::new(SWIFTSHADER_ICD).exists() {
            return false;
        }
        let list = match std::env::var("VK_ADD_DRIVER_FILES") {
            Ok(old) if !old.is_empty() => format!("{old}:{SWIFTSHADER_ICD}"),
            _ => SWIFTSHADER_ICD.to_string(),
        };
        std::env::set_var("VK_ADD_DRIVER_FILES", list);
        true
    })
}

/// A short label for a device: backend plus f16 mode, e.g. "vulkan/f16-native".
pub fn label(dev: &Device) -> String {
    let info = dev.info();
    format!(
        "{}/{} ({})",
        info.adapter.backend,
        if info.f16_native {
            "f16-native"
        } else {
            "f16-packed"
        },
        info.adapter.name
    )
}

/// The key a per-backend test is named by: the backend ("vulkan", "gl", ...), with
/// "_f16_packed" for the forced-packed twin of a device with native f16.
fn key(backend: &str, forced_packed: bool) -> String {
    if forced_packed {
        format!("{backend}_f16_packed")
    } else {
        backend.to_string()
    }
}

/// The devices with their keys, or (under CI=true, when there are none) the message to fail
/// with.
fn open_all() -> Result<Vec<(String, Device)>, String> {
    quick_driver_compiles();
    let mut devs: Vec<(String, Device)> = Vec::new();
    let mut failures = Vec::new();
    let env_backend = std::env::var("FITGRAD_BACKEND")
        .ok()
        .filter(|s| !s.is_empty());
    if let Some(b) = &env_backend {
        match Device::new() {
            Ok(d) => devs.push((key(&d.info().adapter.backend.clone(), false), d)),
            Err(e) => failures.push(format!("FITGRAD_BACKEND={b}: {e}")),
        }
    } else {
        for b in BACKENDS {
            match Device::with_options(DeviceOptions::default().backend(b)) {
                Ok(d) => devs.push((key(b, false), d)),
                Err(e) => failures.push(format!("{b}: {e}")),
            }
        }
    }
    // SwiftShader, chosen by name, where it was asked for (and is not already the Vulkan
    // adapter: a machine without lavapipe or a GPU).
    if add_swiftshader() {
        let vulkan_is_it = devs.iter().any(|(k, d)| {
            k == "vulkan" && d.info().adapter.name.to_lowercase().contains("swiftshader")
        });
        if !vulkan_is_it {
            match Device::with_options(
                DeviceOptions::default()
                    .backend("vulkan")
                    .adapter("swiftshader"),
            ) {
                Ok(d) => devs.push(("vulkan_swiftshader".into(), d)),
                Err(e) => failures.push(format!("vulkan_swiftshader: {e}")),
            }
        }
    } else if swiftshader_wanted() && under_ci() {
        return Err(format!(
            "FITGRAD_TEST_SWIFTSHADER=1 under CI=true, but {SWIFTSHADER_ICD} is missing \
             (apt-get install chromium)"
        ));
    }
    // The packed f16 path on adapters that would otherwise compute in f16.
    let natives: Vec<String> = devs
        .iter()
        .filter(|(k, _)| k != "vulkan_swiftshader")
        .filter(|(_, d)| d.info().f16_native)
        .map(|(_, d)| d.info().adapter.backend.clone())
        .collect();
    for backend in natives {
        match Device::with_options(
            DeviceOptions::default()
                .backend(backend.clone())
                .force_packed_f16(true),
        ) {
            Ok(d) => devs.push((key(&backend, true), d)),
            Err(e) => failures.push(format!("{backend} with force_packed_f16: {e}")),
        }
    }
    if swiftshader_wanted() && under_ci() && !devs.iter().any(|(k, _)| k == "vulkan_swiftshader") {
        if let Some(f) = failures
            .iter()
            .find(|f| f.starts_with("vulkan_swiftshader"))
        {
            return Err(format!("FITGRAD_TEST_SWIFTSHADER=1 under CI=true: {f}"));
        }
    }
    if devs.is_empty() {
        let detail = failures.join("; ");
        if under_ci() {
            return Err(no_device_message(&detail));
        }
        no_device(&detail);
    }
    for (_, d) in &devs {
        log(&format!(
            "fitgrad test device [{}]\n{}\n",
            label(d),
            d.info()
        ));
    }
    Ok(devs)
}

/// One shared device per backend this machine offers (plus a forced-packed-f16 twin of every
/// device with native f16), opened once per test process. Empty (after a loud SKIPPED) when the
/// machine has no adapter and CI is not "true"; panics under CI=true.
pub fn devices() -> Vec<Device> {
    keyed_devices().into_iter().map(|(_, d)| d).collect()
}

fn keyed_devices() -> Vec<(String, Device)> {
    // The outcome is kept either way, so adapters are enumerated once per test process.
    static DEVICES: OnceLock<Result<Vec<(String, Device)>, String>> = OnceLock::new();
    match DEVICES.get_or_init(open_all) {
        Ok(devs) => devs.clone(),
        Err(msg) => panic!("{msg}"),
    }
}

/// The dtypes worth testing a kernel in on `dev`: f32 and f16, except on a forced-packed-f16
/// twin, where only f16 differs (an f32 kernel is the same shader as on the native device, and
/// a software adapter would compile it again for nothing).
pub fn dtypes(dev: &Device) -> &'static [DType] {
    let info = dev.info();
    let twin = !info.f16_native
        && keyed_devices().iter().any(|(_, d)| {
            d.info().f16_native
                && d.info().adapter.wgpu_backend == info.adapter.wgpu_backend
                && d.info().adapter.name == info.adapter.name
        });
    if twin {
        &[DType::F16]
    } else {
        &[DType::F32, DType::F16]
    }
}

/// The dtype a random case tests on `dev` when it draws `f16` (see [`dtypes`]: always f16 on a
/// forced-packed twin).
pub fn dtype_for(dev: &Device, f16: bool) -> DType {
    let d = dtypes(dev);
    d[usize::from(f16) % d.len()]
}

/// Runs `test` on the shared device of backend `key` (see [`device_tests!`]). When this machine
/// has no such adapter the test is skipped loudly; when it has no adapter at all, that is a
/// failure under CI=true (as for [`devices`]).
pub fn run_on(key: &str, test: fn(&Device)) {
    let devs = keyed_devices();
    match devs.iter().find(|(k, _)| k == key) {
        Some((_, d)) => test(d),
        None if devs.is_empty() => {} // already reported by open_all
        None if key == "vulkan_swiftshader" && !swiftshader_wanted() => {
            log("*** SKIPPED on vulkan_swiftshader: set FITGRAD_TEST_SWIFTSHADER=1 to open it ***")
        }
        None => log(&format!(
            "*** SKIPPED on {key}: this machine has no such adapter (it has {}) ***",
            devs.iter()
                .map(|(k, _)| k.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// One `#[test]` per backend for each named `fn(&Device)`, so a failure names the adapter:
/// `device_tests!(matmul_matches_reference)` defines `matmul_matches_reference::vulkan`,
/// `::vulkan_f16_packed`, `::gl` and `::vulkan_swiftshader` (see [`SWIFTSHADER_ICD`]; plus `::metal` on macOS and `::dx12` on Windows), each
/// running the function on that backend's shared device (skipped loudly where the machine has
/// no such adapter). A property test goes inside the function with proptest's closure form:
/// `proptest!(ProptestConfig::with_cases(16), |(dims in strat::shape())| { ... });`.
#[allow(unused_macros)]
macro_rules! device_tests {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn vulkan() {
                $crate::common::run_on("vulkan", super::$name)
            }
            #[test]
            fn vulkan_f16_packed() {
                $crate::common::run_on("vulkan_f16_packed", super::$name)
            }
            #[test]
            fn gl() {
                $crate::common::run_on("gl", super::$name)
            }
            // Opt-in (several times slower than lavapipe): shown as ignored in a plain run,
            // never as passed.
            #[test]
            #[ignore = "SwiftShader: FITGRAD_TEST_SWIFTSHADER=1 cargo test -- --include-ignored"]
            fn vulkan_swiftshader() {
                $crate::common::run_on("vulkan_swiftshader", super::$name)
            }
            #[cfg(target_os = "macos")]
            #[test]
            fn metal() {
                $crate::common::run_on("metal", super::$name)
            }
            #[cfg(windows)]
            #[test]
            fn dx12() {
                $crate::common::run_on("dx12", super::$name)
            }
        }
    )*};
}
#[allow(unused_imports)]
pub(crate) use device_tests;

/// A device of its own (its own arena), for tests that look at memory statistics. Honours
/// FITGRAD_BACKEND through `Device::with_options`. `None` (after a loud SKIPPED) when there is no
/// adapter and CI is not "true".
pub fn fresh_device(opts: DeviceOptions) -> Option<Device> {
    quick_driver_compiles();
    match Device::with_options(opts) {
        Ok(d) => Some(d),
        Err(e) => {
            no_device(&e.to_string());
            None
        }
    }
}

/// A device of its own (its arena's statistics are the test's alone) with `budget`.
pub fn fresh_with_budget(budget: Option<u64>) -> Option<Device> {
    let mut opts = DeviceOptions::default();
    opts.memory_budget = budget;
    fresh_device(opts)
}

/// Every parameter of `m`, read back as f32.
pub fn param_values<M: fitgrad::nn::Module>(m: &M) -> Vec<Vec<f32>> {
    m.parameters()
        .iter()
        .map(|p| p.to_vec_f32().unwrap())
        .collect()
}

/// max over tensors of max |a - b| / max |b| (each tensor scaled by its largest value).
pub fn worst_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let mut worst = 0.0f64;
    for (wa, wb) in a.iter().zip(b) {
        let scale = wb
            .iter()
            .fold(0.0f64, |m, v| m.max(v.abs() as f64))
            .max(1e-30);
        for (x, y) in wa.iter().zip(wb) {
            worst = worst.max((*x as f64 - *y as f64).abs() / scale);
        }
    }
    worst
}

// ---------------------------------------------------------------------------------------------
// Host data
// ---------------------------------------------------------------------------------------------

/// SplitMix64, for test data (independent of the crate's own generator).
pub struct HostRng(u64);

impl HostRng {
    pub fn new(seed: u64) -> Self {
        HostRng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }
}

/// `n` values uniform in [lo, hi).
pub fn host_data(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut r = HostRng::new(seed);
    (0..n).map(|_| r.uniform(lo, hi)).collect()
}

/// `n` values with magnitude in [lo, hi) and a random sign (never near zero: divisors).
pub fn host_data_away_from_zero(seed: u64, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    let mut r = HostRng::new(seed);
    (0..n)
        .map(|_| {
            let m = r.uniform(lo, hi);
            if r.next_u64() & 1 == 0 {
                m
            } else {
                -m
            }
        })
        .collect()
}

pub fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// f32 -> f16 -> f32 (round to nearest even, as `half` does).
pub fn round_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

pub fn round_f16_all(xs: &[f32]) -> Vec<f32> {
    xs.iter().map(|&x| round_f16(x)).collect()
}

/// The host data as the tensor of `dtype` will hold it (rounded through f16 for f16).
pub fn as_dtype(xs: &[f32], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::F32 => xs.to_vec(),
        DType::F16 => round_f16_all(xs),
    }
}

/// A tensor of `dtype` holding `xs` (rounded through half::f16 for f16).
pub fn upload(dev: &Device, xs: &[f32], dims: &[usize], dtype: DType) -> Tensor {
    let t = match dtype {
        DType::F32 => Tensor::from_slice(dev, xs, dims),
        DType::F16 => {
            let h: Vec<f16> = xs.iter().map(|&x| f16::from_f32(x)).collect();
            Tensor::from_slice(dev, &h, dims)
        }
    };
    t.unwrap_or_else(|e| panic!("upload of {dims:?} {dtype} on {}: {e}", label(dev)))
}

/// Reads a tensor back as f32, checking its dtype and dims first.
pub fn download(t: &Tensor, dims: &[usize], dtype: DType) -> Result<Vec<f32>, String> {
    if t.dims() != dims {
        return Err(format!("result dims {:?}, expected {dims:?}", t.dims()));
    }
    if t.dtype() != dtype {
        return Err(format!("result dtype {}, expected {dtype}", t.dtype()));
    }
    t.to_vec_f32().map_err(|e| format!("readback failed: {e}"))
}

// ---------------------------------------------------------------------------------------------
// CPU references (plain loops, nothing clever)
// ---------------------------------------------------------------------------------------------

/// Row-major strides of `dims`.
pub fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; dims.len()];
    let mut acc = 1usize;
    for i in (0..dims.len()).rev() {
        s[i] = acc;
        acc *= dims[i];
    }
    s
}

/// numpy broadcasting of two shapes; `None` when they do not fit.
pub fn broadcast_dims(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0usize; rank];
    for (k, o) in out.iter_mut().enumerate() {
        // k counts from the left of the output; dims are aligned on the right.
        let da = if k + a.len() >= rank {
            a[k + a.len() - rank]
        } else {
            1
        };
        let db = if k + b.len() >= rank {
            b[k + b.len() - rank]
        } else {
            1
        };
        *o = if da == db {
            da
        } else if da == 1 {
            db
        } else if db == 1 {
            da
        } else {
            return None;
        };
    }
    Some(out)
}

/// Linear index into a tensor of `dims` for the output multi-index `idx` (of rank >= dims.len()),
/// with broadcast dims (size 1) pinned to 0.
fn broadcast_index(idx: &[usize], dims: &[usize]) -> usize {
    let st = strides(dims);
    let shift = idx.len() - dims.len();
    let mut off = 0;
    for i in 0..dims.len() {
        let j = if dims[i] == 1 { 0 } else { idx[i + shift] };
        off += j * st[i];
    }
    off
}

/// Multi-index of linear index `lin` in `dims`.
fn unravel(mut lin: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for i in (0..dims.len()).rev() {
        idx[i] = lin % dims[i];
        lin /= dims[i];
    }
    idx
}

/// `f(a, b)` with numpy broadcasting; returns the values and the output dims.
pub fn ref_binary(
    a: &[f32],
    ad: &[usize],
    b: &[f32],
    bd: &[usize],
    f: impl Fn(f32, f32) -> f32,
) -> (Vec<f32>, Vec<usize>) {
    let od = broadcast_dims(ad, bd).expect("reference: shapes do not broadcast");
    let n = numel(&od);
    let mut out = Vec::with_capacity(n);
    for lin in 0..n {
        let idx = unravel(lin, &od);
        out.push(f(
            a[broadcast_index(&idx, ad)],
            b[broadcast_index(&idx, bd)],
        ));
    }
    (out, od)
}

/// `f(x)` for every element.
pub fn ref_unary(x: &[f32], f: impl Fn(f32) -> f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for &v in x {
        out.push(f(v));
    }
    out
}

/// torch.relu: negative values become 0, NaN stays NaN.
pub fn relu(x: f32) -> f32 {
    if x < 0.0 {
        0.0
    } else {
        x
    }
}

/// Sum of every element, accumulated in f64.
pub fn ref_sum(x: &[f32]) -> f64 {
    let mut acc = 0.0f64;
    for &v in x {
        acc += v as f64;
    }
    acc
}

/// Sum (or mean) along `axis` with f64 accumulation; returns values and output dims. The mean
/// of an empty axis is NaN.
pub fn ref_reduce_axis(
    x: &[f32],
    dims: &[usize],
    axis: usize,
    keepdim: bool,
    mean: bool,
) -> (Vec<f32>, Vec<usize>) {
    let outer: usize = dims[..axis].iter().product();
    let len = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = 0.0f64;
            for k in 0..len {
                acc += x[(o * len + k) * inner + i] as f64;
            }
            out.push(if mean {
                (acc / len as f64) as f32
            } else {
                acc as f32
            });
        }
    }
    let mut od = dims.to_vec();
    if keepdim {
        od[axis] = 1;
    } else {
        od.remove(axis);
    }
    (out, od)
}

/// Sum of |x| along `axis` (the scale of a reduction's rounding error).
pub fn ref_abs_sum_axis(x: &[f32], dims: &[usize], axis: usize) -> Vec<f32> {
    let abs: Vec<f32> = x.iter().map(|v| v.abs()).collect();
    ref_reduce_axis(&abs, dims, axis, true, false).0
}

/// Swaps the last two dims (rank >= 2).
pub fn ref_transpose(x: &[f32], dims: &[usize]) -> (Vec<f32>, Vec<usize>) {
    let k = dims.len();
    assert!(k >= 2, "reference transpose needs rank >= 2");
    let (r, c) = (dims[k - 2], dims[k - 1]);
    let batch: usize = dims[..k - 2].iter().product();
    let mut out = vec![0.0f32; x.len()];
    for b in 0..batch {
        for i in 0..r {
            for j in 0..c {
                out[b * r * c + j * r + i] = x[b * r * c + i * c + j];
            }
        }
    }
    let mut od = dims.to_vec();
    od.swap(k - 2, k - 1);
    (out, od)
}

// ---------------------------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------------------------

/// Distance between `x` and the next f16 away from zero (the f16 ulp at `x`).
pub fn f16_ulp(x: f32) -> f32 {
    let h = f16::from_f32(x.abs());
    if !h.is_finite() {
        return 0.0;
    }
    let next = f16::from_bits(h.to_bits() + 1);
    if next.is_finite() {
        next.to_f32() - h.to_f32()
    } else {
        h.to_f32() - f16::from_bits(h.to_bits() - 1).to_f32()
    }
}

/// Tolerance: |got - want| <= abs + rel * |want| + ulps * f16_ulp(want).
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub abs: f32,
    pub rel: f32,
    pub f16_ulps: f32,
}

impl Tol {
    pub const EXACT: Tol = Tol {
        abs: 0.0,
        rel: 0.0,
        f16_ulps: 0.0,
    };

    /// For elementwise results of `dtype` (reference computed from the rounded inputs and, for
    /// f16, rounded to f16).
    pub fn elementwise(dtype: DType) -> Tol {
        match dtype {
            DType::F32 => Tol {
                abs: 1e-6,
                rel: 1e-6,
                f16_ulps: 0.0,
            },
            DType::F16 => Tol {
                abs: 1e-6,
                rel: 1e-3,
                f16_ulps: 2.0,
            },
        }
    }
}

/// Both NaN, equal (including infinities of one sign), or within `tol(i)`.
fn close(got: f32, want: f32, tol: f32) -> bool {
    if want.is_nan() || got.is_nan() {
        return want.is_nan() && got.is_nan();
    }
    if got == want {
        return true;
    }
    if want.is_infinite() || got.is_infinite() {
        return false;
    }
    ((got - want).abs() as f64) <= tol as f64
}

/// Compares element by element with a per-element absolute tolerance; the error names the
/// first mismatch (index, values, tolerance) and how many elements differ.
pub fn check_close_by(
    what: &str,
    got: &[f32],
    want: &[f32],
    tol: impl Fn(usize) -> f32,
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: got {} values, expected {}",
            got.len(),
            want.len()
        ));
    }
    let mut first = None;
    let mut bad = 0usize;
    for i in 0..got.len() {
        let t = tol(i);
        if !close(got[i], want[i], t) {
            bad += 1;
            if first.is_none() {
                first = Some((i, got[i], want[i], t));
            }
        }
    }
    match first {
        None => Ok(()),
        Some((i, g, w, t)) => Err(format!(
            "{what}: {bad} of {} values differ; first at index {i}: got {g:?}, expected {w:?} \
             (|diff| {:e}, tolerance {t:e})",
            got.len(),
            (g - w).abs()
        )),
    }
}

/// Compares with `tol` (abs + rel + f16 ulps).
pub fn check_close(what: &str, got: &[f32], want: &[f32], tol: Tol) -> Result<(), String> {
    check_close_by(what, got, want, |i| {
        let w = want[i].abs();
        if w.is_finite() {
            tol.abs + tol.rel * w + tol.f16_ulps * f16_ulp(w)
        } else {
            0.0 // NaN and infinities must match exactly
        }
    })
}

/// [`check_close`] that panics.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: Tol) {
    if let Err(e) = check_close(what, got, want, tol) {
        panic!("{e}");
    }
}

/// The reference in the result's dtype: f16 results are compared with the rounded reference.
pub fn expect_in(want: Vec<f32>, dtype: DType) -> Vec<f32> {
    as_dtype(&want, dtype)
}

// ---------------------------------------------------------------------------------------------
// Shapes for proptest
// ---------------------------------------------------------------------------------------------

pub mod strategies {
    use proptest::prelude::*;

    /// Elements a generated tensor may have at most (lavapipe is a slow software GPU).
    pub const MAX_NUMEL: usize = 20_000;

    /// One dim: mostly small, often 1, sometimes 0 (empty), sometimes around the 256- and
    /// 512-element workgroup sizes or long.
    pub fn dim() -> impl Strategy<Value = usize> {
        prop_oneof![
            3 => Just(1usize),
            5 => 2usize..9,
            3 => 9usize..40,
            2 => prop::sample::select(vec![63usize, 64, 65, 100, 255, 256, 257, 511, 512, 513, 1000, 1025]),
            1 => Just(0usize),
        ]
    }

    /// Halves the largest dim until the element count is at most `max` (keeps odd sizes odd
    /// often enough: 513 -> 256 -> 128, 1025 -> 512, 257 -> 128, 17 -> 8). An empty dim counts
    /// as 1: a reduction over it fills the other dims (a sum over the 0 of [63, 0, 1000, 1000]
    /// has 63M elements).
    pub fn cap(mut dims: Vec<usize>, max: usize) -> Vec<usize> {
        let numel = |d: &[usize]| d.iter().map(|&n| n.max(1)).product::<usize>();
        while numel(&dims) > max {
            let (i, _) = dims
                .iter()
                .enumerate()
                .max_by_key(|(_, &d)| d)
                .expect("a rank-0 shape has one element");
            dims[i] = (dims[i] / 2) | 1;
            if dims[i] == 1 && numel(&dims) > max {
                // Cannot happen with max >= 1, but never loop forever.
                break;
            }
        }
        dims
    }

    /// A shape of rank `lo..=hi` with at most MAX_NUMEL elements (rank 0, a single case, half
    /// as likely as each other rank).
    pub fn shape_rank(lo: usize, hi: usize) -> impl Strategy<Value = Vec<usize>> {
        let ranks: Vec<usize> = [0, 1, 1, 2, 2, 3, 3, 4, 4]
            .into_iter()
            .filter(|r| (lo..=hi).contains(r))
            .collect();
        prop::sample::select(ranks)
            .prop_flat_map(|rank| prop::collection::vec(dim(), rank))
            .prop_map(|d| cap(d, MAX_NUMEL))
    }

    /// A shape of rank 0..=4.
    pub fn shape() -> impl Strategy<Value = Vec<usize>> {
        shape_rank(0, 4)
    }

    /// Two shapes that broadcast together: both derived from one output shape by dropping
    /// leading dims and setting dims to 1 (so either side, or both, may broadcast).
    pub fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
        (shape(), any::<u64>()).prop_map(|(out, bits)| {
            let rank = out.len();
            let derive = |bits: u64| -> Vec<usize> {
                // Low 3 bits: how many leading dims to drop; then one bit per dim: set to 1.
                let drop = ((bits & 7) as usize) % (rank + 1);
                let drop = if bits & 8 == 0 { 0 } else { drop };
                out[drop..]
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| if (bits >> (4 + i)) & 3 == 0 { 1 } else { d })
                    .collect()
            };
            (derive(bits), derive(bits >> 16))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// CPU references of the activations, softmax family, max / argmax and cross-entropy (f64 inside,
// plain loops)
// ---------------------------------------------------------------------------------------------

/// torch.tanh in f64.
pub fn ref_tanh(x: f32) -> f32 {
    (x as f64).tanh() as f32
}

/// torch gelu with approximate="tanh", in f64.
pub fn ref_gelu(x: f32) -> f32 {
    let x = x as f64;
    let u = 0.797_884_560_802_865_4 * (x + 0.044715 * x * x * x);
    (0.5 * x * (1.0 + u.tanh())) as f32
}

/// 1 / (1 + exp(-x)) in f64.
pub fn ref_sigmoid(x: f32) -> f32 {
    let x = x as f64;
    (1.0 / (1.0 + (-x).exp())) as f32
}

pub fn ref_exp(x: f32) -> f32 {
    (x as f64).exp() as f32
}

/// NaN below 0, -inf at 0 (C's log).
pub fn ref_log(x: f32) -> f32 {
    (x as f64).ln() as f32
}

/// NaN below 0, -0 at -0 (C's sqrt).
pub fn ref_sqrt(x: f32) -> f32 {
    (x as f64).sqrt() as f32
}

/// C's pow (which torch follows): x^0 = 1 even for NaN, negative bases need integer exponents.
pub fn ref_pow(x: f32, p: f32) -> f32 {
    (x as f64).powf(p as f64) as f32
}

/// torch.clamp(x, lo, hi): NaN stays NaN; lo > hi gives hi.
pub fn ref_clamp(x: f32, lo: f32, hi: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let y = if x < lo { lo } else { x };
    if y > hi {
        hi
    } else {
        y
    }
}

/// Softmax (or log-softmax) of every row of length `c`, in f64 with the max subtracted, as torch
/// defines it: x - max, exp, sum, divide. A row that is all -inf, or holds NaN or +inf, is NaN.
pub fn ref_softmax(x: &[f32], c: usize, log: bool) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    if c == 0 {
        return out;
    }
    for row in x.chunks(c) {
        let mut m = f64::NEG_INFINITY;
        let mut nan = false;
        for &v in row {
            if v.is_nan() {
                nan = true;
            }
            if (v as f64) > m {
                m = v as f64;
            }
        }
        let mut s = 0.0f64;
        for &v in row {
            s += (v as f64 - m).exp();
        }
        for &v in row {
            let d = v as f64 - m;
            let y = if log { d - s.ln() } else { d.exp() / s };
            out.push(if nan { f32::NAN } else { y as f32 });
        }
    }
    out
}

/// Max and first argmax along `axis` (NaN counts as the largest, the first NaN wins, ties go to
/// the first index); returns (values, indices as f32, output dims). The axis must not be empty.
pub fn ref_max_axis(
    x: &[f32],
    dims: &[usize],
    axis: usize,
    keepdim: bool,
) -> (Vec<f32>, Vec<f32>, Vec<usize>) {
    let outer: usize = dims[..axis].iter().product();
    let len = dims[axis];
    let inner: usize = dims[axis + 1..].iter().product();
    assert!(len > 0, "reference max over an empty axis");
    let mut vals = Vec::with_capacity(outer * inner);
    let mut idx = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let mut best = x[o * len * inner + i];
            let mut bi = 0usize;
            for k in 1..len {
                let v = x[(o * len + k) * inner + i];
                if best.is_nan() {
                    break;
                }
                if v.is_nan() || v > best {
                    best = v;
                    bi = k;
                }
            }
            vals.push(best);
            idx.push(bi as f32);
        }
    }
    let mut od = dims.to_vec();
    if keepdim {
        od[axis] = 1;
    } else {
        od.remove(axis);
    }
    (vals, idx, od)
}

/// Mean cross-entropy of logits (b, c) against `targets`, and its gradient
/// (softmax - onehot) / b, in f64. The loss of an empty batch is NaN.
pub fn ref_cross_entropy(x: &[f32], b: usize, c: usize, targets: &[u32]) -> (f32, Vec<f32>) {
    let mut loss = 0.0f64;
    let mut grad = Vec::with_capacity(b * c);
    for r in 0..b {
        let row = &x[r * c..(r + 1) * c];
        let t = targets[r] as usize;
        let mut m = f64::NEG_INFINITY;
        for &v in row {
            m = m.max(v as f64);
        }
        let mut s = 0.0f64;
        for &v in row {
            s += (v as f64 - m).exp();
        }
        loss += m + s.ln() - row[t] as f64;
        for (j, &v) in row.iter().enumerate() {
            let hot = if j == t { 1.0 } else { 0.0 };
            grad.push((((v as f64 - m).exp() / s - hot) / b as f64) as f32);
        }
    }
    ((loss / b as f64) as f32, grad)
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

/// An optimizer choice for training tests.
#[derive(Clone, Copy, Debug)]
pub enum Opt {
    /// SGD with this learning rate and momentum (0: none).
    Sgd { lr: f32, momentum: f32 },
    /// AdamW with this learning rate, torch's defaults otherwise (betas 0.9, 0.999, eps 1e-8,
    /// weight decay 0.01).
    AdamW { lr: f32 },
}

impl Opt {
    pub fn lr(self) -> f32 {
        match self {
            Opt::Sgd { lr, .. } | Opt::AdamW { lr } => lr,
        }
    }

    pub fn build(self, params: Vec<Tensor>) -> Box<dyn fitgrad::optim::Optimizer> {
        use fitgrad::optim::{AdamW, Sgd};
        match self {
            Opt::Sgd { lr, momentum } => {
                let sgd = Sgd::new(params, lr).expect("valid SGD");
                if momentum > 0.0 {
                    Box::new(sgd.momentum(momentum).expect("valid momentum"))
                } else {
                    Box::new(sgd)
                }
            }
            Opt::AdamW { lr } => Box::new(AdamW::new(params, lr).expect("valid AdamW")),
        }
    }
}
