//! The matmul autotuner: times the candidate kernels once per adapter and shape class, and
//! remembers the winner in memory and on disk.
//!
//! The disk cache is one text file per adapter (`<class>\t<variant>` lines) under
//! `$FITGRAD_CACHE_DIR`, else the platform's cache folder (`dirs::cache_dir()`: `$XDG_CACHE_HOME`
//! or `~/.cache` on Linux, `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on Windows) + `fitgrad`.
//! Its name is a 64-bit FNV-1a hash of the adapter name, backend, driver, driver info, native
//! f16 and the crate version, so a driver or fitgrad upgrade tunes again; FNV-1a is written out
//! here because std's `DefaultHasher` may change between Rust releases, which would orphan every
//! cache file. It is rewritten atomically (temporary file, then rename). `FITGRAD_AUTOTUNE=0`
//! turns tuning off (the built-in choice is used).
//!
//! Diagnostics go through the `log` crate: each tuned class and its winner at `info`, a cache
//! that cannot be written at `warn`.

use super::matmul::Variant;
use std::collections::HashMap;
use std::path::PathBuf;

#[derive(Default)]
pub(crate) struct TuneCache {
    /// class -> winner; `None` until the disk file was read.
    entries: Option<HashMap<String, Variant>>,
}

/// Whether tuning is on (`FITGRAD_AUTOTUNE=0` or `off` turns it off).
pub(crate) fn enabled() -> bool {
    !matches!(
        std::env::var("FITGRAD_AUTOTUNE").as_deref(),
        Ok("0") | Ok("off") | Ok("false")
    )
}

/// `$FITGRAD_CACHE_DIR` when set and not empty, else the platform's cache folder + `fitgrad`.
fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("FITGRAD_CACHE_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("fitgrad")))
}

/// 64-bit FNV-1a: a fixed function of the bytes, the same on every Rust release and platform.
fn fnv1a(bytes: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    bytes
        .iter()
        .fold(OFFSET, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME))
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
pub(crate) fn cache_path(info: &crate::DeviceInfo) -> Option<PathBuf> {
    let h = fnv1a(adapter_key(info).as_bytes());
    Some(cache_dir()?.join(format!("autotune-{h:016x}.txt")))
}

impl TuneCache {
    fn load(&mut self, path: Option<&PathBuf>) -> &mut HashMap<String, Variant> {
        self.entries.get_or_insert_with(|| {
            let text = path
                .and_then(|p| std::fs::read_to_string(p).ok())
                .unwrap_or_default();
            text.lines()
                .filter_map(|l| {
                    let (k, v) = l.split_once('\t')?;
                    Some((k.to_string(), Variant::parse(v)?))
                })
                .collect()
        })
    }

    pub fn get(&mut self, path: Option<&PathBuf>, class: &str) -> Option<Variant> {
        self.load(path).get(class).copied()
    }

    /// Records the winner of a class just tuned and rewrites the file. A cache that cannot be
    /// written only costs a re-tune next time, so a write error is logged, not returned.
    pub fn put(&mut self, path: Option<&PathBuf>, class: String, v: Variant) {
        log::info!("matmul autotune: shape class {class}: {} wins", v.name());
        let map = self.load(path);
        map.insert(class, v);
        let Some(path) = path else { return };
        let mut lines: Vec<String> = map
            .iter()
            .map(|(k, v)| format!("{k}\t{}", v.name()))
            .collect();
        lines.sort();
        if let Err(e) = crate::fsutil::write_atomic(path, (lines.join("\n") + "\n").as_bytes()) {
            log::warn!(
                "matmul autotune: cannot write the cache (it will tune again next run): {e}"
            );
        }
    }
}

impl Variant {
    /// A stable text form (cache files, benchmark reports).
    pub fn name(&self) -> String {
        match *self {
            Variant::Naive => "naive".into(),
            Variant::Reg { tm, tn, wg_x, wg_y } => format!("reg-{tm}x{tn}-{wg_x}x{wg_y}"),
            Variant::Tiled { bm, bn, bk } => format!("tiled-{bm}x{bn}x{bk}"),
            Variant::Subgroup { sg, tm, tn, wgs } => format!("sg{sg}-{tm}x{tn}-{wgs}"),
        }
    }

    pub fn parse(s: &str) -> Option<Variant> {
        let nums =
            |t: &str| -> Option<Vec<u32>> { t.split(['x', '-']).map(|n| n.parse().ok()).collect() };
        if s == "naive" {
            return Some(Variant::Naive);
        }
        if let Some(rest) = s.strip_prefix("reg-") {
            if let [tm, tn, wg_x, wg_y] = nums(rest)?[..] {
                return Some(Variant::Reg { tm, tn, wg_x, wg_y });
            }
        }
        if let Some(rest) = s.strip_prefix("sg") {
            if let [sg, tm, tn, wgs] = nums(rest)?[..] {
                return Some(Variant::Subgroup { sg, tm, tn, wgs });
            }
        }
        if let Some(rest) = s.strip_prefix("tiled-") {
            if let [bm, bn, bk] = nums(rest)?[..] {
                return Some(Variant::Tiled { bm, bn, bk });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_is_the_published_function() {
        // The reference vectors of the FNV specification (64-bit FNV-1a).
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn variant_names_round_trip() {
        for v in [
            Variant::Naive,
            Variant::Reg {
                tm: 32,
                tn: 16,
                wg_x: 16,
                wg_y: 1,
            },
            Variant::Tiled {
                bm: 64,
                bn: 64,
                bk: 16,
            },
            Variant::Subgroup {
                sg: 8,
                tm: 64,
                tn: 8,
                wgs: 1,
            },
        ] {
            assert_eq!(Variant::parse(&v.name()), Some(v));
        }
        assert_eq!(Variant::parse("reg-1x2"), None);
        assert_eq!(Variant::parse("bogus"), None);
    }
}
