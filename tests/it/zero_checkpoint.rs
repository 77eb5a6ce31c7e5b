//! Sharded ZeRO checkpoints in one process (DataParallel over logical devices of one adapter):
//! a save of four replicas holds what the one-file save holds, and resumes on four, two and one
//! replicas to the weights of the uninterrupted runs (bit for bit where the math is the same),
//! at stage 3 too (each of the MLP's layers a unit sharded over the replicas); a folder whose
//! files do not fit its index, or a model, is refused naming the file.

use crate::common;

use common::*;
use fitgrad::distributed::zero::checkpoint::{self as sharded, INDEX};
use fitgrad::distributed::{load_checkpoint, DataParallel, Zero};
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::optim::AdamW;
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::{BatchSource, Trainer, TrainerConfig};
use fitgrad::{Device, DeviceOptions, Error, Result};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const SEED: u64 = 3;
const WIDTHS: [usize; 3] = [64, 16, 10];

fn digits() -> &'static Dataset {
    static DIGITS: OnceLock<Dataset> = OnceLock::new();
    DIGITS.get_or_init(|| data::load("digits", SEED).expect("the embedded digits").0)
}

/// Another device on `dev`'s adapter, with its own arena.
fn twin(dev: &Device) -> Device {
    let info = dev.info();
    let opts = DeviceOptions::default()
        .backend(info.adapter.backend.clone())
        .adapter(info.adapter.name.clone())
        .force_packed_f16(!info.f16_native);
    Device::with_options(opts).expect("a second device on the same adapter")
}

fn trainer(dev: &Device, widths: &[usize]) -> Result<Trainer<Mlp>> {
    trainer_with_units(dev, widths, false)
}

/// [`trainer`], each layer of the MLP a unit with `units` (what ZeRO stage 3 shards).
fn trainer_with_units(dev: &Device, widths: &[usize], units: bool) -> Result<Trainer<Mlp>> {
    let mut model = Mlp::new(dev, widths, Activation::Relu, SEED)?;
    model.units = units;
    let opt = Box::new(AdamW::new(model.parameters(), 1e-2)?);
    Trainer::new(model, opt, TrainerConfig::new(13, 1, 1e-2))
}

fn replicas(dev: &Device, n: usize, zero: Zero, widths: &[usize]) -> DataParallel<Mlp> {
    let devices: Vec<Device> = (0..n).map(|_| twin(dev)).collect();
    let units = zero.number() == 3;
    DataParallel::with_zero(&devices, zero, |d| trainer_with_units(d, widths, units)).unwrap()
}

/// Four batches of 13 samples.
fn batches() -> Vec<Vec<usize>> {
    let order = digits().epoch_order(SEED, 0);
    order.chunks(13).take(4).map(<[usize]>::to_vec).collect()
}

/// A temporary folder removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("fitgrad-zck-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bits(v: &[Vec<f32>]) -> Vec<u32> {
    v.concat().iter().map(|x| x.to_bits()).collect()
}

fn stage(n: u8) -> Zero {
    Zero::stage(n).unwrap()
}

#[test]
fn a_sharded_save_of_four_replicas_resumes_on_four_two_and_one() {
    run_on("vulkan", four_to_four_two_and_one);
}

fn four_to_four_two_and_one(dev: &Device) {
    let tmp = TempDir::new("resume");
    let (dir, one_file) = (tmp.0.join("ckpt"), tmp.0.join("one.safetensors"));
    let b = batches();
    let mut single = trainer(dev, &WIDTHS).unwrap();
    for idx in &b {
        single.step(digits(), idx).unwrap();
    }
    let want = param_values(&single.model);

    // Four ZeRO-2 replicas: two steps, a sharded and a one-file save, two more steps.
    let zero2 = stage(2).bucket_elements(200).unwrap();
    let mut dp4 = replicas(dev, 4, zero2, &WIDTHS);
    for idx in &b[..2] {
        dp4.step(digits(), idx).unwrap();
    }
    dp4.save_sharded(&dir, 0).unwrap();
    dp4.save_checkpoint(&one_file, 0).unwrap();
    for idx in &b[2..] {
        dp4.step(digits(), idx).unwrap();
    }
    let four = param_values(dp4.model());
    assert!(dir.join(INDEX).is_file());
    for r in 0..4 {
        let f = dir.join(sharded::shard_file(1, r, 4));
        assert!(f.is_file(), "{} is missing", f.display());
    }
    let index = sharded::read_index(&dir).unwrap();
    assert_eq!((index.ranks, index.step, index.save), (4, 2, 1));

    // Put together, the shards are the one-file checkpoint: the same tensors, bit for bit,
    // and the same metadata.
    let got = shards_equal_one_file(&dir, &one_file);

    // Four replicas again (stage 1 now): the same math, the same bits.
    let mut again = replicas(dev, 4, stage(1), &WIDTHS);
    assert_eq!(again.resume_from(&dir).unwrap(), 0);
    assert_eq!(again.steps(), 2);
    // Two ZeRO-2 replicas and one device: another sum order, within 1e-5.
    let mut dp2 = replicas(dev, 2, zero2, &WIDTHS);
    dp2.resume_from(&dir).unwrap();
    let mut alone = trainer(dev, &WIDTHS).unwrap();
    alone.resume_from_checkpoint(&got).unwrap();
    for idx in &b[2..] {
        again.step(digits(), idx).unwrap();
        dp2.step(digits(), idx).unwrap();
        alone.step(digits(), idx).unwrap();
    }
    again.check_identical().unwrap();
    dp2.check_identical().unwrap();
    assert_eq!(
        bits(&param_values(again.model())),
        bits(&four),
        "resumed on four replicas: not the uninterrupted run's bits"
    );
    for (what, got) in [
        ("two replicas", param_values(dp2.model())),
        ("one device", param_values(&alone.model)),
    ] {
        for (base, reference) in [("four replicas", &four), ("one device", &want)] {
            let worst = worst_rel_diff(&got, reference);
            assert!(
                worst < 1e-5,
                "{what} resumed, against the uninterrupted run on {base}: {worst:e}"
            );
        }
    }

    // A second save into the folder: a new save's files, the old ones removed, the index
    // naming the new; one device writes a one-rank save that two replicas resume.
    dp2.save_sharded(&dir, 0).unwrap();
    let index = sharded::read_index(&dir).unwrap();
    assert_eq!((index.ranks, index.step, index.save), (2, 4, 2));
    assert!(!dir.join("save-000001").exists(), "the old save is removed");
    sharded::save_replicas(std::slice::from_ref(&alone), &dir, 0, false).unwrap();
    let mut from_one = replicas(dev, 2, stage(2), &WIDTHS);
    from_one.resume_from(&dir).unwrap();
    let c = load_checkpoint(&dir).unwrap();
    assert_eq!(c.metadata["optim.step_count"], "4");
    assert_eq!(
        bits(&param_values(from_one.model())),
        bits(&param_values(&alone.model))
    );
}

/// Stage 3: four replicas each keep a shard of every layer (each a unit); their sharded save
/// (an index of groups: the parameters in no unit, none here, then each layer's) is the
/// one-file save put together, and resumes on four replicas at stage 3 to the uninterrupted
/// run's bits, and on two replicas at stage 3 and on one device within 1e-5.
#[test]
fn a_stage_3_sharded_save_resumes_on_four_two_and_one() {
    run_on("vulkan", stage_3_four_to_four_two_and_one);
}

fn stage_3_four_to_four_two_and_one(dev: &Device) {
    let tmp = TempDir::new("stage3");
    let (dir, one_file) = (tmp.0.join("ckpt"), tmp.0.join("one.safetensors"));
    let b = batches();
    let mut dp4 = replicas(dev, 4, stage(3), &WIDTHS);
    for idx in &b[..2] {
        dp4.step(digits(), idx).unwrap();
    }
    dp4.save_sharded(&dir, 0).unwrap();
    // The one-file save puts the units and the optimizer state together in host memory: no
    // replica's device holds more than its step did (the whole state, 9,680 bytes for this
    // model, would pass a budget the sharded step fits in).
    let in_use: Vec<u64> = dp4
        .replicas()
        .iter()
        .map(|t| {
            let d = t.device();
            d.reset_peak();
            d.memory_stats().bytes_in_use
        })
        .collect();
    dp4.save_checkpoint(&one_file, 0).unwrap();
    for (r, (t, before)) in dp4.replicas().iter().zip(in_use).enumerate() {
        let grew = t.device().memory_stats().peak_bytes_in_use - before;
        eprintln!("replica {r}: the one-file save's device peak {grew} B over its {before} B");
        assert!(
            grew <= 1024,
            "replica {r}: the one-file save took {grew} B of its device"
        );
    }
    for idx in &b[2..] {
        dp4.step(digits(), idx).unwrap();
    }
    // The units' values are the ranks' shards until gathered.
    dp4.gather_parameters().unwrap();
    let four = param_values(dp4.model());
    let index = sharded::read_index(&dir).unwrap();
    assert_eq!((index.ranks, index.version), (4, 2));
    assert_eq!(
        index.groups.len(),
        1 + WIDTHS.len() - 1,
        "{:?}",
        index.groups
    );
    let got = shards_equal_one_file(&dir, &one_file);
    let mut again = replicas(dev, 4, stage(3), &WIDTHS);
    again.resume_from(&dir).unwrap();
    let mut dp2 = replicas(dev, 2, stage(3), &WIDTHS);
    dp2.resume_from(&dir).unwrap();
    let mut alone = trainer(dev, &WIDTHS).unwrap();
    alone.resume_from_checkpoint(&got).unwrap();
    for idx in &b[2..] {
        again.step(digits(), idx).unwrap();
        dp2.step(digits(), idx).unwrap();
        alone.step(digits(), idx).unwrap();
    }
    again.gather_parameters().unwrap();
    dp2.gather_parameters().unwrap();
    assert_eq!(
        bits(&param_values(again.model())),
        bits(&four),
        "resumed on four replicas at stage 3: not the uninterrupted run's bits"
    );
    for (what, got) in [
        ("two replicas", param_values(dp2.model())),
        ("one device", param_values(&alone.model)),
    ] {
        let worst = worst_rel_diff(&got, &four);
        assert!(
            worst < 1e-5,
            "{what} resumed from stage 3 shards: {worst:e}"
        );
    }
}

/// The `Error::Data` of `r`, and that it names `file`.
fn refused(r: Result<impl Sized>, file: &Path, what: &str) -> String {
    match r {
        Err(Error::Data { path, reason }) => {
            assert_eq!(path, file.display().to_string(), "{what}: {reason}");
            reason
        }
        Err(e) => panic!("{what}: not a data error: {e}"),
        Ok(_) => panic!("{what} was accepted"),
    }
}

#[test]
fn a_sharded_checkpoint_that_does_not_fit_is_refused_naming_the_file() {
    run_on("vulkan", mismatches_are_refused);
}

fn mismatches_are_refused(dev: &Device) {
    let tmp = TempDir::new("refused");
    let dir = tmp.0.join("ckpt");
    let mut dp = replicas(dev, 2, stage(2), &WIDTHS);
    dp.step(digits(), &batches()[0]).unwrap();
    dp.save_sharded(&dir, 0).unwrap();
    let index = dir.join(INDEX);
    let file1 = dir.join(sharded::shard_file(1, 1, 2));
    let copy = tmp.0.join("copy");
    let restore = || {
        let _ = std::fs::remove_dir_all(&copy);
        std::fs::create_dir_all(copy.join("save-000001")).unwrap();
        for f in [
            INDEX.to_string(),
            sharded::shard_file(1, 0, 2),
            sharded::shard_file(1, 1, 2),
        ] {
            std::fs::copy(dir.join(&f), copy.join(&f)).unwrap();
        }
    };
    let (c_index, c_file1) = (copy.join(INDEX), copy.join(sharded::shard_file(1, 1, 2)));

    // Another model (other widths) from a good folder: refused before any weight is written,
    // naming the index.
    let mut other = replicas(dev, 2, stage(1), &[64, 8, 10]);
    let before = param_values(other.model());
    refused(other.resume_from(&dir), &index, "another model");
    assert_eq!(bits(&param_values(other.model())), bits(&before));

    // A missing rank file.
    restore();
    std::fs::remove_file(&c_file1).unwrap();
    let why = refused(load_checkpoint(&copy), &c_file1, "a missing shard");
    assert!(why.contains("missing"), "{why}");
    // A damaged one (one byte changed), and a truncated one.
    restore();
    let mut bytes = std::fs::read(&c_file1).unwrap();
    let at = bytes.len() - 5;
    bytes[at] ^= 0x40;
    std::fs::write(&c_file1, &bytes).unwrap();
    let why = refused(load_checkpoint(&copy), &c_file1, "a damaged shard");
    assert!(why.contains("damaged"), "{why}");
    std::fs::write(&c_file1, &bytes[..100]).unwrap();
    let why = refused(load_checkpoint(&copy), &c_file1, "a truncated shard");
    assert!(why.contains("truncated"), "{why}");
    // An index for other parameters (a shape changed, its hash made to match): the rank files
    // were written for the old list.
    restore();
    let mut j: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&c_index).unwrap()).unwrap();
    j["params"][0]["dims"] = serde_json::json!([10, 64]);
    let list: Vec<sharded::IndexParam> = serde_json::from_value(j["params"].clone()).unwrap();
    j["params_hash"] = sharded::params_hash(&list).into();
    std::fs::write(&c_index, serde_json::to_vec(&j).unwrap()).unwrap();
    let c_file0 = copy.join(sharded::shard_file(1, 0, 2));
    let why = refused(
        load_checkpoint(&copy),
        &c_file0,
        "an index of other parameters",
    );
    assert!(why.contains("other parameters"), "{why}");
    // An edited index whose hash no longer matches, a foreign index, none at all.
    j["params_hash"] = "0000000000000000".into();
    std::fs::write(&c_index, serde_json::to_vec(&j).unwrap()).unwrap();
    refused(load_checkpoint(&copy), &c_index, "an edited index");
    std::fs::write(&c_index, b"{\"format\": 7}").unwrap();
    refused(load_checkpoint(&copy), &c_index, "a foreign index");
    std::fs::remove_file(&c_index).unwrap();
    refused(load_checkpoint(&copy), &c_index, "no index");
    // The one-file loader says what a folder is.
    refused(fitgrad::checkpoint::load(&dir), &dir, "a folder as a file");
    assert!(sharded::check_folder("--save-sharded", &file1).is_err());
}

/// The sharded save in `dir` put together is the one-file save: the same metadata and tensors,
/// bit for bit. Returns it.
fn shards_equal_one_file(dir: &Path, one_file: &Path) -> fitgrad::checkpoint::Checkpoint {
    let (got, file) = (
        load_checkpoint(dir).unwrap(),
        load_checkpoint(one_file).unwrap(),
    );
    assert_eq!(got.metadata, file.metadata);
    assert_eq!(
        got.tensors.keys().collect::<Vec<_>>(),
        file.tensors.keys().collect::<Vec<_>>()
    );
    for (k, t) in &file.tensors {
        assert_eq!(&got.tensors[k], t, "{k} differs from the one-file save's");
    }
    got
}
