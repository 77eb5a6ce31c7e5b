//! The matmul autotuner: times the candidate kernels once per adapter and shape class, and
//! remembers the winner in memory and on disk.
//!
//! The disk cache is one text file per adapter (`<class>\t<variant>` lines) under
//! `$FITGRAD_CACHE_DIR`, else the platform's cache folder (`dirs::cache_dir()`: `$XDG_CACHE_HOME`
//! or `~/.cache` on Linux, `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on Windows) + `fitgrad`.
//! Its name is a 64-bit FNV-1a hash of the adapter name, backend, driver, driver info, native
//! f16 and the crate version, so a driver or fitgrad upgrade tunes again (FNV-1a, src/hash.rs:
//! std's `DefaultHasher` may change between Rust releases, which would orphan every cache file). It is rewritten atomically (temporary file, then rename). `FITGRAD_AUTOTUNE=0`
//! turns tuning off (the built-in choice is used); `FITGRAD_AUTOTUNE_BUDGET` bounds the seconds
//! one run spends tuning (default 15), so a first run on a CPU adapter, where every candidate
//! compiles for seconds, starts quickly and later runs finish the tuning.
//!
//! Diagnostics go through the `log` crate: each tuned class and its winner at `info`, a cache
//! that cannot be written at `warn`.
//!
//! The tuner knows no tensors: the caller hands it a closure that runs a variant on the real
//! operands, and the winners live in the device's extension slot of type [`TuneCache`]. Other
//! kernels with a tile to choose (conv2d's rows per invocation) tune through [`select_named`]:
//! their classes share the file, each prefixed with its kernel's name.

use super::{candidates, default_variant, Problem, Variant};
use crate::kernels::Storage;
use crate::{DType, Device, Error, Result};
use std::collections::HashMap;
use std::path::PathBuf;

/// Problems below this many flops are not worth timing: the built-in choice runs.
const TUNE_MIN_FLOPS: usize = 1 << 22;

/// The autotuner's key: problems in one class share a winner.
fn class_key(dev: &Device, pb: &Problem, dtype: DType) -> String {
    let b = |x: usize| x.next_power_of_two();
    format!(
        "{:?} ta{} tb{}{} m{} n{} k{} batched{} n4{} k4{}",
        Storage::of(dev, dtype),
        pb.trans_a as u8,
        pb.trans_b as u8,
        if pb.k_blocks { " kb" } else { "" },
        b(pb.m),
        b(pb.n),
        b(pb.k),
        (pb.batch > 1) as u8,
        pb.n.is_multiple_of(4) as u8,
        pb.k.is_multiple_of(4) as u8
    )
}

/// The variant for this problem on operands of `dtype`: the cached winner of its class, or (for
/// a problem big enough to be worth it, with tuning on) the fastest candidate timed now by
/// `run`, which runs a variant on the very operands into the output (the caller then overwrites
/// it).
pub(crate) fn select(
    dev: &Device,
    pb: &Problem,
    dtype: DType,
    mut run: impl FnMut(Variant) -> Result<()>,
) -> Result<Variant> {
    let fallback = default_variant(dev, pb, dtype);
    if pb.batch * pb.m * pb.n * pb.k * 2 < TUNE_MIN_FLOPS || !enabled() {
        return Ok(fallback);
    }
    let class = class_key(dev, pb, dtype);
    let path = cache_path(dev.info());
    if let Some(v) = dev
        .with_ext(|c: &mut TuneCache| c.get(path.as_ref(), &class))
        .and_then(|v| Variant::parse(&v))
    {
        return Ok(v);
    }
    // A candidate run onto the output would fold onto it once more: such a problem takes its
    // class's winner (the class leaves `onto` out) or the built-in choice.
    if pb.onto || !may_tune(dev) {
        return Ok(fallback);
    }
    // A class is tuned whole once started (a cut-short result would be no better next run),
    // so a run overruns its budget by at most one class.
    let start = std::time::Instant::now();
    let mut best = (f64::INFINITY, fallback);
    for cand in candidates(dev, pb, dtype) {
        if let Ok(t) = time_variant(dev, || run(cand)) {
            if t < best.0 {
                best = (t, cand);
            }
        }
    }
    let took = start.elapsed().as_secs_f64();
    dev.with_ext(|c: &mut TuneCache| {
        c.spent += took;
        c.put(path.as_ref(), class, best.1.name());
    });
    Ok(best.1)
}

/// The autotuner for a kernel other than the matmul: `class` is its shape class (prefixed with
/// the kernel's name, so classes of different kernels never meet), `names` its candidates as
/// the cache file spells them, `fallback` the index of the built-in choice and `flops` the
/// problem's size. Returns the index of the cached winner, of the fastest candidate timed now
/// by `run` (which runs candidate i on the real operands into the real output), or the
/// fallback (tuning off, a small problem, a planning device, the budget spent).
pub(crate) fn select_named(
    dev: &Device,
    class: String,
    flops: usize,
    names: &[String],
    fallback: usize,
    mut run: impl FnMut(usize) -> Result<()>,
) -> Result<usize> {
    if names.len() < 2 || flops < TUNE_MIN_FLOPS || !enabled() {
        return Ok(fallback);
    }
    let path = cache_path(dev.info());
    let cached = dev.with_ext(|c: &mut TuneCache| c.get(path.as_ref(), &class));
    if let Some(i) = cached.and_then(|v| names.iter().position(|n| *n == v)) {
        return Ok(i);
    }
    if !may_tune(dev) {
        return Ok(fallback);
    }
    let start = std::time::Instant::now();
    let mut best = (f64::INFINITY, fallback);
    for i in 0..names.len() {
        if let Ok(t) = time_variant(dev, || run(i)) {
            if t < best.0 {
                best = (t, i);
            }
        }
    }
    let took = start.elapsed().as_secs_f64();
    dev.with_ext(|c: &mut TuneCache| {
        c.spent += took;
        c.put(path.as_ref(), class, names[best.1].clone());
    });
    Ok(best.1)
}

/// Whether a class may be timed now: not while planning (a cached winner or the built-in
/// choice then), and not once this run's budget is spent (logged once).
fn may_tune(dev: &Device) -> bool {
    if dev.is_planning() {
        return false;
    }
    let budget = budget_seconds(dev);
    let spent = dev.with_ext(|c: &mut TuneCache| c.spent);
    if spent >= budget {
        // The budget is spent: the built-in choice, and the class is tuned in a later run.
        dev.with_ext(|c: &mut TuneCache| {
            if !c.budget_logged {
                c.budget_logged = true;
                log::info!(
                    "autotune: this run's tuning budget ({budget:.0} s, \
                     FITGRAD_AUTOTUNE_BUDGET) is spent; further shape classes use the built-in \
                     kernel choice now and are tuned in later runs"
                );
            }
        });
        return false;
    }
    true
}

/// Seconds of autotuning one device may spend per process before it stops starting new shape
/// classes (`FITGRAD_AUTOTUNE_BUDGET`, default [`DEFAULT_BUDGET_S`]): on a CPU adapter each
/// candidate kernel compiles for up to seconds, and a first run must not wait minutes for its
/// tuning. Classes left over run the built-in choice and are tuned by later runs.
fn budget_seconds(dev: &Device) -> f64 {
    // A CPU adapter compiles each candidate for seconds (one shape class costs tens of
    // seconds cold), more than a short run gains: tuning there is opt-in, and the built-in
    // choice carries the measured winners.
    let default = if dev.info().adapter.is_cpu() {
        0.0
    } else {
        DEFAULT_BUDGET_S
    };
    match env_settings() {
        Ok(env) => env.budget_s.unwrap_or(default),
        Err(e) => {
            log::warn!("{e}; using a budget of {default} s");
            default
        }
    }
}

/// The default tuning budget per device and process, in seconds.
const DEFAULT_BUDGET_S: f64 = 15.0;

/// Seconds one `run` of a variant takes: a warm-up run (which compiles the kernel), then the
/// median of 1 or, for quick kernels, 3 timed runs.
pub fn time_variant(dev: &Device, mut run: impl FnMut() -> Result<()>) -> Result<f64> {
    run()?;
    dev.sync()?;
    let mut times = Vec::new();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        run()?;
        dev.sync()?;
        times.push(t.elapsed().as_secs_f64());
        if times[0] > 0.05 {
            break;
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The winners of one adapter: a device's extension slot (see `Device::with_ext`), filled
/// from the disk cache on first use.
#[derive(Default)]
struct TuneCache {
    /// class -> the winner's name; `None` until the disk file was read.
    entries: Option<HashMap<String, String>>,
    /// Seconds spent tuning on this device in this process.
    spent: f64,
    /// Whether the spent budget was reported.
    budget_logged: bool,
}

/// Whether tuning is on (`FITGRAD_AUTOTUNE=0`, `off` or `false` turns it off). A value that
/// reads as neither leaves it on, with a warning (the examples refuse it up front through
/// [`env_settings`]).
fn enabled() -> bool {
    env_settings().map_or_else(
        |e| {
            log::warn!("{e}; autotuning stays on");
            true
        },
        |env| env.enabled,
    )
}

/// The autotuner's environment: `FITGRAD_AUTOTUNE` and `FITGRAD_AUTOTUNE_BUDGET`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AutotuneEnv {
    /// Whether tuning is on.
    pub enabled: bool,
    /// The tuning budget in seconds, when the environment sets one.
    pub budget_s: Option<f64>,
}

/// Reads `FITGRAD_AUTOTUNE` (unset, empty, 1 / on / true, or 0 / off / false, any case) and
/// `FITGRAD_AUTOTUNE_BUDGET` (seconds >= 0); any other value is an [`Error::InvalidArgument`]
/// naming the variable and what it takes. The one reading of both: the tuner uses it, and so
/// does `fitgrad::run::check_environment`.
pub fn env_settings() -> Result<AutotuneEnv> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let bad = |op: &'static str, v: &str, takes: &str| Error::InvalidArgument {
        op,
        reason: format!("{v:?} is not {takes}; set it so or unset it"),
    };
    let enabled = match var("FITGRAD_AUTOTUNE") {
        None => true,
        Some(v) => match v.trim().to_ascii_lowercase().as_str() {
            "1" | "on" | "true" => true,
            "0" | "off" | "false" => false,
            _ => return Err(bad("FITGRAD_AUTOTUNE", &v, "1, on, true, 0, off or false")),
        },
    };
    let budget_s = match var("FITGRAD_AUTOTUNE_BUDGET") {
        None => None,
        Some(v) => match v.trim().parse::<f64>() {
            Ok(b) if b.is_finite() && b >= 0.0 => Some(b),
            _ => {
                return Err(bad(
                    "FITGRAD_AUTOTUNE_BUDGET",
                    &v,
                    "a number of seconds >= 0 (e.g. 15)",
                ))
            }
        },
    };
    Ok(AutotuneEnv { enabled, budget_s })
}

/// `$FITGRAD_CACHE_DIR` when set and not empty, else the platform's cache folder + `fitgrad`.
fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("FITGRAD_CACHE_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("fitgrad")))
}

/// What identifies an adapter's timings: one field a line, so no two field lists run together.
fn adapter_key(info: &crate::DeviceInfo) -> String {
    let a = &info.adapter;
    format!(
        "{}\n{}\n{}\n{}\n{}\n{}",
        a.name,
        a.backend,
        a.driver,
        a.driver_info,
        env!("CARGO_PKG_VERSION"),
        info.f16_native
    )
}

/// The cache file of one adapter.
fn cache_path(info: &crate::DeviceInfo) -> Option<PathBuf> {
    let h = crate::hash::fnv1a(adapter_key(info).as_bytes());
    Some(cache_dir()?.join(format!("autotune-{h:016x}.txt")))
}

impl TuneCache {
    fn load(&mut self, path: Option<&PathBuf>) -> &mut HashMap<String, String> {
        self.entries.get_or_insert_with(|| {
            let text = path
                .and_then(|p| std::fs::read_to_string(p).ok())
                .unwrap_or_default();
            text.lines()
                .filter_map(|l| {
                    let (k, v) = l.split_once('\t')?;
                    Some((k.to_string(), v.to_string()))
                })
                .collect()
        })
    }

    /// The winner of `class`, reading the file at `path` first if this cache has not yet.
    pub fn get(&mut self, path: Option<&PathBuf>, class: &str) -> Option<String> {
        self.load(path).get(class).cloned()
    }

    /// Records the winner of a class just tuned and rewrites the file. A cache that cannot be
    /// written only costs a re-tune next time, so a write error is logged, not returned.
    pub fn put(&mut self, path: Option<&PathBuf>, class: String, v: String) {
        log::info!("autotune: shape class {class}: {v} wins");
        let map = self.load(path);
        map.insert(class, v);
        let Some(path) = path else { return };
        let mut lines: Vec<String> = map.iter().map(|(k, v)| format!("{k}\t{v}")).collect();
        lines.sort();
        if let Err(e) = crate::fsutil::write_atomic(path, (lines.join("\n") + "\n").as_bytes()) {
            log::warn!(
                "matmul autotune: cannot write the cache (it will tune again next run): {e}"
            );
        }
    }
}
