//! LoRA and QLoRA against references: a fresh adapter leaves the model's output bitwise
//! unchanged; only adapter factors get gradients and optimizer state; a merged model equals
//! base + adapter; PEFT folders round-trip; PEFT's own logits of a fitgrad-trained adapter
//! (tests/fixtures/lora, made by scripts/peft_fixture.py; no Python here) match; the
//! dequantizing matmuls (forward and input gradient, int8 and NF4) against plain loops; NF4's
//! code table against bitsandbytes'; and every bad setting refused with a typed error before
//! any device work (that test opens no device). tests/lora_finetune.rs runs the example.

use crate::common;

use common::lora::*;
use common::*;
use fitgrad::compress::{
    dequantize_nf4, double_dequantize, double_quantize, quantize_gpt_base, quantize_nf4,
    quantize_rows, BaseQuant, NF4,
};
use fitgrad::hf::{
    adapter_of, add_lora, merge_adapter, read_adapter, read_llama_adapter, resolve_targets,
    save_adapter, LoraSpec, PretrainedGpt, PretrainedLlama,
};
use fitgrad::nn::{trainable_parameters, Gpt, GptConfig, Llama, LoraConfig, Module};
use fitgrad::optim::{decay_groups, AdamW};
use fitgrad::tensor::QuantWeight;
use fitgrad::train::text::TextDataset;
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{Activation, DType, Device, Error, Tensor};
use std::sync::Arc;
use std::time::Instant;

fn spec(r: usize, alpha: f32, targets: &[&str]) -> LoraSpec {
    LoraSpec {
        config: LoraConfig {
            r,
            alpha,
            dropout: 0.0,
        },
        targets: targets.iter().map(|t| t.to_string()).collect(),
    }
}

fn logits(gpt: &Gpt, ids: &[u32]) -> Vec<f32> {
    gpt.set_training(false);
    let l = gpt
        .forward_ids(ids, 1, ids.len())
        .unwrap()
        .to_vec_f32()
        .unwrap();
    gpt.set_training(true);
    l
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn tiny(dev: &Device) -> (PretrainedGpt, Gpt) {
    let folder = PretrainedGpt::open(&base_dir(), DType::F32).unwrap();
    let gpt = folder.build(dev).unwrap();
    (folder, gpt)
}

/// Gives every adapter's B random values (a trained adapter's stand-in).
fn randomize_b(gpt: &mut Gpt, seed: u64) {
    let _g = fitgrad::no_grad();
    for (i, (_, l)) in gpt.linears_mut().unwrap().into_iter().enumerate() {
        if let Some(lora) = &l.lora {
            let dims = lora.b.dims().to_vec();
            let dev = lora.b.device().clone();
            let r =
                Tensor::rand_uniform(&dev, &dims, -0.5, 0.5, seed + i as u64, DType::F32).unwrap();
            lora.b.detach().add_(&r).unwrap();
        }
    }
}

/// A named check on a device.
type Check = (&'static str, fn(&Device));

/// Every device check on one Vulkan device of its own: plans read the arena's category
/// counts, which another test thread's frees on a shared device would disturb.
#[test]
#[allow(clippy::field_reassign_with_default)]
fn lora_on_one_device() {
    let mut o = fitgrad::DeviceOptions::default();
    o.backend = Some("vulkan".into());
    let Some(dev) = fresh_device(o) else { return };
    let checks: [Check; 9] = [
        (
            "step_zero_equals_the_base_bitwise",
            step_zero_equals_the_base_bitwise,
        ),
        ("only_adapters_train", only_adapters_train),
        ("merge_and_unmerge", merge_and_unmerge),
        ("adapter_files_round_trip", adapter_files_round_trip),
        ("peft_logits_match", peft_logits_match),
        ("dqmatmul_matches_plain_loops", dqmatmul_matches_plain_loops),
        (
            "nf4_on_the_device_is_table_times_absmax",
            nf4_on_the_device_is_table_times_absmax,
        ),
        ("nf4_base_bytes", nf4_base_bytes),
        ("llama_adapters", llama_adapters),
    ];
    for (name, check) in checks {
        let t = Instant::now();
        check(&dev);
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!("{name}: {:.2} s\n", t.elapsed().as_secs_f64()),
        );
    }
}

/// A fresh adapter on every kind of Linear (c_attn, both c_proj, c_fc) changes no bit of the
/// logits: B is zero and the update is added after the base's matmul.
fn step_zero_equals_the_base_bitwise(dev: &Device) {
    let ids = logits_ids();
    let (_, mut gpt) = tiny(dev);
    let base = logits(&gpt, &ids);
    add_lora(&mut gpt, &spec(4, 8.0, &["c_attn", "c_proj", "c_fc"]), 7).unwrap();
    let with = logits(&gpt, &ids);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&base),
        bits(&with),
        "a fresh adapter changed the logits"
    );
    // Training mode too (the fixture has no dropout).
    let a = gpt
        .forward_ids(&ids, 1, ids.len())
        .unwrap()
        .to_vec_f32()
        .unwrap();
    assert_eq!(bits(&base), bits(&a));
}

/// After add_lora only the factors require grad; one backward gives them gradients and the
/// base none; the trainer's optimizer holds state for the factors alone, and the plan's
/// optimizer state is two moments of each factor.
fn only_adapters_train(dev: &Device) {
    let ids = logits_ids();
    let (_, mut gpt) = tiny(dev);
    let targets = add_lora(&mut gpt, &spec(2, 4.0, &["c_attn", "mlp.c_proj"]), 1).unwrap();
    assert_eq!(targets.len(), 4, "two layers, two modules each");
    let trainable = trainable_parameters(&gpt);
    let names: Vec<&str> = trainable.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "blocks.0.attn.qkv.lora_A.weight",
            "blocks.0.attn.qkv.lora_B.weight",
            "blocks.0.mlp.proj.lora_A.weight",
            "blocks.0.mlp.proj.lora_B.weight",
            "blocks.1.attn.qkv.lora_A.weight",
            "blocks.1.attn.qkv.lora_B.weight",
            "blocks.1.mlp.proj.lora_A.weight",
            "blocks.1.mlp.proj.lora_B.weight",
        ]
    );
    let t = ids.len() - 1;
    gpt.loss(&ids[..t], &ids[1..], 1, t)
        .unwrap()
        .backward()
        .unwrap();
    for (name, p) in gpt.named_parameters() {
        let lora = name.contains(".lora_");
        assert_eq!(
            p.grad().is_some(),
            lora,
            "{name}: gradient present = {}",
            !lora
        );
    }
    // B's gradient is nonzero at step 0 (A's is zero, B being zero).
    let gb = trainable[1].1.grad().unwrap().to_vec_f32().unwrap();
    assert!(gb.iter().any(|&v| v != 0.0));
    gpt.zero_grad();

    let adapter_bytes: u64 = trainable.iter().map(|(_, t)| t.allocated_bytes()).sum();
    let groups = decay_groups(trainable_parameters(&gpt), 0.0);
    let opt = AdamW::with_groups(groups, 1e-2).unwrap();
    let mut tr = Trainer::new(gpt, Box::new(opt), TrainerConfig::new(2, 1, 1e-2)).unwrap();
    let text = TextDataset::new(ids.clone(), 8).unwrap();
    let plan = tr.plan(&text).unwrap();
    assert_eq!(plan.optimizer_state, 2 * adapter_bytes, "{plan}");
    assert!(plan.gradients <= adapter_bytes, "{plan}");
    let before: Vec<Vec<f32>> = tr
        .model
        .named_parameters()
        .iter()
        .map(|(_, t)| t.to_vec_f32().unwrap())
        .collect();
    tr.step(&text, &[0, 3]).unwrap();
    for ((name, p), b) in tr.model.named_parameters().iter().zip(&before) {
        let moved = p.to_vec_f32().unwrap() != *b;
        // A moves only after B has: one step moves B.
        if !name.contains(".lora_") {
            assert!(!moved, "{name}: a frozen base parameter changed");
        } else if name.ends_with("lora_B.weight") {
            assert!(moved, "{name} did not train");
        }
    }
}

/// The merged model's logits equal those of base + adapter within 1e-5, in place and as a
/// merged folder; unmerging restores the weights and the logits.
fn merge_and_unmerge(dev: &Device) {
    let ids = logits_ids();
    let (folder, mut gpt) = tiny(dev);
    let s = spec(3, 6.0, &["c_attn", "c_proj", "c_fc"]);
    add_lora(&mut gpt, &s, 5).unwrap();
    randomize_b(&mut gpt, 11);
    let weights = |g: &mut Gpt| -> Vec<Vec<f32>> {
        g.linears_mut()
            .unwrap()
            .into_iter()
            .map(|(_, l)| l.weight.to_vec_f32().unwrap())
            .collect()
    };
    let w0 = weights(&mut gpt);
    let adapted = logits(&gpt, &ids);
    let (_, plain) = tiny(dev);
    let base = logits(&plain, &ids);
    assert!(
        max_abs_diff(&adapted, &base) > 1e-2,
        "the random B should move the logits"
    );
    for (_, l) in gpt.linears_mut().unwrap() {
        l.merge_lora().unwrap();
        assert!(!l.lora_active());
    }
    let merged = logits(&gpt, &ids);
    let d = max_abs_diff(&merged, &adapted);
    assert!(d <= 1e-5, "merged vs base + adapter: {d}");
    for (_, l) in gpt.linears_mut().unwrap() {
        l.unmerge_lora().unwrap();
        assert!(l.lora_active());
    }
    let w1 = weights(&mut gpt);
    for (a, b) in w0.iter().zip(&w1) {
        let d = max_abs_diff(a, b);
        assert!(d <= 1e-6, "unmerged weight differs by {d}");
    }
    let d = max_abs_diff(&logits(&gpt, &ids), &adapted);
    assert!(d <= 1e-5, "unmerged logits: {d}");

    // The merged folder (host f64 sums) loads as a plain GPT-2 with the same logits.
    let dir = tempfile::tempdir().unwrap();
    merge_adapter(&folder, &adapter_of(&gpt, &s).unwrap(), dir.path()).unwrap();
    let m = PretrainedGpt::open(dir.path(), DType::F32)
        .unwrap()
        .build(dev)
        .unwrap();
    let d = max_abs_diff(&logits(&m, &ids), &adapted);
    assert!(d <= 1e-5, "merged folder vs base + adapter: {d}");
}

/// save_adapter writes PEFT's names and config; read_adapter + apply gives the same factors
/// and bitwise the same logits.
fn adapter_files_round_trip(dev: &Device) {
    let ids = logits_ids();
    let (folder, mut gpt) = tiny(dev);
    let s = spec(2, 16.0, &["attn.c_proj", "c_fc"]);
    add_lora(&mut gpt, &s, 3).unwrap();
    randomize_b(&mut gpt, 2);
    let dir = tempfile::tempdir().unwrap();
    save_adapter(&gpt, &s, dir.path(), "gpt2-tiny").unwrap();
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["r"], 2);
    assert_eq!(cfg["lora_alpha"], 16.0);
    assert_eq!(
        cfg["target_modules"],
        serde_json::json!(["attn.c_proj", "c_fc"])
    );
    let bytes = std::fs::read(dir.path().join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    assert_eq!(names.len(), 8);
    assert_eq!(
        names[0],
        "base_model.model.transformer.h.0.attn.c_proj.lora_A.weight"
    );
    assert_eq!(st.tensor(&names[0]).unwrap().shape(), [2, 24]);
    assert_eq!(
        st.tensor("base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight")
            .unwrap()
            .shape(),
        [96, 2]
    );

    let a = read_adapter(dir.path(), &folder.config).unwrap();
    assert_eq!(a.spec, s);
    let mut again = folder.build(dev).unwrap();
    a.apply(&mut again, 0).unwrap();
    let want = adapter_of(&gpt, &s).unwrap();
    for ((x, y), (u, v)) in a.factors.iter().zip(&want.factors) {
        assert_eq!((x.to_f32(), y.to_f32()), (u.to_f32(), v.to_f32()));
    }
    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    assert_eq!(bits(logits(&again, &ids)), bits(logits(&gpt, &ids)));
}

/// The committed adapters (trained by fitgrad's finetune), loaded by PEFT over the same
/// bases: fitgrad's logits with each equal PEFT's within 1e-4 (GPT-2's Conv1D layers, and a
/// Llama's seven projections under grouped-query attention).
fn peft_logits_match(dev: &Device) {
    let ids = logits_ids();
    let (folder, mut gpt) = tiny(dev);
    let a = read_adapter(&adapter_dir(), &folder.config).unwrap();
    a.apply(&mut gpt, 0).unwrap();
    let (_, plain) = tiny(dev);
    let vocab = folder.config.vocab_size;
    let got = [logits(&gpt, &ids), logits(&plain, &ids)];
    check_peft_logits("expected_peft", ids.len(), vocab, &got);

    let ids = llama_logits_ids();
    let folder = PretrainedLlama::open(&llama_base_dir(), DType::F32).unwrap();
    let mut m = folder.build(dev).unwrap();
    let plain = logits_of(&m, &ids);
    read_llama_adapter(&llama_adapter_dir(), &folder.config)
        .unwrap()
        .apply(&mut m, 0)
        .unwrap();
    let vocab = folder.config.vocab_size;
    let got = [logits_of(&m, &ids), plain];
    check_peft_logits("expected_peft_llama", ids.len(), vocab, &got);
}

/// A Llama's logits of `ids` in evaluation mode.
fn logits_of(m: &Llama, ids: &[u32]) -> Vec<f32> {
    m.set_training(false);
    let l = m
        .forward_ids(ids, 1, ids.len())
        .unwrap()
        .to_vec_f32()
        .unwrap();
    m.set_training(true);
    l
}

/// `[adapted, base]` logits (n, vocab) against PEFT's in the fixture file `name`: the adapted
/// within 1e-4, the base's more than 1e-2 away (the adapter is not a no-op).
fn check_peft_logits(name: &str, n: usize, vocab: usize, [got, plain]: &[Vec<f32>; 2]) {
    let bytes = std::fs::read(fixtures().join(format!("lora/{name}.safetensors"))).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let want = st.tensor("logits").unwrap();
    assert_eq!(want.shape(), [n, vocab], "{name}");
    let want: Vec<f32> = bytemuck::pod_collect_to_vec(want.data());
    let d = max_abs_diff(got, &want);
    assert!(d <= 1e-4, "{name}: fitgrad vs PEFT logits: {d}");
    assert!(max_abs_diff(plain, &want) > 1e-2, "{name}");
}

/// The quantized weight of `w` (r, k) on `dev` in `format`, with its dequantized values on
/// the host by each format's rule.
fn quantized(
    dev: &Device,
    format: BaseQuant,
    w: &[f32],
    r: usize,
    k: usize,
) -> (QuantWeight, Vec<f32>) {
    match format {
        BaseQuant::Int8 => {
            let (q, scale) = quantize_rows(w, r, k).unwrap();
            let deq = (0..r * k).map(|i| q[i] as f32 * scale[i / k]).collect();
            (QuantWeight::int8(dev, &q, &scale, r, k).unwrap(), deq)
        }
        BaseQuant::Nf4 { double_quant } => {
            let (codes, absmax) = quantize_nf4(w).unwrap();
            if double_quant {
                let d = double_quantize(&absmax);
                let am = double_dequantize(&d);
                let deq = dequantize_nf4(&codes, &am);
                (
                    QuantWeight::nf4(dev, &codes, &[], Some(&d), r, k).unwrap(),
                    deq,
                )
            } else {
                let deq = dequantize_nf4(&codes, &absmax);
                (
                    QuantWeight::nf4(dev, &codes, &absmax, None, r, k).unwrap(),
                    deq,
                )
            }
        }
        BaseQuant::None => unreachable!(),
    }
}

/// y = x · dequant(W)ᵀ + b and dx = dy · dequant(W) against f64 plain loops, for int8, NF4
/// and double-quantized NF4, on shapes with 1s, odd sizes, no rows, row counts around the
/// kernel's 8 rows per invocation, reductions that are not a multiple of its 8-term steps,
/// blocks of 64 crossing rows, sizes past the 64-wide workgroup, and more than 256 blocks
/// (second-level statistics). Each row's output is the
/// same bits computed alone as within the batch (the sums' order does not depend on where
/// a row falls in the kernel's tile).
fn dqmatmul_matches_plain_loops(dev: &Device) {
    let shapes = [
        (1, 1, 1),
        (0, 5, 7),
        (1, 7, 3),
        (3, 64, 65),
        (5, 130, 17),
        (2, 63, 129),
        (4, 33, 70),
        (2, 131, 141),
        (8, 64, 64),
        (9, 24, 72),
        (7, 128, 3),
        (17, 9, 5),
    ];
    let formats = [
        BaseQuant::Int8,
        BaseQuant::Nf4 {
            double_quant: false,
        },
        BaseQuant::Nf4 { double_quant: true },
    ];
    for (si, &(m, k, r)) in shapes.iter().enumerate() {
        let seed = 100 + si as u64 * 7;
        let w = host_data(seed, r * k, -1.0, 1.0);
        let x = host_data(seed + 1, m * k, -1.0, 1.0);
        let b = host_data(seed + 2, r, -0.5, 0.5);
        let g = host_data(seed + 3, m * r, -1.0, 1.0);
        for f in formats {
            let (q, deq) = quantized(dev, f, &w, r, k);
            let q = Arc::new(q);
            let xt = Tensor::from_slice(dev, &x, &[m, k])
                .unwrap()
                .with_requires_grad();
            let bt = Tensor::from_slice(dev, &b, &[r]).unwrap();
            let y = q.linear(&xt, Some(&bt), Activation::None).unwrap();
            assert_eq!(y.dims(), [m, r]);
            let got = y.to_vec_f32().unwrap();
            for i in 0..m {
                let xi = Tensor::from_slice(dev, &x[i * k..(i + 1) * k], &[1, k]).unwrap();
                let alone = q.linear(&xi, Some(&bt), Activation::None).unwrap();
                let alone = alone.to_vec_f32().unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&alone),
                    bits(&got[i * r..(i + 1) * r]),
                    "{f} forward ({m}, {k}, {r}): row {i} alone"
                );
            }
            for i in 0..m {
                for o in 0..r {
                    let (mut s, mut mag) = (b[o] as f64, b[o].abs() as f64);
                    for j in 0..k {
                        s += x[i * k + j] as f64 * deq[o * k + j] as f64;
                        mag += (x[i * k + j] * deq[o * k + j]).abs() as f64;
                    }
                    let e = (got[i * r + o] as f64 - s).abs();
                    assert!(
                        e <= 1e-6 * (1.0 + mag),
                        "{f} forward ({m}, {k}, {r}) at ({i}, {o}): {} vs {s}",
                        got[i * r + o]
                    );
                }
            }
            y.backward_with(Tensor::from_slice(dev, &g, &[m, r]).unwrap())
                .unwrap();
            let dx = xt.grad().unwrap().to_vec_f32().unwrap();
            for i in 0..m {
                for j in 0..k {
                    let (mut s, mut mag) = (0.0f64, 0.0f64);
                    for o in 0..r {
                        s += g[i * r + o] as f64 * deq[o * k + j] as f64;
                        mag += (g[i * r + o] * deq[o * k + j]).abs() as f64;
                    }
                    let e = (dx[i * k + j] as f64 - s).abs();
                    assert!(
                        e <= 1e-6 * (1.0 + mag),
                        "{f} input gradient ({m}, {k}, {r}) at ({i}, {j}): {} vs {s}",
                        dx[i * k + j]
                    );
                }
            }
        }
    }
}

/// bitsandbytes' NF4 code values as published (bitsandbytes/functional.py,
/// `get_4bit_type("nf4")`).
const BNB_NF4: [f64; 16] = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
];

/// The shader's dequantized values (read through the identity: x = I gives dequant(W)ᵀ) are
/// the code table's value times the block's absmax, bitwise; with double quantization the
/// block absmax is the decoded statistic.
fn nf4_on_the_device_is_table_times_absmax(dev: &Device) {
    let (r, k) = (5, 77);
    let w = host_data(9, r * k, -2.0, 3.0);
    let (codes, absmax) = quantize_nf4(&w).unwrap();
    let eye: Vec<f32> = (0..k * k)
        .map(|i| if i / k == i % k { 1.0 } else { 0.0 })
        .collect();
    let x = Tensor::from_slice(dev, &eye, &[k, k]).unwrap();
    let read = |q: QuantWeight| -> Vec<f32> {
        let y = Arc::new(q).linear(&x, None, Activation::None).unwrap();
        let yt = y.to_vec_f32().unwrap(); // (k, r): yt[j, o] = W[o, j]
        (0..r * k).map(|i| yt[(i % k) * r + i / k]).collect()
    };
    let got = read(QuantWeight::nf4(dev, &codes, &absmax, None, r, k).unwrap());
    for i in 0..r * k {
        let want = BNB_NF4[codes[i] as usize] as f32 * absmax[i / 64];
        assert_eq!(got[i].to_bits(), want.to_bits(), "element {i}");
    }
    let d = double_quantize(&absmax);
    let am = double_dequantize(&d);
    let got = read(QuantWeight::nf4(dev, &codes, &[], Some(&d), r, k).unwrap());
    for i in 0..r * k {
        let want = BNB_NF4[codes[i] as usize] as f32 * am[i / 64];
        assert!(
            (got[i] - want).abs() <= 2.0 * f32::EPSILON * want.abs(),
            "element {i}"
        );
    }
}

/// The NF4 base of a GPT's blocks (width 128) takes at most 0.145x of its f32 bytes, with and
/// without double quantization; int8 about a quarter.
fn nf4_base_bytes(dev: &Device) {
    let cfg = GptConfig::new(16, 8, 1, 2, 128);
    for (quant, most) in [
        (BaseQuant::Nf4 { double_quant: true }, 0.145),
        (
            BaseQuant::Nf4 {
                double_quant: false,
            },
            0.145,
        ),
        (BaseQuant::Int8, 0.26),
    ] {
        let mut gpt = Gpt::new(dev, cfg.clone()).unwrap();
        let (bytes, params) = quantize_gpt_base(&mut gpt, quant).unwrap();
        assert_eq!(params, 12 * 128 * 128);
        let ratio = bytes as f64 / (4.0 * params as f64);
        let _ = std::io::Write::write_fmt(
            &mut std::io::stderr(),
            format_args!(
                "{quant} base: {bytes} bytes for {params} parameters, {ratio:.4}x of f32\n"
            ),
        );
        assert!(ratio <= most, "{quant}: {ratio}x of f32");
        // No dense weight of a block remains a parameter.
        assert!(gpt
            .named_parameters()
            .iter()
            .all(|(n, _)| !(n.starts_with("blocks.")
                && n.ends_with(".weight")
                && !n.contains("ln"))));
    }
}

/// The code table is bitsandbytes' (the shader's is checked against it in src/compress/nf4.rs);
/// quantize then dequantize gives table value times block absmax.
#[test]
fn nf4_table_is_bitsandbytes() {
    assert_eq!(NF4, BNB_NF4.map(|v| v as f32));
    let w = host_data(3, 200, -1.5, 0.7);
    let (codes, absmax) = quantize_nf4(&w).unwrap();
    assert_eq!(absmax.len(), 4);
    for (b, chunk) in w.chunks(64).enumerate() {
        let m = chunk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        assert_eq!(absmax[b], m);
    }
    let back = dequantize_nf4(&codes, &absmax);
    for i in 0..w.len() {
        assert_eq!(back[i], BNB_NF4[codes[i] as usize] as f32 * absmax[i / 64]);
        // The nearest code: no other table value is closer.
        let x = w[i] / absmax[i / 64];
        let best = BNB_NF4
            .iter()
            .map(|&v| (v as f32 - x).abs())
            .fold(f32::INFINITY, f32::min);
        assert!((BNB_NF4[codes[i] as usize] as f32 - x).abs() <= best + 1e-7);
    }
}

/// Bad settings, each a typed error naming the problem, raised on the host (no device is
/// opened in this test).
#[test]
fn bad_settings_are_refused_before_device_work() {
    let folder = PretrainedGpt::open(&base_dir(), DType::F32).unwrap();
    let cfg = &folder.config;
    let inval = |e: Error, says: &str| match e {
        Error::InvalidArgument { reason, .. } => {
            assert!(reason.contains(says), "'{reason}' does not say '{says}'")
        }
        other => panic!("expected InvalidArgument saying '{says}', got {other:?}"),
    };
    // Rank 0, and above the smaller width of c_attn (24 -> 72).
    inval(
        resolve_targets(cfg, &spec(0, 8.0, &["c_attn"])).unwrap_err(),
        "rank 0",
    );
    inval(
        resolve_targets(cfg, &spec(25, 8.0, &["c_attn"])).unwrap_err(),
        "rank 25",
    );
    assert!(resolve_targets(cfg, &spec(24, 8.0, &["c_attn"])).is_ok());
    inval(
        LoraConfig {
            r: 2,
            alpha: 8.0,
            dropout: 1.0,
        }
        .check("x", 4, 4)
        .unwrap_err(),
        "lora_dropout",
    );
    // A target that matches no module (a Llama name on a GPT-2).
    inval(
        resolve_targets(cfg, &spec(4, 8.0, &["q_proj"])).unwrap_err(),
        "'q_proj'",
    );
    inval(
        resolve_targets(cfg, &spec(4, 8.0, &[])).unwrap_err(),
        "no target",
    );

    // An adapter for another base: other widths, or a module this base lacks.
    let mut wider = cfg.clone();
    wider.dim = 32;
    match read_adapter(&adapter_dir(), &wider) {
        Err(Error::Data { path, reason }) => {
            assert!(path.ends_with("adapter_model.safetensors"), "{path}");
            assert!(reason.contains("another base"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let dir = tempfile::tempdir().unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(adapter_dir().join(f), dir.path().join(f)).unwrap();
    }
    let mut deeper = cfg.clone();
    deeper.layers = 1;
    match read_adapter(dir.path(), &deeper) {
        Err(Error::Data { reason, .. }) => assert!(reason.contains("another base"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(read_adapter(dir.path(), cfg).is_ok());
    // A DoRA adapter is not plain LoRA.
    let path = dir.path().join("adapter_config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut j: serde_json::Value = serde_json::from_str(&text).unwrap();
    j["use_dora"] = serde_json::json!(true);
    std::fs::write(&path, j.to_string()).unwrap();
    assert!(matches!(
        read_adapter(dir.path(), cfg),
        Err(Error::Data { .. })
    ));
}

/// A Llama (random, grouped-query attention, untied head) under LoRA on all seven projection
/// kinds: a fresh adapter changes no bit of the logits; only the adapters get gradients; the
/// saved file has PEFT's Llama names and shapes; read back and applied to a fresh base, it
/// gives the trained model's logits bitwise. A GPT-2 name is refused, naming Llama's.
fn llama_adapters(dev: &Device) {
    use fitgrad::hf::{read_llama_adapter, resolve_llama_targets};
    use fitgrad::nn::LlamaConfig;
    let mut cfg = LlamaConfig::new(64, 16, 24, 2, 4, 2, 16);
    cfg.tie_embeddings = false;
    let ids: Vec<u32> = (0..9).map(|i| (i * 7 + 3) % 64).collect();
    let logits = |m: &Llama| {
        m.forward_ids(&ids, 1, ids.len())
            .unwrap()
            .to_vec_f32()
            .unwrap()
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let all = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ];
    let s = spec(2, 4.0, &all);
    let mut m = Llama::new(dev, cfg.clone()).unwrap();
    let base = logits(&m);
    let targets = add_lora(&mut m, &s, 5).unwrap();
    assert_eq!(targets.len(), 14, "two layers, seven modules each");
    assert_eq!(
        bits(&logits(&m)),
        bits(&base),
        "a fresh adapter changed the logits"
    );
    m.forward_ids(&ids, 1, ids.len())
        .unwrap()
        .mean()
        .unwrap()
        .backward()
        .unwrap();
    for (name, p) in m.named_parameters() {
        let lora = name.contains(".lora_");
        assert_eq!(p.grad().is_some(), lora, "{name}");
    }
    m.zero_grad();
    {
        let _g = fitgrad::no_grad();
        for (i, (_, l)) in m.linears_mut().unwrap().into_iter().enumerate() {
            let lora = l.lora.as_ref().unwrap();
            let dims = lora.b.dims().to_vec();
            let r = Tensor::rand_uniform(dev, &dims, -0.5, 0.5, 40 + i as u64, DType::F32).unwrap();
            lora.b.detach().add_(&r).unwrap();
        }
    }
    let trained = logits(&m);
    assert_ne!(bits(&trained), bits(&base));
    let dir = tempfile::tempdir().unwrap();
    save_adapter(&m, &s, dir.path(), "llama-tiny").unwrap();
    let written: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    let fan_in_fan_out = &written["fan_in_fan_out"];
    assert_eq!(fan_in_fan_out, false, "a Llama's projections are nn.Linear");
    let bytes = std::fs::read(dir.path().join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.names().len(), 28);
    let shape = |n: &str| st.tensor(n).unwrap().shape().to_vec();
    let key =
        |l: usize, m: &str, f: &str| format!("base_model.model.model.layers.{l}.{m}.{f}.weight");
    assert_eq!(shape(&key(0, "self_attn.q_proj", "lora_A")), [2, 16]);
    assert_eq!(shape(&key(1, "self_attn.k_proj", "lora_B")), [8, 2]);
    assert_eq!(shape(&key(1, "mlp.down_proj", "lora_A")), [2, 24]);
    assert_eq!(shape(&key(0, "mlp.gate_proj", "lora_B")), [24, 2]);
    let a = read_llama_adapter(dir.path(), &cfg).unwrap();
    assert_eq!(a.spec, s);
    let mut again = Llama::new(dev, cfg.clone()).unwrap();
    a.apply(&mut again, 0).unwrap();
    assert_eq!(
        bits(&logits(&again)),
        bits(&trained),
        "the adapter read back"
    );
    // Another base's widths are refused.
    let mut wider = cfg.clone();
    wider.intermediate = 32;
    assert!(matches!(
        read_llama_adapter(dir.path(), &wider),
        Err(Error::Data { .. })
    ));
    match resolve_llama_targets(&cfg, &spec(2, 4.0, &["c_attn"])) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(
                reason.contains("Llama") && reason.contains("q_proj"),
                "{reason}"
            )
        }
        other => panic!("{:?}", other.err()),
    }
}
