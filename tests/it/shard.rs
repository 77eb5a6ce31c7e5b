//! Data sharding: the shard file round trip and its errors (a file changed after `open` too),
//! the epoch order equal to the in-memory order, sharded training equal to in-memory training
//! for any shard size, and a dataset larger than the memory budget training in shards.

use crate::common;

use common::device_tests;
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::optim::{AdamW, Sgd};
use fitgrad::train::data::Dataset;
use fitgrad::train::epoch_permutation;
use fitgrad::train::shard::ShardedDataset;
use fitgrad::train::{ShardedView, Trainer, TrainerConfig};
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};
use std::path::PathBuf;

device_tests!(rows_match_the_host);

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("fitgrad-test-{}-{name}", std::process::id()))
}

/// n samples of `dim` features whose first feature is the sample's index (to identify it).
fn synthetic(n: usize, dim: usize) -> Dataset {
    let mut features = Vec::with_capacity(n * dim);
    for i in 0..n {
        features.push(i as f32);
        features.extend((1..dim).map(|j| ((i * 31 + j * 7) % 17) as f32 / 17.0));
    }
    Dataset {
        name: "synthetic".into(),
        features,
        labels: (0..n).map(|i| (i % 10) as u32).collect(),
        dim,
        classes: 10,
    }
}

#[test]
fn shard_file_round_trip_and_errors() {
    let data = synthetic(103, 5);
    let path = temp("roundtrip.fgshard");
    ShardedDataset::create(&data, &path).unwrap();
    let s = ShardedDataset::open(&path, 25).unwrap();
    assert_eq!((s.len, s.dim, s.classes, s.num_shards()), (103, 5, 10, 5));
    // Shard 4 holds the last 3 samples of the epoch's order; features travel with their labels.
    let order = epoch_permutation(103, 1, 0);
    assert_eq!(s.epoch_order(1, 0), order);
    let last = s.read_shard(4, 1, 0).unwrap();
    let ids: Vec<usize> = last.features.chunks(5).map(|r| r[0] as usize).collect();
    assert_eq!(ids, order[100..]);
    for (row, &l) in last.features.chunks(5).zip(&last.labels) {
        let i = row[0] as usize;
        assert_eq!(row, &data.features[i * 5..i * 5 + 5]);
        assert_eq!(l, data.labels[i]);
    }
    // Any rows in any order, repeats included: runs of consecutive rows and single rows.
    let rows = [5, 6, 7, 2, 3, 102, 101, 100, 0, 6, 50];
    let got = s.read_rows(&rows).unwrap();
    for (k, &i) in rows.iter().enumerate() {
        assert_eq!(
            got.features[k * 5..k * 5 + 5],
            data.features[i * 5..i * 5 + 5]
        );
        assert_eq!(got.labels[k], data.labels[i]);
    }
    assert!(s.read_rows(&[]).unwrap().labels.is_empty());
    assert!(matches!(
        s.read_rows(&[3, 103]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        s.read_shard(5, 1, 0),
        Err(Error::InvalidArgument { .. })
    ));

    let bytes = std::fs::read(&path).unwrap();
    let bad = temp("bad.fgshard");
    for (what, content) in [
        ("truncated", bytes[..bytes.len() - 4].to_vec()),
        ("extra", [bytes.clone(), vec![0; 4]].concat()),
        (
            "magic",
            [b"NOTSHARD".to_vec(), bytes[8..].to_vec()].concat(),
        ),
        ("short", bytes[..10].to_vec()),
    ] {
        std::fs::write(&bad, content).unwrap();
        match ShardedDataset::open(&bad, 10) {
            Err(Error::Data { path, reason }) => {
                assert!(path.contains("bad.fgshard"), "{what}: {path}");
                assert!(!reason.is_empty());
            }
            other => panic!("{what}: expected Error::Data, got {other:?}"),
        }
    }
    assert!(matches!(
        ShardedDataset::open(&temp("missing.fgshard"), 10),
        Err(Error::Io { .. })
    ));
    assert!(matches!(
        ShardedDataset::open(&path, 0),
        Err(Error::InvalidArgument { .. })
    ));
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&bad);
}

#[test]
fn epoch_order_is_the_in_memory_order() {
    let Some(dev) = common::fresh_device(DeviceOptions::default()) else {
        return;
    };
    let data = synthetic(230, 3);
    let path = temp("order.fgshard");
    ShardedDataset::create(&data, &path).unwrap();
    let s = ShardedDataset::open(&path, 50).unwrap();
    let ids = |seed, epoch| -> Vec<usize> {
        s.epoch(&dev, seed, epoch)
            .flat_map(|shard| {
                let (x, y) = shard.unwrap();
                let v = x.to_vec::<f32>().unwrap();
                assert_eq!(x.dims(), [y.len(), 3]);
                v.chunks(3).map(|r| r[0] as usize).collect::<Vec<_>>()
            })
            .collect()
    };
    let a = ids(7, 0);
    assert_eq!(a, epoch_permutation(230, 7, 0), "the in-memory order");
    assert_eq!(a, ids(7, 0), "same seed and epoch, same order");
    assert_ne!(a, ids(7, 1), "another epoch reshuffles");
    assert_ne!(a, ids(8, 0), "another seed reshuffles");
    assert_eq!(ids(8, 3), epoch_permutation(230, 8, 3));
    let _ = std::fs::remove_file(&path);
}

#[test]
fn dataset_larger_than_the_budget_trains_in_shards() {
    // 40,000 x 64 f32 = 10 MiB of features under a 4 MiB budget.
    let budget = 4 << 20;
    let Some(dev) = common::fresh_device(DeviceOptions::default().memory_budget(budget)) else {
        return;
    };
    let mut data = synthetic(40_000, 64);
    data.features
        .iter_mut()
        .step_by(64)
        .for_each(|v| *v /= 40_000.0);
    assert!(
        matches!(
            Tensor::from_slice(&dev, &data.features, &[40_000, 64]),
            Err(Error::OutOfMemory { .. })
        ),
        "the whole dataset must not fit the budget"
    );
    let path = temp("big.fgshard");
    ShardedDataset::create(&data, &path).unwrap();
    let s = ShardedDataset::open(&path, 2_000).unwrap();
    // Long runs of consecutive rows are read in several bounded reads.
    let all: Vec<usize> = (0..40_000).collect();
    assert!(s.read_rows(&all).unwrap().features == data.features);
    let model = Mlp::new(&dev, &[64, 32, 10], Activation::Relu, 0).unwrap();
    let opt = Sgd::new(model.parameters(), 0.01).unwrap();
    let config = TrainerConfig::default().batch_size(500);
    let mut trainer = Trainer::new(model, Box::new(opt), config).unwrap();
    let mut steps = 0;
    trainer
        .train_epoch_sharded(&s, 3, 0, |_, done, total| {
            steps = done;
            assert!(done <= total);
            Ok(())
        })
        .unwrap();
    assert_eq!(steps, 80);
    assert_eq!(trainer.steps(), 80);
    let loss = trainer.take_loss().unwrap();
    assert!(loss.is_finite(), "loss {loss}");
    let stats = dev.memory_stats();
    assert!(stats.peak_bytes_reserved <= budget, "{stats:?}");
    // And the device still works after the refused upload.
    assert_eq!(
        Tensor::ones(&dev, &[3], DType::F32)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        [1.0; 3]
    );
    let _ = std::fs::remove_file(&path);
}

/// The planner's view of a sharded epoch counts what the epoch keeps on the device: two
/// shards of 70 x 64 f32 and the rows of a batch that spans two of them,
/// to the byte over the in-memory plan. Preallocated from that view, a sharded epoch creates
/// no buffer and stays under the plan; fitted to a budget through the view, it never runs out
/// of memory mid-training (the in-memory plan would fit a budget the shards then pass).
#[test]
fn plans_count_the_shards_so_prealloc_and_budgets_hold() {
    let Some(dev) = common::fresh_device(DeviceOptions::default()) else {
        return;
    };
    let data = synthetic(160, 64);
    let path = temp("planned.fgshard");
    ShardedDataset::create(&data, &path).unwrap();
    let s = ShardedDataset::open(&path, 70).unwrap();
    let trainer = |dev: &Device| {
        let model = Mlp::new(dev, &[64, 32, 10], Activation::Relu, 0)?;
        let opt = AdamW::new(model.parameters(), 1e-3)?;
        Trainer::new(
            model,
            Box::new(opt),
            TrainerConfig::default().batch_size(32),
        )
    };
    let view = ShardedView::new(&data, Some(70), 32).unwrap();
    let mut t = trainer(&dev).unwrap();
    let in_memory = t.plan(&data).unwrap();
    let sharded = t.plan(&view).unwrap();
    // 70 % 32 != 0: batches span shards, joined as (32, 64).
    assert_eq!(sharded.peak, in_memory.peak + 2 * 70 * 64 * 4 + 32 * 64 * 4);
    t.prealloc(&view).unwrap();
    let before = dev.memory_stats();
    dev.reset_peak();
    t.train_epoch_sharded(&s, 1, 0, |_, _, _| Ok(())).unwrap();
    let after = dev.memory_stats();
    assert_eq!(
        after.buffers_created, before.buffers_created,
        "a buffer was created during training after prealloc"
    );
    assert!(
        after.peak_bytes_in_use <= sharded.peak,
        "{after:?} vs {sharded:?}"
    );

    // The smallest budgets, in memory and through the view (from a budget of 1 KiB).
    let smallest = |through_view: bool| {
        let dev = common::fresh_device(DeviceOptions::default().memory_budget(1 << 10)).unwrap();
        let built = if through_view {
            Trainer::build_within_budget(&dev, &view, || trainer(&dev))
        } else {
            Trainer::build_within_budget(&dev, &data, || trainer(&dev))
        };
        match built {
            Err(Error::BudgetTooSmall { minimum, .. }) => minimum,
            other => panic!("1 KiB: {:?}", other.err()),
        }
    };
    let (in_memory_min, sharded_min) = (smallest(false), smallest(true));
    assert!(
        sharded_min >= in_memory_min + 2 * 70 * 64 * 4,
        "{sharded_min} vs {in_memory_min}"
    );
    // What the in-memory plan accepts, the shards pass: the epoch fails at its first shard.
    let dev = common::fresh_device(DeviceOptions::default().memory_budget(in_memory_min)).unwrap();
    let mut t = Trainer::build_within_budget(&dev, &data, || trainer(&dev)).unwrap();
    assert!(t.train_epoch_sharded(&s, 1, 0, |_, _, _| Ok(())).is_err());
    // Fitted through the view, the epoch runs under its budget with no out-of-memory retry.
    let dev = common::fresh_device(DeviceOptions::default().memory_budget(sharded_min)).unwrap();
    let mut t = Trainer::build_within_budget(&dev, &view, || trainer(&dev)).unwrap();
    t.train_epoch_sharded(&s, 1, 0, |_, _, _| Ok(())).unwrap();
    let events = t.take_events();
    assert!(events.is_empty(), "out of memory mid-training: {events:?}");
    assert!(dev.memory_stats().peak_bytes_reserved <= sharded_min);
    let _ = std::fs::remove_file(&path);
}

/// Every parameter, read back.
fn weights(model: &Mlp) -> Vec<Vec<f32>> {
    model
        .parameters()
        .iter()
        .map(|p| p.to_vec::<f32>().unwrap())
        .collect()
}

/// max |a - b| / max |a|.
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max);
    diff / a.iter().map(|x| x.abs() as f64).fold(1e-30, f64::max)
}

/// Two epochs of the same seed give the weights, loss and steps of the in-memory run for any
/// shard size: one sample per shard, sizes that divide neither the batch nor the effective
/// batch, the effective batch itself, and one larger than the dataset; with accumulation and
/// micro-batches, so batches span shards and micro-batches split across their pieces.
#[test]
fn sharded_training_equals_in_memory_training() {
    let Some(dev) = common::devices().into_iter().next() else {
        return;
    };
    let n = 45;
    let mut data = synthetic(n, 6);
    data.features
        .iter_mut()
        .step_by(6)
        .for_each(|v| *v /= n as f32);
    let path = temp("exact.fgshard");
    ShardedDataset::create(&data, &path).unwrap();
    let config = TrainerConfig::new(4, 3, 1e-2).micro_batch(3);
    // The effective batch is 12: 4 steps per epoch, the last of 9 samples.
    let trainer = || {
        let model = Mlp::new(&dev, &[6, 16, 10], Activation::Relu, 5).unwrap();
        let opt = AdamW::new(model.parameters(), 1e-2).unwrap();
        Trainer::new(model, Box::new(opt), config.clone()).unwrap()
    };
    let seed = 11;
    let mut reference = trainer();
    let mut ref_totals = Vec::new();
    for epoch in 0..2 {
        reference
            .train_epoch(&data, seed, epoch, |_, done, total| {
                ref_totals.push((done, total));
                Ok(())
            })
            .unwrap();
    }
    assert_eq!(reference.steps(), 8);
    let ref_loss = reference.take_loss().unwrap();
    let ref_weights = weights(&reference.model);
    for shard_size in [1, 7, 10, 12, 100] {
        let s = ShardedDataset::open(&path, shard_size).unwrap();
        let mut t = trainer();
        let mut totals = Vec::new();
        for epoch in 0..2 {
            t.train_epoch_sharded(&s, seed, epoch, |_, done, total| {
                totals.push((done, total));
                Ok(())
            })
            .unwrap();
        }
        assert_eq!(t.steps(), reference.steps(), "shard size {shard_size}");
        assert_eq!(totals, ref_totals, "shard size {shard_size}");
        let loss = t.take_loss().unwrap();
        assert!(
            ((loss - ref_loss) / ref_loss).abs() <= 1e-5,
            "shard size {shard_size}: loss {loss} vs {ref_loss}"
        );
        for (k, (a, b)) in ref_weights.iter().zip(weights(&t.model)).enumerate() {
            let d = rel_diff(a, &b);
            assert!(d <= 1e-5, "shard size {shard_size}, parameter {k}: {d}");
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// A file replaced after `open` (other sizes, other classes, other length) is an
/// `Error::Data` naming it on the next read, in `read_rows` and mid-epoch; so is a label out
/// of range.
#[test]
fn a_file_changed_after_open_is_a_data_error() {
    let path = temp("changed.fgshard");
    let original = synthetic(40, 4);
    ShardedDataset::create(&original, &path).unwrap();
    let s = ShardedDataset::open(&path, 8).unwrap();
    assert!(s.read_shard(0, 0, 0).is_ok());
    let expect_data = |what: &str, r: fitgrad::Result<_>| match r {
        Err(Error::Data { path, reason }) => {
            assert!(path.contains("changed.fgshard"), "{what}: {path}");
            assert!(!reason.is_empty());
        }
        Err(e) => panic!("{what}: expected Error::Data, got {e}"),
        Ok(_) => panic!("{what}: expected Error::Data, got a shard"),
    };
    let mut more_classes = original.clone();
    more_classes.classes = 12;
    let bytes = std::fs::read(&path).unwrap();
    for (what, content) in [
        ("more samples", None),
        ("other classes", Some(more_classes)),
        ("other features", Some(synthetic(32, 5))),
    ] {
        let d = content.unwrap_or_else(|| synthetic(41, 4));
        ShardedDataset::create(&d, &path).unwrap();
        expect_data(what, s.read_shard(0, 0, 0).map(|_| ()));
    }
    // The same header, but bytes appended.
    std::fs::write(&path, [bytes.clone(), vec![0; 4]].concat()).unwrap();
    expect_data("appended", s.read_rows(&[0]).map(|_| ()));
    std::fs::write(&path, &bytes).unwrap();
    assert!(s.read_rows(&[0]).is_ok(), "the original file reads again");

    // Replaced mid-epoch: shard 3's read starts after the replacement.
    if let Some(dev) = common::devices().into_iter().next() {
        let mut it = s.epoch(&dev, 0, 0);
        assert!(it.next().unwrap().is_ok());
        ShardedDataset::create(&synthetic(41, 4), &path).unwrap();
        let rest: Vec<_> = it.collect();
        let failed = rest.iter().position(|r| r.is_err()).expect("a read fails");
        assert!(failed <= 2, "shard {} failed", failed + 1);
        expect_data(
            "mid-epoch",
            rest.into_iter().nth(failed).unwrap().map(|_| ()),
        );
    }

    // A label not below the classes (open reads only the header).
    let mut bad = Vec::new();
    bad.extend_from_slice(b"FGSHARD1");
    for v in [2u64, 1, 3] {
        bad.extend_from_slice(&v.to_le_bytes());
    }
    for v in [0.5f32, 1.5] {
        bad.extend_from_slice(&v.to_le_bytes());
    }
    for l in [1u32, 5] {
        bad.extend_from_slice(&l.to_le_bytes());
    }
    std::fs::write(&path, bad).unwrap();
    let s = ShardedDataset::open(&path, 1).unwrap();
    assert_eq!(s.read_rows(&[0]).unwrap().labels, [1]);
    expect_data("label", s.read_rows(&[1]).map(|_| ()));
    let _ = std::fs::remove_file(&path);
}

/// `Tensor::rows` against the host: f32 rows (the copy engine) and f16 rows of odd width, whose
/// byte ranges are not 4-byte aligned (the host path); bad ranges are errors.
fn rows_match_the_host(dev: &Device) {
    for (dtype, cols) in [(DType::F32, 3usize), (DType::F16, 3), (DType::F16, 4)] {
        let host: Vec<f32> = (0..7 * cols).map(|i| i as f32).collect();
        let t = common::upload(dev, &host, &[7, cols], dtype);
        for (a, b) in [(0, 7), (1, 4), (3, 3), (5, 7), (6, 7)] {
            let r = t.rows(a, b).unwrap();
            assert_eq!(r.dims(), [b - a, cols]);
            assert_eq!(
                r.to_vec_f32().unwrap(),
                host[a * cols..b * cols],
                "{} {dtype} cols {cols} rows {a}..{b}",
                common::label(dev)
            );
        }
        assert!(matches!(t.rows(5, 8), Err(Error::Shape { .. })));
        assert!(matches!(t.rows(4, 3), Err(Error::Shape { .. })));
    }
}

/// A process id that no longer runs: a child that has exited and been waited for.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("run `true`");
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// Leftovers of killed processes go, a running process's stay: a new `TempShardFile` removes
/// the shard files (and interrupted writes of them) whose owner is dead; a save removes the
/// temporary files of a killed save to the same path. Its own file goes when it is dropped.
#[cfg(unix)]
#[test]
fn stale_shard_and_temporary_files_are_removed() {
    let tmp = std::env::temp_dir();
    let dead = dead_pid();
    let stale = tmp.join(format!("fitgrad-{dead}-0-0-digits.fgshard"));
    let stale_write = tmp.join(format!(".fitgrad-{dead}-0-0-digits.fgshard.tmp-{dead}-x"));
    // pid 1 always runs.
    let running = tmp.join("fitgrad-1-0-0-test-keep.fgshard");
    for p in [&stale, &stale_write, &running] {
        std::fs::write(p, b"x").unwrap();
    }
    let file = fitgrad::train::shard::TempShardFile::new("a/b");
    assert!(
        !stale.exists() && !stale_write.exists(),
        "a dead owner's files stay"
    );
    assert!(running.exists(), "a running process's file was removed");
    std::fs::remove_file(&running).unwrap();
    let name = file
        .path()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        name.starts_with(&format!("fitgrad-{}-", std::process::id()))
            && name.ends_with("a-b.fgshard"),
        "{name}"
    );
    ShardedDataset::create(&synthetic(4, 3), file.path()).unwrap();
    let path = file.path().to_path_buf();
    drop(file);
    assert!(!path.exists(), "the shard file outlived its guard");

    // A save killed before its rename left `.NAME.tmp-PID-...`; the next save removes it.
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("run.bin");
    let killed = dir.path().join(format!(".run.bin.tmp-{dead}-abc"));
    let live = dir.path().join(".run.bin.tmp-1-abc");
    std::fs::write(&killed, vec![0u8; 1000]).unwrap();
    std::fs::write(&live, b"x").unwrap();
    fitgrad::write_atomic(&target, b"new").unwrap();
    assert!(!killed.exists(), "a killed save's temporary file stayed");
    assert!(
        live.exists(),
        "a running writer's temporary file was removed"
    );
    assert_eq!(std::fs::read(&target).unwrap(), b"new");
}

const SIGNAL_CHILD_ENV: &str = "FITGRAD_SHARD_SIGNAL_CHILD";

/// The child of `shard_file_removed_on_sigint_and_sigterm`: makes a shard file, prints its
/// path and waits to be signalled.
#[test]
#[ignore = "run by shard_file_removed_on_sigint_and_sigterm in a child process"]
fn shard_signal_child() {
    if std::env::var_os(SIGNAL_CHILD_ENV).is_none() {
        return;
    }
    let file = fitgrad::train::shard::TempShardFile::new("signal");
    ShardedDataset::create(&synthetic(4, 3), file.path()).unwrap();
    println!("shard file: {}", file.path().display());
    std::thread::sleep(std::time::Duration::from_secs(30));
}

/// Ctrl-C (SIGINT) and SIGTERM remove the shard file of the process they stop, which exits
/// with status 130.
#[cfg(unix)]
#[test]
fn shard_file_removed_on_sigint_and_sigterm() {
    use std::io::{BufRead, BufReader};
    if std::env::var_os(SIGNAL_CHILD_ENV).is_some() {
        return;
    }
    for signal in ["INT", "TERM"] {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "shard::shard_signal_child",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(SIGNAL_CHILD_ENV, "1")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut path = None;
        for line in BufReader::new(child.stdout.take().unwrap()).lines() {
            // The harness may print "test NAME ... " before it on the same line.
            let line = line.unwrap();
            if let Some((_, p)) = line.split_once("shard file: ") {
                path = Some(PathBuf::from(p));
                break;
            }
        }
        let path = path.expect("the child printed its shard file");
        assert!(path.exists());
        let killed = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &child.id().to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(130), "SIG{signal}: {status}");
        assert!(!path.exists(), "SIG{signal} left {}", path.display());
    }
}
