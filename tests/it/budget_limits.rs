//! Budgets against the model and the adapter: a budget too small for the model itself gets the
//! smallest budget that works (and a run with exactly that budget succeeds); a budget of 0 or
//! above the adapter's reported memory, and a reservation past it, are typed errors.

use crate::common;

use common::*;
use fitgrad::nn::{Activation, Mlp, Module};
use fitgrad::optim::{AdamW, Optimizer};
use fitgrad::train::{HostRows, Trainer, TrainerConfig};
use fitgrad::{Device, Error, Result};

fn build(dev: &Device) -> Result<Trainer<Mlp>> {
    let model = Mlp::new(dev, &[16, 256, 256, 4], Activation::Relu, 3)?;
    let opt: Box<dyn Optimizer> = Box::new(AdamW::new(model.parameters(), 1e-3)?);
    Trainer::new(model, opt, TrainerConfig::new(8, 1, 1e-3))
}

#[test]
fn a_budget_too_small_for_the_model_names_a_budget_that_works() {
    let x = host_data(1, 8 * 16, -1.0, 1.0);
    let y: Vec<u32> = (0..8).map(|i| i % 4).collect();
    let rows = HostRows::new(&x, &y).unwrap();
    // 64 KiB cannot hold the model's ~137k parameters (548 KiB in f32).
    let Some(dev) = fresh_with_budget(Some(64 << 10)) else {
        return;
    };
    let err = Trainer::build_within_budget(&dev, &rows, || build(&dev))
        .err()
        .expect("64 KiB cannot hold the model");
    let Error::BudgetTooSmall {
        budget, minimum, ..
    } = err
    else {
        panic!("expected BudgetTooSmall, got {err}");
    };
    assert_eq!(budget, 64 << 10);
    assert!(minimum > 548 << 10, "{minimum}");
    // Nothing stays behind, and the budget is back.
    let stats = dev.memory_stats();
    assert_eq!(stats.bytes_in_use, 0);
    assert_eq!(stats.budget, Some(64 << 10));

    // A fresh run with exactly that budget builds, fits and trains.
    let dev = fresh_with_budget(Some(minimum)).unwrap();
    let mut t = Trainer::build_within_budget(&dev, &rows, || build(&dev))
        .expect("the minimum budget builds the model");
    t.step_rows(&x, &y)
        .expect("a step under the minimum budget");
    t.step_rows(&x, &y).expect("a second step");
    assert!(dev.memory_stats().peak_bytes_reserved <= minimum);
}

#[test]
fn budgets_and_reservations_are_checked_against_the_adapter() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    assert!(matches!(
        dev.set_memory_budget(Some(0)),
        Err(Error::InvalidArgument { .. })
    ));
    let Some(memory) = dev.info().adapter.memory else {
        // The adapter reports no memory (not Vulkan): nothing to check against.
        return;
    };
    let err = dev.set_memory_budget(Some(memory + 1)).unwrap_err();
    assert!(
        err.to_string().contains("device memory"),
        "the error says why: {err}"
    );
    assert_eq!(
        dev.memory_stats().budget,
        None,
        "a refused budget changed it"
    );
    let opts = fitgrad::DeviceOptions::default().memory_budget(memory.saturating_mul(2));
    assert!(matches!(
        Device::with_options(opts),
        Err(Error::InvalidArgument { .. })
    ));
    let err = dev.reserve(memory + (1 << 20)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert_eq!(dev.memory_stats().bytes_reserved, 0, "nothing was reserved");
    dev.set_memory_budget(Some(memory))
        .expect("the adapter's own size is a valid budget");
}

/// The adapter's per-buffer limit is a constraint of fitting, with or without a budget: a
/// batch whose activations would pass `max_storage_buffer_binding_size` gets the largest
/// micro-batch within it (the step is only planned: nothing that big is allocated).
#[test]
fn micro_batches_stay_within_the_per_buffer_limit() {
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let limits = &dev.info().limits;
    let limit = limits
        .max_storage_buffer_binding_size
        .min(limits.max_buffer_size);
    // (n, 4096) f32 hidden activations: n samples pass the limit by a tenth.
    let n = (limit / (4096 * 4)) as usize * 11 / 10;
    let x = host_data(2, n * 16, -1.0, 1.0);
    let y: Vec<u32> = (0..n as u32).map(|i| i % 4).collect();
    let rows = HostRows::new(&x, &y).unwrap();
    let build = |dev: &Device| {
        let model = Mlp::new(dev, &[16, 4096, 4], Activation::Relu, 3)?;
        let opt: Box<dyn Optimizer> = Box::new(AdamW::new(model.parameters(), 1e-3)?);
        Trainer::new(model, opt, TrainerConfig::new(n, 1, 1e-3))
    };
    let mut plain = build(&dev).unwrap();
    assert!(matches!(plain.plan(&rows), Err(Error::Limit { .. })));
    drop(plain);
    for budget in [None, Some(1u64 << 30)] {
        let dev = fresh_with_budget(budget).unwrap();
        let mut t = Trainer::build_within_budget(&dev, &rows, || build(&dev)).unwrap();
        let micro = t.micro_batch();
        assert!(
            micro < n && micro as u64 * 4096 * 4 <= limit,
            "{micro} of {n}"
        );
        let plan = t.plan(&rows).unwrap();
        assert_eq!(plan.micro_batch, micro);
        if budget.is_none() {
            // The largest: one more sample passes the limit.
            assert!((micro as u64 + 1) * 4096 * 4 > limit, "{micro}");
        }
    }
}

/// Evaluation under a budget splits a batch that does not fit instead of failing: 4,096
/// samples at once would need 4 MiB per hidden layer under a 1.5 MiB budget; the loss and
/// accuracy are those of small batches without a budget, and the budget holds.
#[test]
fn evaluation_splits_batches_to_fit_the_budget() {
    let budget = 3 << 19;
    let Some(dev) = fresh_with_budget(Some(budget)) else {
        return;
    };
    let n = 4096;
    let x = host_data(5, n * 16, -1.0, 1.0);
    let y: Vec<u32> = (0..n as u32).map(|i| i % 4).collect();
    let rows = HostRows::new(&x, &y).unwrap();
    let t = build(&dev).unwrap();
    let split = t.evaluate(&rows, n).unwrap();
    assert!(dev.memory_stats().peak_bytes_reserved <= budget);
    dev.set_memory_budget(None).unwrap();
    let small = t.evaluate(&rows, 64).unwrap();
    assert!(
        (split.loss - small.loss).abs() <= 1e-5 * small.loss.abs(),
        "{split:?} {small:?}"
    );
    assert_eq!(split.accuracy, small.accuracy);
}

/// A Llama-70B `config.json` (the tiny fixture's with 70B's sizes) in a temporary folder.
fn llama_70b_config() -> (tempfile::TempDir, std::path::PathBuf) {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/hf/llama-tiny-gqa/config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let c = json.as_object_mut().unwrap();
    for (k, v) in [
        ("hidden_size", 8192),
        ("num_hidden_layers", 80),
        ("num_attention_heads", 64),
        ("num_key_value_heads", 8),
        ("head_dim", 128),
        ("intermediate_size", 28672),
        ("vocab_size", 128256),
        ("max_position_embeddings", 8192),
    ] {
        c.insert(k.into(), v.into());
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
    (dir, path)
}

/// Any size plans on any adapter (issue 43, item 6): a Llama-70B step is planned on a device
/// that only plans, whatever that adapter's buffer and binding limits (lavapipe: 2 GiB buffers,
/// 128 MiB bindings; the embedding alone is 4 GiB in f32), and the figures are the model's.
#[test]
fn a_70b_model_plans_on_any_adapter() {
    use fitgrad::hf::ModelConfig;
    use fitgrad::nn::Llama;
    use fitgrad::train::text::TextDataset;
    let (_d, path) = llama_70b_config();
    let ModelConfig::Llama(cfg) = ModelConfig::open(path.to_str().unwrap())
        .unwrap()
        .with(fitgrad::DType::F32, 1)
    else {
        panic!("a Llama config");
    };
    let Some(dev) = fresh_device(fitgrad::DeviceOptions::default().plan_only(true)) else {
        return;
    };
    let context = 16;
    let ids: Vec<u32> = (0..2 * context as u32 + 1).collect();
    let data = TextDataset::new(ids, context).unwrap();
    let model = Llama::new(&dev, cfg).expect("a 70B Llama is made on a planning device");
    let params = model.num_parameters() as u64;
    assert!(params > 70_000_000_000, "{params}");
    let opt: Box<dyn Optimizer> = Box::new(AdamW::new(model.parameters(), 1e-4).unwrap());
    let mut t = Trainer::new(model, opt, TrainerConfig::new(1, 1, 1e-4)).unwrap();
    let plan = t.plan(&data).expect("a 70B step plans");
    // Parameters, gradients and AdamW's two moments, in f32.
    assert!(
        plan.peak > 16 * params,
        "{} for {params} parameters",
        plan.peak
    );
}

/// A real run of a model with a tensor no buffer of the adapter holds is refused before any
/// device work, naming the tensor and the limit (the 70B's embedding is 3.9 GiB in f32; lavapipe's
/// buffers hold 2 GiB; adapters with larger buffers skip).
#[test]
fn a_tensor_past_the_adapters_buffers_is_named() {
    use fitgrad::hf::ModelConfig;
    use fitgrad::nn::Llama;
    let (_d, path) = llama_70b_config();
    let ModelConfig::Llama(cfg) = ModelConfig::open(path.to_str().unwrap())
        .unwrap()
        .with(fitgrad::DType::F32, 1)
    else {
        panic!("a Llama config");
    };
    let Some(dev) = fresh_with_budget(None) else {
        return;
    };
    let limit = dev.info().limits.max_buffer_size;
    let embed = (cfg.vocab_size * cfg.dim * 4) as u64;
    if embed <= limit {
        eprintln!("SKIPPED: this adapter's buffers hold the 70B's embedding");
        return;
    }
    match Llama::new(&dev, cfg) {
        Err(Error::TensorLimit {
            tensor,
            bytes,
            limit: l,
        }) => {
            assert_eq!(tensor, "model.embed_tokens.weight");
            assert_eq!((bytes, l), (embed, limit));
        }
        Err(e) => panic!("{e} is not a TensorLimit"),
        Ok(_) => panic!("a 70B Llama was made on {}", dev.info().adapter),
    }
    assert_eq!(dev.memory_stats().bytes_reserved, 0, "nothing was made");
}
