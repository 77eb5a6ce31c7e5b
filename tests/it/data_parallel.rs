//! DataParallel over two logical devices of one adapter: the weights of one device with the
//! same effective batch (uneven shares, a replica with no sample, micro-batches under a
//! budget), replicas bitwise identical after every step, the all-reduce buffer in the plan as
//! measured, a model that differs refused on every replica, and a failing replica stopping the
//! others instead of leaving them waiting, and batch norm's running statistics made rank 0's
//! on every replica after each step. The in-process group's collectives are checked
//! without a device.

use crate::common;

use common::*;
use fitgrad::distributed::zero::{CollectiveKind, ShardLayout, StepCollectives, GRANULE};
use fitgrad::distributed::{attach_zero, share_of, Communicator, DataParallel, LocalGroup, Zero};
use fitgrad::memory::Category;
use fitgrad::nn::{self, Activation, BatchNorm2d, Linear, Mlp, Module};
use fitgrad::optim::AdamW;
use fitgrad::train::data::{self, Dataset};
use fitgrad::train::{BatchSource, ClassBatch, StepContext, TrainModel, Trainer, TrainerConfig};
use fitgrad::{Device, DeviceOptions, Error, Result, Tensor};
use std::sync::OnceLock;
use std::time::Duration;

device_tests!(
    two_replicas_match_one_device,
    budgets_micro_batches_and_the_planned_buffer,
    a_different_model_is_refused,
    a_failing_replica_stops_the_others,
    zero_stages_match_stage_0_and_one_device,
    zero_with_clipping_and_mixed_precision_matches_one_device,
    a_zero_checkpoint_resumes_on_other_replica_counts,
    zero_stages_send_the_bytes_of_stage_0,
    batch_norm_buffers_are_rank_0s_on_every_replica,
    zero_2_frees_gradients_during_backward
);

const SEED: u64 = 3;
const WIDTHS: [usize; 3] = [64, 16, 10];

fn digits() -> &'static Dataset {
    static DIGITS: OnceLock<Dataset> = OnceLock::new();
    DIGITS.get_or_init(|| data::load("digits", SEED).expect("the embedded digits").0)
}

/// Another device on `dev`'s adapter, backend and f16 mode, with its own arena and `budget`.
fn twin(dev: &Device, budget: Option<u64>) -> Device {
    let info = dev.info();
    let mut opts = DeviceOptions::default()
        .backend(info.adapter.backend.clone())
        .adapter(info.adapter.name.clone())
        .force_packed_f16(!info.f16_native);
    opts.memory_budget = budget;
    Device::with_options(opts).expect("a second device on the same adapter")
}

/// An MLP of `widths` and AdamW with `config` on `dev`.
fn trainer(dev: &Device, widths: &[usize], config: TrainerConfig) -> Result<Trainer<Mlp>> {
    let model = Mlp::new(dev, widths, Activation::Relu, SEED)?;
    let opt = Box::new(AdamW::new(model.parameters(), 1e-2)?);
    Trainer::new(model, opt, config.lr(1e-2))
}

/// The batches the tests step through: 13 samples (shares of 7 and 6), 1 sample (replica 1
/// gets none), then 13 again.
fn batches() -> Vec<Vec<usize>> {
    let order = digits().epoch_order(SEED, 0);
    vec![
        order[0..13].to_vec(),
        order[13..14].to_vec(),
        order[14..27].to_vec(),
        order[27..40].to_vec(),
    ]
}

/// Runs the batches on one device and on two replicas and compares.
fn two_replicas_match_one_device(dev: &Device) {
    let config = TrainerConfig::new(13, 1, 1e-2);
    let mut single = trainer(dev, &WIDTHS, config.clone()).unwrap();
    let devices = [twin(dev, None), twin(dev, None)];
    let mut dp = DataParallel::new(&devices, |d| trainer(d, &WIDTHS, config.clone())).unwrap();
    for (i, idx) in batches().iter().enumerate() {
        single.step(digits(), idx).unwrap();
        dp.step(digits(), idx).unwrap();
        dp.check_identical()
            .unwrap_or_else(|e| panic!("after step {i} on {}: {e}", label(dev)));
    }
    let worst = worst_rel_diff(&param_values(dp.model()), &param_values(&single.model));
    assert!(
        worst < 1e-5,
        "{}: data-parallel weights differ from one device's by {worst:e}",
        label(dev)
    );
    let (a, b) = (dp.take_loss().unwrap(), single.take_loss().unwrap());
    assert!((a - b).abs() <= 1e-5 * b.abs(), "mean loss {a} against {b}");
    let stats = dp.all_reduce_stats();
    assert_eq!(stats.len(), 2);
    assert!(stats.iter().all(|s| s.steps == 4), "{stats:?}");
}

/// Replicas under budgets with micro-batches of 3 give one device's weights; each plan has
/// the all-reduce buffer (what a real step then holds as communication), and a step of a
/// share of 7 in micro-batches of 3 is planned as 3 micro-batches.
fn budgets_micro_batches_and_the_planned_buffer(dev: &Device) {
    let config = TrainerConfig::new(13, 2, 1e-2);
    let mut single = trainer(dev, &WIDTHS, config.clone()).unwrap();
    let devices = [twin(dev, Some(64 << 20)), twin(dev, Some(64 << 20))];
    let mut dp = DataParallel::new(&devices, |d| {
        trainer(d, &WIDTHS, config.clone().micro_batch(3))
    })
    .unwrap();
    let plans = dp.plan(digits()).unwrap();
    let params: usize = single.model.num_parameters();
    // One f32 per gradient element and one for the loss, in 256-byte blocks.
    let buffer = ((params as u64 + 1) * 4).div_ceil(256) * 256;
    for (i, p) in plans.iter().enumerate() {
        assert_eq!(p.all_reduce_buffer, buffer, "replica {i}: {p}");
        assert_eq!(p.micro_batch, 3);
        // Replica 0 runs 13 of the 26 samples: micro-batches of 3, 3, 3, 3, 1.
        assert_eq!(p.micro_batches, 5, "replica {i}: {p}");
    }
    let order = digits().epoch_order(SEED, 1);
    for idx in order[..78].chunks(26) {
        single.step(digits(), idx).unwrap();
        dp.step(digits(), idx).unwrap();
    }
    dp.check_identical().unwrap();
    let worst = worst_rel_diff(&param_values(dp.model()), &param_values(&single.model));
    assert!(worst < 1e-5, "{}: {worst:e}", label(dev));
    for (i, d) in devices.iter().enumerate() {
        let held = d.memory_stats().category_peaks.get(Category::Communication);
        assert_eq!(held, buffer, "replica {i}: the measured all-reduce buffer");
    }
    assert_eq!(dp.fit_to_budgets(digits()).unwrap().len(), 2);
}

/// A replica with another hidden width, or another learning rate, is refused on building.
fn a_different_model_is_refused(dev: &Device) {
    let devices = [twin(dev, None), twin(dev, None)];
    let config = TrainerConfig::new(8, 1, 1e-2);
    let widths = |d: &Device| {
        if *d == devices[1] {
            vec![64, 17, 10]
        } else {
            WIDTHS.to_vec()
        }
    };
    let err = DataParallel::new(&devices, |d| trainer(d, &widths(d), config.clone()))
        .err()
        .expect("another model must be refused");
    let msg = err.to_string();
    assert!(matches!(err, Error::Distributed { .. }), "{msg}");
    assert!(msg.contains("ranks [1]"), "{msg}");
    let err = DataParallel::new(&devices, |d| {
        let lr = if *d == devices[1] { 2e-2 } else { 1e-2 };
        let model = Mlp::new(d, &WIDTHS, Activation::Relu, SEED)?;
        let opt = Box::new(AdamW::new(model.parameters(), lr)?);
        Trainer::new(model, opt, config.clone().lr(lr))
    })
    .err()
    .expect("another learning rate must be refused");
    assert!(matches!(err, Error::Distributed { .. }), "{err}");
}

/// The digits, failing for one sample: the replica whose share holds it fails.
struct FailAt(usize);

impl BatchSource for FailAt {
    type Batch = ClassBatch;
    fn len(&self) -> usize {
        digits().len()
    }
    fn batch(&self, indices: &[usize]) -> Result<ClassBatch> {
        if indices.contains(&self.0) {
            return Err(Error::InvalidArgument {
                op: "FailAt::batch",
                reason: format!("sample {} is unreadable", self.0),
            });
        }
        digits().batch(indices)
    }
}

/// Replica 1 fails on its share; replica 0, waiting in the all-reduce, is woken with an
/// error naming it, the step returns replica 1's own error, and the next step is refused.
fn a_failing_replica_stops_the_others(dev: &Device) {
    let devices = [twin(dev, None), twin(dev, None)];
    let config = TrainerConfig::new(8, 1, 1e-2);
    let mut dp = DataParallel::new(&devices, |d| trainer(d, &WIDTHS, config.clone())).unwrap();
    let data = FailAt(6);
    dp.step(&data, &[0, 1, 2, 3, 4, 5, 7, 8]).unwrap();
    let err = dp.step(&data, &[0, 1, 2, 3, 4, 5, 6, 7]).unwrap_err();
    assert!(err.to_string().contains("sample 6 is unreadable"), "{err}");
    let again = dp.step(&data, &[0, 1]).unwrap_err();
    assert!(
        matches!(again, Error::Distributed { .. }) && again.to_string().contains("replica 1"),
        "{again}"
    );
}

/// Shares cover 0..n in order, differ by at most one sample, and the longer ones come first.
#[test]
fn shares_split_a_batch_evenly_in_order() {
    for size in 1..6 {
        for n in 0..40 {
            let shares: Vec<_> = (0..size).map(|r| share_of(n, r, size)).collect();
            assert_eq!(shares[0].start, 0);
            assert_eq!(shares[size - 1].end, n);
            for w in shares.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].len() == w[1].len() || w[0].len() == w[1].len() + 1);
            }
        }
    }
}

/// Threads sum in rank order (the same bits as a plain loop adding rank 0, 1, 2), broadcast
/// rank 0's bytes and gather everyone's values, collective after collective.
#[test]
fn local_group_collectives() {
    let (_group, members) = LocalGroup::new(3, Duration::from_secs(60)).unwrap();
    let inputs: Vec<Vec<f32>> = (0..3)
        .map(|r| host_data(r as u64, 1000, -1e3, 1e3))
        .collect();
    let mut expected = inputs[0].clone();
    for v in &inputs[1..] {
        expected.iter_mut().zip(v).for_each(|(e, x)| *e += x);
    }
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = members
            .into_iter()
            .zip(&inputs)
            .map(|(mut m, input)| {
                s.spawn(move || {
                    let mut out = Vec::new();
                    for round in 0..5u64 {
                        let mut buf = input.clone();
                        m.all_reduce_sum(&mut buf).unwrap();
                        let mut bytes = vec![m.rank() as u8; 4];
                        m.broadcast(&mut bytes).unwrap();
                        let all = m.all_gather(&[m.rank() as u64, round]).unwrap();
                        out.push((buf, bytes, all));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, out) in results.iter().enumerate() {
        for (round, (buf, bytes, all)) in out.iter().enumerate() {
            let same = buf
                .iter()
                .zip(&expected)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "rank {rank} round {round}: the sum differs");
            assert_eq!(bytes, &vec![0u8; 4]);
            let r = round as u64;
            assert_eq!(all, &vec![0, r, 1, r, 2, r]);
        }
    }
}

/// A member alone in a collective times out with an error naming who did not come; members
/// calling different collectives both get an error; a failure reaches every later call.
#[test]
fn local_group_errors_instead_of_hanging() {
    let (_group, mut members) = LocalGroup::new(2, Duration::from_millis(200)).unwrap();
    let err = members[0].all_reduce_sum(&mut [1.0]).unwrap_err();
    assert!(err.to_string().contains("[1]"), "{err}");
    let err = members[1].broadcast(&mut [0]).unwrap_err();
    assert!(err.to_string().contains("replica 0"), "{err}");

    let (group, members) = LocalGroup::new(2, Duration::from_secs(60)).unwrap();
    let errors: Vec<Error> = std::thread::scope(|s| {
        let handles: Vec<_> = members
            .into_iter()
            .map(|mut m| {
                s.spawn(move || {
                    if m.rank() == 0 {
                        m.all_reduce_sum(&mut [1.0, 2.0]).unwrap_err()
                    } else {
                        m.all_gather(&[1]).unwrap_err()
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(errors
        .iter()
        .all(|e| matches!(e, Error::Distributed { .. })));
    assert!(group.failure().is_some());
    assert!(LocalGroup::new(0, Duration::from_secs(1)).is_err());
}

/// The flat collectives against plain loops, at 1, 2 and 3 members: the reduce-scatter gives
/// each member its part of the rank-order sum (the all-reduce's bits), the all-gather every
/// member's shard in rank order; a buffer that is not `size` shards is refused.
#[test]
fn flat_collectives_match_plain_loops() {
    for size in [1usize, 2, 3] {
        let shard = 257;
        let (_group, members) = LocalGroup::new(size, Duration::from_secs(60)).unwrap();
        let inputs: Vec<Vec<f32>> = (0..size)
            .map(|r| host_data(10 + r as u64, shard * size, -1e3, 1e3))
            .collect();
        let mut sum = vec![0f32; shard * size];
        for (k, s) in sum.iter_mut().enumerate() {
            *s = inputs[0][k];
            for v in &inputs[1..] {
                *s += v[k];
            }
        }
        let results: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .zip(&inputs)
                .map(|(mut m, input)| {
                    s.spawn(move || {
                        let mut mine = vec![0f32; shard];
                        m.reduce_scatter(input, &mut mine).unwrap();
                        let mut all = vec![0f32; shard * m.size()];
                        m.all_gather_f32(&mine, &mut all).unwrap();
                        let mut reduced = input.clone();
                        m.all_reduce_sum(&mut reduced).unwrap();
                        let bad = m.reduce_scatter(input, &mut vec![0f32; shard + 1]);
                        assert!(matches!(bad, Err(Error::InvalidArgument { .. })), "{bad:?}");
                        (mine, all, reduced)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (r, (mine, all, reduced)) in results.iter().enumerate() {
            assert_eq!(
                bits(mine),
                bits(&sum[r * shard..(r + 1) * shard]),
                "size {size} rank {r}"
            );
            assert_eq!(
                bits(all),
                bits(&sum),
                "size {size} rank {r}: the all-gather"
            );
            assert_eq!(
                bits(reduced),
                bits(&sum),
                "size {size} rank {r}: the all-reduce"
            );
        }
    }
}

/// Every element of every parameter lies in exactly one rank's shard, at the place the
/// layout says, for counts not divisible by the ranks, empty and one-element tensors, one
/// rank, and shards that start inside a tensor; every shard has the same length and every
/// piece starts on a granule.
#[test]
fn shard_layout_covers_every_element_once() {
    let lists: [&[usize]; 4] = [&[10, 300, 1, 0, 129], &[1], &[1024, 16, 160, 10], &[5000]];
    let mut boundary_inside = false;
    for numels in lists {
        for ranks in [1usize, 2, 3, 4] {
            let l = ShardLayout::new(numels, ranks).unwrap();
            assert_eq!(l.padded_len(), l.shard_len() * ranks);
            assert!(l.shard_len().is_multiple_of(GRANULE));
            // Plain loop: the owner and position of each element of each parameter.
            let mut seen: Vec<Vec<u32>> = numels.iter().map(|&n| vec![0; n]).collect();
            for r in 0..ranks {
                for pc in l.pieces(r) {
                    assert!(
                        pc.within.start % GRANULE == 0,
                        "{numels:?} / {ranks}: {pc:?}"
                    );
                    assert!(pc.at + pc.within.len() <= l.shard_len());
                    assert_eq!(
                        l.offsets()[pc.param] + pc.within.start,
                        r * l.shard_len() + pc.at
                    );
                    boundary_inside |= pc.within.start > 0;
                    for k in pc.within.clone() {
                        seen[pc.param][k] += 1;
                    }
                }
            }
            assert!(
                seen.iter().flatten().all(|&c| c == 1),
                "{numels:?} over {ranks}"
            );
            let end = l.offsets().last().unwrap() + numels.last().unwrap();
            assert!(end <= l.padded_len());
        }
    }
    assert!(boundary_inside, "some shard starts inside a tensor");
    assert!(ShardLayout::new(&[3], 0).is_err());
    assert!(matches!(Zero::stage(4), Err(Error::InvalidArgument { .. })));
    assert!(Zero::from_flag(Some("x")).is_err());
}

/// Stage 2 takes each bucket's gradients off the device as soon as backward has completed
/// them: on three replicas with buckets of at most 100 elements (one parameter each here) and
/// micro-batches of 3 (summed
/// on the host between them), the most gradient bytes a replica's device held at once stays
/// below the full gradient set, which stage 1 holds; the weights are stage 1's bit for bit,
/// and the planned step peak is the measured one.
fn zero_2_frees_gradients_during_backward(dev: &Device) {
    let config = TrainerConfig::new(13, 1, 1e-2).micro_batch(3);
    let peak_grads = |dp: &DataParallel<Mlp>| {
        dp.replicas()
            .iter()
            .map(|t| {
                let s = t.device().memory_stats();
                s.category_peaks.get(Category::Gradients)
            })
            .max()
            .unwrap()
    };
    let dp1 = zero_run(dev, Zero::stage(1).unwrap(), &config);
    let zero2 = Zero::stage(2).unwrap().bucket_elements(100).unwrap();
    let mut dp2 = zero_run(dev, zero2, &config);
    let full: u64 = dp1
        .model()
        .parameters()
        .iter()
        .map(|p| p.allocated_bytes())
        .sum();
    let (g1, g2) = (peak_grads(&dp1), peak_grads(&dp2));
    assert!(
        g1 >= full,
        "stage 1 holds every gradient: {g1} of {full} bytes"
    );
    // The second layer's gradients are gone before the first layer's weight and bias (4096 +
    // 256 bytes) are made; the shard's gradients (a third, in views) come after backward.
    assert!(
        g2 < full,
        "stage 2 held {g2} gradient bytes at once, the full set is {full}"
    );
    // The memory summary reports the gradients the arena held at the in-use peak, not a full
    // set assumed from the parameters.
    for (r, t) in dp2.replicas().iter().enumerate() {
        let s = t.memory_summary();
        let held = s.stats.peak_by_category.get(Category::Gradients);
        assert_eq!(s.gradient_bytes, held, "replica {r}");
        assert!(
            s.gradient_bytes < full,
            "replica {r}: {} of {full}",
            s.gradient_bytes
        );
    }
    let bits = |v: &[Vec<f32>]| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&param_values(dp2.model())),
        bits(&param_values(dp1.model())),
        "stage 2's weights differ from stage 1's"
    );
    let plans = dp2.plan(digits()).unwrap();
    for (r, (p, t)) in plans.iter().zip(dp2.replicas()).enumerate() {
        let measured = t.device().memory_stats().peak_bytes_in_use;
        assert!(
            p.peak <= measured,
            "replica {r}: planned {} over measured {measured}",
            p.peak
        );
    }
}

/// Steps of three replicas at `zero`, returning the trained replicas.
fn zero_run(dev: &Device, zero: Zero, config: &TrainerConfig) -> DataParallel<Mlp> {
    let devices = [twin(dev, None), twin(dev, None), twin(dev, None)];
    let mut dp =
        DataParallel::with_zero(&devices, zero, |d| trainer(d, &WIDTHS, config.clone())).unwrap();
    for (i, idx) in batches().iter().enumerate() {
        dp.step(digits(), idx).unwrap();
        dp.check_identical()
            .unwrap_or_else(|e| panic!("{zero:?} after step {i} on {}: {e}", label(dev)));
    }
    dp
}

/// ZeRO stages 1 and 2 over three replicas (shard boundaries inside the first weight; stage 2
/// in buckets of ~200 elements, so several) give stage 0's weights bit for bit and one
/// device's within 1e-5; each replica plans and holds a third of the optimizer state and,
/// in stage 2, its planned peak equals the measured one.
fn zero_stages_match_stage_0_and_one_device(dev: &Device) {
    let config = TrainerConfig::new(13, 1, 1e-2);
    let mut single = trainer(dev, &WIDTHS, config.clone()).unwrap();
    for idx in batches() {
        single.step(digits(), &idx).unwrap();
    }
    let want = param_values(&single.model);
    let mut dp0 = zero_run(dev, Zero::OFF, &config);
    let base = param_values(dp0.model());
    let state0 = dp0.replicas()[0].optimizer.state_bytes();
    for zero in [
        Zero::stage(1).unwrap(),
        Zero::stage(2).unwrap().bucket_elements(200).unwrap(),
    ] {
        let mut dp = zero_run(dev, zero, &config);
        let got = param_values(dp.model());
        let bits = |v: &[Vec<f32>]| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&base),
            "{zero:?}: weights differ from stage 0's"
        );
        let worst = worst_rel_diff(&got, &want);
        assert!(worst < 1e-5, "{zero:?} on {}: {worst:e}", label(dev));
        let (a, b) = (dp.take_loss().unwrap(), dp0.take_loss().unwrap());
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{zero:?}: mean loss {a} against {b}"
        );
        for (r, t) in dp.replicas().iter().enumerate() {
            let st = t.optimizer.state_bytes();
            assert!(
                3 * st <= state0 + 3 * 2 * 256 * 4,
                "{zero:?} replica {r}: {st} of {state0}"
            );
        }
        let plans = dp.plan(digits()).unwrap();
        for (r, p) in plans.iter().enumerate() {
            assert!(
                3 * p.optimizer_state <= state0 + 3 * 2 * 256 * 4,
                "replica {r}: {p}"
            );
        }
        dp0.take_loss().ok();
        dp0 = zero_run(dev, Zero::OFF, &config);
    }
}

/// Stage 2 with gradient clipping (a norm over every replica's shard), in f32 and under mixed
/// precision (loss scaling, the overflow decision shared), matches stage 0 within 1e-5 (and
/// in f32 one device).
fn zero_with_clipping_and_mixed_precision_matches_one_device(dev: &Device) {
    let zero = Zero::stage(2).unwrap().bucket_elements(300).unwrap();
    for mixed in [false, true] {
        let mut config = TrainerConfig::new(13, 1, 1e-2).clip_grad_norm(0.05);
        if mixed {
            config = config.precision(fitgrad::train::Precision::Mixed);
        }
        let base = zero_run(dev, Zero::OFF, &config);
        let dp = zero_run(dev, zero, &config);
        let got = param_values(dp.model());
        let worst = worst_rel_diff(&got, &param_values(base.model()));
        assert!(
            worst < 1e-5,
            "mixed {mixed} on {}: {worst:e} from stage 0",
            label(dev)
        );
        if !mixed {
            let mut single = trainer(dev, &WIDTHS, config.clone()).unwrap();
            for idx in batches() {
                single.step(digits(), &idx).unwrap();
            }
            let worst = worst_rel_diff(&got, &param_values(&single.model));
            assert!(worst < 1e-5, "{}: {worst:e} from one device", label(dev));
        }
    }
}

/// A ZeRO-2 checkpoint of three replicas holds the whole optimizer state (every tensor of one
/// device's within 1e-5), and resumes on one device and on two ZeRO-1 replicas to the weights
/// of an uninterrupted run; a state of another model is refused.
fn a_zero_checkpoint_resumes_on_other_replica_counts(dev: &Device) {
    let config = TrainerConfig::new(13, 1, 1e-2);
    let b = batches();
    let mut single = trainer(dev, &WIDTHS, config.clone()).unwrap();
    for idx in &b[..2] {
        single.step(digits(), idx).unwrap();
    }
    let tag: String = label(dev)
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let dir = std::env::temp_dir().join(format!("fitgrad-zero-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (path, one) = (dir.join("zero.safetensors"), dir.join("one.safetensors"));
    single.save_checkpoint(&one, 0).unwrap();
    let devices = [twin(dev, None), twin(dev, None), twin(dev, None)];
    let zero2 = Zero::stage(2).unwrap().bucket_elements(100).unwrap();
    let mut dp =
        DataParallel::with_zero(&devices, zero2, |d| trainer(d, &WIDTHS, config.clone())).unwrap();
    for idx in &b[..2] {
        dp.step(digits(), idx).unwrap();
    }
    dp.save_checkpoint(&path, 0).unwrap();
    let (a, want) = (
        fitgrad::checkpoint::load(&path).unwrap(),
        fitgrad::checkpoint::load(&one).unwrap(),
    );
    let names = |c: &fitgrad::checkpoint::Checkpoint| c.tensors.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&a), names(&want));
    for (k, t) in &want.tensors {
        let worst = worst_rel_diff(&[a.tensors[k].to_f32()], &[t.to_f32()]);
        assert!(worst < 1e-5, "{k}: {worst:e}");
    }
    for idx in &b[2..] {
        single.step(digits(), idx).unwrap();
    }
    let want = param_values(&single.model);
    let mut resumed = trainer(dev, &WIDTHS, config.clone()).unwrap();
    resumed.resume_from(&path).unwrap();
    let two = [twin(dev, None), twin(dev, None)];
    let mut dp2 = DataParallel::with_zero(&two, Zero::stage(1).unwrap(), |d| {
        trainer(d, &WIDTHS, config.clone())
    })
    .unwrap();
    dp2.resume_from(&path).unwrap();
    for idx in &b[2..] {
        resumed.step(digits(), idx).unwrap();
        dp2.step(digits(), idx).unwrap();
    }
    dp2.check_identical().unwrap();
    for (what, got) in [
        ("one device", param_values(&resumed.model)),
        ("two replicas", param_values(dp2.model())),
    ] {
        let worst = worst_rel_diff(&got, &want);
        assert!(worst < 1e-5, "{what} resumed on {}: {worst:e}", label(dev));
    }
    let mut other = DataParallel::with_zero(&two, Zero::stage(1).unwrap(), |d| {
        trainer(d, &[64, 8, 10], config.clone())
    })
    .unwrap();
    assert!(other.resume_from(&path).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A communicator that counts the bytes its member sends, as a ring moves them: 2(N-1)/N of
/// an all-reduced buffer, (N-1)/N of a reduce-scattered or all-gathered one.
struct Counting<C> {
    inner: C,
    sent: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl<C: Communicator> Counting<C> {
    fn add(&self, ring_parts: u64, buffer_bytes: usize) {
        let n = self.inner.size() as u64;
        let b = ring_parts * (n - 1) * buffer_bytes as u64 / n;
        self.sent.fetch_add(b, std::sync::atomic::Ordering::Relaxed);
    }
}

impl<C: Communicator> Communicator for Counting<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        self.add(2, buf.len() * 4);
        self.inner.all_reduce_sum(buf)
    }
    fn broadcast(&mut self, buf: &mut [u8]) -> Result<()> {
        self.add(1, buf.len() * self.inner.size());
        self.inner.broadcast(buf)
    }
    fn all_gather(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        self.add(1, values.len() * 8 * self.inner.size());
        self.inner.all_gather(values)
    }
    fn reduce_scatter(&mut self, buf: &[f32], shard: &mut [f32]) -> Result<()> {
        self.add(1, buf.len() * 4);
        self.inner.reduce_scatter(buf, shard)
    }
    fn all_gather_f32(&mut self, shard: &[f32], buf: &mut [f32]) -> Result<()> {
        self.add(1, buf.len() * 4);
        self.inner.all_gather_f32(shard, buf)
    }
}

/// The bytes each of two replicas sends per step at `zero`, measured over the batches' steps
/// (the set-up's checks not counted), and the replicas' final weights.
fn bytes_sent_per_step(
    dev: &Device,
    widths: &[usize],
    zero: Zero,
) -> (Vec<u64>, Vec<Vec<Vec<f32>>>) {
    let (_, comms) = LocalGroup::new(2, Duration::from_secs(60)).unwrap();
    let config = TrainerConfig::new(13, 1, 1e-2);
    let steps = batches().len() as u64;
    let out: Vec<(u64, Vec<Vec<f32>>)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let config = config.clone();
                s.spawn(move || {
                    let d = twin(dev, None);
                    let mut t = trainer(&d, widths, config).unwrap();
                    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
                    let counting = Counting {
                        inner: comm,
                        sent: sent.clone(),
                    };
                    attach_zero(&mut t, counting, zero).unwrap();
                    let before = sent.load(std::sync::atomic::Ordering::Relaxed);
                    for idx in batches() {
                        t.step(digits(), &idx).unwrap();
                    }
                    let after = sent.load(std::sync::atomic::Ordering::Relaxed);
                    ((after - before) / steps, param_values(&t.model))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    out.into_iter().unzip()
}

/// Stages 1 and 2 send per step what stage 0 sends, measured through a counting communicator
/// on two replicas whose parameters fill the shards exactly: the reduce-scatter and the
/// all-gather carry the gradient values the all-reduce carries, and only the few words of
/// the loss, flags and checks differ. Each measurement equals what the plan counts
/// ([`Zero::collectives`]), and each stage ends with the same weights on both replicas.
fn zero_stages_send_the_bytes_of_stage_0(dev: &Device) {
    // 64*128 + 128 + 128*128 + 128 elements: each parameter on a granule, the whole a
    // multiple of two shards' granules, so no padding.
    let widths = [64, 128, 128];
    let numels = [64 * 128, 128, 128 * 128, 128];
    let elements: usize = numels.iter().sum();
    assert_eq!(ShardLayout::new(&numels, 2).unwrap().padded_len(), elements);
    let planned = |zero: Zero| -> u64 {
        zero.collectives(&numels, 2, StepCollectives::default())
            .unwrap()
            .iter()
            .map(|c| c.sent_bytes)
            .sum()
    };
    let mut sent = Vec::new();
    for zero in [
        Zero::OFF,
        Zero::stage(1).unwrap(),
        Zero::stage(2).unwrap().bucket_elements(5000).unwrap(),
    ] {
        let (bytes, weights) = bytes_sent_per_step(dev, &widths, zero);
        assert_eq!(bytes[0], bytes[1], "{zero:?}: both replicas send alike");
        assert_eq!(bytes[0], planned(zero), "{zero:?}: measured = planned");
        assert_eq!(
            weights[0], weights[1],
            "{zero:?}: replicas hold the same bits"
        );
        sent.push(bytes[0]);
    }
    // The gradient values: one all-reduce of them against a reduce-scatter and an all-gather.
    let values = |zero: Zero| -> u64 {
        zero.collectives(&numels, 2, StepCollectives::default())
            .unwrap()
            .iter()
            .filter(|c| c.what == "gradients" || c.what == "parameters")
            .map(|c| c.sent_bytes)
            .sum()
    };
    let stage0 = Zero::OFF
        .collectives(&numels, 2, StepCollectives::default())
        .unwrap();
    assert_eq!(stage0[0].kind, CollectiveKind::AllReduce);
    // The all-reduce's buffer is the gradients, the loss and one flag per parameter.
    let control = 2 * (1 + numels.len() as u64) * 4 / 2;
    assert_eq!(
        stage0[0].sent_bytes - control,
        values(Zero::stage(1).unwrap())
    );
    assert_eq!(sent[1], sent[2], "stages 1 and 2 send alike");
    let (s0, s1) = (sent[0] as f64, sent[1] as f64);
    assert!(
        (s1 - s0).abs() <= 1e-3 * s0,
        "stage 1 sends {s1} bytes per step, stage 0 {s0}"
    );
    eprintln!(
        "{}: bytes sent per replica per step, 2 replicas, {elements} parameters: stage 0 {}, \
         stages 1 and 2 {}",
        label(dev),
        sent[0],
        sent[1]
    );
}

/// Batch norm over the digits seen as (B, 4, 4, 4), then a Linear head: the running
/// statistics depend on the data alone, so their reference is torch's rule on host loops.
#[derive(Clone)]
struct NormNet {
    bn: BatchNorm2d,
    head: Linear,
}

fitgrad::module! {
    impl Module for NormNet {
        params { bn, head }
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let b = x.dims()[0];
            let h = self.bn.forward(&x.reshape(&[b, 4, 4, 4])?)?;
            self.head.forward(&h.reshape(&[b, 64])?)
        }
    }
}

impl TrainModel<ClassBatch> for NormNet {
    fn forward_loss(&self, b: &ClassBatch, ctx: &StepContext) -> Result<Tensor> {
        let x = b.x.to_device(&ctx.device)?;
        nn::cross_entropy(&self.forward(&x)?, &b.y)
    }
}

/// Each replica's forward updates its running statistics from its own share; after the step
/// every replica holds rank 0's (PyTorch DDP's broadcast_buffers), which are torch's rule
/// applied to rank 0's shares only. Replica 1's own shares would give other values.
fn batch_norm_buffers_are_rank_0s_on_every_replica(dev: &Device) {
    let config = TrainerConfig::new(13, 1, 1e-2);
    let devices = [twin(dev, None), twin(dev, None)];
    let mut dp = DataParallel::new(&devices, |d| {
        let model = NormNet {
            bn: BatchNorm2d::new(d, 4)?,
            head: Linear::new(d, 64, 10, SEED)?,
        };
        let opt = Box::new(AdamW::new(model.parameters(), 1e-2)?);
        Trainer::new(model, opt, config.clone())
    })
    .unwrap();
    // torch's rule, in f64, on the shares of replica `r`: mean <- 0.9 mean + 0.1 batch mean,
    // var <- 0.9 var + 0.1 unbiased batch variance, from 0 and 1.
    let expected = |r: usize| {
        let (mut mean, mut var) = (vec![0.0f64; 4], vec![1.0f64; 4]);
        for idx in batches() {
            let share = &idx[share_of(idx.len(), r, 2)];
            if share.is_empty() {
                continue;
            }
            for c in 0..4 {
                let v: Vec<f64> = share
                    .iter()
                    .flat_map(|&i| &digits().features[i * 64 + 16 * c..i * 64 + 16 * c + 16])
                    .map(|&x| f64::from(x))
                    .collect();
                let m = v.iter().sum::<f64>() / v.len() as f64;
                let unbiased =
                    v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len() - 1) as f64;
                mean[c] = 0.9 * mean[c] + 0.1 * m;
                var[c] = 0.9 * var[c] + 0.1 * unbiased;
            }
        }
        (mean, var)
    };
    for idx in batches() {
        dp.step(digits(), &idx).unwrap();
    }
    let buffers = |r: usize| -> Vec<Vec<f32>> {
        dp.replicas()[r]
            .model
            .named_buffers()
            .iter()
            .map(|(_, t)| t.to_vec_f32().unwrap())
            .collect()
    };
    assert_eq!(
        buffers(0),
        buffers(1),
        "{}: replicas' running statistics",
        label(dev)
    );
    let (mean, var) = expected(0);
    let got = buffers(1);
    for c in 0..4 {
        assert!(
            (f64::from(got[0][c]) - mean[c]).abs() < 1e-5,
            "mean {c}: {got:?} vs {mean:?}"
        );
        assert!(
            (f64::from(got[1][c]) - var[c]).abs() < 1e-4 * var[c],
            "var {c}: {got:?} vs {var:?}"
        );
    }
    let (mean1, _) = expected(1);
    assert!(
        (0..4).any(|c| (mean1[c] - mean[c]).abs() > 1e-3),
        "the replicas' shares must differ for the test to mean anything"
    );
}

/// Ranks agree on every setting that shapes the run before any collective (issue 43, item 3):
/// the same settings pass; another `--steps` on one rank ends every rank with the same error
/// naming `--steps`; another number of settings (another program) is named as such.
#[test]
fn ranks_agree_on_their_settings_or_all_name_the_flag() {
    use fitgrad::distributed::agree_settings;
    let run = |steps: &[&str], extra: &[bool]| -> Vec<Result<()>> {
        let (_group, members) = LocalGroup::new(steps.len(), Duration::from_secs(60)).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .map(|mut m| {
                    let r = m.rank();
                    let (steps, extra) = (steps[r].to_string(), extra[r]);
                    s.spawn(move || {
                        let mut settings = vec![
                            ("--batch-size", "32".to_string()),
                            ("--steps", steps),
                            ("--precision", "f32".to_string()),
                        ];
                        if extra {
                            settings.push(("--zero", "2".into()));
                        }
                        agree_settings(&mut m, &settings)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    assert!(run(&["100", "100", "100"], &[false; 3])
        .iter()
        .all(|r| r.is_ok()));
    let errors = run(&["100", "100", "7"], &[false; 3]);
    for (rank, r) in errors.iter().enumerate() {
        match r {
            Err(Error::Distributed { reason, .. }) => assert!(
                reason.contains("--steps differs") && reason.contains("rank 2 from rank 0"),
                "rank {rank}: {reason}"
            ),
            other => panic!("rank {rank}: {other:?}"),
        }
    }
    let errors = run(&["1", "1"], &[false, true]);
    assert!(
        errors
            .iter()
            .all(|r| matches!(r, Err(Error::Distributed { reason, .. }) if reason.contains("the program differs"))),
        "{errors:?}"
    );
}
