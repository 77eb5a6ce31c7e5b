//! Hugging Face folders against what transformers and tokenizers computed on them
//! (tests/fixtures/hf, made by scripts/make_hf_fixtures.py; no Python here): per-position logits
//! and the eval loss of eval.txt within 1e-4 for each GPT-2 fixture (f32, f16 sharded without
//! `transformer.`, bf16 with mask buffers, a tied head and eps 1e-3), the tokenizer's ids and
//! decoded text, the finetune example, the export read back, greedy generation through the KV
//! cache against plain forwards, and every bad folder refused with an error naming the file and
//! the tensor before any device work (those tests open no device).

use crate::common;

use crate::examples::finetune;

use common::*;
use fitgrad::checkpoint::HostTensor;
use fitgrad::hf::{save_gpt2, PretrainedGpt, Tokenizer};
use fitgrad::nn::{Gpt, GptConfig, Module, Sampling};
use fitgrad::train::window_loss;
use fitgrad::{DType, Device, Error};
use serde_json::Value;
use std::path::{Path, PathBuf};

const MODELS: [&str; 3] = ["gpt2-tiny", "gpt2-tiny-f16-sharded", "gpt2-tiny-bf16"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

fn expected() -> Value {
    let text = std::fs::read_to_string(fixtures().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn eval_text() -> String {
    std::fs::read_to_string(fixtures().join("eval.txt")).unwrap()
}

device_tests!(logits_match_transformers);

/// The rest on one Vulkan device of its own (one set of kernel compiles): the example plans a
/// step, and a plan on a device other test threads use at the same time sees their frees (the
/// arena's category counts then underflow).
#[test]
#[allow(clippy::field_reassign_with_default)]
fn eval_finetune_export_and_generation() {
    let mut o = fitgrad::DeviceOptions::default();
    o.backend = Some("vulkan".into());
    if let Some(dev) = fresh_device(o) {
        eval_loss_matches_transformers(&dev);
        finetune_on(&dev);
        export_reads_back_on(&dev);
        greedy_on(&dev);
    }
}

fn logits_match_transformers(dev: &Device) {
    let exp = expected();
    let ids = ids_of(&exp["logits_ids"]);
    let bytes = std::fs::read(fixtures().join("expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for name in MODELS {
        let folder = PretrainedGpt::open(&fixtures().join(name), DType::F32).unwrap();
        let gpt = folder.build(dev).unwrap();
        gpt.set_training(false);
        let got = gpt
            .forward_ids(&ids, 1, ids.len())
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let want = st.tensor(name).unwrap();
        assert_eq!(want.shape(), [ids.len(), gpt.gpt_config().vocab_size]);
        let want: Vec<f32> = bytemuck::pod_collect_to_vec(want.data());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= 1e-4,
            "{name} on {}: logits differ from transformers' by up to {worst}",
            label(dev)
        );
    }
}

fn eval_loss_matches_transformers(dev: &Device) {
    let exp = expected();
    let tok = Tokenizer::from_file(&fixtures().join("gpt2-tiny/tokenizer.json")).unwrap();
    let ids = tok.encode(&eval_text()).unwrap();
    assert_eq!(ids, ids_of(&exp["eval_ids"]), "eval.txt's ids");
    for name in MODELS {
        let gpt = PretrainedGpt::open(&fixtures().join(name), DType::F32)
            .unwrap()
            .build(dev)
            .unwrap();
        gpt.set_training(false);
        for (context, want) in exp["models"][name]["eval"].as_object().unwrap() {
            let context: usize = context.parse().unwrap();
            let got = window_loss(&gpt, &ids, context, 4, DType::F32).unwrap();
            let loss = want["eval_loss"].as_f64().unwrap();
            assert_eq!(got.tokens as u64, want["tokens"].as_u64().unwrap());
            assert!(
                (got.loss - loss).abs() <= 1e-4,
                "{name} at context {context} on {}: eval loss {} against transformers' {loss}",
                label(dev),
                got.loss
            );
        }
    }
}

/// Every parameter of `a` equals `b`'s, bit for bit.
fn same_weights(a: &Gpt, b: &Gpt) {
    let (pa, pb) = (a.named_parameters(), b.named_parameters());
    assert_eq!(pa.len(), pb.len());
    for ((na, ta), (nb, tb)) in pa.iter().zip(&pb) {
        assert_eq!(na, nb);
        assert_eq!(
            HostTensor::read(ta).unwrap(),
            HostTensor::read(tb).unwrap(),
            "{na}"
        );
    }
}

fn export_reads_back_on(dev: &Device) {
    let dir = tempfile::tempdir().unwrap();
    // A loaded model, with its tokenizer.
    let src = fixtures().join("gpt2-tiny-bf16");
    let folder = PretrainedGpt::open(&src, DType::F32).unwrap();
    let gpt = folder.build(dev).unwrap();
    let out = dir.path().join("loaded");
    save_gpt2(&gpt, &out, Some(&src.join("tokenizer.json"))).unwrap();
    let back = PretrainedGpt::open(&out, DType::F32).unwrap();
    assert_eq!(back.config, folder.config);
    same_weights(&gpt, &back.build(dev).unwrap());
    assert_eq!(
        std::fs::read(out.join("tokenizer.json")).unwrap(),
        std::fs::read(src.join("tokenizer.json")).unwrap()
    );
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(json["layer_norm_epsilon"].as_f64().unwrap() as f32, 1e-3);
    assert_eq!(json["architectures"][0], "GPT2LMHeadModel");
    // The tokenizer's <|endoftext|> (id 0 in the fixtures') starts and ends texts.
    assert_eq!(
        (json["bos_token_id"].as_u64(), json["eos_token_id"].as_u64()),
        (Some(0), Some(0))
    );
    // The crate's own model (odd sizes, another eps), without a tokenizer.
    let mut cfg = GptConfig::new(13, 6, 1, 3, 9);
    cfg.layer_norm_eps = 1e-6;
    cfg.seed = 5;
    let own = Gpt::new(dev, cfg.clone()).unwrap();
    let out = dir.path().join("own");
    save_gpt2(&own, &out, None).unwrap();
    assert!(!out.join("tokenizer.json").exists());
    let back = PretrainedGpt::open(&out, DType::F32).unwrap();
    assert_eq!(back.config.layer_norm_eps, 1e-6);
    assert_eq!(
        (back.config.vocab_size, back.config.context, back.config.dim),
        (13, 6, 9)
    );
    let back = back.build(dev).unwrap();
    same_weights(&own, &back);
    let ids = [1, 2, 3, 12];
    assert_eq!(
        own.forward_ids(&ids, 1, 4).unwrap().to_vec_f32().unwrap(),
        back.forward_ids(&ids, 1, 4).unwrap().to_vec_f32().unwrap()
    );
}

/// Read as f16, the f16 file's weights are its own bits and the bf16 file's are rounded once;
/// on the host, before any device work (f16 compute is the kernels' own tests' business).
#[test]
fn f16_reads_keep_the_values() {
    for name in ["gpt2-tiny-f16-sharded", "gpt2-tiny-bf16"] {
        let dir = fixtures().join(name);
        let (a, b) = (
            PretrainedGpt::open(&dir, DType::F32).unwrap(),
            PretrainedGpt::open(&dir, DType::F16).unwrap(),
        );
        assert_eq!(b.config.dtype, DType::F16);
        let (a, b) = (a.host_weights(), b.host_weights());
        assert_eq!(a.len(), b.len());
        for ((na, ta), (nb, tb)) in a.iter().zip(b) {
            assert_eq!((na, &ta.dims), (nb, &tb.dims));
            assert_eq!(tb.dtype, DType::F16);
            let want: Vec<f32> = ta
                .to_f32()
                .iter()
                .map(|&v| half::f16::from_f32(v).to_f32())
                .collect();
            assert_eq!(tb.to_f32(), want, "{name}: {na}");
        }
    }
}

#[test]
fn tokenizer_matches_the_python_library() {
    let exp = expected();
    for name in MODELS {
        let tok = Tokenizer::from_file(&fixtures().join(name).join("tokenizer.json")).unwrap();
        assert_eq!(tok.vocab_size(), 320);
        for case in exp["tokenizer"].as_array().unwrap() {
            let text = case["text"].as_str().unwrap();
            let ids = tok.encode(text).unwrap();
            assert_eq!(ids, ids_of(&case["ids"]), "ids of {text:?}");
            assert_eq!(
                tok.decode(&ids).unwrap(),
                case["decoded"].as_str().unwrap(),
                "text of {text:?}"
            );
        }
    }
    let tok = Tokenizer::from_file(&fixtures().join("gpt2-tiny/tokenizer.json")).unwrap();
    assert!(matches!(
        tok.decode(&[320]),
        Err(Error::InvalidArgument { .. })
    ));
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("tokenizer.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    assert!(
        matches!(Tokenizer::from_file(&bad), Err(Error::Data { path, .. }) if path.ends_with("tokenizer.json"))
    );
}

/// A copy of fixture `name` in a temporary folder, for breaking.
fn copy_of(name: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join(name);
    std::fs::create_dir(&to).unwrap();
    for f in std::fs::read_dir(fixtures().join(name)).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
    }
    (dir, to)
}

/// The error of opening `dir`, which must be an `Error::Data` whose path ends with `file` and
/// whose message holds each of `words`.
fn refused(dir: &Path, file: &str, words: &[&str]) {
    match PretrainedGpt::open(dir, DType::F32) {
        Err(Error::Data { path, reason }) => {
            assert!(
                path.ends_with(file),
                "{path}: {reason} (expected the file {file})"
            );
            for w in words {
                assert!(reason.contains(w), "{path}: {reason} (expected '{w}')");
            }
        }
        Err(e) => panic!("{e} is not an Error::Data"),
        Ok(_) => panic!("{} loaded", dir.display()),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let path = dir.join("config.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(json.as_object_mut().unwrap());
    std::fs::write(path, serde_json::to_string(&json).unwrap()).unwrap();
}

/// Rewrites `dir/file` with `f` applied to its tensors (name, dtype, dims, bytes).
fn edit_weights(
    dir: &Path,
    file: &str,
    f: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let path = dir.join(file);
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    f(&mut ts);
    let views: Vec<(String, safetensors::tensor::TensorView)> = ts
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

#[test]
fn bad_folders_are_refused_before_device_work() {
    let st = "model.safetensors";
    // No folder contents at all, then no weights.
    let empty = tempfile::tempdir().unwrap();
    refused(empty.path(), "", &["no config.json"]);

    let (_d, dir) = copy_of("gpt2-tiny");
    edit_config(&dir, |c| {
        c.insert("model_type".into(), "llama".into());
    });
    refused(&dir, "config.json", &["model_type \"llama\"", "gpt2"]);

    let (_d, dir) = copy_of("gpt2-tiny");
    edit_config(&dir, |c| {
        c.insert(
            "architectures".into(),
            serde_json::json!(["GPT2ForSequenceClassification"]),
        );
    });
    refused(&dir, "config.json", &["GPT2ForSequenceClassification"]);

    let (_d, dir) = copy_of("gpt2-tiny");
    edit_config(&dir, |c| {
        c.insert("activation_function".into(), "gelu".into());
    });
    refused(&dir, "config.json", &["\"gelu\"", "tanh"]);

    let (_d, dir) = copy_of("gpt2-tiny");
    std::fs::remove_file(dir.join(st)).unwrap();
    refused(&dir, "gpt2-tiny", &["no model.safetensors"]);

    // A wrong shape: the config's vocabulary no longer matches the embedding.
    let (_d, dir) = copy_of("gpt2-tiny");
    edit_config(&dir, |c| {
        c.insert("vocab_size".into(), 321.into());
    });
    refused(&dir, st, &["'wte.weight'", "[320, 24]", "[321, 24]"]);

    // Missing, extra and foreign-dtype tensors.
    let (_d, dir) = copy_of("gpt2-tiny");
    edit_weights(&dir, st, |ts| {
        ts.retain(|t| t.0 != "transformer.h.1.mlp.c_fc.bias")
    });
    refused(&dir, st, &["missing", "'h.1.mlp.c_fc.bias'"]);

    let (_d, dir) = copy_of("gpt2-tiny");
    edit_weights(&dir, st, |ts| {
        ts.push((
            "transformer.h.2.ln_1.weight".into(),
            safetensors::Dtype::F32,
            vec![24],
            vec![0; 96],
        ))
    });
    refused(&dir, st, &["'h.2.ln_1.weight'", "not parameters"]);

    let (_d, dir) = copy_of("gpt2-tiny");
    edit_weights(&dir, st, |ts| {
        let t = ts
            .iter_mut()
            .find(|t| t.0 == "transformer.ln_f.bias")
            .unwrap();
        t.1 = safetensors::Dtype::I32;
    });
    refused(&dir, st, &["'transformer.ln_f.bias'", "I32"]);

    // An untied head.
    let (_d, dir) = copy_of("gpt2-tiny-bf16");
    edit_weights(&dir, st, |ts| {
        let t = ts.iter_mut().find(|t| t.0 == "lm_head.weight").unwrap();
        t.3[0] ^= 1;
    });
    refused(&dir, st, &["'lm_head.weight'", "untied"]);

    // Truncated: the data ends early.
    let (_d, dir) = copy_of("gpt2-tiny");
    let bytes = std::fs::read(dir.join(st)).unwrap();
    std::fs::write(dir.join(st), &bytes[..bytes.len() - 100]).unwrap();
    refused(&dir, st, &["truncated"]);

    // A shard the index names is gone; a tensor moved out of the shard the index gives.
    let (_d, dir) = copy_of("gpt2-tiny-f16-sharded");
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    match PretrainedGpt::open(&dir, DType::F32) {
        Err(Error::Io { path, .. }) => assert!(path.ends_with("model-00002-of-00002.safetensors")),
        other => panic!("{:?}", other.err()),
    }
    let (_d, dir) = copy_of("gpt2-tiny-f16-sharded");
    let first = "model-00001-of-00002.safetensors";
    let mut moved = None;
    edit_weights(&dir, first, |ts| moved = ts.pop());
    edit_weights(&dir, "model-00002-of-00002.safetensors", |ts| {
        ts.push(moved.clone().unwrap())
    });
    let name = moved.unwrap().0;
    refused(&dir, "model-00002-of-00002.safetensors", &[&name, first]);

    // A bf16 value past f16's range loads as f32 and is refused as f16, naming the tensor.
    let (_d, dir) = copy_of("gpt2-tiny-bf16");
    edit_weights(&dir, st, |ts| {
        let t = ts.iter_mut().find(|t| t.0 == "h.0.ln_2.weight").unwrap();
        t.3[..2].copy_from_slice(&half::bf16::from_f32(1e6).to_le_bytes());
    });
    PretrainedGpt::open(&dir, DType::F32).unwrap();
    match PretrainedGpt::open(&dir, DType::F16) {
        Err(Error::Data { path, reason }) => {
            assert!(path.ends_with(st), "{path}");
            assert!(
                reason.contains("'h.0.ln_2.weight'") && reason.contains("overflows f16"),
                "{reason}"
            );
        }
        other => panic!("{:?}", other.err()),
    }

    // No tokenizer.
    let (_d, dir) = copy_of("gpt2-tiny");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let folder = PretrainedGpt::open(&dir, DType::F32).unwrap();
    assert!(
        matches!(folder.tokenizer(), Err(Error::Data { reason, .. }) if reason.contains("tokenizer.json"))
    );
}

/// A folder or adapter holding NaN or an infinity, in any float dtype and any shard, is refused
/// naming the file and the tensor: a model that cannot compute would report `eval loss: NaN` as
/// a result (issue 43, item 5). Read on the bits; no device.
#[test]
fn non_finite_weights_are_refused_naming_the_tensor() {
    let cases: [(&str, &str, &str, &str); 4] = [
        // (folder, file, tensor (the file's last float one if empty), what)
        (
            "gpt2-tiny",
            "model.safetensors",
            "h.0.attn.c_attn.bias",
            "NaN",
        ),
        (
            "gpt2-tiny-bf16",
            "model.safetensors",
            "h.0.ln_2.weight",
            "-inf",
        ),
        (
            "gpt2-tiny-f16-sharded",
            "model-00002-of-00002.safetensors",
            "",
            "inf",
        ),
        ("llama-tiny-gqa", "model.safetensors", "", "NaN"),
    ];
    for (folder, file, tensor, what) in cases {
        let (_d, dir) = copy_of(folder);
        let mut name = tensor.to_string();
        edit_weights(&dir, file, |ts| {
            use safetensors::Dtype as S;
            let float = |d: S| matches!(d, S::F32 | S::F16 | S::BF16);
            let t = match ts
                .iter_mut()
                .find(|t| !tensor.is_empty() && t.0.ends_with(tensor))
            {
                Some(t) => t,
                None => ts.iter_mut().rev().find(|t| float(t.1)).unwrap(),
            };
            name = t.0.clone();
            // The first element's bits in the tensor's own dtype.
            let (nan, inf, sign) = match t.1 {
                S::F32 => (0x7fc0_0000u32, 0x7f80_0000u32, 0x8000_0000u32),
                S::F16 => (0x7e00, 0x7c00, 0x8000),
                _ => (0x7fc0, 0x7f80, 0x8000),
            };
            let bits = match what {
                "NaN" => nan,
                "inf" => inf,
                _ => inf | sign,
            };
            let size = if t.1 == S::F32 { 4 } else { 2 };
            t.3[..size].copy_from_slice(&bits.to_le_bytes()[..size]);
        });
        for dtype in [DType::F32, DType::F16] {
            let r = if folder.starts_with("llama") {
                fitgrad::hf::PretrainedLlama::open(&dir, dtype).map(|_| ())
            } else {
                PretrainedGpt::open(&dir, dtype).map(|_| ())
            };
            match r {
                Err(Error::Data { path, reason }) => {
                    assert!(path.ends_with(file), "{path}: {reason}");
                    assert!(
                        reason.contains(&format!("'{name}'"))
                            && reason.contains(&format!("element 0 is {what}")),
                        "{folder}: {reason}"
                    );
                }
                Err(e) => panic!("{folder}: {e} is not an Error::Data"),
                Ok(()) => panic!("{folder} with {what} in '{name}' loaded"),
            }
        }
    }

    // A PEFT adapter holding NaN.
    let dir = tempfile::tempdir().unwrap();
    let adapter =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora/gpt2-tiny-adapter");
    for f in std::fs::read_dir(&adapter).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.path().join(f.file_name())).unwrap();
    }
    let mut name = String::new();
    edit_weights(dir.path(), "adapter_model.safetensors", |ts| {
        let t = ts.last_mut().unwrap();
        name = t.0.clone();
        let n = t.3.len();
        t.3[n - 4..].copy_from_slice(&f32::NAN.to_bits().to_le_bytes());
    });
    let base = PretrainedGpt::open(&fixtures().join("gpt2-tiny"), DType::F32).unwrap();
    match fitgrad::hf::read_adapter(dir.path(), &base.config) {
        Err(Error::Data { reason, .. }) => {
            assert!(
                reason.contains(&format!("'{name}'")) && reason.contains("NaN"),
                "{reason}"
            )
        }
        Err(e) => panic!("{e} is not an Error::Data"),
        Ok(_) => panic!("an adapter holding NaN loaded"),
    }
}

/// Under a budget that holds one window's forward but not eight, `window_loss` splits its
/// forwards and gives the loss of the unbudgeted run (issue 43, item 6: finetune --eval-text at
/// the named smallest budget ran out of memory during evaluation).
#[test]
fn window_loss_splits_its_batches_to_fit_the_budget() {
    let tok = Tokenizer::from_file(&fixtures().join("gpt2-tiny/tokenizer.json")).unwrap();
    let ids = tok.encode(&eval_text()).unwrap();
    let folder = PretrainedGpt::open(&fixtures().join("gpt2-tiny"), DType::F32).unwrap();
    let Some(free) = fresh_with_budget(None) else {
        return;
    };
    let gpt = folder.build(&free).unwrap();
    gpt.set_training(false);
    let want = window_loss(&gpt, &ids, 32, 8, DType::F32).unwrap();
    // The logits of 8 windows alone are 8 * 32 * 320 * 4 = 320 KiB.
    let budget = 256 << 10;
    let dev = fresh_with_budget(Some(budget)).unwrap();
    let gpt = folder.build(&dev).unwrap();
    gpt.set_training(false);
    let got = window_loss(&gpt, &ids, 32, 8, DType::F32).expect("the windows split to fit");
    assert!(dev.memory_stats().peak_bytes_reserved <= budget);
    assert_eq!((got.tokens, got.windows), (want.tokens, want.windows));
    assert!(
        (got.loss - want.loss).abs() <= 1e-6 * want.loss,
        "{} against {}",
        got.loss,
        want.loss
    );
}

fn finetune_args(extra: &[&str]) -> finetune::Args {
    use clap::Parser;
    let mut all = vec!["finetune".to_string()];
    all.extend(extra.iter().map(|s| s.to_string()));
    finetune::Args::try_parse_from(&all).unwrap_or_else(|e| panic!("{all:?}: {e}"))
}

/// `finetune` on `dev` with these flags.
fn finetune_run(dev: &Device, extra: &[&str]) -> finetune::Report {
    let args = finetune_args(extra);
    let setup = finetune::prepare(&args).unwrap();
    finetune::run(&args, setup, dev).unwrap()
}

fn finetune_on(dev: &Device) {
    let exp = expected();
    let eval = fixtures().join("eval.txt");
    let eval = eval.to_str().unwrap();
    // --steps 0: the loaded model's loss, transformers' within 1e-4, for each GPT-2 and Llama
    // fixture.
    let llama: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("expected_llama.json")).unwrap(),
    )
    .unwrap();
    let gpt2 = MODELS.iter().map(|m| (*m, &exp));
    let llamas = ["llama-tiny-gqa", "llama-tiny-tied"].map(|m| (m, &llama));
    for (name, exp) in gpt2.chain(llamas) {
        let model = fixtures().join(name);
        let r = finetune_run(
            dev,
            &[
                "--model",
                model.to_str().unwrap(),
                "--eval-text",
                eval,
                "--context",
                "32",
                "--steps",
                "0",
                "--json",
            ],
        );
        let want = exp["models"][name]["eval"]["32"]["eval_loss"]
            .as_f64()
            .unwrap();
        let got = r.eval.unwrap().loss;
        assert!(
            (got - want).abs() <= 1e-4,
            "{name}: finetune's eval_loss {got}, transformers' {want}"
        );
    }
    let model = fixtures().join("gpt2-tiny-f16-sharded");
    let model = model.to_str().unwrap();

    // A few steps on the eval text itself lower its loss; the saved folder loads and gives the
    // fine-tuned loss; generation continues the prompt.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tuned");
    let r = finetune_run(
        dev,
        &[
            "--model",
            model,
            "--eval-text",
            eval,
            "--text",
            eval,
            "--steps",
            "4",
            "--lr",
            "3e-3",
            "--context",
            "16",
            "--save",
            out.to_str().unwrap(),
            "--generate",
            "ROMEO.",
            "--max-new-tokens",
            "5",
        ],
    );
    let (before, after) = (r.eval_before.unwrap().loss, r.eval.unwrap().loss);
    assert!(after < before - 0.1, "fine-tuning: {before} -> {after}");
    assert!(r.generated.unwrap().starts_with("ROMEO."));
    let again = finetune_run(
        dev,
        &[
            "--model",
            out.to_str().unwrap(),
            "--eval-text",
            eval,
            "--context",
            "16",
        ],
    );
    assert!(
        (again.eval.unwrap().loss - after).abs() <= 1e-5,
        "the saved folder's loss"
    );

    // Flags refused before any device work.
    let refused = |extra: &[&str], says: &str| {
        let mut all = vec!["--model", model];
        all.extend(extra);
        match finetune::prepare(&finetune_args(&all)) {
            Err(e) => assert!(e.to_string().contains(says), "{extra:?}: {e}"),
            Ok(_) => panic!("{extra:?} accepted"),
        }
    };
    refused(&["--steps", "2"], "--text");
    refused(&["--context", "33"], "n_positions = 32");
    refused(&["--fit", "auto"], "--memory-budget");
    refused(&["--eval-text", "/no/such/file"], "/no/such/file");
}

/// Greedy (top-k 1) decoding through the KV cache, past the context (the window slides),
/// against argmax of a whole forward of the last `context` tokens at every step.
fn greedy_on(dev: &Device) {
    let gpt = PretrainedGpt::open(&fixtures().join("gpt2-tiny"), DType::F32)
        .unwrap()
        .build(dev)
        .unwrap();
    let prompt = &ids_of(&expected()["eval_ids"])[..5];
    let mut greedy = Sampling::new(1.0, 7);
    greedy.top_k = Some(1);
    let cached = gpt.generate_with(prompt, 34, &greedy).unwrap();
    let context = gpt.gpt_config().context;
    let mut plain = prompt.to_vec();
    gpt.set_training(false);
    while plain.len() < cached.len() {
        let w = &plain[plain.len().saturating_sub(context)..];
        let logits = gpt
            .forward_ids(w, 1, w.len())
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let last = &logits[logits.len() - 320..];
        let best = (0..320).fold(0, |b, i| if last[i] > last[b] { i } else { b });
        plain.push(best as u32);
    }
    assert_eq!(cached, plain);
    // Seeded top-p sampling repeats itself.
    let mut nucleus = Sampling::new(0.9, 3);
    nucleus.top_p = Some(0.8);
    assert_eq!(
        gpt.generate_with(prompt, 8, &nucleus).unwrap(),
        gpt.generate_with(prompt, 8, &nucleus).unwrap()
    );
    nucleus.top_p = Some(1.5);
    assert!(matches!(
        gpt.generate_with(prompt, 8, &nucleus),
        Err(Error::InvalidArgument { .. })
    ));
}

/// `finetune --config` with these flags.
fn config_run(extra: &[&str]) -> fitgrad::Result<finetune::ConfigReport> {
    finetune::run_config(&finetune_args(extra))
}

/// `--config` plans a model from its config alone, on a device that only plans, and that plan
/// is the peak a real run of the same config (random weights, random ids) measures. The
/// shipped configs plan at full size: GPT-2 124M's parameters and gradients, no weights read.
#[test]
fn config_plans_what_a_run_measures() {
    for name in ["gpt2-tiny", "llama-tiny-gqa"] {
        let dir = fixtures().join(name);
        let dir = dir.to_str().unwrap();
        let base = ["--config", dir, "--context", "16", "--batch-size", "2"];
        let planned = config_run(&[&base[..], &["--plan"]].concat()).unwrap();
        assert!(planned.measured_peak.is_none());
        let run = config_run(&[&base[..], &["--steps", "2"]].concat()).unwrap();
        assert_eq!(
            planned.plan, run.plan,
            "{name}: the plan on a planning-only device"
        );
        assert_eq!(
            run.measured_peak,
            Some(run.plan.peak),
            "{name}: two steps measure the plan's peak"
        );
        assert!(run.train_loss.unwrap().is_finite());
    }
    let gpt2 = config_run(&[
        "--config",
        "gpt2",
        "--plan",
        "--context",
        "128",
        "--batch-size",
        "1",
        "--optimizer",
        "sgd",
    ])
    .unwrap();
    let bytes = 124_439_808u64 * 4;
    let p = &gpt2.plan;
    assert!(
        p.parameters >= bytes && p.parameters < bytes + bytes / 100,
        "{p:?}"
    );
    assert_eq!(p.gradients, p.parameters, "{p:?}");
    assert_eq!(p.optimizer_state, 0, "{p:?}");
    // Under a budget past the adapter's memory (a larger GPU), fit auto still chooses.
    let fits = config_run(&[
        "--config",
        "gpt2",
        "--plan",
        "--context",
        "64",
        "--batch-size",
        "1",
        "--memory-budget",
        "64GiB",
    ])
    .unwrap();
    assert!(fits.plan.optimizer_state >= 2 * bytes, "{:?}", fits.plan);
}

/// `--config --plan` under LoRA plans every rung of fit auto's LoRA ladder from the config
/// alone (dense, int8 and NF4 bases, without and with checkpointing): a quantized base plans
/// below the dense one, the flags' own rung is the plan printed, and every rung run for real
/// (random weights) measures its plan to the byte. LoRA flags without --lora-rank are refused.
#[test]
fn config_plans_the_lora_ladder() {
    let dir = fixtures().join("gpt2-tiny");
    let dir = dir.to_str().unwrap();
    let base = [
        "--config",
        dir,
        "--context",
        "16",
        "--batch-size",
        "2",
        "--lora-rank",
        "4",
        "--lora-targets",
        "c_attn,c_fc",
        "--quantize",
        "nf4",
    ];
    let planned = config_run(&[&base[..], &["--plan"]].concat()).unwrap();
    let rungs = &planned.candidates;
    assert_eq!(rungs.len(), 6, "{rungs:?}");
    let peak = |q: &str, ck: bool| {
        rungs
            .iter()
            .find(|r| r.0 == q && r.1 == ck)
            .unwrap_or_else(|| panic!("{q} {ck}: {rungs:?}"))
            .2
    };
    for ck in [false, true] {
        assert!(peak("int8", ck) < peak("none", ck), "{rungs:?}");
        assert!(peak("nf4", ck) < peak("none", ck), "{rungs:?}");
    }
    assert_eq!(planned.plan.peak, peak("nf4", false));
    assert_eq!(planned.plan.gradients, 0, "{:?}", planned.plan);
    // The full fine-tune printed beside: every weight with its two moments.
    let full = planned.full_plan.as_ref().unwrap();
    let weights = 4 * 22_944u64;
    assert!(
        full.parameters >= weights && full.optimizer_state >= 2 * weights,
        "{full:?}"
    );
    assert!(full.peak > peak("none", false), "{full:?}");
    // Every rung run for real: the first step peaks at the plan's first step (the optimizer
    // makes its moments in the update, after the forward and backward), the second at the
    // plan's peak (its forward and backward hold them), both to the byte.
    for (q, ck) in rungs.iter().map(|r| (r.0.as_str(), r.1)) {
        let mut flags = base.to_vec();
        *flags.last_mut().unwrap() = q;
        if ck {
            flags.push("--checkpoint-activations");
        }
        let what = format!("base {q}, checkpointing {ck}");
        let run = config_run(&[&flags[..], &["--steps", "2"]].concat()).unwrap();
        let plan = &run.plan;
        assert_eq!(plan.peak, peak(q, ck), "{what}: the ladder's plan");
        assert!(plan.first_step_peak < plan.peak, "{what}: {plan:?}");
        assert_eq!(
            (run.measured_first_step_peak, run.measured_peak),
            (Some(plan.first_step_peak), Some(plan.peak)),
            "{what}: {plan:?}"
        );
    }
    match config_run(&["--config", dir, "--plan", "--quantize", "nf4"]) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("--lora-rank"), "{reason}")
        }
        other => panic!("{:?}", other.err()),
    }
}

/// `--config` LoRA on a Llama (grouped-query attention): the ladder plans the dense, int8 and
/// NF4 bases, each without and with checkpointing, quantized below dense, and an NF4 run's two
/// steps measure the plan's first-step and steady peaks to the byte.
#[test]
fn config_plans_a_llama_lora_step() {
    let dir = fixtures().join("llama-tiny-gqa");
    let base = [
        "--config",
        dir.to_str().unwrap(),
        "--context",
        "16",
        "--batch-size",
        "2",
        "--lora-rank",
        "2",
        "--lora-targets",
        "q_proj,v_proj,down_proj",
        "--quantize",
        "nf4",
    ];
    let planned = config_run(&[&base[..], &["--plan"]].concat()).unwrap();
    let rungs = &planned.candidates;
    let names: Vec<(&str, bool)> = rungs.iter().map(|r| (r.0.as_str(), r.1)).collect();
    let want: Vec<(&str, bool)> = ["none", "int8", "nf4"]
        .into_iter()
        .flat_map(|q| [(q, false), (q, true)])
        .collect();
    assert_eq!(names, want);
    for ck in [0, 1] {
        assert!(
            rungs[2 + ck].2 < rungs[ck].2 && rungs[4 + ck].2 < rungs[ck].2,
            "{rungs:?}"
        );
    }
    assert_eq!(planned.plan.peak, rungs[4].2);
    assert_eq!(planned.plan.gradients, 0, "{:?}", planned.plan);
    let run = config_run(&[&base[..], &["--steps", "2"]].concat()).unwrap();
    assert_eq!(run.plan, planned.plan);
    assert_eq!(
        (run.measured_first_step_peak, run.measured_peak),
        (Some(run.plan.first_step_peak), Some(run.plan.peak)),
        "{:?}",
        run.plan
    );
    assert!(run.full_plan.unwrap().peak > rungs[0].2);
}

/// Bad `--config` values are typed errors before any device work.
#[test]
fn bad_configs_are_refused() {
    match config_run(&["--config", "gpt9", "--plan"]) {
        Err(Error::Data { reason, .. }) => assert!(reason.contains("gpt2-medium"), "{reason}"),
        other => panic!("{:?}", other.err()),
    }
    let (_d, dir) = copy_of("gpt2-tiny");
    edit_config(&dir, |c| {
        c.insert("model_type".into(), "bert".into());
    });
    match config_run(&["--config", dir.to_str().unwrap(), "--plan"]) {
        Err(Error::Data { reason, .. }) => assert!(reason.contains("\"bert\""), "{reason}"),
        other => panic!("{:?}", other.err()),
    }
    let dir = fixtures().join("gpt2-tiny");
    for (flags, words) in [
        (&["--context", "0", "--plan"][..], "--context 0"),
        (&[][..], "add --plan"),
    ] {
        let mut all = vec!["--config", dir.to_str().unwrap()];
        all.extend_from_slice(flags);
        match config_run(&all) {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(reason.contains(words), "{reason}")
            }
            other => panic!("{all:?}: {:?}", other.err()),
        }
    }
    use clap::Parser;
    assert!(
        finetune::Args::try_parse_from(["finetune", "--config", "gpt2", "--model", "x"]).is_err()
    );
}
