//! Int8 quantization against plain-loop references on every device: the quantization rule
//! (per-row scale, |W - scale q| <= scale / 2, q in [-127, 127]); the quantized matmul against
//! dequantize-then-matmul in f64 on random shapes (1, odd, K and N not multiples of 4, empty
//! batches, batched inputs) in f32 and f16, with bias and every activation; repeatability;
//! every Linear of a custom model; the digits MLP in int8 (weights <= 0.27x the f32 bytes,
//! accuracy within 1 point); the safetensors round trip; and the typed errors.

use crate::common;

use common::*;
use fitgrad::compress::{quantize_model, quantize_rows, QuantizedLinear, QuantizedMlp};
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{DType, Device, Error, Result, Tensor};
use proptest::prelude::*;
use std::sync::OnceLock;

/// act(x · (scale q)ᵀ + b) in f64: the dequantized weights, then a plain matmul.
fn reference(
    x: &[f32],
    q: &[i8],
    scale: &[f32],
    bias: Option<&[f32]>,
    (m, n, k): (usize, usize, usize),
    act: Activation,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let mut s = 0f64;
            for t in 0..k {
                let w = scale[j] as f64 * q[j * k + t] as f64;
                s += x[i * k + t] as f64 * w;
            }
            if let Some(b) = bias {
                s += b[j] as f64;
            }
            let y = s as f32;
            out.push(match act {
                Activation::None => y,
                Activation::Relu => relu(y),
                Activation::Gelu => ref_gelu(y),
                Activation::Tanh => ref_tanh(y),
                Activation::Sigmoid => ref_sigmoid(y),
                Activation::Silu => y * ref_sigmoid(y),
            });
        }
    }
    out
}

/// One (batch, m, n, k) case: a random W (n, k) and bias quantized on the device, a random x
/// of `dtype`, the layer's output against the reference built from the layer's own int8
/// values and scales; and the quantization rule on those values.
#[allow(clippy::too_many_arguments)]
fn check_case(
    dev: &Device,
    (batch, m, n, k): (usize, usize, usize, usize),
    bias: bool,
    act: Activation,
    dtype: DType,
    seed: u64,
) {
    let what = format!(
        "batch {batch} m {m} n {n} k {k} bias {bias} {act} {dtype} on {}",
        label(dev)
    );
    let w_host = host_data(seed, n * k, -1.0, 1.0);
    let b_host = host_data(seed ^ 3, n, -1.0, 1.0);
    let w = upload(dev, &w_host, &[n, k], DType::F32);
    let b = upload(dev, &b_host, &[n], DType::F32);
    let layer = QuantizedLinear::quantize(&w, bias.then_some(&b)).unwrap();
    let q = layer.int8().unwrap();
    let scale = layer.scale().to_vec_f32().unwrap();
    // The rule: per row, the largest |q| is 127 and every weight within half a step.
    for r in 0..n {
        let row = &w_host[r * k..(r + 1) * k];
        let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert_eq!(scale[r], amax / 127.0, "{what}: scale of row {r}");
        let qr = &q[r * k..(r + 1) * k];
        assert_eq!(
            qr.iter().map(|v| v.unsigned_abs()).max(),
            Some(127),
            "{what}"
        );
        for (t, (&wv, &qv)) in row.iter().zip(qr).enumerate() {
            // In f64: f32's quotient W / scale may round up to a half (by half an ulp of a
            // number under 128, 2^-18) and then away, so the bound is half a step plus that.
            let err = (wv as f64 - scale[r] as f64 * qv as f64).abs();
            assert!(
                err <= scale[r] as f64 * (0.5 + 1.0 / 262_144.0),
                "{what}: W[{r}, {t}] = {wv} quantized to {qv} x {}",
                scale[r]
            );
        }
    }
    let x_host = as_dtype(&host_data(seed ^ 5, batch * m * k, -1.0, 1.0), dtype);
    let x_dims: Vec<usize> = if batch == 1 {
        vec![m, k]
    } else {
        vec![batch, m, k]
    };
    let x = upload(dev, &x_host, &x_dims, dtype);
    let out = layer.forward_act(&x, act).unwrap();
    let mut out_dims = x_dims.clone();
    *out_dims.last_mut().unwrap() = n;
    let got = download(&out, &out_dims, dtype).unwrap();
    let want = expect_in(
        reference(
            &x_host,
            &q,
            &scale,
            bias.then_some(&b_host),
            (batch * m, n, k),
            act,
        ),
        dtype,
    );
    // Sums of k products of values in [-1, 1], as for the f32 matmul.
    let tol = match dtype {
        DType::F32 => Tol {
            abs: 2e-6 * (k as f32 + 1.0),
            rel: 1e-5,
            f16_ulps: 0.0,
        },
        DType::F16 => Tol {
            abs: 1e-4 * (k as f32 + 1.0),
            rel: 2e-3,
            f16_ulps: 2.0,
        },
    };
    assert_close(&what, &got, &want, tol);
    // Bitwise the same on a second run.
    let again = layer.forward_act(&x, act).unwrap().to_vec_f32().unwrap();
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        again.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "{what}: not repeatable"
    );
}

fn size(small: bool) -> impl Strategy<Value = usize> {
    let big: Vec<usize> = if small {
        vec![17, 33, 64, 70]
    } else {
        vec![63, 64, 65, 255, 256, 257]
    };
    prop_oneof![
        3 => Just(1usize),
        4 => 2usize..9,
        3 => 9usize..40,
        2 => prop::sample::select(big),
    ]
}

/// Random shapes (rows of x may be 0; 1, odd, N and K not multiples of 4, several workgroups
/// of columns), batched inputs, with and without bias, every activation, f32 and f16.
fn qmatmul_matches_dequantized_reference(dev: &Device) {
    let act = prop::sample::select(vec![
        Activation::None,
        Activation::Relu,
        Activation::Gelu,
        Activation::Tanh,
        Activation::Sigmoid,
    ]);
    proptest!(ProptestConfig::with_cases(16), |(
        m in prop_oneof![Just(0usize), size(true)], n in size(false), k in size(false),
        batch in prop_oneof![3 => Just(1usize), 1 => 2usize..4],
        bias in any::<bool>(), act in act, f16 in any::<bool>(), seed in any::<u64>(),
    )| {
        let dtype = dtype_for(dev, f16);
        check_case(dev, (batch, m, n, k), bias, act, dtype, seed);
    });
    // Fixed edges: one of everything; K = 5 (a tail word), N = 6 (packed f16 rows staged).
    check_case(dev, (1, 1, 1, 1), true, Activation::None, DType::F32, 1);
    check_case(dev, (1, 3, 6, 5), true, Activation::Relu, DType::F16, 2);
    check_case(dev, (2, 4, 8, 12), false, Activation::Gelu, DType::F16, 3);
}

/// A model that is only a list of named tensors, standing in for a user's own model.
struct Params(Vec<(String, Tensor)>);

impl Module for Params {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.0.clone()
    }
}

/// `quantize_model` finds the Linear weights (2-D `*.weight`, bias by name) of any module,
/// leaving norms and embeddings as they were; the quantized layer matches the f32 layer.
fn every_linear_of_a_custom_model(dev: &Device) {
    let t = |dims: &[usize], seed| {
        upload(
            dev,
            &host_data(seed, numel(dims), -1.0, 1.0),
            dims,
            DType::F32,
        )
    };
    let model = Params(vec![
        ("tok_emb.weight".into(), t(&[11, 6], 1)),
        ("stem.weight".into(), t(&[5, 6], 2)),
        ("stem.bias".into(), t(&[5], 3)),
        ("norm.weight".into(), t(&[5], 4)),
        ("head.weight".into(), t(&[3, 5], 5)),
    ]);
    let qm = quantize_model(&model).unwrap();
    let names: Vec<&str> = qm.layers().iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(names, ["stem", "head"]);
    let rest: Vec<&str> = qm.rest().iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(rest, ["tok_emb.weight", "norm.weight"]);
    assert!(qm.layer("stem").unwrap().bias().is_some());
    assert!(qm.layer("head").unwrap().bias().is_none());
    // The stem in int8 against the f32 stem: within the quantization error.
    let x_host = host_data(9, 4 * 6, -1.0, 1.0);
    let x = upload(dev, &x_host, &[4, 6], DType::F32);
    let mut opts = fitgrad::MatmulOptions::default();
    opts.trans_b = true;
    opts.bias = Some(&model.0[2].1);
    let want = x
        .matmul_with(&model.0[1].1, &opts)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    let got = qm
        .layer("stem")
        .unwrap()
        .forward(&x)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    // |x| <= 1 and each weight within scale / 2 <= 1 / 254: at most 6 / 254 per output.
    assert_close(
        "int8 stem vs f32",
        &got,
        &want,
        Tol {
            abs: 6.0 / 254.0,
            rel: 0.0,
            f16_ulps: 0.0,
        },
    );
    let none = Params(vec![("norm.weight".into(), t(&[5], 1))]);
    assert!(matches!(
        quantize_model(&none),
        Err(Error::InvalidArgument { .. })
    ));
}

/// The embedded digits, split once per test binary.
fn digits() -> &'static (Dataset, Dataset) {
    static DIGITS: OnceLock<(Dataset, Dataset)> = OnceLock::new();
    DIGITS.get_or_init(|| data::load("digits", 0).expect("the embedded digits load"))
}

/// A digits MLP [64, 256, 10] trained for 5 epochs, then quantized: the int8 weights take at
/// most 0.27x the f32 weights' device bytes, the test accuracy drops by at most 1 point, and
/// the model saved and loaded (safetensors, I8 weights) gives bitwise the same logits.
fn digits_mlp_in_int8(dev: &Device) {
    let (train, test) = digits();
    let model = Mlp::new(dev, &[train.dim, 256, train.classes], Activation::Relu, 1).unwrap();
    let opt = Opt::AdamW { lr: 3e-3 }.build(model.parameters());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(64, 1, 3e-3)).unwrap();
    for epoch in 0..5 {
        t.train_epoch(train, 0, epoch, |_, _, _| Ok(())).unwrap();
    }
    let f32_acc = t.evaluate(test, 512).unwrap().accuracy.unwrap();
    let q = QuantizedMlp::from_mlp(&t.model).unwrap();
    let q_acc = q.evaluate(test, 512).unwrap().accuracy.unwrap();
    let f32_bytes: u64 = t
        .model
        .layers
        .iter()
        .map(|l| l.weight.allocated_bytes())
        .sum();
    let q_bytes = q.model().weight_bytes();
    let ratio = q_bytes as f64 / f32_bytes as f64;
    eprintln!(
        "digits on {}: f32 {f32_acc:.4} ({f32_bytes} B of weights), int8 {q_acc:.4} ({q_bytes} B, {ratio:.3}x)",
        label(dev)
    );
    assert!(ratio <= 0.27, "int8 weights are {ratio:.3}x the f32 bytes");
    assert!(
        q_acc >= f32_acc - 0.01,
        "int8 accuracy {q_acc} vs f32 {f32_acc}"
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("digits-int8.safetensors");
    q.save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("layers.0.weight_q").unwrap();
    assert_eq!(w.dtype(), safetensors::Dtype::I8);
    assert_eq!(w.shape(), [256, train.dim]);
    assert_eq!(
        q.model().to_bytes().unwrap(),
        bytes,
        "the same model, other bytes"
    );
    let back = QuantizedMlp::load(dev, &path).unwrap();
    let x = Tensor::from_slice(dev, &test.features[..16 * test.dim], &[16, test.dim]).unwrap();
    let a = q.forward(&x).unwrap().to_vec_f32().unwrap();
    let b = back.forward(&x).unwrap().to_vec_f32().unwrap();
    assert_eq!(a, b, "logits after the round trip");
    // An f32 checkpoint is not a quantized model.
    let ckpt = dir.path().join("f32.safetensors");
    fitgrad::checkpoint::save(&ckpt, &t.model, None, &Default::default()).unwrap();
    assert!(matches!(
        QuantizedMlp::load(dev, &ckpt),
        Err(Error::Data { .. })
    ));
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        QuantizedMlp::load(dev, &path),
        Err(Error::Data { .. })
    ));
}

/// Non-2-D weights, mismatched biases and inputs, non-finite weights, a backward through the
/// inference layer: typed errors.
fn bad_inputs_are_typed_errors(dev: &Device) {
    let w3 = Tensor::zeros(dev, &[2, 3, 4], DType::F32).unwrap();
    let w1 = Tensor::zeros(dev, &[4], DType::F32).unwrap();
    for w in [&w3, &w1] {
        assert!(matches!(
            QuantizedLinear::quantize(w, None),
            Err(Error::Shape { .. })
        ));
    }
    let w = upload(dev, &host_data(1, 12, -1.0, 1.0), &[3, 4], DType::F32);
    let b = Tensor::zeros(dev, &[4], DType::F32).unwrap();
    assert!(matches!(
        QuantizedLinear::quantize(&w, Some(&b)),
        Err(Error::Shape { .. })
    ));
    let nan = Tensor::from_slice(dev, &[1.0f32, f32::NAN], &[1, 2]).unwrap();
    assert!(matches!(
        QuantizedLinear::quantize(&nan, None),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        quantize_rows(&[1.0; 5], 2, 3),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        QuantizedLinear::from_int8(dev, &[1; 6], &[1.0; 3], None, 3, 3),
        Err(Error::Shape { .. })
    ));
    let layer = QuantizedLinear::quantize(&w, None).unwrap();
    let x = Tensor::zeros(dev, &[2, 5], DType::F32).unwrap();
    assert!(matches!(layer.forward(&x), Err(Error::Shape { .. })));
    let scalar = Tensor::zeros(dev, &[], DType::F32).unwrap();
    assert!(matches!(layer.forward(&scalar), Err(Error::Shape { .. })));
    let x = Tensor::ones(dev, &[2, 4], DType::F32)
        .unwrap()
        .with_requires_grad();
    let y = layer.forward(&x).unwrap().sum().unwrap();
    assert!(matches!(y.backward(), Err(Error::Autograd(_))));
    if let Some(other) = devices().into_iter().find(|d| d != dev) {
        let x = Tensor::zeros(&other, &[2, 4], DType::F32).unwrap();
        assert!(matches!(
            layer.forward(&x),
            Err(Error::DeviceMismatch { .. })
        ));
    }
}

common::device_tests!(
    qmatmul_matches_dequantized_reference,
    every_linear_of_a_custom_model,
    digits_mlp_in_int8,
    bad_inputs_are_typed_errors,
);
