//! Resume refuses a checkpoint whose run had other settings that change the math: the
//! optimizer's hyperparameters, the base learning rate, the schedule, the effective batch.

use crate::common;

use common::*;
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::optim::{AdamW, LrSchedule, Optimizer, Sgd};
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{Device, Error};

fn trainer(dev: &Device, opt: &str, wd: f32, lr: f32, batch: usize) -> Trainer<Mlp> {
    let model = Mlp::new(dev, &[6, 8, 3], Activation::Relu, 1).unwrap();
    let params = model.parameters();
    let opt: Box<dyn Optimizer> = match opt {
        "adamw" => Box::new(AdamW::new(params, lr).unwrap().weight_decay(wd).unwrap()),
        _ => Box::new(Sgd::new(params, lr).unwrap().momentum(0.9).unwrap()),
    };
    Trainer::new(model, opt, TrainerConfig::new(batch, 1, lr)).unwrap()
}

#[test]
fn resume_checks_what_changes_the_math() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.safetensors");
    let x = host_data(4, 4 * 6, -1.0, 1.0);
    let y = vec![0u32, 1, 2, 0];
    let mut t = trainer(&dev, "adamw", 0.01, 1e-3, 4);
    t.step_rows(&x, &y).unwrap();
    t.save_checkpoint(&path, 1).unwrap();

    let refused = |mut t: Trainer<Mlp>, what: &str| {
        let err = t.resume_from(&path).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::Data { .. }), "{what}: {err:?}");
        assert!(msg.contains(what), "the error names {what}: {msg}");
        assert_eq!(t.steps(), 0, "a refused resume changed the trainer");
    };
    refused(trainer(&dev, "adamw", 0.1, 1e-3, 4), "weight_decay");
    refused(trainer(&dev, "adamw", 0.01, 3e-3, 4), "lr");
    refused(trainer(&dev, "adamw", 0.01, 1e-3, 2), "effective_batch");
    refused(trainer(&dev, "sgd", 0.0, 1e-3, 4), "adamw");
    let mut cosine = trainer(&dev, "adamw", 0.01, 1e-3, 4);
    let mut cfg = TrainerConfig::new(4, 1, 1e-3);
    cfg.schedule = LrSchedule::WarmupCosine {
        warmup_steps: 1,
        total_steps: 10,
        min_lr_ratio: 0.0,
    };
    cosine = Trainer::new(cosine.model, cosine.optimizer, cfg).unwrap();
    refused(cosine, "schedule");

    // The same settings resume.
    let mut same = trainer(&dev, "adamw", 0.01, 1e-3, 4);
    assert_eq!(same.resume_from(&path).unwrap(), 1);
    assert_eq!(same.steps(), 1);
}
