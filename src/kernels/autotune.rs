//! The matmul autotuner: times the candidate kernels once per adapter and shape class, and
//! remembers the winner in memory and on disk.
//!
//! The disk cache is one text file per adapter (`<class>\t<variant>` lines) under
//! `$FITGRAD_CACHE_DIR`, else `$XDG_CACHE_HOME/fitgrad`, else `~/.cache/fitgrad`; its name hashes
//! the adapter name, backend, driver and the crate version, so a driver or fitgrad upgrade tunes
//! again. It is rewritten atomically (temporary file, then rename). `FITGRAD_AUTOTUNE=0` turns
//! tuning off (the built-in choice is used).

use super::matmul::Variant;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
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

fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("FITGRAD_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("fitgrad")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("fitgrad")))
}

/// The cache file of one adapter.
pub(crate) fn cache_path(info: &crate::DeviceInfo) -> Option<PathBuf> {
    let a = &info.adapter;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (
        &a.name,
        &a.backend,
        &a.driver,
        &a.driver_info,
        env!("CARGO_PKG_VERSION"),
        info.f16_native,
    )
        .hash(&mut h);
    Some(cache_dir()?.join(format!("autotune-{:016x}.txt", h.finish())))
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

    /// Records a winner and rewrites the file. A cache that cannot be written only costs a
    /// re-tune next time, so write errors are ignored.
    pub fn put(&mut self, path: Option<&PathBuf>, class: String, v: Variant) {
        let map = self.load(path);
        map.insert(class, v);
        let Some(path) = path else { return };
        let mut lines: Vec<String> = map
            .iter()
            .map(|(k, v)| format!("{k}\t{}", v.name()))
            .collect();
        lines.sort();
        let _ = crate::fsutil::write_atomic(path, (lines.join("\n") + "\n").as_bytes());
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
