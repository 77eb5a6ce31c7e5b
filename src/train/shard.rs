//! Data sharding: a dataset kept on disk and streamed through the device one shard at a time,
//! so a dataset larger than the memory budget (or than host memory) trains.
//!
//! [`ShardedDataset::create`] writes a dataset once into a flat binary file (`FGSHARD1` header,
//! then f32 features row-major, then u32 labels); [`ShardedDataset::open`] reads only the header.
//!
//! Sharding is exact: an epoch's order is the in-memory order, [`epoch_permutation`] of the
//! dataset's length by seed and epoch, and shard k is samples `k * shard_size ..` *of that order*.
//! A background thread gathers a shard's rows from the file (positioned reads, one per run of
//! consecutive row indices) while the previous shard trains; the shard is uploaded as one
//! (rows, dim) device tensor when the previous one is handed out, so at most two shards are on
//! the device: the current one and the next. The trainer's effective batches span shard
//! boundaries, so any shard size gives the batches, steps and weights of the in-memory run.
//!
//! Every read checks the header again against what `open` saw (n, dim, classes and the file's
//! length): a file replaced under a running epoch is an [`Error::Data`], not garbage samples.

pub use super::temp_shard::TempShardFile;

use super::data::Dataset;
use super::order::epoch_permutation;
use crate::{Device, Error, Result, Tensor};
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"FGSHARD1";
/// Magic, then n, dim, classes as u64 little-endian.
const HEADER: u64 = 8 + 3 * 8;
/// The largest single read of a run of consecutive rows (the gather's scratch buffer).
const MAX_READ: usize = 4 << 20;

/// A dataset on disk, read shard by shard.
#[derive(Clone, Debug)]
pub struct ShardedDataset {
    path: PathBuf,
    /// Samples in the file.
    pub len: usize,
    /// Features per sample.
    pub dim: usize,
    /// Label classes (every label is below it).
    pub classes: usize,
    /// Samples per shard (the last may be shorter).
    pub shard_size: usize,
    /// The file's length when it was opened.
    file_len: u64,
}

/// One shard in host memory: `features` is (labels.len(), dim) row-major, in epoch order.
pub struct HostShard {
    /// The shard's rows, row-major.
    pub features: Vec<f32>,
    /// One label per row.
    pub labels: Vec<u32>,
}

/// What a shard file's header says.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Header {
    n: u64,
    dim: u64,
    classes: u64,
    /// The file length the header implies.
    file_len: u64,
}

/// Reads and checks the header of the open file `f`, and that the file's length matches it.
fn read_header(f: &mut File, path: &Path) -> Result<Header> {
    let data_err = |reason: String| Error::Data {
        path: path.display().to_string(),
        reason,
    };
    let mut head = [0u8; HEADER as usize];
    f.read_exact(&mut head)
        .map_err(|_| data_err("too short for a shard file header".into()))?;
    if &head[..8] != MAGIC {
        return Err(data_err("not a fitgrad shard file (bad magic)".into()));
    }
    let field = |i: usize| u64::from_le_bytes(head[8 + 8 * i..16 + 8 * i].try_into().unwrap());
    let (n, dim, classes) = (field(0), field(1), field(2));
    let expected = n
        .checked_mul(dim)
        .and_then(|v| v.checked_add(n))
        .and_then(|v| v.checked_mul(4))
        .and_then(|v| v.checked_add(HEADER))
        .ok_or_else(|| data_err(format!("header sizes overflow: {n} x {dim}")))?;
    let actual = f
        .metadata()
        .map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?
        .len();
    if actual != expected {
        return Err(data_err(format!(
            "expected {expected} bytes for {n} samples of {dim} features, found {actual}{}",
            if actual < expected {
                " (truncated)"
            } else {
                ""
            }
        )));
    }
    Ok(Header {
        n,
        dim,
        classes,
        file_len: actual,
    })
}

/// Fills `buf` from `offset` of `f` without moving a shared cursor.
#[cfg(unix)]
fn read_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(f, buf, offset)
}

/// Fills `buf` from `offset` of `f` (seek, then read).
#[cfg(not(unix))]
fn read_at(mut f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom};
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(buf)
}

impl ShardedDataset {
    /// Writes `data` to `path` (atomically) in the shard file format.
    pub fn create(data: &Dataset, path: &Path) -> Result<()> {
        let mut bytes =
            Vec::with_capacity(HEADER as usize + data.features.len() * 4 + data.labels.len() * 4);
        bytes.extend_from_slice(MAGIC);
        for v in [data.len(), data.dim, data.classes] {
            bytes.extend_from_slice(&(v as u64).to_le_bytes());
        }
        for f in &data.features {
            bytes.extend_from_slice(&f.to_le_bytes());
        }
        for l in &data.labels {
            bytes.extend_from_slice(&l.to_le_bytes());
        }
        crate::fsutil::write_atomic(path, &bytes)
    }

    /// Opens a shard file, checking its header and size.
    pub fn open(path: &Path, shard_size: usize) -> Result<ShardedDataset> {
        if shard_size == 0 {
            return Err(Error::InvalidArgument {
                op: "ShardedDataset::open",
                reason: "shard_size must be positive".into(),
            });
        }
        let mut f = File::open(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        let h = read_header(&mut f, path)?;
        let size = |v: u64| {
            usize::try_from(v).map_err(|_| Error::Data {
                path: path.display().to_string(),
                reason: format!("{v} does not fit this machine's usize"),
            })
        };
        Ok(ShardedDataset {
            path: path.to_path_buf(),
            len: size(h.n)?,
            dim: size(h.dim)?,
            classes: size(h.classes)?,
            shard_size,
            file_len: h.file_len,
        })
    }

    /// Shards per epoch.
    pub fn num_shards(&self) -> usize {
        self.len.div_ceil(self.shard_size)
    }

    /// The sample order of an epoch: the in-memory run's order (the one seeded shuffle).
    pub fn epoch_order(&self, seed: u64, epoch: u64) -> Vec<usize> {
        epoch_permutation(self.len, seed, epoch)
    }

    /// The position range of shard `k` in an epoch's order.
    fn shard_range(&self, k: usize) -> std::ops::Range<usize> {
        let start = (k * self.shard_size).min(self.len);
        start..(start + self.shard_size).min(self.len)
    }

    /// Shard `k` of an epoch: the samples at positions `k * shard_size ..` of
    /// [`ShardedDataset::epoch_order`], in that order. Errors as [`ShardedDataset::read_rows`],
    /// and [`Error::InvalidArgument`] for a shard past the last.
    pub fn read_shard(&self, k: usize, seed: u64, epoch: u64) -> Result<HostShard> {
        if k >= self.num_shards() {
            return Err(Error::InvalidArgument {
                op: "ShardedDataset::read_shard",
                reason: format!("shard {k} of {} shards", self.num_shards()),
            });
        }
        self.read_rows(&self.epoch_order(seed, epoch)[self.shard_range(k)])
    }

    /// The samples `indices` (rows of the file, each `< len`), in that order. The file's
    /// header is checked again first: [`Error::Data`] if n, dim, classes or the file's length
    /// changed since `open`, or for a label not below `classes`; [`Error::InvalidArgument`] for
    /// an index out of range.
    pub fn read_rows(&self, indices: &[usize]) -> Result<HostShard> {
        let data_err = |reason: String| Error::Data {
            path: self.path.display().to_string(),
            reason,
        };
        if let Some(&i) = indices.iter().find(|&&i| i >= self.len) {
            return Err(Error::InvalidArgument {
                op: "ShardedDataset::read_rows",
                reason: format!("sample {i} is out of range for {} samples", self.len),
            });
        }
        let mut f = File::open(&self.path).map_err(|source| Error::Io {
            path: self.path.display().to_string(),
            source,
        })?;
        let h = read_header(&mut f, &self.path)?;
        let opened = Header {
            n: self.len as u64,
            dim: self.dim as u64,
            classes: self.classes as u64,
            file_len: self.file_len,
        };
        if h != opened {
            return Err(data_err(format!(
                "the file changed since it was opened: {} samples x {} features, {} classes, \
                 {} bytes, was {} x {}, {} classes, {} bytes",
                h.n, h.dim, h.classes, h.file_len, self.len, self.dim, self.classes, self.file_len
            )));
        }
        // (row, position in the shard), by row, so consecutive rows are read together.
        let mut sorted: Vec<(usize, usize)> = indices.iter().copied().zip(0..).collect();
        sorted.sort_unstable();
        let row_bytes = self.dim * 4;
        let mut features = vec![0f32; indices.len() * self.dim];
        let mut labels = vec![0u32; indices.len()];
        let io = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => {
                data_err("the file was truncated while a shard was read".into())
            }
            _ => Error::Io {
                path: self.path.display().to_string(),
                source: e,
            },
        };
        gather(
            &f,
            HEADER,
            row_bytes,
            &sorted,
            bytemuck::cast_slice_mut(&mut features),
        )
        .map_err(io)?;
        let labels_at = HEADER + (self.len * row_bytes) as u64;
        gather(
            &f,
            labels_at,
            4,
            &sorted,
            bytemuck::cast_slice_mut(&mut labels),
        )
        .map_err(io)?;
        // The file is little-endian and the bytes were read as native words.
        if cfg!(target_endian = "big") {
            features
                .iter_mut()
                .for_each(|v| *v = f32::from_bits(v.to_bits().swap_bytes()));
            labels.iter_mut().for_each(|v| *v = v.swap_bytes());
        }
        if let Some(&bad) = labels.iter().find(|&&l| l as usize >= self.classes) {
            return Err(data_err(format!(
                "label {bad} is not below {} classes",
                self.classes
            )));
        }
        Ok(HostShard { features, labels })
    }

    /// Iterates an epoch's shards in order: each comes back uploaded to `device` as a
    /// (rows, dim) f32 tensor with its labels. The next one is read from disk on another thread
    /// while the current one trains and uploaded when the current one is handed out, so with
    /// the previous shard dropped before `next`, at most two are on the device.
    pub fn epoch<'a>(&'a self, device: &'a Device, seed: u64, epoch: u64) -> ShardIter<'a> {
        ShardIter {
            data: self,
            device,
            order: self.epoch_order(seed, epoch),
            next: 0,
            reading: None,
            ready: None,
        }
    }
}

/// Reads rows `sorted[..].0` (ascending), each `row_bytes` long at `base + row * row_bytes`
/// of `f`, into `out` at `sorted[..].1 * row_bytes`: one read per run of consecutive rows, at
/// most [`MAX_READ`] bytes each.
fn gather(
    f: &File,
    base: u64,
    row_bytes: usize,
    sorted: &[(usize, usize)],
    out: &mut [u8],
) -> std::io::Result<()> {
    if row_bytes == 0 {
        return Ok(());
    }
    let max_rows = (MAX_READ / row_bytes).max(1);
    let mut scratch = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        // Rows sorted[i].0 .. sorted[j - 1].0 are consecutive (a repeated row ends the run).
        let mut j = i + 1;
        while j < sorted.len() && j - i < max_rows && sorted[j].0 == sorted[j - 1].0 + 1 {
            j += 1;
        }
        scratch.resize((j - i) * row_bytes, 0);
        read_at(f, &mut scratch, base + (sorted[i].0 * row_bytes) as u64)?;
        for (k, &(_, pos)) in sorted[i..j].iter().enumerate() {
            out[pos * row_bytes..(pos + 1) * row_bytes]
                .copy_from_slice(&scratch[k * row_bytes..(k + 1) * row_bytes]);
        }
        i = j;
    }
    Ok(())
}

/// See [`ShardedDataset::epoch`].
pub struct ShardIter<'a> {
    data: &'a ShardedDataset,
    device: &'a Device,
    /// The epoch's sample order.
    order: Vec<usize>,
    /// The shard whose read starts next.
    next: usize,
    /// The disk read of the shard after `ready`.
    reading: Option<std::thread::JoinHandle<Result<HostShard>>>,
    /// The next shard, already on the device.
    ready: Option<(Tensor, Vec<u32>)>,
}

impl ShardIter<'_> {
    fn start_read(&mut self) {
        if self.next < self.data.num_shards() {
            let data = self.data.clone();
            // The thread gets only this shard's indices (shard_size of them).
            let rows = self.order[self.data.shard_range(self.next)].to_vec();
            self.next += 1;
            self.reading = Some(std::thread::spawn(move || data.read_rows(&rows)));
        }
    }

    fn finish_read(&mut self) -> Result<Option<(Tensor, Vec<u32>)>> {
        let Some(handle) = self.reading.take() else {
            return Ok(None);
        };
        let shard = handle.join().map_err(|_| Error::Data {
            path: self.data.path.display().to_string(),
            reason: "the shard reader thread panicked".into(),
        })??;
        let rows = shard.labels.len();
        let x = Tensor::from_slice(self.device, &shard.features, &[rows, self.data.dim])?;
        Ok(Some((x, shard.labels)))
    }
}

impl Iterator for ShardIter<'_> {
    type Item = Result<(Tensor, Vec<u32>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.next == 0 {
            // The first shard is read while the caller waits.
            self.start_read();
            match self.finish_read() {
                Ok(s) => self.ready = s,
                Err(e) => return Some(Err(e)),
            }
        }
        let current = self.ready.take()?;
        // The following shard: its disk read started while the previous shard trained; upload
        // it now so it is on the device while `current` trains, and start reading the one
        // after it in the background.
        if self.reading.is_none() {
            self.start_read();
        }
        match self.finish_read() {
            Ok(s) => self.ready = s,
            Err(e) => return Some(Err(e)),
        }
        self.start_read();
        Some(Ok(current))
    }
}
