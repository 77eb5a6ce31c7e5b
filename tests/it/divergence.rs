//! Training that goes wrong says so: a non-finite loss stops training with a typed error naming
//! the step, before the update (the weights stay as they were), and never replaces a good
//! checkpoint with a NaN one; a mixed-precision run whose weights blow up stops once loss
//! scaling has skipped too many tries in a row, and saves nothing; resuming with another
//! precision is refused.

use crate::common;

use common::*;
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::optim::Sgd;
use fitgrad::train::{Precision, Trainer, TrainerConfig};
use fitgrad::{DeviceOptions, Error};

fn trainer(lr: f32, precision: Precision) -> Option<Trainer<Mlp>> {
    let dev = fresh_device(DeviceOptions::default())?;
    let m = Mlp::with_dtype(
        &dev,
        &[8, 16, 4],
        Activation::Relu,
        precision.param_dtype(),
        1,
    )
    .unwrap();
    let opt = Box::new(Sgd::new(m.parameters(), lr).unwrap());
    let cfg = TrainerConfig::new(16, 1, lr).precision(precision);
    Some(Trainer::new(m, opt, cfg).unwrap())
}

fn batch() -> (Vec<f32>, Vec<u32>) {
    let x = host_data(3, 16 * 8, -1.0, 1.0);
    let y = (0..16).map(|i| i % 4).collect();
    (x, y)
}

#[test]
fn nonfinite_loss_stops_with_the_step_and_keeps_the_checkpoint() {
    let Some(mut t) = trainer(0.1, Precision::F32) else {
        return;
    };
    let (x, y) = batch();
    t.step_rows(&x, &y).unwrap();
    let dir = std::env::temp_dir().join(format!("fitgrad-diverge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("good.safetensors");
    t.save_checkpoint(&path, 1).unwrap();
    let good = std::fs::read(&path).unwrap();

    // A NaN input makes the loss NaN at step 1.
    let mut bad = x.clone();
    bad[5] = f32::NAN;
    let before: Vec<Vec<f32>> = t
        .model
        .parameters()
        .iter()
        .map(|p| p.to_vec_f32().unwrap())
        .collect();
    let err = t.step_rows(&bad, &y).unwrap_err();
    match &err {
        Error::NonFinite { step, what, .. } => {
            assert_eq!(*step, 1);
            assert!(what.contains("loss"), "{what}");
        }
        e => panic!("expected NonFinite, got {e:?}"),
    }
    assert!(err.to_string().contains("step 1"), "{err}");
    let after: Vec<Vec<f32>> = t
        .model
        .parameters()
        .iter()
        .map(|p| p.to_vec_f32().unwrap())
        .collect();
    assert_eq!(before, after, "the failed step changed the weights");
    assert_eq!(t.steps(), 1);
    assert!(t.model.parameters().iter().all(|p| p.grad().is_none()));
    // The trainer keeps working.
    t.step_rows(&x, &y).unwrap();
    assert_eq!(t.steps(), 2);

    // Poisoned weights are never saved over the good file.
    // The infinity is written into the model's own weight in place, through a view outside
    // the graph (a checkpoint holding it is refused by apply_model).
    t.model.parameters()[0]
        .detach()
        .fill_(f32::INFINITY)
        .unwrap();
    let err = t.save_checkpoint(&path, 2).unwrap_err();
    assert!(matches!(err, Error::NonFinite { .. }), "{err:?}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        good,
        "the good checkpoint was replaced"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn resume_refuses_another_precision() {
    let Some(mut t) = trainer(0.1, Precision::F32) else {
        return;
    };
    let (x, y) = batch();
    t.step_rows(&x, &y).unwrap();
    let dir = std::env::temp_dir().join(format!("fitgrad-precision-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("f32.safetensors");
    t.save_checkpoint(&path, 1).unwrap();
    let mut mixed = trainer(0.1, Precision::Mixed).unwrap();
    let err = mixed.resume_from(&path).unwrap_err();
    assert!(err.to_string().contains("precision f32"), "{err}");
    assert_eq!(mixed.steps(), 0);
    let mut same = trainer(0.1, Precision::F32).unwrap();
    assert_eq!(same.resume_from(&path).unwrap(), 1);
    let _ = std::fs::remove_dir_all(dir);
}

/// lr 1e30 pushes the weights to about 1e30 in one update (finite in f32, infinite in f16):
/// every later try overflows. The trainer stops with the step after
/// `max_skipped_in_a_row` + 1 skipped tries, and a save after it keeps the good file.
#[test]
fn blown_up_mixed_run_stops_naming_the_step() {
    let Some(mut t) = trainer(1e30, Precision::Mixed) else {
        return;
    };
    let most = t.config().max_skipped_in_a_row;
    let (x, y) = batch();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("good.safetensors");
    t.save_checkpoint(&path, 0).unwrap();
    let good = std::fs::read(&path).unwrap();
    let mut tries = 0;
    let err = loop {
        tries += 1;
        assert!(tries <= 2 * most + 10, "still training after {tries} tries");
        if let Err(e) = t.step_rows(&x, &y) {
            break e;
        }
    };
    let skipped = t.scaler().unwrap().skipped_steps();
    match &err {
        Error::NonFinite { step, what, .. } => {
            assert_eq!(*step, t.steps(), "the error names the step not taken");
            assert!(
                what.contains(&format!("{} tries in a row", most + 1)),
                "{what}"
            );
        }
        e => panic!("expected NonFinite, got {e:?}"),
    }
    assert!(skipped > most, "{skipped} skipped");
    assert!(
        t.steps() >= 1 && t.steps() + skipped == tries,
        "{} + {skipped} vs {tries}",
        t.steps()
    );
    let err = t.save_checkpoint(&path, 0).unwrap_err();
    assert!(matches!(err, Error::NonFinite { .. }), "{err:?}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        good,
        "the good checkpoint was replaced"
    );
}
