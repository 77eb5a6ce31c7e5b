//! Data sharding: the shard file round trip and its errors, seeded reproducible order with every
//! sample once per epoch, and a dataset larger than the memory budget training in shards.

mod common;

use fitgrad::nn::{Act, Mlp, Module};
use fitgrad::optim::Sgd;
use fitgrad::train::data::Dataset;
use fitgrad::train::shard::ShardedDataset;
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{DType, DeviceOptions, Error, Tensor};
use std::path::PathBuf;

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
    // Shard 4 holds the last 3 samples, shuffled; features travel with their labels.
    let last = s.read_shard(4, 1, 0).unwrap();
    let mut ids: Vec<usize> = last.features.chunks(5).map(|r| r[0] as usize).collect();
    for (row, &l) in last.features.chunks(5).zip(&last.labels) {
        assert_eq!(
            row,
            &data.features[row[0] as usize * 5..row[0] as usize * 5 + 5]
        );
        assert_eq!(l, data.labels[row[0] as usize]);
    }
    ids.sort();
    assert_eq!(ids, vec![100, 101, 102]);

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
fn epoch_order_is_seeded_and_complete() {
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
    assert_eq!(a, ids(7, 0), "same seed and epoch, same order");
    assert_ne!(a, ids(7, 1), "another epoch reshuffles");
    assert_ne!(a, ids(8, 0), "another seed reshuffles");
    let mut sorted = a.clone();
    sorted.sort();
    assert_eq!(sorted, (0..230).collect::<Vec<_>>(), "every sample once");
    let _ = std::fs::remove_file(&path);
}

#[test]
fn dataset_larger_than_the_budget_trains_in_shards() {
    // 40,000 x 64 f32 = 10 MiB of features under a 4 MiB budget.
    let budget = 4 << 20;
    let Some(dev) = common::fresh_device(DeviceOptions {
        memory_budget: Some(budget),
        ..Default::default()
    }) else {
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
    let model = Mlp::new(&dev, &[64, 32, 10], Act::Relu, 0).unwrap();
    let opt = Sgd::new(model.parameters(), 0.01).unwrap();
    let config = TrainerConfig {
        batch_size: 500,
        ..Default::default()
    };
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

/// `Tensor::rows` against the host: f32 rows (the copy engine) and f16 rows of odd width, whose
/// byte ranges are not 4-byte aligned (the host path); bad ranges are errors.
#[test]
fn rows_match_the_host() {
    for dev in common::devices() {
        for (dtype, cols) in [(DType::F32, 3usize), (DType::F16, 3), (DType::F16, 4)] {
            let host: Vec<f32> = (0..7 * cols).map(|i| i as f32).collect();
            let t = common::upload(&dev, &host, &[7, cols], dtype);
            for (a, b) in [(0, 7), (1, 4), (3, 3), (5, 7), (6, 7)] {
                let r = t.rows(a, b).unwrap();
                assert_eq!(r.dims(), [b - a, cols]);
                assert_eq!(
                    r.to_vec_f32().unwrap(),
                    host[a * cols..b * cols],
                    "{} {dtype} cols {cols} rows {a}..{b}",
                    common::label(&dev)
                );
            }
            assert!(matches!(t.rows(5, 8), Err(Error::Shape { .. })));
            assert!(matches!(t.rows(4, 3), Err(Error::Shape { .. })));
        }
    }
}
