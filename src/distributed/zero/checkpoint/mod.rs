//! Sharded checkpoints: each rank writes its shard of the parameters and of the optimizer state,
//! rank 0 an index, and any number of ranks (or one process) reads them back.
//!
//! A folder `DIR` holds
//!
//! ```text
//! DIR/index.json                                  what the save holds (below), written last
//! DIR/save-000003/rank-00000-of-00004.safetensors rank 0's shard (and the model's buffers)
//! DIR/save-000003/rank-00001-of-00004.safetensors ...
//! ```
//!
//! Every rank file is a safetensors file with the tensors `shard.params` (the rank's range of
//! the flat, padded parameter buffer of [`ShardLayout`], f32) and `shard.optim.NAME` (the same
//! range of each optimizer state tensor, `exp_avg`, ..., zeros where a parameter has no state
//! yet); rank 0's also holds the model's buffers (`model.NAME`). Its metadata name the rank,
//! the rank count, the shard length, the save and the hash of the parameter list.
//!
//! ZeRO stage 3 lays its parameters out in groups, each over the ranks by its own layout: the
//! parameters in no unit, then each unit's ([`Trainer::shard_groups`]). A rank's range is then
//! its shard of each group, one after the other, and the index lists each group's shard
//! length (`groups`) and each parameter's group, its offset counted in that group's flat
//! buffer. Without groups (stages 0 to 2) the index is version 1, as before them.
//!
//! `index.json` records the format, the rank count, the shard length, the step, the save's
//! number, the parameter list in the optimizer's order (name, shape, dtype, offset in the flat
//! buffer), its hash (FNV-1a of names, shapes and dtypes), each rank file with its length and
//! FNV-1a hash, and the metadata of the one-file checkpoint ([`crate::checkpoint`]'s table).
//!
//! A save writes into a new `save-N` folder, then replaces the index atomically, then removes
//! the older folders: a kill at any point leaves the previous index and the files it names
//! whole. All ranks must see `DIR` (one machine, or a shared file system).
//!
//! [`load_sharded`] reads every rank file, checks each against the index (present, length,
//! hash, rank, parameter hash) and puts the whole state together as the one-file checkpoint
//! of the same run, so a trainer resumes from it as from [`crate::checkpoint::load`]'s, and
//! a ZeRO replica keeps the pieces of its own layout (re-sharding to any rank count).

use super::ShardLayout;
use crate::checkpoint::{self, Checkpoint, HostTensor, TrainingState, MODEL_PREFIX};
use crate::distributed::Communicator;
use crate::hash::Fnv1a;
use crate::nn::Module;
use crate::train::Trainer;
use crate::{DType, Error, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

mod load;
pub use load::{load_checkpoint, load_sharded, read_index};

/// The index's file name in a sharded checkpoint's folder.
pub const INDEX: &str = "index.json";
/// The index's `format`.
pub const INDEX_FORMAT: &str = "fitgrad-sharded";
/// The newest index layout this code writes and reads: 2 has groups (ZeRO stage 3), 1 not.
pub const INDEX_VERSION: u32 = 2;
const SHARD_PARAMS: &str = "shard.params";
const SHARD_OPTIM: &str = "shard.optim.";

/// One parameter in the index, in the layout's order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexParam {
    /// The model's name of it (`layers.0.weight`).
    pub name: String,
    /// Its shape.
    pub dims: Vec<usize>,
    /// `f32` or `f16`.
    pub dtype: String,
    /// Where it starts in its group's flat buffer.
    pub offset: usize,
    /// Its group ([`ShardIndex::groups`]); 0 without groups.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub group: usize,
}

fn is_zero(v: &usize) -> bool {
    *v == 0
}

/// One rank's file in the index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndexFile {
    /// The rank that wrote it.
    pub rank: usize,
    /// Its path within the folder.
    pub file: String,
    /// Its length in bytes.
    pub bytes: u64,
    /// FNV-1a of its bytes, 16 hex digits.
    pub fnv1a64: String,
}

/// `index.json` (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardIndex {
    /// [`INDEX_FORMAT`].
    pub format: String,
    /// [`INDEX_VERSION`].
    pub version: u32,
    /// Ranks that wrote the save (one file each).
    pub ranks: usize,
    /// Elements of every rank's shard (of every group together).
    pub shard_len: usize,
    /// Elements of every rank's shard of each group, in the order a rank file holds them;
    /// empty for one group (of `shard_len`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<usize>,
    /// The optimizer steps the run had taken.
    pub step: u64,
    /// The save's number: its files are in `save-NNNNNN/`.
    pub save: u64,
    /// FNV-1a of the parameter list (names, shapes, dtypes), 16 hex digits.
    pub params_hash: String,
    /// The parameters in the layout's (the optimizer's) order.
    pub params: Vec<IndexParam>,
    /// The rank files, rank 0 first.
    pub files: Vec<IndexFile>,
    /// The one-file checkpoint's metadata (model configuration, position, optimizer).
    pub metadata: BTreeMap<String, String>,
}

/// What one rank's file adds to the index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardRecord {
    /// The file's length.
    pub bytes: u64,
    /// FNV-1a of its bytes.
    pub hash: u64,
    /// Per parameter (layout order), the updates its state has had; 0 outside the shard.
    pub param_steps: Vec<u64>,
}

impl ShardRecord {
    fn words(&self) -> Vec<u64> {
        [self.bytes, self.hash]
            .into_iter()
            .chain(self.param_steps.iter().copied())
            .collect()
    }
}

/// The path of rank `rank`'s file of save `save` within the folder.
pub fn shard_file(save: u64, rank: usize, ranks: usize) -> String {
    format!("save-{save:06}/rank-{rank:05}-of-{ranks:05}.safetensors")
}

fn hex(v: u64) -> String {
    format!("{v:016x}")
}

/// FNV-1a of the parameters' names, shapes and dtypes: which model the state belongs to.
pub fn params_hash(params: &[IndexParam]) -> String {
    let mut h = Fnv1a::default();
    for p in params {
        h = h
            .bytes(p.name.as_bytes())
            .bytes(&[0])
            .words(p.dims.iter().map(|&d| d as u64))
            .bytes(p.dtype.as_bytes())
            .bytes(&[0]);
    }
    hex(h.finish())
}

/// The optimizer's parameters (the layout's order) with the model's names for them.
fn named_params<M: Module>(trainer: &Trainer<M>) -> Result<Vec<(String, Tensor)>> {
    let named = trainer.model.named_parameters();
    trainer
        .optimizer
        .params()
        .iter()
        .map(|p| {
            let (name, _) =
                named
                    .iter()
                    .find(|(_, m)| m.is_same(p))
                    .ok_or_else(|| Error::InvalidArgument {
                        op: "zero::save_sharded",
                        reason:
                            "the optimizer updates a tensor that is not a parameter of the model"
                                .into(),
                    })?;
            Ok((name.clone(), p.clone()))
        })
        .collect()
}

/// The groups of a save, each its parameters' indices (in the optimizer's order) and their
/// layout over the ranks ([`Trainer::shard_groups`]).
struct Groups(Vec<(Vec<usize>, ShardLayout)>);

impl Groups {
    fn of<M: Module>(
        trainer: &Trainer<M>,
        params: &[(String, Tensor)],
        ranks: usize,
    ) -> Result<Groups> {
        let groups = trainer.shard_groups();
        let mut seen = vec![0usize; params.len()];
        groups.iter().flatten().for_each(|&i| {
            if let Some(s) = seen.get_mut(i) {
                *s += 1
            }
        });
        if groups.iter().flatten().any(|&i| i >= params.len()) || seen.iter().any(|&s| s != 1) {
            return Err(Error::InvalidArgument {
                op: "zero::save_sharded",
                reason: "the shard groups do not hold each of the optimizer's parameters once"
                    .into(),
            });
        }
        let groups = groups
            .into_iter()
            .map(|idx| {
                let numels: Vec<usize> = idx.iter().map(|&i| params[i].1.numel()).collect();
                Ok((idx, ShardLayout::new(&numels, ranks)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Groups(groups))
    }

    /// Elements of a rank's file: its shard of every group.
    fn shard_len(&self) -> usize {
        self.0.iter().map(|(_, l)| l.shard_len()).sum()
    }

    /// Rank `rank`'s pieces, group after group, each named by its parameter's index in the
    /// optimizer's order and placed in the rank's file.
    fn pieces(&self, rank: usize) -> Vec<super::Piece> {
        let mut out = Vec::new();
        let mut start = 0;
        for (idx, l) in &self.0 {
            out.extend(l.pieces(rank).into_iter().map(|pc| super::Piece {
                param: idx[pc.param],
                within: pc.within,
                at: start + pc.at,
            }));
            start += l.shard_len();
        }
        out
    }

    fn index_params(&self, params: &[(String, Tensor)]) -> Vec<IndexParam> {
        let mut at = vec![(0, 0); params.len()];
        for (g, (idx, l)) in self.0.iter().enumerate() {
            for (&i, &offset) in idx.iter().zip(l.offsets()) {
                at[i] = (g, offset);
            }
        }
        params
            .iter()
            .zip(at)
            .map(|((name, p), (group, offset))| IndexParam {
                name: name.clone(),
                dims: p.dims().to_vec(),
                dtype: p.dtype().to_string(),
                offset,
                group,
            })
            .collect()
    }

    /// The index's `groups`: empty for one.
    fn lens(&self) -> Vec<usize> {
        match self.0.len() {
            1 => Vec::new(),
            _ => self.0.iter().map(|(_, l)| l.shard_len()).collect(),
        }
    }
}

/// Writes rank `rank`'s file of save `save` (of `ranks`) into `dir`, atomically, and returns
/// what the index records of it. `sharded_state`: the trainer's optimizer is a
/// [`ZeroOptimizer`](super::ZeroOptimizer) holding this rank's pieces only (the values are
/// those of its pieces, so at stage 3 no unit is gathered); otherwise it holds the whole
/// state and the rank's range of it is written.
pub fn write_shard<M: Module>(
    trainer: &Trainer<M>,
    dir: &Path,
    save: u64,
    rank: usize,
    ranks: usize,
    sharded_state: bool,
) -> Result<ShardRecord> {
    let op = "zero::save_sharded";
    let params = named_params(trainer)?;
    let groups = Groups::of(trainer, &params, ranks)?;
    let pieces = groups.pieces(rank);
    let state = trainer.optimizer.state();
    if !state.codes.is_empty() || !state.host.is_empty() {
        return Err(Error::InvalidArgument {
            op,
            reason: "a sharded checkpoint holds f32 optimizer state on the device; 8-bit or \
                     offloaded state saves to one file (--save)"
                .into(),
        });
    }
    let n = groups.shard_len();
    let mut values = vec![0f32; n];
    let own = match sharded_state {
        true => trainer.step_tensors(),
        false => Vec::new(),
    };
    if sharded_state && own.len() != pieces.len() {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "the replica updates {} pieces, its shard has {}",
                own.len(),
                pieces.len()
            ),
        });
    }
    for (j, pc) in pieces.iter().enumerate() {
        let v = match sharded_state {
            true => own[j].to_vec_f32()?,
            false => params[pc.param].1.to_vec_f32()?[pc.within.clone()].to_vec(),
        };
        values[pc.at..pc.at + v.len()].copy_from_slice(&v);
    }
    let mut param_steps = vec![0u64; params.len()];
    let want = if sharded_state {
        pieces.len()
    } else {
        params.len()
    };
    if state.param_steps.len() != want {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "the optimizer's state covers {} tensors, the shard {want}: save a ZeRO \
                 replica as one (its stage above 0), a replicated optimizer as whole",
                state.param_steps.len()
            ),
        });
    }
    for (j, pc) in pieces.iter().enumerate() {
        let k = if sharded_state { j } else { pc.param };
        param_steps[pc.param] = state.param_steps[k];
    }
    let mut optim: BTreeMap<String, Vec<f32>> = BTreeMap::new();
    for (key, t) in &state.tensors {
        let Some((k, name)) = key
            .split_once('.')
            .and_then(|(k, name)| Some((k.parse::<usize>().ok()?, name)))
        else {
            return Err(Error::InvalidArgument {
                op,
                reason: format!("optimizer state tensor '{key}' is not named by its tensor"),
            });
        };
        let v = t.to_vec_f32()?;
        let flat = optim
            .entry(name.to_string())
            .or_insert_with(|| vec![0f32; n]);
        let mine = pieces.iter().enumerate().filter(|(j, pc)| {
            if sharded_state {
                *j == k
            } else {
                pc.param == k
            }
        });
        for (_, pc) in mine {
            let src = if sharded_state {
                0..v.len()
            } else {
                pc.within.clone()
            };
            if src.len() != pc.within.len() || src.end > v.len() {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!("optimizer state tensor '{key}' does not fit its parameter"),
                });
            }
            flat[pc.at..pc.at + pc.within.len()].copy_from_slice(&v[src]);
        }
    }
    let f32_tensor =
        |v: &[f32]| HostTensor::new(DType::F32, &[v.len()], bytemuck::cast_slice(v).to_vec());
    let mut c = Checkpoint::default();
    c.tensors.insert(SHARD_PARAMS.into(), f32_tensor(&values)?);
    for (name, v) in &optim {
        c.tensors
            .insert(format!("{SHARD_OPTIM}{name}"), f32_tensor(v)?);
    }
    if rank == 0 {
        for (name, t) in trainer.model.named_buffers() {
            c.tensors
                .insert(format!("{MODEL_PREFIX}{name}"), HostTensor::read(&t)?);
        }
    }
    let m = &mut c.metadata;
    m.insert("format".into(), checkpoint::FORMAT.into());
    m.insert("version".into(), checkpoint::VERSION.to_string());
    m.insert("step".into(), trainer.steps().to_string());
    m.insert("shard.rank".into(), rank.to_string());
    m.insert("shard.ranks".into(), ranks.to_string());
    m.insert("shard.len".into(), n.to_string());
    m.insert("shard.save".into(), save.to_string());
    m.insert(
        "shard.params_hash".into(),
        params_hash(&groups.index_params(&params)),
    );
    let path = dir.join(shard_file(save, rank, ranks));
    let bytes = c.to_bytes()?;
    crate::fsutil::write_atomic(&path, &bytes)?;
    Ok(ShardRecord {
        bytes: bytes.len() as u64,
        hash: Fnv1a::default().bytes(&bytes).finish(),
        param_steps,
    })
}

/// The number of the next save into `dir`: past the index's and every `save-N` folder's.
pub fn next_save(dir: &Path) -> u64 {
    let mut last = read_index(dir).map_or(0, |i| i.save);
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name();
            if let Some(n) = name.to_str().and_then(|s| s.strip_prefix("save-")) {
                last = last.max(n.parse().unwrap_or(0));
            }
        }
    }
    last + 1
}

/// Writes `dir`'s index of save `save` (of `records.len()` ranks, whose files are written)
/// atomically, then removes the folders of other saves.
pub fn write_index<M: Module>(
    trainer: &Trainer<M>,
    dir: &Path,
    save: u64,
    records: &[ShardRecord],
    state: &TrainingState,
) -> Result<()> {
    let ranks = records.len();
    let params = named_params(trainer)?;
    let groups = Groups::of(trainer, &params, ranks)?;
    let ip = groups.index_params(&params);
    let param_steps: Vec<u64> = (0..params.len())
        .map(|i| records.iter().map(|r| r.param_steps[i]).max().unwrap_or(0))
        .collect();
    let mut metadata = checkpoint::run_metadata(&trainer.model, state);
    let opt = trainer.optimizer.as_ref();
    metadata.extend(checkpoint::optimizer_metadata(
        opt,
        opt.step_count(),
        &param_steps,
    ));
    let lens = groups.lens();
    let index = ShardIndex {
        format: INDEX_FORMAT.into(),
        // Version 1 readers know no groups; a save without them stays theirs.
        version: if lens.is_empty() { 1 } else { INDEX_VERSION },
        ranks,
        shard_len: groups.shard_len(),
        groups: lens,
        step: state.step,
        save,
        params_hash: params_hash(&ip),
        params: ip,
        files: records
            .iter()
            .enumerate()
            .map(|(rank, r)| IndexFile {
                rank,
                file: shard_file(save, rank, ranks),
                bytes: r.bytes,
                fnv1a64: hex(r.hash),
            })
            .collect(),
        metadata,
    };
    let path = dir.join(INDEX);
    let json = serde_json::to_vec_pretty(&index).map_err(|e| Error::Data {
        path: path.display().to_string(),
        reason: format!("cannot write the index: {e}"),
    })?;
    crate::fsutil::write_atomic(&path, &json)?;
    // The older saves' folders are no longer named by the index (best effort: a folder left
    // behind is removed by the next save).
    let current = format!("save-{save:06}");
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("save-") && name != current && e.path().is_dir() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(())
}

/// A sharded save of data-parallel training over `comm`: every rank writes its file, rank 0
/// the index once all are written (see the module docs). Call it on every rank at the same
/// point; `sharded_state` as [`write_shard`]'s.
pub fn save_sharded<M: Module, C: Communicator>(
    trainer: &Trainer<M>,
    comm: &mut C,
    dir: &Path,
    epochs_done: u64,
    sharded_state: bool,
) -> Result<()> {
    // Every rank holds the same parameters, so every rank passes or fails this alike.
    let state = trainer.checkpoint_training_state(&dir.join(INDEX), epochs_done)?;
    let (rank, ranks) = (comm.rank(), comm.size());
    let mine = if rank == 0 { next_save(dir) } else { 0 };
    let save = comm.all_gather(&[mine])?[0];
    let record = write_shard(trainer, dir, save, rank, ranks, sharded_state)?;
    let words = record.words();
    let all = comm.all_gather(&words)?;
    if rank == 0 {
        let records: Vec<ShardRecord> = all
            .chunks(words.len())
            .map(|w| ShardRecord {
                bytes: w[0],
                hash: w[1],
                param_steps: w[2..].to_vec(),
            })
            .collect();
        write_index(trainer, dir, save, &records, &state)?;
    }
    // No rank goes on before the index names the new files.
    comm.all_gather(&[0])?;
    Ok(())
}

/// A sharded save of replicas held in one process (replica `i` is rank `i`; one replica is a
/// one-rank save of a whole optimizer).
pub fn save_replicas<M: Module>(
    replicas: &[Trainer<M>],
    dir: &Path,
    epochs_done: u64,
    sharded_state: bool,
) -> Result<()> {
    let Some(first) = replicas.first() else {
        return Err(Error::InvalidArgument {
            op: "zero::save_sharded",
            reason: "no replica to save".into(),
        });
    };
    let state = first.checkpoint_training_state(&dir.join(INDEX), epochs_done)?;
    let save = next_save(dir);
    let records = replicas
        .iter()
        .enumerate()
        .map(|(rank, t)| write_shard(t, dir, save, rank, replicas.len(), sharded_state))
        .collect::<Result<Vec<_>>>()?;
    write_index(first, dir, save, &records, &state)
}

/// Checks that `dir` (given by `flag`) can hold a sharded checkpoint: a folder, or a path
/// where one can be made; not a file.
pub fn check_folder(flag: &'static str, dir: &Path) -> Result<()> {
    let invalid = |reason: String| Error::InvalidArgument { op: flag, reason };
    if dir.as_os_str().is_empty() {
        return Err(invalid("names no folder".into()));
    }
    if dir.exists() && !dir.is_dir() {
        return Err(invalid(format!(
            "'{}' is a file; a sharded checkpoint is a folder (its index.json and one file per \
             rank): give a folder's path",
            dir.display()
        )));
    }
    Ok(())
}
