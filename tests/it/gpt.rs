//! nn::Gpt on every device, with tiny configurations (vocabulary 11, context 8, 2 layers, 2
//! heads, width 16): shapes in f32 and f16; parameter names, count (the formula) and the tied
//! head; the whole model's gradient against central finite differences at a random point; a
//! few AdamW steps fitting a repeated sequence; block checkpointing with dropout giving the same
//! loss and gradients bit for bit, and a lower activation peak; KV-cached logits against the
//! full forward; generation against an uncached reference, reproducible for a seed; the
//! configuration and input errors, before any device work; the checkpoint file round trip.

use crate::common;

use common::*;
use fitgrad::checkpoint::{Checkpoint, TrainingState};
use fitgrad::nn::{AttentionKind, Gpt, GptConfig, Mlp, Module};
use fitgrad::optim::{AdamW, Optimizer};
use fitgrad::tensor::Rng;
use fitgrad::{DType, Device, DeviceOptions, Error, SoftmaxOptions, Tensor};
use proptest::prelude::*;

const VOCAB: usize = 11;
const CONTEXT: usize = 8;

/// vocabulary 11, context 8, 2 layers, 2 heads, width 16.
fn tiny(dtype: DType) -> GptConfig {
    let mut cfg = GptConfig::new(VOCAB, CONTEXT, 2, 2, 16);
    cfg.dtype = dtype;
    cfg.seed = 3;
    cfg
}

/// `n` ids below `VOCAB` from `seed`.
fn ids(seed: u64, n: usize) -> Vec<u32> {
    let mut r = HostRng::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % VOCAB as u64) as u32)
        .collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn is_invalid<T>(r: fitgrad::Result<T>) -> bool {
    matches!(r, Err(Error::InvalidArgument { .. }))
}

/// A device of its own on `dev`'s backend (its memory statistics are the test's alone).
// Option structs are built with default() and then assigned, never as literals (they are
// becoming #[non_exhaustive]).
#[allow(clippy::field_reassign_with_default)]
fn fresh_like(dev: &Device) -> Option<Device> {
    let mut o = DeviceOptions::default();
    o.backend = Some(dev.info().adapter.backend.clone());
    fresh_device(o)
}

device_tests!(
    shapes_and_dtypes,
    parameters_are_named_counted_and_tied,
    gradients_match_finite_differences,
    adamw_fits_a_repeated_sequence,
    checkpointed_blocks_are_exact_with_dropout,
    checkpointed_blocks_lower_the_peak,
    cached_logits_match_the_full_forward,
    generation_matches_an_uncached_reference,
    bad_configs_and_inputs_are_refused_before_device_work,
    checkpoint_file_round_trip,
);

fn shapes_and_dtypes(dev: &Device) {
    for dtype in [DType::F32, DType::F16] {
        let gpt = Gpt::new(dev, tiny(dtype)).unwrap();
        proptest!(ProptestConfig::with_cases(4), |(batch in 1usize..=3, t in 1usize..=CONTEXT, seed in any::<u64>())| {
            let what = format!("({batch}, {t}) {dtype} on {}", label(dev));
            let x = ids(seed, batch * t);
            let logits = gpt.forward_ids(&x, batch, t).unwrap();
            prop_assert_eq!(logits.dims(), &[batch, t, VOCAB][..], "{}", what);
            prop_assert_eq!(logits.dtype(), dtype, "{}", what);
            let v = logits.to_vec_f32().unwrap();
            prop_assert!(v.iter().all(|x| x.is_finite()), "{}: logits {:?}", what, v);
            // The forward of the same ids is bitwise the same run to run.
            prop_assert_eq!(bits(&gpt.forward_ids(&x, batch, t).unwrap()), bits(&logits), "{}", what);
            let mixed = gpt.forward_ids_in(&x, batch, t, DType::F16).unwrap();
            prop_assert_eq!(mixed.dtype(), DType::F32, "{}", what);
            prop_assert_eq!(mixed.dims(), logits.dims(), "{}", what);
            let loss = gpt.loss(&x, &ids(seed ^ 1, batch * t), batch, t).unwrap();
            prop_assert_eq!(loss.dims(), &[] as &[usize], "{}", what);
            // Near-uniform logits at init: the loss is about ln(V).
            let l = loss.item().unwrap();
            prop_assert!((l - (VOCAB as f32).ln()).abs() < 0.3, "{}: loss {}", what, l);
        });
    }
}

fn parameters_are_named_counted_and_tied(dev: &Device) {
    let cfg = tiny(DType::F32);
    let gpt = Gpt::new(dev, cfg.clone()).unwrap();
    let named = gpt.named_parameters();
    let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    let mut want = vec!["wte.weight".to_string(), "wpe.weight".to_string()];
    for i in 0..cfg.layers {
        for p in ["ln1", "attn.qkv", "attn.proj", "ln2", "mlp.fc", "mlp.proj"] {
            for w in ["weight", "bias"] {
                want.push(format!("blocks.{i}.{p}.{w}"));
            }
        }
    }
    want.extend(["ln_f.weight".to_string(), "ln_f.bias".to_string()]);
    assert_eq!(names, want, "names");
    // V·C + T·C + layers·(12·C² + 13·C) + 2·C, the head being wte.
    let (v, t, l, c) = (VOCAB, CONTEXT, cfg.layers, cfg.dim);
    let formula = v * c + t * c + l * (12 * c * c + 13 * c) + 2 * c;
    assert_eq!(gpt.num_parameters(), formula);
    assert_eq!(cfg.num_parameters().unwrap(), formula);
    let shape = |n: &str| {
        named
            .iter()
            .find(|(k, _)| k == n)
            .unwrap()
            .1
            .dims()
            .to_vec()
    };
    assert_eq!(shape("wte.weight"), [v, c]);
    assert_eq!(shape("blocks.1.attn.qkv.weight"), [3 * c, c]);
    assert_eq!(shape("blocks.0.mlp.proj.weight"), [c, 4 * c]);

    // Tied head: ids that never use tokens 9 and 10 still give their rows of wte a gradient,
    // which only the head (logits = x · Wteᵀ) can give.
    let x: Vec<u32> = (0..2 * CONTEXT).map(|i| (i % 9) as u32).collect();
    gpt.loss(&x, &x, 2, CONTEXT).unwrap().backward().unwrap();
    let g = named[0]
        .1
        .grad()
        .expect("wte has a gradient")
        .to_vec_f32()
        .unwrap();
    let row10 = &g[10 * c..11 * c];
    assert!(row10.iter().any(|&v| v != 0.0), "row 10 of wte: {row10:?}");
    assert!(named[1].1.grad().is_some(), "wpe has a gradient");
    gpt.zero_grad();

    // GPT-2's init: biases 0, residual projections with a smaller spread.
    let std = |n: &str| {
        let v = named
            .iter()
            .find(|(k, _)| k == n)
            .unwrap()
            .1
            .to_vec_f32()
            .unwrap();
        (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
    };
    assert_eq!(std("blocks.0.attn.qkv.bias"), 0.0);
    let (fc, proj) = (
        std("blocks.0.mlp.fc.weight"),
        std("blocks.0.mlp.proj.weight"),
    );
    assert!((fc - 0.02).abs() < 0.003, "fc std {fc}");
    assert!(
        (proj - 0.01).abs() < 0.002,
        "proj std {proj} (0.02 / sqrt(2 layers))"
    );
}

/// Every f32 parameter of the checkpoint `ck` set to random values (LayerNorm weights near 1),
/// so no gradient is tiny at the point checked.
fn randomize(ck: &mut Checkpoint) {
    for (i, (name, h)) in ck.tensors.iter_mut().enumerate() {
        let n = h.numel();
        let mut v = host_data(100 + i as u64, n, -0.5, 0.5);
        if name.contains("ln") && name.ends_with("weight") {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        h.bytes = bytemuck::cast_slice(&v).to_vec();
    }
}

fn set(ck: &mut Checkpoint, key: &str, i: usize, value: f32) {
    let b = &mut ck.tensors.get_mut(key).unwrap().bytes;
    b[4 * i..4 * i + 4].copy_from_slice(&value.to_le_bytes());
}

fn gradients_match_finite_differences(dev: &Device) {
    let gpt = Gpt::new(dev, tiny(DType::F32)).unwrap();
    let mut ck = Checkpoint::capture(&gpt, None, &TrainingState::default()).unwrap();
    randomize(&mut ck);
    ck.apply_model(&gpt).unwrap();
    let (b, t) = (2, 5);
    let (x, y) = (ids(7, b * t), ids(8, b * t));
    let loss_at = |ck: &Checkpoint| {
        ck.apply_model(&gpt).unwrap();
        let _g = fitgrad::no_grad();
        gpt.loss(&x, &y, b, t).unwrap().item().unwrap() as f64
    };
    gpt.loss(&x, &y, b, t).unwrap().backward().unwrap();
    let params = gpt.named_parameters();
    let checked = [
        "wte.weight",
        "wpe.weight",
        "blocks.0.ln1.weight",
        "blocks.0.attn.qkv.weight",
        "blocks.0.attn.proj.bias",
        "blocks.1.mlp.fc.weight",
        "blocks.1.mlp.proj.weight",
        "ln_f.bias",
    ];
    for name in checked {
        let p = &params.iter().find(|(n, _)| n == name).unwrap().1;
        let g = p.grad().unwrap().to_vec_f32().unwrap();
        let key = format!("model.{name}");
        let values = ck.tensors[&key].to_f32();
        // The two entries with the largest gradient (relative errors are meaningful there).
        let mut order: Vec<usize> = (0..g.len()).collect();
        order.sort_by(|&i, &j| g[j].abs().total_cmp(&g[i].abs()));
        for &i in &order[..2] {
            let h = 1e-2f32;
            let x0 = values[i];
            set(&mut ck, &key, i, x0 + h);
            let plus = loss_at(&ck);
            set(&mut ck, &key, i, x0 - h);
            let minus = loss_at(&ck);
            set(&mut ck, &key, i, x0);
            let fd = (plus - minus) / (2.0 * h as f64);
            let got = g[i] as f64;
            assert!(
                (got - fd).abs() <= 2e-4 + 2e-2 * fd.abs(),
                "{name}[{i}] on {}: gradient {got:e}, finite difference {fd:e}",
                label(dev)
            );
        }
    }
    ck.apply_model(&gpt).unwrap();
}

/// ids (2, 8) of a repeating sequence and its next tokens.
fn repeated() -> (Vec<u32>, Vec<u32>) {
    let seq: Vec<u32> = (0..2 * CONTEXT + 1)
        .map(|i| [1, 4, 2, 8, 5, 7][i % 6])
        .collect();
    let x: Vec<u32> = seq[..CONTEXT]
        .iter()
        .chain(&seq[3..3 + CONTEXT])
        .copied()
        .collect();
    let y: Vec<u32> = seq[1..=CONTEXT]
        .iter()
        .chain(&seq[4..4 + CONTEXT])
        .copied()
        .collect();
    (x, y)
}

fn adamw_fits_a_repeated_sequence(dev: &Device) {
    let gpt = Gpt::new(dev, tiny(DType::F32)).unwrap();
    let mut opt = AdamW::new(gpt.parameters(), 1e-2).unwrap();
    let (x, y) = repeated();
    let mut losses = Vec::new();
    for _ in 0..30 {
        let loss = gpt.loss(&x, &y, 2, CONTEXT).unwrap();
        losses.push(loss.item().unwrap());
        loss.backward().unwrap();
        opt.step().unwrap();
        gpt.zero_grad();
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        last < 0.3 * first,
        "loss went from {first} to {last} on {}: {losses:?}",
        label(dev)
    );
}

fn checkpointed_blocks_are_exact_with_dropout(dev: &Device) {
    for dtype in [DType::F32, DType::F16] {
        let mut cfg = tiny(dtype);
        cfg.dropout = 0.2;
        let plain = Gpt::new(dev, cfg.clone()).unwrap();
        cfg.checkpoint_blocks = true;
        let ckpt = Gpt::new(dev, cfg).unwrap();
        assert!(ckpt.checkpoint_blocks() && !plain.checkpoint_blocks());
        let (x, y) = repeated();
        // Two steps: the second checks that the dropout counters stayed in step.
        for step in 0..2 {
            let what = format!("step {step}, {dtype} on {}", label(dev));
            let a = plain.loss(&x, &y, 2, CONTEXT).unwrap();
            let b = ckpt.loss(&x, &y, 2, CONTEXT).unwrap();
            assert_eq!(bits(&a), bits(&b), "loss, {what}");
            a.backward().unwrap();
            b.backward().unwrap();
            for ((name, p), (_, q)) in plain.named_parameters().iter().zip(ckpt.named_parameters())
            {
                let (gp, gq) = (p.grad().unwrap(), q.grad().unwrap());
                assert_eq!(bits(&gp), bits(&gq), "gradient of {name}, {what}");
            }
            plain.zero_grad();
            ckpt.zero_grad();
        }
        // Dropout was on: evaluation mode gives another loss.
        let train = plain.loss(&x, &y, 2, CONTEXT).unwrap().item().unwrap();
        plain.set_training(false);
        let eval = plain.loss(&x, &y, 2, CONTEXT).unwrap().item().unwrap();
        assert_ne!(train, eval, "{dtype}: dropout changed nothing");
    }
}

fn checkpointed_blocks_lower_the_peak(dev: &Device) {
    let Some(fresh) = fresh_like(dev) else { return };
    // Four blocks: checkpointed, the step keeps the input of each block's two residual halves
    // and one half's recomputed activations at a time. The peak measured here also holds the
    // gradients that backward creates (a fixed share at this width), so the whole peak falls
    // to under 0.65x; the activations alone fall to under half (the planner's categories at
    // train_gpt's default width: 0.47x at 2 blocks, 0.30x at 4).
    let mut cfg = GptConfig::new(VOCAB, 16, 4, 4, 32);
    cfg.dropout = 0.1;
    let gpt = Gpt::new(&fresh, cfg).unwrap();
    let x = ids(5, 4 * 16);
    let step = |checkpointed: bool| {
        gpt.set_checkpoint_blocks(checkpointed);
        let before = fresh.memory_stats().bytes_in_use;
        fresh.reset_peak();
        gpt.loss(&x, &x, 4, 16).unwrap().backward().unwrap();
        let peak = fresh.memory_stats().peak_bytes_in_use - before;
        gpt.zero_grad();
        assert_eq!(
            fresh.memory_stats().bytes_in_use,
            before,
            "the step left memory behind"
        );
        peak
    };
    let plain = step(false);
    let ckpt = step(true);
    assert!(
        (ckpt as f64) <= 0.65 * plain as f64,
        "peak above the parameters on {}: {ckpt} bytes checkpointed, {plain} plain",
        label(dev)
    );
}

fn cached_logits_match_the_full_forward(dev: &Device) {
    for dtype in [DType::F32, DType::F16] {
        let gpt = Gpt::new(dev, tiny(dtype)).unwrap();
        gpt.set_training(false);
        let batch = 2;
        let seq = ids(11, batch * CONTEXT);
        let full = gpt
            .forward_ids(&seq, batch, CONTEXT)
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let tol = match dtype {
            DType::F32 => Tol {
                abs: 1e-5,
                rel: 1e-4,
                f16_ulps: 0.0,
            },
            DType::F16 => Tol {
                abs: 2e-3,
                rel: 2e-2,
                f16_ulps: 4.0,
            },
        };
        // Rows start..start + len of every batch, from seq (B, CONTEXT) and logits (B, T, V).
        let cols = |v: &[u32], start: usize, len: usize| -> Vec<u32> {
            (0..batch)
                .flat_map(|b| v[b * CONTEXT + start..b * CONTEXT + start + len].to_vec())
                .collect()
        };
        let want = |start: usize, len: usize| -> Vec<f32> {
            (0..batch)
                .flat_map(|b| {
                    full[(b * CONTEXT + start) * VOCAB..(b * CONTEXT + start + len) * VOCAB]
                        .to_vec()
                })
                .collect()
        };
        // A prefill of 3 positions, then one at a time.
        let mut cache = gpt.kv_cache();
        let mut start = 0;
        for len in [3, 1, 1, 1, 1, 1] {
            let got = gpt
                .forward_cached(&cols(&seq, start, len), batch, len, &mut cache)
                .unwrap();
            assert_eq!(got.dims(), [batch, len, VOCAB]);
            let what = format!(
                "cached positions {start}..{} {dtype} on {}",
                start + len,
                label(dev)
            );
            check_close(&what, &got.to_vec_f32().unwrap(), &want(start, len), tol).unwrap();
            start += len;
            assert_eq!(cache.len(), start);
        }
        // Past the context, another batch, or another model's cache: refused.
        assert!(is_invalid(gpt.forward_cached(
            &cols(&seq, 0, 3),
            batch,
            3,
            &mut cache
        )));
        assert!(is_invalid(gpt.forward_cached(&seq[..1], 1, 1, &mut cache)));
        let mut cfg = tiny(dtype);
        cfg.layers = 1;
        let other = Gpt::new(dev, cfg).unwrap();
        assert!(is_invalid(gpt.forward_cached(
            &seq[..1],
            1,
            1,
            &mut other.kv_cache()
        )));
        cache.clear();
        assert!(cache.is_empty());
        gpt.forward_cached(&seq[..1], 1, 1, &mut cache).unwrap();
    }
}

/// generate without a cache: the full forward of the last `CONTEXT` tokens at every step, and
/// the same sampling rule (softmax on the device, inverse transform on the host).
fn reference_generate(
    gpt: &Gpt,
    prompt: &[u32],
    max_new: usize,
    temperature: f32,
    seed: u64,
) -> Vec<u32> {
    let _g = fitgrad::no_grad();
    let mut rng = Rng::new(seed);
    let mut out = prompt.to_vec();
    for _ in 0..max_new {
        let w = &out[out.len().saturating_sub(CONTEXT)..];
        let logits = gpt.forward_ids(w, 1, w.len()).unwrap();
        let probs = logits
            .narrow(1, w.len() - 1, 1)
            .unwrap()
            .softmax_masked(SoftmaxOptions::new().scale(1.0 / temperature))
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let total: f64 = probs.iter().map(|&p| p as f64).sum();
        let u = rng.next_f64() * total;
        let mut acc = 0.0;
        let next = probs
            .iter()
            .position(|&p| {
                acc += p as f64;
                u < acc
            })
            .unwrap();
        out.push(next as u32);
    }
    out
}

fn generation_matches_an_uncached_reference(dev: &Device) {
    let mut cfg = tiny(DType::F32);
    cfg.dropout = 0.1;
    let gpt = Gpt::new(dev, cfg).unwrap();
    let prompt = [3, 1, 4];
    // 12 new tokens: the window slides past the context of 8.
    let a = gpt.generate(&prompt, 12, 0.9, 7).unwrap();
    assert!(gpt.is_training(), "generate restores training mode");
    assert_eq!(a.len(), prompt.len() + 12);
    assert_eq!(&a[..3], &prompt);
    assert!(a.iter().all(|&i| (i as usize) < VOCAB));
    assert_eq!(
        gpt.generate(&prompt, 12, 0.9, 7).unwrap(),
        a,
        "same seed, same tokens"
    );
    assert_ne!(
        gpt.generate(&prompt, 12, 0.9, 8).unwrap(),
        a,
        "another seed"
    );
    gpt.set_training(false);
    assert_eq!(
        reference_generate(&gpt, &prompt, 12, 0.9, 7),
        a,
        "on {}",
        label(dev)
    );
    // A prompt longer than the context is cropped to its last CONTEXT tokens.
    let long = ids(3, CONTEXT + 3);
    let b = gpt.generate(&long, 2, 1.5, 1).unwrap();
    assert_eq!(b, reference_generate(&gpt, &long, 2, 1.5, 1));
    assert_eq!(gpt.generate(&prompt, 0, 1.0, 0).unwrap(), prompt);
    // f16 generates too.
    let half = Gpt::new(dev, tiny(DType::F16)).unwrap();
    assert_eq!(half.generate(&prompt, 4, 1.0, 2).unwrap().len(), 7);
}

fn bad_configs_and_inputs_are_refused_before_device_work(dev: &Device) {
    let Some(fresh) = fresh_like(dev) else { return };
    let with = |f: &dyn Fn(&mut GptConfig)| {
        let mut c = tiny(DType::F32);
        f(&mut c);
        c
    };
    let bad_configs = [
        with(&|c| c.heads = 3),
        with(&|c| c.vocab_size = 0),
        with(&|c| c.context = 0),
        with(&|c| c.layers = 0),
        with(&|c| c.heads = 0),
        with(&|c| c.dim = 0),
        with(&|c| c.dropout = 1.0),
        with(&|c| c.dropout = -0.1),
        with(&|c| c.dropout = f32::NAN),
        with(&|c| c.vocab_size = (1 << 24) + 1),
        with(&|c| {
            c.dim = usize::MAX / 4;
            c.heads = 1;
        }),
    ];
    for cfg in bad_configs {
        match Gpt::new(&fresh, cfg.clone()) {
            Err(e @ Error::InvalidArgument { .. }) if cfg.heads == 3 => {
                let msg = e.to_string();
                assert!(msg.contains("divide") && msg.contains("dim = 18"), "{msg}");
            }
            Err(Error::InvalidArgument { .. }) => {}
            Err(e) => panic!("{cfg:?}: {e}"),
            Ok(_) => panic!("{cfg:?} was accepted"),
        }
    }
    assert!(is_invalid(
        with(&|c| c.dim = usize::MAX / 4).num_parameters()
    ));
    assert_eq!(
        fresh.memory_stats().allocations,
        0,
        "a refused config allocated"
    );

    let gpt = Gpt::new(&fresh, tiny(DType::F32)).unwrap();
    let x = ids(1, 2 * 4);
    let before = fresh.memory_stats().allocations;
    let mut cache = gpt.kv_cache();
    let refused = [
        is_invalid(gpt.forward_ids(&x, 2, 3)),
        is_invalid(gpt.forward_ids(&x, 0, 4)),
        is_invalid(gpt.forward_ids(&[], 1, 0)),
        is_invalid(gpt.forward_ids(&ids(1, CONTEXT + 1), 1, CONTEXT + 1)),
        is_invalid(gpt.forward_ids(&[1, 2, 11, 3], 1, 4)),
        is_invalid(gpt.loss(&x, &x[..7], 2, 4)),
        is_invalid(gpt.loss(&x, &[0, 0, 0, 0, 0, 0, 0, 11], 2, 4)),
        is_invalid(gpt.generate(&[], 3, 1.0, 0)),
        is_invalid(gpt.generate(&[1, 11], 3, 1.0, 0)),
        is_invalid(gpt.generate(&x, 3, 0.0, 0)),
        is_invalid(gpt.generate(&x, 3, -1.0, 0)),
        is_invalid(gpt.generate(&x, 3, f32::NAN, 0)),
        is_invalid(gpt.generate(&x, 3, f32::INFINITY, 0)),
        is_invalid(gpt.generate(&x, 3, 1e-45, 0)),
        is_invalid(gpt.forward_cached(&ids(1, CONTEXT + 1), 1, CONTEXT + 1, &mut cache)),
        is_invalid(gpt.forward(&Tensor::zeros(&fresh, &[1, 16], DType::F32).unwrap())),
    ];
    let failed: Vec<usize> = (0..refused.len()).filter(|&i| !refused[i]).collect();
    assert!(
        failed.is_empty(),
        "not refused with InvalidArgument: cases {failed:?}"
    );
    // The zeros tensor of the last case is the only allocation.
    assert_eq!(
        fresh.memory_stats().allocations,
        before + 1,
        "a refused call allocated"
    );
}

fn checkpoint_file_round_trip(dev: &Device) {
    let mut cfg = tiny(DType::F32);
    cfg.dropout = 0.25;
    cfg.seed = 9;
    cfg.attention = AttentionKind::Composed;
    let gpt = Gpt::new(dev, cfg.clone()).unwrap();
    gpt.set_checkpoint_blocks(true);
    // Train a step so the weights are not the init's.
    let (x, y) = repeated();
    let mut opt = AdamW::new(gpt.parameters(), 1e-2).unwrap();
    gpt.loss(&x, &y, 2, CONTEXT).unwrap().backward().unwrap();
    opt.step().unwrap();
    let bytes = Checkpoint::capture(&gpt, None, &TrainingState::default())
        .unwrap()
        .to_bytes()
        .unwrap();
    let back = Checkpoint::from_bytes(&bytes, "memory")
        .unwrap()
        .rebuild(|cfg| Gpt::from_config(dev, cfg))
        .unwrap();
    cfg.checkpoint_blocks = true;
    assert_eq!(back.gpt_config(), cfg);
    assert_eq!(param_values(&back), param_values(&gpt));
    gpt.set_training(false);
    back.set_training(false);
    assert_eq!(
        bits(&back.forward_ids(&x, 2, CONTEXT).unwrap()),
        bits(&gpt.forward_ids(&x, 2, CONTEXT).unwrap())
    );
    // An Mlp's file is not a Gpt's.
    let mlp = Mlp::new(dev, &[4, 3], fitgrad::Activation::Relu, 0).unwrap();
    let c = Checkpoint::capture(&mlp, None, &TrainingState::default()).unwrap();
    assert!(matches!(
        c.rebuild(|cfg| Gpt::from_config(dev, cfg)).map(|_| ()),
        Err(Error::Data { .. })
    ));
}
