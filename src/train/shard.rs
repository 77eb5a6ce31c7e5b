//! Data sharding: a dataset kept on disk and streamed through the device one shard at a time,
//! so a dataset larger than the memory budget (or than host memory) trains.
//!
//! [`ShardedDataset::create`] writes a dataset once into a flat binary file (`FGSHARD1` header,
//! then f32 features row-major, then u32 labels); [`ShardedDataset::open`] reads only the header.
//! An epoch visits the shards in a seeded order; each shard is read with one seek by a background
//! thread while the previous shard trains, shuffled within itself (seeded by seed, epoch and
//! shard), and uploaded as one device tensor. At most two shards are on the device: the current
//! one and the prefetched next one. Batches are row ranges of the shard tensor, copied by the
//! copy engine.
//!
//! The order differs from a full-dataset shuffle (samples mix within a shard, shards mix per
//! epoch), as with every sharded loader; it depends only on the seed and epoch, so runs repeat.

use crate::tensor::Rng;
use crate::{Device, Error, Result, Tensor};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::data::Dataset;

const MAGIC: &[u8; 8] = b"FGSHARD1";
/// Magic, then n, dim, classes as u64 little-endian.
const HEADER: u64 = 8 + 3 * 8;

/// A dataset on disk, read shard by shard.
#[derive(Clone, Debug)]
pub struct ShardedDataset {
    path: PathBuf,
    pub len: usize,
    pub dim: usize,
    pub classes: usize,
    /// Samples per shard (the last may be shorter).
    pub shard_size: usize,
}

/// One shard in host memory, already shuffled.
pub struct HostShard {
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
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
        let data_err = |reason: String| Error::Data {
            path: path.display().to_string(),
            reason,
        };
        if shard_size == 0 {
            return Err(Error::InvalidArgument {
                op: "ShardedDataset::open",
                reason: "shard_size must be positive".into(),
            });
        }
        let io = |source| Error::Io {
            path: path.display().to_string(),
            source,
        };
        let mut f = File::open(path).map_err(io)?;
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
        let actual = f.metadata().map_err(io)?.len();
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
        Ok(ShardedDataset {
            path: path.to_path_buf(),
            len: n as usize,
            dim: dim as usize,
            classes: classes as usize,
            shard_size,
        })
    }

    pub fn num_shards(&self) -> usize {
        self.len.div_ceil(self.shard_size)
    }

    /// The shards of an epoch in their seeded order.
    pub fn shard_order(&self, seed: u64, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.num_shards()).collect();
        shuffle(&mut order, mix(seed, epoch, u64::MAX));
        order
    }

    /// Reads shard `k` from disk and shuffles its samples (seeded by seed, epoch and k).
    pub fn read_shard(&self, k: usize, seed: u64, epoch: u64) -> Result<HostShard> {
        let start = k * self.shard_size;
        let rows = self.shard_size.min(self.len.saturating_sub(start));
        let io = |source| Error::Io {
            path: self.path.display().to_string(),
            source,
        };
        let mut f = File::open(&self.path).map_err(io)?;
        let mut feat = vec![0u8; rows * self.dim * 4];
        f.seek(SeekFrom::Start(HEADER + (start * self.dim * 4) as u64))
            .map_err(io)?;
        f.read_exact(&mut feat).map_err(io)?;
        let mut lab = vec![0u8; rows * 4];
        f.seek(SeekFrom::Start(
            HEADER + (self.len * self.dim * 4 + start * 4) as u64,
        ))
        .map_err(io)?;
        f.read_exact(&mut lab).map_err(io)?;
        let features: Vec<f32> = bytemuck::pod_collect_to_vec(&feat);
        let labels: Vec<u32> = bytemuck::pod_collect_to_vec(&lab);
        if let Some(&bad) = labels.iter().find(|&&l| l as usize >= self.classes) {
            return Err(Error::Data {
                path: self.path.display().to_string(),
                reason: format!(
                    "label {bad} in shard {k} is not below {} classes",
                    self.classes
                ),
            });
        }
        // Shuffle within the shard so batches are contiguous row ranges on the device.
        let mut order: Vec<usize> = (0..rows).collect();
        shuffle(&mut order, mix(seed, epoch, k as u64));
        let mut out = HostShard {
            features: Vec::with_capacity(features.len()),
            labels: Vec::with_capacity(rows),
        };
        for i in order {
            out.features
                .extend_from_slice(&features[i * self.dim..(i + 1) * self.dim]);
            out.labels.push(labels[i]);
        }
        Ok(out)
    }

    /// Iterates an epoch's shards: each comes back uploaded to `device` as a (rows, dim) f32
    /// tensor with its labels, while the next one is read from disk on another thread and
    /// uploaded before the current one is handed out (so at most two are on the device).
    pub fn epoch<'a>(&'a self, device: &'a Device, seed: u64, epoch: u64) -> ShardIter<'a> {
        ShardIter {
            data: self,
            device,
            seed,
            epoch,
            order: self.shard_order(seed, epoch),
            next: 0,
            reading: None,
            ready: None,
        }
    }
}

/// See [`ShardedDataset::epoch`].
pub struct ShardIter<'a> {
    data: &'a ShardedDataset,
    device: &'a Device,
    seed: u64,
    epoch: u64,
    order: Vec<usize>,
    next: usize,
    /// The disk read of the shard after `ready`.
    reading: Option<std::thread::JoinHandle<Result<HostShard>>>,
    /// The next shard, already on the device.
    ready: Option<(Tensor, Vec<u32>)>,
}

impl ShardIter<'_> {
    fn start_read(&mut self) {
        if self.next < self.order.len() {
            let (data, k) = (self.data.clone(), self.order[self.next]);
            let (seed, epoch) = (self.seed, self.epoch);
            self.next += 1;
            self.reading = Some(std::thread::spawn(move || data.read_shard(k, seed, epoch)));
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

/// Seeds a shuffle from the run's seed, the epoch and a stream id.
fn mix(seed: u64, epoch: u64, stream: u64) -> u64 {
    let mut r = Rng::new(seed ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ stream.rotate_left(17));
    r.next_u64()
}

/// Fisher–Yates.
fn shuffle(v: &mut [usize], seed: u64) {
    let mut rng = Rng::new(seed);
    for i in (1..v.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
}
