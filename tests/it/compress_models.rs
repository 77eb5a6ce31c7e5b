//! Pruning, int8 quantization and distillation on models other than the Mlp, on every device:
//! a user's model written with `module!` (two Linear layers around a LayerNorm) and a tiny Gpt.
//! The default filter picks their Linear weights only (no norm, bias, embedding or the Gpt's
//! tied head); pruned weights stay exactly 0 through trainer steps; every Linear quantizes,
//! pruned zeros stay int8 zeros, each quantized layer matches `x · dequant(W)ᵀ + b` computed
//! with the f32 matmul, the custom model's forward through its int8 layers matches the same
//! model with dequantized weights, and a quantized Gpt's file round-trips; the custom model
//! learns as a student of an Mlp.

use crate::common;

use common::*;
use fitgrad::compress::{
    distillation_loss, quantize_model, Distill, DistillConfig, PruneConfig, Pruner,
    QuantizedLinear, QuantizedModel,
};
use fitgrad::nn::{self, Gpt, GptConfig, LayerNorm, Linear, Mlp, Module};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::text::TextDataset;
use fitgrad::train::{BatchSource, ClassBatch, StepContext, TrainModel, Trainer, TrainerConfig};
use fitgrad::{Activation, Device, MatmulOptions, Result, Tensor};
use std::sync::OnceLock;

/// fc2(norm(relu(fc1(x)))): (B, 64) -> (B, 10).
struct Net {
    fc1: Linear,
    norm: LayerNorm,
    fc2: Linear,
}

fitgrad::module! {
    impl Module for Net {
        params { fc1, norm, fc2 }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let h = self.fc1.forward(x)?.relu()?;
            self.fc2.forward(&self.norm.forward(&h)?)
        }
    }
}

impl TrainModel<ClassBatch> for Net {
    fn forward_loss(&self, b: &ClassBatch, ctx: &StepContext) -> Result<Tensor> {
        nn::cross_entropy(&self.forward(&b.x.to_device(&ctx.device)?)?, &b.y)
    }
}

fn net(dev: &Device, d: &Dataset) -> Net {
    Net {
        fc1: Linear::new(dev, d.dim, 32, 1).unwrap(),
        norm: LayerNorm::new(dev, 32).unwrap(),
        fc2: Linear::new(dev, 32, d.classes, 2).unwrap(),
    }
}

/// The embedded digits, split once per test binary.
fn digits() -> &'static (Dataset, Dataset) {
    static DIGITS: OnceLock<(Dataset, Dataset)> = OnceLock::new();
    DIGITS.get_or_init(|| data::load("digits", 0).expect("the embedded digits load"))
}

/// The pruner's report after training: exactly round(s n) weights pruned, every one 0.
fn assert_pruned(pruner: &Pruner, s: f64) {
    let r = pruner.report().unwrap();
    assert_eq!(r.pruned(), (s * r.numel() as f64).round() as usize, "{r}");
    for l in &r.layers {
        assert_eq!(l.pruned_nonzero, 0, "a pruned weight is not 0\n{r}");
    }
}

/// f32 results of a sum over `k` products in another order: tests/quantize.rs's tolerance.
fn sum_tol(k: usize) -> Tol {
    Tol {
        abs: 2e-6 * (k as f32 + 1.0),
        rel: 1e-5,
        f16_ulps: 0.0,
    }
}

/// `layer` against `x · dequant(W)ᵀ + b` with the f32 matmul (the layer's own int8 values),
/// and the layer's int8 zero wherever `w` (the f32 weight it came from) is zero.
fn check_layer(what: &str, layer: &QuantizedLinear, w: &Tensor, x: &Tensor) {
    let dq = layer.dequantize().unwrap();
    let mut opts = MatmulOptions::default();
    opts.trans_b = true;
    opts.bias = layer.bias();
    let want = x.matmul_with(&dq, &opts).unwrap().to_vec_f32().unwrap();
    let got = layer.forward(x).unwrap().to_vec_f32().unwrap();
    assert_close(what, &got, &want, sum_tol(layer.in_features()));
    let q = layer.int8().unwrap();
    let w = w.to_vec_f32().unwrap();
    assert!(
        w.iter().zip(&q).all(|(&w, &q)| w != 0.0 || q == 0),
        "{what}: a zero weight is not an int8 zero"
    );
}

/// The custom model: pruned one-shot to 50% and trained, its Linear weights (and only those)
/// pruned and 0; quantized, each layer against the dequantized matmul and the whole int8
/// forward against the model with dequantized weights.
fn custom_model_prunes_and_quantizes(dev: &Device) {
    let (train, test) = digits();
    let model = net(dev, train);
    let opt = Opt::AdamW { lr: 3e-3 }.build(model.parameters());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(64, 1, 3e-3)).unwrap();
    let mut pruner = Pruner::new(&t.model, PruneConfig::new(0.5)).unwrap();
    assert_eq!(pruner.names(), ["fc1.weight", "fc2.weight"]);
    let idx: Vec<usize> = (0..64).collect();
    for _ in 0..4 {
        t.step(train, &idx).unwrap();
        pruner.step(t.steps()).unwrap();
    }
    assert_pruned(&pruner, 0.5);

    let q = quantize_model(&t.model).unwrap();
    let names: Vec<&str> = q.layers().iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(names, ["fc1", "fc2"]);
    let rest: Vec<&str> = q.rest().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(rest, ["norm.weight", "norm.bias"]);
    let x = Tensor::from_slice(dev, &test.features[..9 * test.dim], &[9, test.dim]).unwrap();
    let (fc1, fc2) = (q.layer("fc1").unwrap(), q.layer("fc2").unwrap());
    check_layer("fc1", fc1, &t.model.fc1.weight, &x);
    let h = t.model.fc1.forward(&x).unwrap().relu().unwrap();
    let h = t.model.norm.forward(&h).unwrap();
    check_layer("fc2", fc2, &t.model.fc2.weight, &h);

    // The model's forward with its Linear layers in int8, against the same model whose
    // Linear weights are the dequantized ones.
    let int8 = {
        let h = fc1.forward_act(&x, Activation::Relu).unwrap();
        fc2.forward(&t.model.norm.forward(&h).unwrap()).unwrap()
    };
    let mut dq = Net {
        fc1: t.model.fc1.clone(),
        norm: t.model.norm.clone(),
        fc2: t.model.fc2.clone(),
    };
    dq.fc1.weight = fc1.dequantize().unwrap();
    dq.fc2.weight = fc2.dequantize().unwrap();
    assert_close(
        "custom model in int8",
        &int8.to_vec_f32().unwrap(),
        &dq.forward(&x).unwrap().to_vec_f32().unwrap(),
        // Two layers' sums and a layer norm between them.
        sum_tol(4 * train.dim),
    );
}

/// A tiny Gpt: the default filter prunes the blocks' Linear weights (not wte, wpe or the
/// norms), which stay 0 through trainer steps; every Linear quantizes (qkv, proj, fc, proj)
/// with its bias, the rest is kept, each layer matches the dequantized matmul, and the file
/// round-trips.
fn gpt_prunes_and_quantizes(dev: &Device) {
    let mut cfg = GptConfig::new(11, 8, 1, 2, 16);
    cfg.seed = 4;
    let gpt = Gpt::new(dev, cfg).unwrap();
    let tokens: Vec<u32> = (0..64u32).map(|i| (i * 5 + i / 3) % 11).collect();
    let text = TextDataset::new(tokens, 8).unwrap();
    let opt = Opt::AdamW { lr: 1e-2 }.build(gpt.parameters());
    let mut t = Trainer::new(gpt, opt, TrainerConfig::new(4, 1, 1e-2)).unwrap();
    let mut pruner = Pruner::new(&t.model, PruneConfig::new(0.6)).unwrap();
    let linears = [
        "blocks.0.attn.qkv",
        "blocks.0.attn.proj",
        "blocks.0.mlp.fc",
        "blocks.0.mlp.proj",
    ];
    let weights: Vec<String> = linears.iter().map(|p| format!("{p}.weight")).collect();
    assert_eq!(pruner.names(), weights);
    for i in 0..3 {
        t.step(&text, &[i, i + 10, i + 20, i + 30]).unwrap();
        pruner.step(t.steps()).unwrap();
    }
    assert_pruned(&pruner, 0.6);
    let named = t.model.named_parameters();
    let param = |n: &str| named.iter().find(|(k, _)| k == n).unwrap().1.clone();
    let wte = param("wte.weight").to_vec_f32().unwrap();
    assert!(wte.iter().all(|&v| v != 0.0), "the embedding was pruned");

    let q = quantize_model(&t.model).unwrap();
    let prefixes: Vec<&str> = q.layers().iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(prefixes, linears);
    let rest: Vec<&str> = q.rest().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        rest,
        [
            "wte.weight",
            "wpe.weight",
            "blocks.0.ln1.weight",
            "blocks.0.ln1.bias",
            "blocks.0.ln2.weight",
            "blocks.0.ln2.bias",
            "ln_f.weight",
            "ln_f.bias"
        ]
    );
    for p in linears {
        let layer = q.layer(p).unwrap();
        assert!(layer.bias().is_some(), "{p} lost its bias");
        let w = param(&format!("{p}.weight"));
        let k = w.dims()[1];
        let x = upload(
            dev,
            &host_data(7, 5 * k, -1.0, 1.0),
            &[5, k],
            fitgrad::DType::F32,
        );
        check_layer(p, layer, &w, &x);
    }
    assert_eq!(q.config().get("kind").map(String::as_str), Some("gpt"));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gpt-int8.safetensors");
    q.save(&path).unwrap();
    let back = QuantizedModel::load(dev, &path).unwrap();
    assert_eq!(back.config(), q.config());
    let mut want: Vec<(String, Vec<i8>)> = q
        .layers()
        .iter()
        .map(|(p, l)| (p.clone(), l.int8().unwrap()))
        .collect();
    want.sort();
    let got: Vec<(String, Vec<i8>)> = back
        .layers()
        .iter()
        .map(|(p, l)| (p.clone(), l.int8().unwrap()))
        .collect();
    assert_eq!(
        got, want,
        "the int8 layers after the round trip (in name order)"
    );
    let rest_values = |m: &QuantizedModel| {
        let mut v: Vec<(String, Vec<f32>)> = m
            .rest()
            .iter()
            .map(|(n, t)| (n.clone(), t.to_vec_f32().unwrap()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    assert!(
        rest_values(&back) == rest_values(&q),
        "the kept parameters changed"
    );
}

/// The custom model as the student of an Mlp teacher: the trainer's loss is
/// distillation_loss of the two forwards, and the student's weights move.
fn custom_model_as_a_student(dev: &Device) {
    let (train, _) = digits();
    let teacher = Mlp::new(dev, &[train.dim, 48, train.classes], Activation::Relu, 9).unwrap();
    let student = net(dev, train);
    let before = param_values(&student);
    let idx: Vec<usize> = (100..132).collect();
    let b = train.batch(&idx).unwrap();
    let want = {
        let _g = fitgrad::no_grad();
        let x = b.x.to_device(dev).unwrap();
        let (s, t) = (student.forward(&x).unwrap(), teacher.forward(&x).unwrap());
        let c = DistillConfig::default();
        distillation_loss(&s, &t, &b.y, c.alpha, c.temperature)
            .unwrap()
            .item()
            .unwrap()
    };
    let model = Distill::new(teacher, student, DistillConfig::default()).unwrap();
    let opt = Opt::AdamW { lr: 3e-3 }.build(model.parameters());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(32, 1, 3e-3)).unwrap();
    t.step(train, &idx).unwrap();
    assert_eq!(t.take_loss().unwrap(), want);
    assert_ne!(param_values(&t.model.student), before);
}

common::device_tests!(
    custom_model_prunes_and_quantizes,
    gpt_prunes_and_quantizes,
    custom_model_as_a_student,
);
