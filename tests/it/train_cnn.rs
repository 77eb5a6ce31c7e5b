//! train_cnn (included as a module, run as a user runs it, on tiny synthetic 6x6 images): the
//! seeded crops and flips against a plain-loop reference; half the unbudgeted peak as
//! `--memory-budget` with group norm ends with the unbudgeted run's weights; the planned peak
//! equals the measured one (f32, and checkpointed mixed precision).

use crate::common;

use crate::examples::train_cnn;

use clap::Parser;
use fitgrad::distributed::Job;
use fitgrad::train::data::Dataset;
use fitgrad::train::{BatchSource, Features};
use std::io::Write;
use train_cnn::augment::{Augment, Augmented};

const SIDE: usize = 6;

/// A pseudo-random value in [0, 1) for (i, k).
fn noise(i: usize, k: usize) -> f32 {
    let h = (i as u64 * 0x9e37_79b9 + k as u64 * 0x85eb_ca6b) % 1009;
    h as f32 / 1009.0
}

/// `rows` 6x6 images of 3 classes (a bright row, column or diagonal, plus noise).
fn images(rows: usize) -> Dataset {
    let mut features = Vec::new();
    let mut labels = Vec::new();
    for i in 0..rows {
        let class = i % 3;
        let line = 1 + i % 4;
        for r in 0..SIDE {
            for c in 0..SIDE {
                let on = match class {
                    0 => r == line,
                    1 => c == line,
                    _ => r == c,
                };
                features.push(0.3 * noise(i, r * SIDE + c) + if on { 1.0 } else { 0.0 });
            }
        }
        labels.push(class as u32);
    }
    Dataset {
        name: "images".into(),
        features,
        labels,
        dim: SIDE * SIDE,
        classes: 3,
    }
}

fn host(features: &Features) -> Vec<f32> {
    match features {
        Features::Host { data, .. } => data.clone(),
        Features::Device(t) => t.to_vec_f32().unwrap(),
    }
}

/// torchvision's RandomCrop(padding) then RandomHorizontalFlip, as plain loops over an
/// explicitly padded image.
fn reference(img: &[f32], pad: usize, dy: usize, dx: usize, flip: bool) -> Vec<f32> {
    let w = SIDE + 2 * pad;
    let mut padded = vec![0.0f32; w * w];
    for r in 0..SIDE {
        for c in 0..SIDE {
            padded[(r + pad) * w + c + pad] = img[r * SIDE + c];
        }
    }
    let mut out = Vec::new();
    for r in 0..SIDE {
        let mut row: Vec<f32> = (0..SIDE).map(|c| padded[(r + dy) * w + c + dx]).collect();
        if flip {
            row.reverse();
        }
        out.extend(row);
    }
    out
}

#[test]
fn crops_and_flips_are_seeded_and_match_the_reference() {
    let data = images(40);
    let aug = Augment { pad: 2, flip: true };
    let a = Augmented::new(&data, SIDE, aug, 7).unwrap();
    let b = Augmented::new(&data, SIDE, aug, 7).unwrap();
    // The trainer's epoch_order sets the epoch; the order is the dataset's own.
    assert_eq!(a.epoch_order(3, 1), data.epoch_order(3, 1));
    b.set_epoch(1);
    let idx: Vec<usize> = (0..40).rev().collect();
    let batch = a.batch(&idx).unwrap();
    assert_eq!(host(&batch.x), host(&b.batch(&idx).unwrap().x), "same seed");
    assert_eq!(batch.y, data.batch(&idx).unwrap().y);
    // The micro-batch that holds a sample does not change it.
    let mut split = host(&a.batch(&idx[..13]).unwrap().x);
    split.extend(host(&a.batch(&idx[13..]).unwrap().x));
    assert_eq!(split, host(&batch.x));
    // Each image is the reference's for its draw.
    let got = host(&batch.x);
    let n = SIDE * SIDE;
    let mut offsets = std::collections::HashSet::new();
    let mut flips = [0; 2];
    for (k, &i) in idx.iter().enumerate() {
        let d = a.draw(1, i);
        assert!(d.dy <= 4 && d.dx <= 4, "{d:?}");
        let img = &data.features[i * n..(i + 1) * n];
        assert_eq!(
            &got[k * n..(k + 1) * n],
            reference(img, 2, d.dy, d.dx, d.flip)
        );
        offsets.insert((d.dy, d.dx));
        flips[usize::from(d.flip)] += 1;
    }
    // The draws vary: many offsets, both flips, and another epoch draws otherwise.
    assert!(offsets.len() >= 10, "{offsets:?}");
    assert!(flips[0] > 5 && flips[1] > 5, "{flips:?}");
    a.set_epoch(2);
    assert_ne!(host(&a.batch(&idx).unwrap().x), got);
    let other_seed = Augmented::new(&data, SIDE, aug, 8).unwrap();
    other_seed.set_epoch(1);
    assert_ne!(host(&other_seed.batch(&idx).unwrap().x), got);
    // Off, the batches are the dataset's; bad paddings and shapes are typed errors.
    let off = Augmented::new(&data, SIDE, Augment::default(), 7).unwrap();
    assert_eq!(
        host(&off.batch(&idx).unwrap().x),
        host(&data.batch(&idx).unwrap().x)
    );
    let crop_only = Augment {
        pad: 1,
        flip: false,
    };
    assert!(Augmented::new(&data, SIDE, crop_only, 7).is_ok());
    let too_wide = Augment { pad: 6, flip: true };
    assert!(matches!(
        Augmented::new(&data, SIDE, too_wide, 7),
        Err(fitgrad::Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        Augmented::new(&data, 5, aug, 7),
        Err(fitgrad::Error::InvalidArgument { .. })
    ));
}

/// The synthetic images as a CSV file the example loads (`--dataset FILE`).
fn images_csv(rows: usize) -> tempfile::NamedTempFile {
    let data = images(rows);
    let mut f = tempfile::Builder::new().suffix(".csv").tempfile().unwrap();
    let header: Vec<String> = (0..data.dim).map(|k| format!("p{k}")).collect();
    writeln!(f, "{},label", header.join(",")).unwrap();
    for (row, label) in data.features.chunks(data.dim).zip(&data.labels) {
        let vals: Vec<String> = row.iter().map(|v| v.to_string()).collect();
        writeln!(f, "{},{label}", vals.join(",")).unwrap();
    }
    f.flush().unwrap();
    f
}

fn run(csv: &tempfile::NamedTempFile, batch: usize, extra: &[&str]) -> train_cnn::Outcome {
    try_run(csv, batch, extra).unwrap_or_else(|e| panic!("{extra:?}: {e}"))
}

/// The example on the images of `csv`, width 4, one epoch of batches of `batch`, with `extra`.
fn try_run(
    csv: &tempfile::NamedTempFile,
    batch: usize,
    extra: &[&str],
) -> fitgrad::Result<train_cnn::Outcome> {
    let path = csv.path().display().to_string();
    let batch = batch.to_string();
    let mut argv = vec![
        "train_cnn",
        "--dataset",
        &path,
        "--width",
        "4",
        "--batch-size",
        &batch,
        "--epochs",
        "1",
    ];
    argv.extend_from_slice(extra);
    let args = train_cnn::Args::try_parse_from(argv).unwrap();
    train_cnn::run(args, &Job::Single)
}

/// max |a - b| / max |a| of each tensor, the worst first.
fn worst_difference(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> (f32, String) {
    assert_eq!(a.len(), b.len());
    let mut worst = (0.0f32, String::new());
    for ((na, va), (nb, vb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        let largest = va
            .iter()
            .fold(0.0f32, |m, v| m.max(v.abs()))
            .max(f32::MIN_POSITIVE);
        let diff = va
            .iter()
            .zip(vb)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        if diff / largest > worst.0 {
            worst = (diff / largest, na.clone());
        }
    }
    worst
}

/// Half the unbudgeted peak as the budget: micro-batches with accumulation, and with group
/// norm (which mixes no samples, and turns on batch-invariant sums) the same weights at the
/// end, bit for bit.
#[test]
fn group_norm_under_half_the_peak_ends_with_the_same_weights() {
    if common::fresh_with_budget(None).is_none() {
        return;
    }
    let csv = images_csv(240);
    let flags = ["--norm", "group", "--optimizer", "sgd", "--lr", "0.05"];
    let whole = run(&csv, 96, &flags);
    let budget = (whole.measured_peak / 2).to_string();
    let mut budgeted_flags = flags.to_vec();
    budgeted_flags.extend(["--memory-budget", &budget]);
    let budgeted = run(&csv, 96, &budgeted_flags);
    assert_eq!(whole.micro_batch, 96);
    assert!(
        budgeted.micro_batch < 96 && budgeted.measured_peak <= whole.measured_peak / 2,
        "micro-batch {} at {} bytes",
        budgeted.micro_batch,
        budgeted.measured_peak
    );
    let (diff, name) = worst_difference(&whole.tensors, &budgeted.tensors);
    eprintln!(
        "micro-batch {} of 96, worst {name}: {diff:e}",
        budgeted.micro_batch
    );
    // Batch-invariant sums: bit for bit, not only within the 1e-5.
    assert_eq!(diff, 0.0, "{name}: {diff:e} relative");
    // The parameters moved: the comparison is not of two untrained models.
    let fresh = run(
        &csv,
        96,
        &["--norm", "group", "--optimizer", "sgd", "--lr", "1e-12"],
    );
    let (moved, _) = worst_difference(&fresh.tensors, &whole.tensors);
    assert!(moved > 1e-3, "{moved}");
}

/// A stem stride out of 1..=4 is refused by the parser, and a schedule that contradicts
/// `--cosine` before any device work.
#[test]
fn schedule_and_stem_stride_are_checked() {
    for stride in ["0", "5"] {
        let argv = ["train_cnn", "--stem-stride", stride];
        assert!(train_cnn::Args::try_parse_from(argv).is_err(), "{stride}");
    }
    refused(
        &["--cosine", "--schedule", "constant"],
        "--schedule constant",
    );
}

/// No output overwrites an input or another output, refused before any device work (issue
/// 43): the dataset as `--save` or `--report`, one file as both, a folder as `--save`.
#[test]
fn outputs_never_overwrite_inputs_or_each_other() {
    let csv = images_csv(8);
    let data = csv.path().display().to_string();
    let before = std::fs::read(csv.path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.bin").display().to_string();
    let folder = dir.path().display().to_string();
    for (flags, says) in [
        (vec!["--save", &data], "--dataset"),
        (vec!["--report", &data], "--dataset"),
        (vec!["--save", &out, "--report", &out], "--save"),
        (vec!["--save", &folder], "folder"),
    ] {
        let mut argv = vec!["train_cnn", "--dataset", &data];
        argv.extend(&flags);
        let args = train_cnn::Args::try_parse_from(argv).unwrap();
        match train_cnn::prepare(&args) {
            Err(fitgrad::Error::InvalidArgument { reason, .. }) => {
                assert!(reason.contains(says), "{flags:?}: {reason}")
            }
            other => panic!("{flags:?}: {:?}", other.err()),
        }
    }
    assert_eq!(
        std::fs::read(csv.path()).unwrap(),
        before,
        "the dataset changed"
    );
}

/// Every count is bounded by the rule every example shares, before any device work (issue
/// 43): an accumulation that divided by zero, epochs that wrapped the schedule, a width
/// that failed inside.
#[test]
fn counts_are_bounded() {
    let huge = (1u64 << 58).to_string();
    refused(&["--accum-steps", &huge], "--accum-steps");
    refused(&["--epochs", "9223372036854775808", "--cosine"], "--epochs");
    refused(&["--width", "100000"], "--width");
    refused(&["--batch-size", "0"], "--batch-size");
}

/// The example run with `flags` (on a dataset that does not exist) is refused before any
/// device work with an [`fitgrad::Error::InvalidArgument`] whose reason `says` this.
fn refused(flags: &[&str], says: &str) {
    let mut argv = vec!["train_cnn", "--dataset", "/nonexistent"];
    argv.extend_from_slice(flags);
    let args = train_cnn::Args::try_parse_from(argv).unwrap();
    match train_cnn::run(args, &Job::Single) {
        Err(fitgrad::Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains(says), "{reason}")
        }
        other => panic!("{flags:?}: {other:?}"),
    }
}

/// The planned peak of a step equals the measured one within 2%: f32 with batch norm, and
/// checkpointed residual blocks in mixed precision.
#[test]
fn planned_peak_equals_the_measured_one() {
    if common::fresh_with_budget(None).is_none() {
        return;
    }
    let csv = images_csv(48);
    for flags in [
        &[][..],
        &["--checkpoint-activations", "--precision", "mixed"][..],
        &["--augment", "--norm", "group"][..],
        &["--stem-stride", "2", "--schedule", "cosine"][..],
    ] {
        let o = run(&csv, 16, flags);
        let ratio = o.planned_peak as f64 / o.measured_peak as f64;
        assert!(
            (ratio - 1.0).abs() <= 0.02,
            "{flags:?}: planned {} measured {}",
            o.planned_peak,
            o.measured_peak
        );
        assert!(o.test_accuracy.is_finite());
    }
}

/// Batch norm under half the unbudgeted peak (the embedded digits, three steps of 64): the
/// micro-batch the budget fit chose runs every step without running out. The third step is
/// the one that needs it: a finely split budget arena still changes its free ranges in the
/// second, so the plan runs steps until they repeat.
#[test]
fn batch_norm_under_half_the_peak_runs_the_fitted_micro_batch() {
    if common::fresh_with_budget(None).is_none() {
        return;
    }
    let digits = |extra: &[&str]| {
        let mut argv = vec![
            "train_cnn",
            "--dataset",
            "digits",
            "--train-samples",
            "192",
            "--epochs",
            "1",
        ];
        argv.extend_from_slice(extra);
        let args = train_cnn::Args::try_parse_from(argv).unwrap();
        train_cnn::run(args, &Job::Single).unwrap()
    };
    let whole = digits(&[]);
    let budget = (whole.measured_peak / 2).to_string();
    let budgeted = digits(&["--memory-budget", &budget]);
    assert!(budgeted.micro_batch < 64, "{}", budgeted.micro_batch);
    assert_eq!(
        budgeted.oom_retries, 0,
        "micro-batch {}",
        budgeted.micro_batch
    );
    assert!(budgeted.measured_peak <= whole.measured_peak / 2);
}

/// `--fast-sums` belongs to group norm: with batch norm it is refused before any device work.
#[test]
fn fast_sums_need_group_norm() {
    refused(&["--fast-sums"], "--norm group");
}

/// Every budget from the minimum that `--fit auto`'s error names upwards fits: the rungs that
/// move state to the host keep checkpointing and mixed precision on, and where f32 (whose
/// weights need no f16 copies) is the most frugal configuration, a budget between its minimum
/// and what those rungs need takes it instead of an error that names a smaller minimum.
#[test]
fn fit_auto_fits_every_budget_from_the_minimum_it_names() {
    if common::fresh_with_budget(None).is_none() {
        return;
    }
    let csv = images_csv(64);
    let plan = |budget: u64| {
        let budget = budget.to_string();
        try_run(
            &csv,
            32,
            &["--memory-budget", &budget, "--fit", "auto", "--plan"],
        )
    };
    let minimum = match plan(64 << 10) {
        Err(fitgrad::Error::BudgetTooSmall { minimum, .. }) => minimum,
        other => panic!("64 KiB: {other:?}"),
    };
    for step in [0, 8] {
        let budget = minimum + step * minimum / 16;
        let outcome = plan(budget).unwrap_or_else(|e| panic!("{budget} (minimum {minimum}): {e}"));
        assert!(outcome.planned_peak <= budget, "{budget}");
    }
}

/// The smallest budget a too-small `--memory-budget` names (the model built under each
/// budget tried, as the other examples do) runs when passed back, and one byte less is
/// refused again (issue 43 item 6).
#[test]
fn minimum_budget_works_as_printed() {
    if common::fresh_with_budget(None).is_none() {
        return;
    }
    let csv = images_csv(32);
    let run = |budget: &str| try_run(&csv, 16, &["--memory-budget", budget]).map(|_| ());
    common::budget_figure::figure_passed_back_works(run, "1KiB");
}

/// `--fit auto` under a 1-byte budget names the smallest budget (a `BudgetTooSmall`), not a
/// raw out-of-memory (issue 43 item 6).
#[test]
fn fit_auto_under_one_byte_names_the_smallest_budget() {
    if common::fresh_with_budget(None).is_none() {
        return;
    }
    let csv = images_csv(32);
    match try_run(&csv, 16, &["--memory-budget", "1", "--fit", "auto"]) {
        Err(fitgrad::Error::BudgetTooSmall { minimum, .. }) => assert!(minimum > 1),
        other => panic!("{other:?}"),
    }
}

/// What ranks agree on before any collective (issue 43 item 3): every flag as resolved, a
/// default included, the dataset with its size, and not what only rank 0 writes; a flag
/// given otherwise is the pair that differs.
#[test]
fn ranks_agree_on_every_flag_as_resolved() {
    let csv = images_csv(8);
    let path = csv.path().display().to_string();
    let settings = |extra: &[&str]| {
        let mut argv = vec!["train_cnn", "--dataset", &path, "--save", "/tmp/x"];
        argv.extend_from_slice(extra);
        fitgrad::run::flag_settings::<train_cnn::Args>(argv.into_iter().map(Into::into)).unwrap()
    };
    let a = settings(&["--epochs", "1"]);
    let b = settings(&["--epochs", "2"]);
    let get = |s: &[(String, String)], f: &str| s.iter().find(|(k, _)| k == f).cloned();
    let size = std::fs::metadata(csv.path()).unwrap().len();
    assert_eq!(
        get(&a, "--dataset").unwrap().1,
        format!("{path} ({size} bytes)")
    );
    assert_eq!(
        get(&a, "--accum-steps").unwrap().1,
        "1",
        "a default is agreed on too"
    );
    assert!(get(&a, "--save").is_none(), "rank 0 alone writes");
    let differ: Vec<_> = a.iter().zip(&b).filter(|(x, y)| x != y).collect();
    assert_eq!(differ.len(), 1, "{differ:?}");
    assert_eq!(differ[0].0 .0, "--epochs");
}

/// A run that diverges suggests only flags train_cnn has: no `--clip-grad-norm` (issue 43
/// item 7).
#[test]
fn divergence_names_only_flags_it_has() {
    if common::fresh_with_budget(None).is_none() {
        return;
    }
    let csv = images_csv(32);
    match try_run(&csv, 16, &["--lr", "1e30", "--optimizer", "sgd"]) {
        Err(e @ fitgrad::Error::NonFinite { .. }) => {
            let msg = e.to_string();
            assert!(!msg.contains("--clip-grad-norm"), "{msg}");
            assert!(msg.contains("--lr") && msg.contains("--resume"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
}

/// A negative number given to a flag is refused naming the flag and saying it takes a
/// positive number, not as clap's "unexpected argument '-1'" (issue 43 item 7); the shared
/// parse of every example.
#[test]
fn negative_numbers_name_their_flag() {
    let argv = |extra: &[&str]| {
        let mut a = vec!["train_cnn", "--dataset", "digits"];
        a.extend_from_slice(extra);
        a.into_iter()
            .map(Into::into)
            .collect::<Vec<std::ffi::OsString>>()
    };
    for flag in ["--batch-size", "--epochs", "--accum-steps", "--width"] {
        let err = fitgrad::run::try_parse_from::<train_cnn::Args>(argv(&[flag, "-1"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("{flag} takes a positive number, got -1")),
            "{err}"
        );
    }
    assert!(fitgrad::run::try_parse_from::<train_cnn::Args>(argv(&["--epochs", "2"])).is_ok());
}
