//! Knowledge distillation on every device: the loss against an f64 plain-loop reference and
//! its gradient against central finite differences (shapes with one row, one class, odd
//! widths; temperatures below and above 1; alpha 0, between, 1); `Distill` in the trainer
//! (only the student changes, the teacher gets no gradient and keeps no memory past a step:
//! a step leaves behind exactly what the same student's step alone leaves; with alpha 0 it
//! trains bit for bit as the student alone); a Gpt teacher and student on token batches; and
//! the typed errors.

use crate::common;

use common::gradcheck::{check_grads, input};
use common::*;
use fitgrad::compress::{distillation_loss, Distill, DistillConfig};
use fitgrad::nn::{Activation, Gpt, GptConfig, Mlp, Module};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::text::TextDataset;
use fitgrad::train::{BatchSource, Trainer, TrainerConfig};
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};
use proptest::prelude::*;
use std::sync::OnceLock;

/// log-softmax of one row in f64.
fn log_softmax(row: &[f64]) -> Vec<f64> {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
    row.iter().map(|v| v - m - s.ln()).collect()
}

/// The loss in f64: alpha T^2 mean_rows KL(p_t || p_s) + (1 - alpha) mean_rows CE.
fn reference(s: &[f64], t: &[f64], labels: &[u32], c: usize, alpha: f64, temp: f64) -> f64 {
    let b = labels.len();
    let (mut kl, mut ce) = (0.0, 0.0);
    for r in 0..b {
        let srow: Vec<f64> = s[r * c..(r + 1) * c].iter().map(|v| v / temp).collect();
        let trow: Vec<f64> = t[r * c..(r + 1) * c].iter().map(|v| v / temp).collect();
        let (ls, lt) = (log_softmax(&srow), log_softmax(&trow));
        for j in 0..c {
            kl += lt[j].exp() * (lt[j] - ls[j]);
        }
        ce -= log_softmax(&s[r * c..(r + 1) * c])[labels[r] as usize];
    }
    alpha * temp * temp * kl / b as f64 + (1.0 - alpha) * ce / b as f64
}

/// The loss and d loss / d student against the reference and finite differences; the teacher
/// gets no gradient.
fn check(dev: &Device, b: usize, c: usize, alpha: f32, temp: f32, seed: u64) {
    let labels: Vec<u32> = (0..b)
        .map(|i| ((seed as usize + 7 * i) % c) as u32)
        .collect();
    let s = host_data(seed, b * c, -3.0, 3.0);
    let t = host_data(seed ^ 11, b * c, -3.0, 3.0);
    let what = format!("distillation_loss b {b} c {c} alpha {alpha} T {temp}");
    let lab = labels.clone();
    check_grads(
        dev,
        &what,
        &[input(s, &[b, c], true), input(t, &[b, c], false)],
        seed,
        &move |xs: &[Tensor]| distillation_loss(&xs[0], &xs[1], &lab, alpha, temp),
        &move |xs: &[Vec<f64>]| {
            vec![reference(
                &xs[0],
                &xs[1],
                &labels,
                c,
                alpha as f64,
                temp as f64,
            )]
        },
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

/// Random shapes, temperatures and weights, and the edges.
fn loss_and_gradient_match_reference(dev: &Device) {
    proptest!(ProptestConfig::with_cases(8), |(
        b in 1usize..6, c in 1usize..13, alpha in 0.0f32..=1.0, temp in 0.25f32..8.0,
        seed in any::<u64>(),
    )| {
        check(dev, b, c, alpha, temp, seed);
    });
    check(dev, 1, 1, 0.5, 2.0, 1);
    check(dev, 3, 10, 0.0, 4.0, 2);
    check(dev, 4, 7, 1.0, 0.5, 3);
}

/// The embedded digits, split once per test binary.
fn digits() -> &'static (Dataset, Dataset) {
    static DIGITS: OnceLock<(Dataset, Dataset)> = OnceLock::new();
    DIGITS.get_or_init(|| data::load("digits", 0).expect("the embedded digits load"))
}

/// `Distill` in the trainer: its loss is `distillation_loss` of the two models' logits, the
/// optimizer holds the student's parameters only, steps change the student and never the
/// teacher (which gets no gradient), and evaluation reports the student's accuracy. Memory:
/// a step leaves behind exactly the bytes the same student's step leaves without a teacher
/// (its gradients and AdamW state), so no teacher logits or activations outlive a step.
fn distill_trains_the_student_only(shared: &Device) {
    // A device of its own on the same backend: its bytes in use are this test's alone.
    let mut opts = DeviceOptions::default();
    opts.backend = Some(shared.info().adapter.backend.clone());
    let Some(own) = fresh_device(opts) else {
        return;
    };
    let dev = &own;
    let (train, test) = digits();
    let student_of = |seed| Mlp::new(dev, &[train.dim, 8, train.classes], Activation::Relu, seed);
    let teacher = Mlp::new(dev, &[train.dim, 32, train.classes], Activation::Relu, 1).unwrap();
    let teacher_before = param_values(&teacher);
    let model = Distill::new(
        teacher,
        student_of(2).unwrap(),
        DistillConfig::new(0.7, 3.0),
    )
    .unwrap();
    assert_eq!(model.parameters().len(), 4, "the student's two layers");
    // The first step's loss (one micro-batch of 64) is distillation_loss of the logits.
    let idx: Vec<usize> = (0..64).collect();
    let batch = train.batch(&idx).unwrap();
    let want = {
        let _g = fitgrad::no_grad();
        let x = batch.x.to_device(dev).unwrap();
        let s_logits = model.student.forward(&x).unwrap();
        let t_logits = model.teacher.forward(&x).unwrap();
        distillation_loss(&s_logits, &t_logits, &batch.y, 0.7, 3.0)
            .unwrap()
            .item()
            .unwrap()
    };
    let student_before = param_values(&model.student);
    let in_use = || {
        dev.sync().unwrap();
        dev.memory_stats().bytes_in_use
    };
    let opt = Opt::AdamW { lr: 3e-3 }.build(model.parameters());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(64, 1, 3e-3)).unwrap();
    let before = in_use();
    t.step(train, &idx).unwrap();
    assert_eq!(
        t.take_loss().unwrap(),
        want,
        "Distill's loss is distillation_loss of the logits"
    );
    let left = in_use() - before;
    for _ in 0..3 {
        t.step(train, &idx).unwrap();
        assert_eq!(in_use() - before, left, "a step left memory behind");
    }
    // The same student trained alone, on the same device next to the first trainer.
    let alone = student_of(2).unwrap();
    let opt = Opt::AdamW { lr: 3e-3 }.build(alone.parameters());
    let mut a = Trainer::new(alone, opt, TrainerConfig::new(64, 1, 3e-3)).unwrap();
    let before_alone = in_use();
    for _ in 0..4 {
        a.step(train, &idx).unwrap();
    }
    let _ = a.take_loss().unwrap();
    let _ = t.take_loss().unwrap();
    assert_eq!(
        in_use() - before_alone,
        left,
        "a distillation step leaves more than the student's own step"
    );
    assert_eq!(
        param_values(&t.model.teacher),
        teacher_before,
        "the teacher changed"
    );
    assert!(t
        .model
        .teacher
        .parameters()
        .iter()
        .all(|p| p.grad().is_none()));
    assert_ne!(
        param_values(&t.model.student),
        student_before,
        "the student did not learn"
    );
    let e = t.evaluate(test, 512).unwrap();
    assert!(e.accuracy.is_some() && e.loss.is_finite());
}

/// With alpha 0 the soft term is exactly 0, so a `Distill` trains its student bit for bit as
/// the same student trained alone: the whole path from the trainer to the student's gradients
/// adds nothing of its own.
fn alpha_zero_is_the_student_alone(dev: &Device) {
    let (train, _) = digits();
    let student = |seed| Mlp::new(dev, &[train.dim, 16, train.classes], Activation::Relu, seed);
    let teacher = Mlp::new(dev, &[train.dim, 32, train.classes], Activation::Relu, 1).unwrap();
    let model = Distill::new(teacher, student(3).unwrap(), DistillConfig::new(0.0, 2.0)).unwrap();
    let opt = Opt::AdamW { lr: 3e-3 }.build(model.parameters());
    let mut d = Trainer::new(model, opt, TrainerConfig::new(32, 1, 3e-3)).unwrap();
    let alone = student(3).unwrap();
    let opt = Opt::AdamW { lr: 3e-3 }.build(alone.parameters());
    let mut a = Trainer::new(alone, opt, TrainerConfig::new(32, 1, 3e-3)).unwrap();
    for step in 0..4 {
        let idx: Vec<usize> = (step * 32..step * 32 + 32).collect();
        d.step(train, &idx).unwrap();
        a.step(train, &idx).unwrap();
        assert_eq!(
            d.take_loss().unwrap(),
            a.take_loss().unwrap(),
            "step {step}"
        );
    }
    assert_eq!(param_values(&d.model.student), param_values(&a.model));
}

/// A Gpt teacher and a narrower Gpt student on token batches: the loss is distillation_loss of
/// their next-token logits (batch * t rows), only the student learns, and evaluation gives a
/// loss but no per-sample accuracy (a window has t labels). A teacher with another vocabulary
/// is an `Error::Shape` at the first step.
fn gpt_teacher_and_student(dev: &Device) {
    let cfg = |dim, vocab, seed| {
        let mut c = GptConfig::new(vocab, 8, 1, 2, dim);
        c.seed = seed;
        c
    };
    let tokens: Vec<u32> = (0..64u32).map(|i| (i * 7 + i / 5) % 11).collect();
    let text = TextDataset::new(tokens, 8).unwrap();
    let teacher = Gpt::new(dev, cfg(16, 11, 1)).unwrap();
    let student = Gpt::new(dev, cfg(8, 11, 2)).unwrap();
    let teacher_before = param_values(&teacher);
    let student_before = param_values(&student);
    let idx = [0usize, 5, 9];
    let b = text.batch(&idx).unwrap();
    let want = {
        let _g = fitgrad::no_grad();
        let rows = b.batch * b.t;
        let s = student.forward_ids(&b.ids, b.batch, b.t).unwrap();
        let t = teacher.forward_ids(&b.ids, b.batch, b.t).unwrap();
        distillation_loss(
            &s.reshape(&[rows, 11]).unwrap(),
            &t.reshape(&[rows, 11]).unwrap(),
            &b.targets,
            0.5,
            2.0,
        )
        .unwrap()
        .item()
        .unwrap()
    };
    let model = Distill::new(teacher, student, DistillConfig::new(0.5, 2.0)).unwrap();
    let opt = Opt::AdamW { lr: 1e-2 }.build(model.parameters());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(3, 1, 1e-2)).unwrap();
    t.step(&text, &idx).unwrap();
    assert_eq!(t.take_loss().unwrap(), want, "the Gpt pair's loss");
    assert_eq!(param_values(&t.model.teacher), teacher_before);
    assert_ne!(param_values(&t.model.student), student_before);
    let e = t.evaluate(&text, 16).unwrap();
    assert!(e.loss.is_finite() && e.accuracy.is_none());

    let wide = Gpt::new(dev, cfg(8, 13, 3)).unwrap();
    let model = Distill::new(
        wide,
        Gpt::new(dev, cfg(8, 11, 2)).unwrap(),
        DistillConfig::default(),
    )
    .unwrap();
    let opt = Opt::AdamW { lr: 1e-2 }.build(model.parameters());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(3, 1, 1e-2)).unwrap();
    assert!(matches!(t.step(&text, &idx), Err(Error::Shape { .. })));
}

/// Bad temperatures and weights, a teacher of another width, labels of another count, and a
/// teacher on another device: typed errors.
fn bad_settings_are_typed_errors(dev: &Device) {
    let s = Tensor::zeros(dev, &[3, 5], DType::F32).unwrap();
    let t = Tensor::zeros(dev, &[3, 5], DType::F32).unwrap();
    let labels = [0u32, 1, 2];
    for temp in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(matches!(
            distillation_loss(&s, &t, &labels, 0.5, temp),
            Err(Error::InvalidArgument { .. })
        ));
    }
    for alpha in [-0.1, 1.5, f32::NAN] {
        assert!(matches!(
            distillation_loss(&s, &t, &labels, alpha, 2.0),
            Err(Error::InvalidArgument { .. })
        ));
    }
    let wide = Tensor::zeros(dev, &[3, 10], DType::F32).unwrap();
    assert!(matches!(
        distillation_loss(&s, &wide, &labels, 0.5, 2.0),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        distillation_loss(&s, &t, &labels[..2], 0.5, 2.0),
        Err(Error::Shape { .. })
    ));
    let flat = Tensor::zeros(dev, &[15], DType::F32).unwrap();
    assert!(matches!(
        distillation_loss(&flat, &flat, &labels, 0.5, 2.0),
        Err(Error::Shape { .. })
    ));
    if let Some(other) = devices().into_iter().find(|d| d != dev) {
        let far = Tensor::zeros(&other, &[3, 5], DType::F32).unwrap();
        assert!(matches!(
            distillation_loss(&s, &far, &labels, 0.5, 2.0),
            Err(Error::DeviceMismatch { .. })
        ));
    }
    let m = |seed| Mlp::new(dev, &[4, 3], Activation::Relu, seed).unwrap();
    assert!(matches!(
        Distill::new(m(1), m(2), DistillConfig::new(0.5, 0.0)),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        Distill::new(m(1), m(2), DistillConfig::default().alpha(2.0)),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(DistillConfig::default()
        .temperature(-1.0)
        .validate()
        .is_err());
    assert!(DistillConfig::default().validate().is_ok());
    // A label past the classes: typed, from the loss's checks.
    assert!(matches!(
        distillation_loss(&s, &t, &[0, 1, 5], 0.5, 2.0),
        Err(Error::InvalidArgument { .. })
    ));
    // A teacher with 5 classes for a 3-class student fails at the first step.
    let (train, _) = digits();
    let narrow = |out, seed| Mlp::new(dev, &[train.dim, out], Activation::Relu, seed).unwrap();
    let model = Distill::new(narrow(5, 1), narrow(3, 2), DistillConfig::new(0.5, 2.0)).unwrap();
    let opt = Opt::AdamW { lr: 1e-3 }.build(model.parameters());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(4, 1, 1e-3)).unwrap();
    assert!(matches!(
        t.step(train, &[0, 1, 2, 3]),
        Err(Error::Shape { .. })
    ));
}

common::device_tests!(
    loss_and_gradient_match_reference,
    distill_trains_the_student_only,
    alpha_zero_is_the_student_alone,
    gpt_teacher_and_student,
    bad_settings_are_typed_errors,
);
