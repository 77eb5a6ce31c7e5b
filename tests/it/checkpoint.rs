//! Checkpoints: model + AdamW state + training state round trip bitwise on every device; a run
//! saved halfway and resumed into fresh objects ends bitwise where the uninterrupted run does;
//! damaged, foreign and mismatched files give `Error::Data` (never a panic); a process killed
//! during saves leaves the previous checkpoint loadable; Python's `safetensors` reads the file.

use crate::common;

use common::*;
use fitgrad::checkpoint::{self, Checkpoint, HostTensor, ScalerState, TrainingState};
use fitgrad::nn::{cross_entropy, Activation, Mlp, Module};
use fitgrad::optim::{AdamW, Optimizer, Sgd};
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

device_tests!(
    round_trip_model_optimizer_and_training_state,
    resume_from_checkpoint_matches_uninterrupted_run,
    trainer_checkpoints_are_byte_for_byte_reproducible
);

/// A folder of its own under the system temp folder, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "fitgrad-ckpt-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const WIDTHS: [usize; 3] = [16, 32, 8];
const BATCH: usize = 12;

fn adamw(model: &Mlp) -> AdamW {
    AdamW::new(model.parameters(), 1e-2)
        .and_then(|o| o.weight_decay(0.1))
        .unwrap()
}

/// The fixed host batch of step `i`.
fn batch(i: u64) -> (Vec<f32>, Vec<u32>) {
    let x = host_data(100 + i, BATCH * WIDTHS[0], -1.0, 1.0);
    let y = (0..BATCH as u32)
        .map(|r| (r * 3 + i as u32) % WIDTHS[2] as u32)
        .collect();
    (x, y)
}

/// One training step on batch `i`: forward, cross-entropy, backward, AdamW step.
fn train_step(dev: &Device, model: &Mlp, opt: &mut AdamW, i: u64) {
    let (x, y) = batch(i);
    let x = Tensor::from_slice(dev, &x, &[BATCH, WIDTHS[0]]).unwrap();
    let x = match model.layers[0].weight.dtype() {
        DType::F32 => x,
        DType::F16 => x.to_dtype(DType::F16).unwrap(),
    };
    opt.zero_grad();
    let loss = cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
    loss.backward().unwrap();
    opt.step().unwrap();
}

fn host(t: &Tensor) -> HostTensor {
    HostTensor::read(t).unwrap()
}

fn assert_same_params(a: &dyn Module, b: &dyn Module, what: &str) {
    let (pa, pb) = (a.named_parameters(), b.named_parameters());
    assert_eq!(pa.len(), pb.len());
    for ((na, ta), (nb, tb)) in pa.iter().zip(&pb) {
        assert_eq!(na, nb);
        assert_eq!(host(ta), host(tb), "{what}: parameter {na} differs");
    }
}

fn assert_same_state(a: &dyn Optimizer, b: &dyn Optimizer, what: &str) {
    let (sa, sb) = (a.state(), b.state());
    assert_eq!(sa.step_count, sb.step_count, "{what}: step_count");
    assert_eq!(sa.param_steps, sb.param_steps, "{what}: param_steps");
    assert_eq!(sa.tensors.len(), sb.tensors.len(), "{what}: state tensors");
    for ((na, ta), (nb, tb)) in sa.tensors.iter().zip(&sb.tensors) {
        assert_eq!(na, nb);
        assert_eq!(host(ta), host(tb), "{what}: state {na} differs");
    }
}

fn sample_state() -> TrainingState {
    TrainingState::default()
        .step(2)
        .epoch(1)
        // Past 2^53: must survive as an integer, not through a float.
        .rng_state(u64::MAX - 12345)
        .scaler(ScalerState::new(65536.0 * 1.1, 17))
        .extra("lr", "0.01")
        .extra("note", "quotes \" and, commas")
}

/// The `Error::Data` reason, or a panic naming what came instead.
fn data_reason<T: std::fmt::Debug>(r: fitgrad::Result<T>, path: &Path, what: &str) -> String {
    match r {
        Err(Error::Data { path: p, reason }) => {
            assert_eq!(
                p,
                path.display().to_string(),
                "{what}: the error names the file"
            );
            reason
        }
        other => panic!("{what}: expected Error::Data, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Round trip and resume (GPU)
// ---------------------------------------------------------------------------------------------

fn round_trip_model_optimizer_and_training_state(dev: &Device) {
    let tmp = TempDir::new("roundtrip");
    for dtype in [DType::F32, DType::F16] {
        let what = format!("{} {dtype}", label(dev));
        let model = Mlp::with_dtype(dev, &WIDTHS, Activation::Relu, dtype, 1).unwrap();
        let mut opt = adamw(&model);
        for i in 0..2 {
            train_step(dev, &model, &mut opt, i);
        }
        let path = tmp.join(&format!("rt-{dtype}.safetensors"));
        let state = sample_state();
        checkpoint::save(&path, &model, Some(&opt), &state).unwrap();

        let ckpt = checkpoint::load(&path).unwrap();
        assert!(ckpt.is_fitgrad());
        assert_eq!(ckpt.training_state().unwrap(), state, "{what}");
        let names: Vec<&str> = ckpt.tensors.keys().map(String::as_str).collect();
        assert!(names.contains(&"model.layers.0.weight"), "{names:?}");
        assert!(names.contains(&"optim.3.exp_avg_sq"), "{names:?}");
        for (name, h) in &ckpt.tensors {
            // Optimizer state is f32 whatever the parameters' dtype.
            let want = if name.starts_with("optim.") {
                DType::F32
            } else {
                dtype
            };
            assert_eq!(h.dtype, want, "{what}: {name} keeps its dtype");
        }

        // Fresh objects from another seed, loaded from the file.
        let fresh = Mlp::with_dtype(dev, &WIDTHS, Activation::Relu, dtype, 99).unwrap();
        let mut fresh_opt = adamw(&fresh);
        ckpt.apply_model(&fresh).unwrap();
        ckpt.apply_optimizer(&mut fresh_opt).unwrap();
        assert_same_params(&model, &fresh, &what);
        assert_same_state(&opt, &fresh_opt, &what);

        // optimizer_state() + load_state() is the same path by hand.
        let mut by_hand = adamw(&fresh);
        by_hand
            .load_state(ckpt.optimizer_state(dev).unwrap())
            .unwrap();
        assert_same_state(&opt, &by_hand, &what);

        // Without an optimizer and without a scaler.
        let plain = TrainingState::default();
        checkpoint::save(&path, &model, None, &plain).unwrap();
        let ckpt = checkpoint::load(&path).unwrap();
        assert_eq!(ckpt.training_state().unwrap(), plain);
        assert!(ckpt.tensors.keys().all(|k| k.starts_with("model.")));
        let r = ckpt.apply_optimizer(&mut fresh_opt);
        let reason = data_reason(r, &path, "no optimizer state");
        assert!(reason.contains("no optimizer state"), "{reason}");
    }
}

fn resume_from_checkpoint_matches_uninterrupted_run(dev: &Device) {
    const N: u64 = 6;
    let tmp = TempDir::new("resume");
    let what = label(dev);
    let straight = Mlp::new(dev, &WIDTHS, Activation::Relu, 5).unwrap();
    let mut straight_opt = adamw(&straight);
    for i in 0..N {
        train_step(dev, &straight, &mut straight_opt, i);
    }

    let first = Mlp::new(dev, &WIDTHS, Activation::Relu, 5).unwrap();
    let mut first_opt = adamw(&first);
    for i in 0..N / 2 {
        train_step(dev, &first, &mut first_opt, i);
    }
    let path = tmp.join("resume.safetensors");
    let state = TrainingState::default().step(N / 2);
    checkpoint::save(&path, &first, Some(&first_opt), &state).unwrap();
    drop((first, first_opt));

    // A new process would start here: other weights, an optimizer without state.
    let resumed = Mlp::new(dev, &WIDTHS, Activation::Relu, 77).unwrap();
    let mut resumed_opt = adamw(&resumed);
    let ckpt = checkpoint::load(&path).unwrap();
    ckpt.apply_model(&resumed).unwrap();
    ckpt.apply_optimizer(&mut resumed_opt).unwrap();
    let start = ckpt.training_state().unwrap().step;
    for i in start..N {
        train_step(dev, &resumed, &mut resumed_opt, i);
    }
    assert_same_params(&straight, &resumed, &what);
    assert_same_state(&straight_opt, &resumed_opt, &what);
}

// ---------------------------------------------------------------------------------------------
// Mismatches (GPU)
// ---------------------------------------------------------------------------------------------

#[test]
fn mismatched_models_and_optimizers_are_data_errors() {
    let tmp = TempDir::new("mismatch");
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let model = Mlp::new(&dev, &[4, 8, 3], Activation::Relu, 1).unwrap();
    let mut opt = adamw(&model);
    let (x, y) = (host_data(1, 2 * 4, -1.0, 1.0), [0u32, 2]);
    let x = Tensor::from_slice(&dev, &x, &[2, 4]).unwrap();
    cross_entropy(&model.forward(&x).unwrap(), &y)
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    let path = tmp.join("m.safetensors");
    checkpoint::save(&path, &model, Some(&opt), &TrainingState::default()).unwrap();
    let ckpt = checkpoint::load(&path).unwrap();

    // Same shapes, another stored configuration (the activation): refused, nothing written.
    let gelu = Mlp::new(&dev, &[4, 8, 3], Activation::Gelu, 1).unwrap();
    let before = host(&gelu.layers[0].weight);
    let reason = data_reason(ckpt.apply_model(&gelu), &path, "config");
    assert!(
        reason.contains("activation = relu") && reason.contains("activation = gelu"),
        "{reason}"
    );
    assert_eq!(host(&gelu.layers[0].weight), before, "nothing written");
    let wide = Mlp::new(&dev, &[4, 9, 3], Activation::Relu, 1).unwrap();
    let before = host(&wide.layers[0].weight);
    // Without it (a file from a model that stores none), the tensors themselves are checked.
    let mut tensors_only = ckpt.clone();
    tensors_only
        .metadata
        .retain(|k, _| !k.starts_with(checkpoint::CONFIG_PREFIX));
    let ckpt = tensors_only;

    // Another hidden width: the first tensor named with both shapes.
    let reason = data_reason(ckpt.apply_model(&wide), &path, "shape");
    assert!(
        reason.contains("model.layers.0.weight") && reason.contains("[9, 4]"),
        "{reason}"
    );
    assert_eq!(host(&wide.layers[0].weight), before, "nothing written");

    // Another dtype.
    let half = Mlp::with_dtype(&dev, &[4, 8, 3], Activation::Relu, DType::F16, 1).unwrap();
    let reason = data_reason(ckpt.apply_model(&half), &path, "dtype");
    assert!(reason.contains("f16") && reason.contains("f32"), "{reason}");

    // A layer more: missing names; the layers that do fit are left alone.
    let deeper = Mlp::new(&dev, &[4, 8, 3, 3], Activation::Relu, 2).unwrap();
    let before = host(&deeper.layers[0].weight);
    let reason = data_reason(ckpt.apply_model(&deeper), &path, "missing");
    assert!(reason.contains("model.layers.2.weight"), "{reason}");
    assert_eq!(host(&deeper.layers[0].weight), before, "nothing written");

    // A tensor the model does not have.
    let mut more = ckpt.clone();
    more.tensors.insert(
        "model.layers.7.weight".into(),
        HostTensor::new(DType::F32, &[1], vec![0; 4]).unwrap(),
    );
    let reason = data_reason(more.apply_model(&model), &path, "extra");
    assert!(reason.contains("model.layers.7.weight"), "{reason}");

    // A model holding NaN, an infinity or an f16 NaN evaluates to a NaN loss: refused by
    // name, nothing written (issue 43, item 5).
    for (bits, what) in [
        (0x7fc0_0001u32, "NaN"),
        (0xff80_0000, "-inf"),
        (0x7f80_0000, "inf"),
    ] {
        let mut broken = ckpt.clone();
        let t = broken.tensors.get_mut("model.layers.1.bias").unwrap();
        t.bytes[4..8].copy_from_slice(&bits.to_le_bytes());
        let before = host(model.layers[1].bias.as_ref().unwrap());
        let reason = data_reason(broken.apply_model(&model), &path, what);
        assert!(
            reason.contains("'model.layers.1.bias'")
                && reason.contains(&format!("holds {what} (element 1)")),
            "{reason}"
        );
        assert_eq!(
            host(model.layers[1].bias.as_ref().unwrap()),
            before,
            "nothing written"
        );
    }

    // Optimizer state for other shapes.
    let mut wide_opt = adamw(&wide);
    let reason = data_reason(ckpt.apply_optimizer(&mut wide_opt), &path, "optimizer");
    assert!(reason.contains("does not fit"), "{reason}");

    // Another kind of optimizer.
    let mut sgd = Sgd::new(model.parameters(), 0.1).unwrap();
    let reason = data_reason(ckpt.apply_optimizer(&mut sgd), &path, "sgd");
    assert!(
        reason.contains("adamw") && reason.contains("sgd"),
        "{reason}"
    );

    // A plain state dict (no `model.` prefix, no metadata) still applies by name, but has no
    // training state.
    let mut foreign = Checkpoint::default();
    foreign.tensors = ckpt
        .tensors
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("model.")?.to_string(), v.clone())))
        .collect();
    let fpath = tmp.join("foreign.safetensors");
    foreign.save(&fpath).unwrap();
    let foreign = checkpoint::load(&fpath).unwrap();
    assert!(!foreign.is_fitgrad());
    let target = Mlp::new(&dev, &[4, 8, 3], Activation::Relu, 3).unwrap();
    foreign.apply_model(&target).unwrap();
    assert_same_params(&model, &target, "foreign");
    let reason = data_reason(foreign.training_state(), &fpath, "foreign state");
    assert!(reason.contains("not a fitgrad checkpoint"), "{reason}");
    let reason = data_reason(foreign.optimizer_state(&dev), &fpath, "foreign optim");
    assert!(reason.contains("not written by fitgrad"), "{reason}");
    let reason = data_reason(foreign.apply_model(&deeper), &fpath, "foreign missing");
    assert!(reason.contains("not written by fitgrad"), "{reason}");
}

// ---------------------------------------------------------------------------------------------
// Damaged files (host only)
// ---------------------------------------------------------------------------------------------

/// A safetensors file from a header and data, with the 8-byte length in front.
fn raw(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// A valid fitgrad checkpoint built on the host.
fn host_checkpoint() -> Checkpoint {
    let w: Vec<f32> = host_data(3, 12, -1.0, 1.0);
    let b: Vec<half::f16> = host_data(4, 3, -1.0, 1.0)
        .into_iter()
        .map(half::f16::from_f32)
        .collect();
    let mut c = Checkpoint::default();
    c.tensors.insert(
        "model.w".into(),
        HostTensor::new(DType::F32, &[3, 4], bytemuck::cast_slice(&w).to_vec()).unwrap(),
    );
    c.tensors.insert(
        "model.b".into(),
        HostTensor::new(DType::F16, &[3], bytemuck::cast_slice(&b).to_vec()).unwrap(),
    );
    c.metadata = BTreeMap::from([
        ("format".into(), "fitgrad".into()),
        ("version".into(), "1".into()),
        ("step".into(), "3".into()),
        ("epoch".into(), "0".into()),
        ("rng_state".into(), "9".into()),
    ]);
    c
}

#[test]
fn damaged_and_foreign_files_are_data_errors() {
    let tmp = TempDir::new("damaged");
    let path = tmp.join("c.safetensors");

    // A missing file is an I/O error naming it.
    match checkpoint::load(&tmp.join("nope.safetensors")) {
        Err(Error::Io { path, .. }) => assert!(path.ends_with("nope.safetensors")),
        other => panic!("missing file: {other:?}"),
    }

    // The valid file, as a baseline.
    let good = host_checkpoint().to_bytes().unwrap();
    std::fs::write(&path, &good).unwrap();
    let c = checkpoint::load(&path).unwrap();
    assert_eq!(c.tensors, host_checkpoint().tensors);
    assert_eq!(c.training_state().unwrap().step, 3);

    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", vec![], "too short"),
        ("seven bytes", good[..7].to_vec(), "too short"),
        ("cut in the header", good[..20].to_vec(), "truncated"),
        (
            "cut in the data",
            good[..good.len() - 3].to_vec(),
            "truncated",
        ),
        ("one byte appended", [&good[..], &[0]].concat(), "offsets"),
        ("random bytes", host_bytes(7, 4096), "header"),
        (
            "header length of 2^63",
            [&(1u64 << 63).to_le_bytes()[..], b"{}"].concat(),
            "not a safetensors file",
        ),
        (
            "header length past the end",
            [&1000u64.to_le_bytes()[..], b"{\"a\":1}"].concat(),
            "truncated",
        ),
        ("header not JSON", raw("{not json", &[]), "JSON"),
        (
            "header not UTF-8",
            [&4u64.to_le_bytes()[..], &[b'"', 0xff, 0xfe, b'"']].concat(),
            "UTF-8",
        ),
        (
            "unknown dtype",
            raw(
                r#"{"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}}"#,
                &[0; 4],
            ),
            "JSON",
        ),
        (
            "dtype fitgrad cannot hold",
            raw(
                r#"{"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#,
                &[0; 8],
            ),
            "dtype I64",
        ),
        (
            "offsets past the data",
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
                &[0; 4],
            ),
            "offsets",
        ),
        (
            "offsets that do not fit the shape",
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                &[0; 4],
            ),
            "shape and dtype",
        ),
        (
            "overlapping offsets",
            raw(
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
                &[0; 4],
            ),
            "offsets",
        ),
        (
            // Offsets near 2^64 overflow safetensors' own arithmetic: caught before it.
            "offsets near 2^64",
            raw(
                r#"{"a":{"dtype":"U8","shape":[18446744073709551000],"data_offsets":[0,18446744073709551000]}}"#,
                &[],
            ),
            "that large",
        ),
        (
            // Offsets that pass safetensors' checks and end at 2^64 - 1, where its
            // `end + header length` overflows (a panic in debug builds).
            "offsets chained up to 2^64",
            raw(&chained_header(), &[]),
            "that large",
        ),
        (
            "shape overflowing usize",
            raw(
                r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#,
                &[],
            ),
            "",
        ),
        (
            "a newer fitgrad",
            raw(
                r#"{"__metadata__":{"format":"fitgrad","version":"99"}}"#,
                &[],
            ),
            "newer fitgrad",
        ),
        (
            "metadata not strings",
            raw(r#"{"__metadata__":{"step":3}}"#, &[]),
            "JSON",
        ),
    ];
    for (what, bytes, expect) in cases {
        std::fs::write(&path, &bytes).unwrap();
        let reason = data_reason(checkpoint::load(&path), &path, what);
        assert!(
            reason.contains(expect),
            "{what}: reason '{reason}' lacks '{expect}'"
        );
        eprintln!("{what}: {reason}");
    }

    // A foreign file (no format metadata) loads as tensors, with no training state.
    std::fs::write(
        &path,
        raw(
            r#"{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            &1.5f32.to_le_bytes(),
        ),
    )
    .unwrap();
    let c = checkpoint::load(&path).unwrap();
    assert!(!c.is_fitgrad());
    assert_eq!(c.tensors["w"].to_f32(), vec![1.5]);
    let reason = data_reason(c.training_state(), &path, "foreign");
    assert!(reason.contains("not a fitgrad checkpoint"), "{reason}");

    // Bad values in a fitgrad file's metadata.
    for (key, value, expect) in [
        ("step", "-1", "not a count"),
        ("rng_state", "18446744073709551616", "not a count"),
        ("scaler.scale", "1.0", "only one of"),
    ] {
        let mut c = host_checkpoint();
        c.metadata.insert(key.into(), value.into());
        c.save(&path).unwrap();
        let c = checkpoint::load(&path).unwrap();
        let reason = data_reason(c.training_state(), &path, key);
        assert!(reason.contains(expect), "{key}: {reason}");
    }
}

/// Sixteen U8 tensors whose contiguous offsets end at `u64::MAX` (each passes safetensors'
/// size checks).
fn chained_header() -> String {
    let mut start = 0u64;
    let parts: Vec<String> = (0..16)
        .map(|i| {
            let size = if i < 15 { 1u64 << 60 } else { u64::MAX - start };
            let s = format!(
                r#""t{i}":{{"dtype":"U8","shape":[{size}],"data_offsets":[{start},{}]}}"#,
                start + size
            );
            start += size;
            s
        })
        .collect();
    format!("{{{}}}", parts.join(","))
}

fn host_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut r = HostRng::new(seed);
    (0..n).map(|_| r.next_u64() as u8).collect()
}

// ---------------------------------------------------------------------------------------------
// Reproducible bytes
// ---------------------------------------------------------------------------------------------

/// `host_checkpoint` with many metadata keys, inserted in the order `keys` gives.
fn many_keys(keys: impl Iterator<Item = usize>) -> Checkpoint {
    let mut c = host_checkpoint();
    for k in keys {
        c.metadata
            .insert(format!("extra.k{k:02}"), format!("v \"{k}\""));
    }
    c
}

#[test]
fn checkpoint_bytes_are_reproducible_and_read_as_safetensors() {
    // Forty metadata keys: a HashMap's order would differ between two maps.
    let forward = many_keys(0..40).to_bytes().unwrap();
    let backward = many_keys((0..40).rev()).to_bytes().unwrap();
    assert!(forward == backward, "insertion order leaks into the file");
    for _ in 0..4 {
        assert!(many_keys(0..40).to_bytes().unwrap() == forward);
    }
    // Load and write again: the same bytes.
    let loaded = Checkpoint::from_bytes(&forward, "mem").unwrap();
    assert_eq!(loaded.metadata.len(), 45);
    assert!(
        loaded.to_bytes().unwrap() == forward,
        "load + save changes the bytes"
    );

    // The header: 8-byte aligned, metadata first with sorted keys, then the tensors.
    let n = u64::from_le_bytes(forward[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
    let header = std::str::from_utf8(&forward[8..8 + n]).unwrap();
    assert!(header.starts_with(r#"{"__metadata__":{"epoch":"0","extra.k00":"v \"0\"","#));
    let keys: Vec<usize> = loaded
        .metadata
        .keys()
        .map(|k| header.find(&format!("\"{k}\"")).unwrap())
        .collect();
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "{header}");

    // What safetensors itself writes, byte for byte, where its HashMap has no order to leak:
    // no metadata, and a single key.
    let mut c = host_checkpoint();
    for meta in [
        BTreeMap::new(),
        BTreeMap::from([("format".into(), "fitgrad".into())]),
    ] {
        c.metadata = meta;
        let theirs = safetensors::serialize(
            c.tensors.iter(),
            (!c.metadata.is_empty()).then(|| c.metadata.clone().into_iter().collect()),
        )
        .unwrap();
        assert!(c.to_bytes().unwrap() == theirs, "{} keys", c.metadata.len());
    }

    // A tensor whose bytes do not fit its shape is refused, not written.
    let mut bad = host_checkpoint();
    bad.tensors.get_mut("model.w").unwrap().bytes.pop();
    let reason = data_reason(bad.to_bytes(), Path::new(""), "short tensor");
    assert!(reason.contains("'model.w' holds 47 bytes"), "{reason}");
}

fn trainer_checkpoints_are_byte_for_byte_reproducible(dev: &Device) {
    use fitgrad::train::data::Dataset;
    use fitgrad::train::{Precision, Trainer, TrainerConfig};
    let tmp = TempDir::new("bytes");
    let data = Dataset {
        name: "rows".into(),
        features: host_data(7, 2 * BATCH * WIDTHS[0], -1.0, 1.0),
        labels: (0..2 * BATCH as u32)
            .map(|r| r % WIDTHS[2] as u32)
            .collect(),
        dim: WIDTHS[0],
        classes: WIDTHS[2],
    };
    let rows: Vec<usize> = (0..data.len()).collect();
    let what = label(dev);
    let trainer = |seed| {
        let model = Mlp::new(dev, &WIDTHS, Activation::Relu, seed).unwrap();
        let opt = Box::new(adamw(&model));
        // Mixed precision: a scaler's state too.
        let config = TrainerConfig::new(BATCH, 1, 1e-2).precision(Precision::Mixed);
        Trainer::new(model, opt, config).unwrap()
    };
    let mut t = trainer(1);
    for batch in rows.chunks(BATCH) {
        t.step(&data, batch).unwrap();
    }
    let (a, b) = (tmp.join("a.safetensors"), tmp.join("b.safetensors"));
    t.save_checkpoint(&a, 1).unwrap();
    t.save_checkpoint(&b, 1).unwrap();
    let bytes = std::fs::read(&a).unwrap();
    assert!(
        bytes == std::fs::read(&b).unwrap(),
        "{what}: two saves differ"
    );

    // Into a fresh trainer and out again; and through the host checkpoint alone.
    let mut fresh = trainer(99);
    assert_eq!(fresh.resume_from(&a).unwrap(), 1);
    let c = tmp.join("c.safetensors");
    fresh.save_checkpoint(&c, 1).unwrap();
    assert!(
        bytes == std::fs::read(&c).unwrap(),
        "{what}: resume + save differs"
    );
    let d = tmp.join("d.safetensors");
    checkpoint::load(&a).unwrap().save(&d).unwrap();
    assert!(
        bytes == std::fs::read(&d).unwrap(),
        "{what}: load + save differs"
    );
}

#[test]
fn concurrent_atomic_writes_to_one_path_never_mix() {
    // Eight threads save to one path at once: each through its own temporary file, so the
    // result is one whole file of one writer, and no temporary file is left behind.
    let tmp = TempDir::new("threads");
    let path = tmp.join("shared.bin");
    std::thread::scope(|s| {
        for t in 0..8u8 {
            let path = &path;
            s.spawn(move || {
                for _ in 0..10 {
                    fitgrad::write_atomic(path, &vec![t; 64 << 10]).unwrap();
                }
            });
        }
    });
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len(), 64 << 10);
    assert!(bytes.iter().all(|&b| b == bytes[0]), "two writers mixed");
    let names: Vec<String> = std::fs::read_dir(&tmp.0)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["shared.bin"]);
    #[cfg(unix)]
    {
        // The mode a plain File::create gives (0666 less the umask), not tempfile's 0600.
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let plain = tmp.join("plain");
        std::fs::File::create(&plain).unwrap();
        assert_eq!(mode(&path), mode(&plain), "{:o}", mode(&path));
    }
}

// ---------------------------------------------------------------------------------------------
// Killed during saves
// ---------------------------------------------------------------------------------------------

const CHILD_ENV: &str = "FITGRAD_CKPT_KILL_CHILD";
/// ~52 MB of f32 parameters.
const BIG: [usize; 5] = [2048, 2048, 2048, 2048, 256];

/// Not a test on its own: run by `killed_during_save_keeps_the_previous_checkpoint` as a child
/// process with FITGRAD_CKPT_KILL_CHILD="<checkpoint>;<progress file>;<first step>", it saves a
/// large checkpoint to the same path over and over until it is killed (or a minute passes).
#[test]
#[ignore = "child process of killed_during_save_keeps_the_previous_checkpoint: set \
            FITGRAD_CKPT_KILL_CHILD=<checkpoint>;<progress file>;<first step>"]
fn kill_child_saver() {
    let Some(child) = kill::Child::from_env(CHILD_ENV) else {
        return;
    };
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    let model = Mlp::new(&dev, &BIG, Activation::Relu, 11).unwrap();
    child.save_until_killed(|step| {
        let state = TrainingState::default().step(step);
        checkpoint::save(&child.path, &model, None, &state).unwrap();
    });
}

#[test]
fn killed_during_save_keeps_the_previous_checkpoint() {
    if devices().is_empty() {
        return;
    }
    let tmp = TempDir::new("kill");
    let path = tmp.join("big.safetensors");
    let mut reference: Option<Checkpoint> = None;
    let mut last_step = 0;
    kill::kill_during_saves(
        "checkpoint::kill_child_saver",
        CHILD_ENV,
        &path,
        8,
        |round, first| {
            let c = checkpoint::load(&path)
                .unwrap_or_else(|e| panic!("round {round}: the checkpoint does not load: {e}"));
            let step = c.training_state().unwrap().step;
            assert!(
                step >= first && step >= last_step,
                "round {round}: step {step}"
            );
            last_step = step;
            match &reference {
                None => reference = Some(c),
                Some(r) => assert!(r.tensors == c.tensors, "round {round}: tensors differ"),
            }
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Python
// ---------------------------------------------------------------------------------------------

const PY_READ: &str = r#"
import json, sys
from safetensors import safe_open
import numpy as np
out = {"tensors": {}}
with safe_open(sys.argv[1], framework="np") as f:
    out["metadata"] = f.metadata()
    for k in f.keys():
        t = f.get_tensor(k)
        out["tensors"][k] = {"shape": list(t.shape), "dtype": str(t.dtype),
                             "hex": t.astype(t.dtype.newbyteorder("<")).tobytes().hex()}
print(json.dumps(out))
"#;

/// Writes a state dict for an Mlp [3, 2] (weight arange/10, bias -1, -2) in f16.
const PY_WRITE: &str = r#"
import sys
import numpy as np
from safetensors.numpy import save_file
save_file({"layers.0.weight": (np.arange(6, dtype=np.float32) / 10).reshape(2, 3).astype(np.float16),
           "layers.0.bias": np.array([-1, -2], dtype=np.float16)},
          sys.argv[1], metadata={"format": "np"})
"#;

fn python() -> String {
    std::env::var("FITGRAD_PYTHON").unwrap_or_else(|_| "python3".into())
}

#[test]
fn python_safetensors_reads_the_checkpoint() {
    let py = python();
    let has = std::process::Command::new(&py)
        .args(["-c", "import safetensors.numpy, numpy"])
        .output();
    if !has.is_ok_and(|o| o.status.success()) {
        eprintln!(
            "NOTE: python_safetensors_reads_the_checkpoint checked nothing: '{py}' with the \
             safetensors and numpy modules is not available (pip install safetensors numpy)"
        );
        return;
    }
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let tmp = TempDir::new("python");
    let path = tmp.join("py.safetensors");
    let model = Mlp::new(&dev, &[3, 5, 2], Activation::Relu, 4).unwrap();
    let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
    let x = Tensor::from_slice(&dev, &host_data(5, 6, -1.0, 1.0), &[2, 3]).unwrap();
    cross_entropy(&model.forward(&x).unwrap(), &[1, 0])
        .unwrap()
        .backward()
        .unwrap();
    opt.step().unwrap();
    let mut state = sample_state();
    state.step = 1;
    checkpoint::save(&path, &model, Some(&opt), &state).unwrap();
    let half_model = Mlp::with_dtype(&dev, &[3, 2], Activation::Relu, DType::F16, 4).unwrap();
    let hpath = tmp.join("py16.safetensors");
    checkpoint::save(&hpath, &half_model, None, &TrainingState::default()).unwrap();

    let script = tmp.join("read.py");
    std::fs::write(&script, PY_READ).unwrap();
    for p in [&path, &hpath] {
        let out = std::process::Command::new(&py)
            .arg(&script)
            .arg(p)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "python failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let ours = checkpoint::load(p).unwrap();
        let meta = v["metadata"].as_object().unwrap();
        assert_eq!(meta.len(), ours.metadata.len());
        for (k, val) in &ours.metadata {
            assert_eq!(meta[k].as_str(), Some(val.as_str()), "metadata {k}");
        }
        let tensors = v["tensors"].as_object().unwrap();
        assert_eq!(tensors.len(), ours.tensors.len());
        for (name, h) in &ours.tensors {
            let t = &tensors[name];
            let shape: Vec<usize> = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(shape, h.dims, "{name}");
            let dtype = match h.dtype {
                DType::F32 => "float32",
                DType::F16 => "float16",
            };
            assert_eq!(t["dtype"], dtype, "{name}");
            let hex: String = h.bytes.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(t["hex"], hex, "{name}: bytes");
        }
        eprintln!(
            "python safetensors read {} ({} tensors, metadata format = {})",
            p.display(),
            tensors.len(),
            meta["format"]
        );
    }

    // And the other way: a state dict numpy wrote applies to a model by name.
    let script = tmp.join("write.py");
    std::fs::write(&script, PY_WRITE).unwrap();
    let npath = tmp.join("np.safetensors");
    let out = std::process::Command::new(&py)
        .arg(&script)
        .arg(&npath)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let c = checkpoint::load(&npath).unwrap();
    assert!(!c.is_fitgrad());
    c.apply_model(&half_model).unwrap();
    let w = half_model.layers[0].weight.to_vec_f32().unwrap();
    let want: Vec<f32> = (0..6).map(|i| round_f16(i as f32 / 10.0)).collect();
    assert_eq!(w, want);
    let b = half_model.layers[0].bias.as_ref().unwrap();
    assert_eq!(b.to_vec_f32().unwrap(), vec![-1.0, -2.0]);
}
