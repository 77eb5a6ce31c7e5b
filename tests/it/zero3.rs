//! ZeRO stage 3's units gathered from the ranks: two replicas of an in-process group, each on
//! its own device of one adapter, stream a three-unit model whose only home is each rank's
//! shard. Every step's loss, every rank's shard of the summed gradient and the shards after
//! a plain f32 SGD update on them are bitwise those of one process that runs each rank's
//! batch on the whole model and sums the gradients in rank order; the collectives are the
//! schedule's (a gather before each forward and recomputation not already resident, a
//! reduce-scatter per unit after its backward) and their bytes are a ring's; each gather runs
//! while the device computes the work recorded before it.

use crate::common;

use common::*;
use fitgrad::distributed::zero::{start_stage3, ShardLayout};
use fitgrad::distributed::{Communicator, DataParallel, LocalComm, LocalGroup, Zero};
use fitgrad::nn::Mlp;
use fitgrad::nn::{Gpt, GptConfig};
use fitgrad::nn::{Linear, Module, Unit};
use fitgrad::optim::{AdamW, Optimizer, Sgd};
use fitgrad::residency::born_on_host;
use fitgrad::train::text::TextDataset;
use fitgrad::train::{Trainer, TrainerConfig};
use fitgrad::{Device, DeviceOptions, Error, Result, Tensor};
use std::sync::{Arc, Mutex};
use std::time::Duration;

device_tests!(
    stage_3_matches_one_process,
    a_units_gather_runs_while_the_device_computes,
    stage_3_without_units_is_refused,
    data_parallel_stage_3_matches_stage_2,
    stage_3_of_a_model_made_on_host,
    stage_3_of_a_model_made_on_host_with_sgd,
    stage_3_refuses_asked_for_parameter_offload,
    mlp_made_on_host_names_its_layers
);

const W: usize = 24;
const UNITS: usize = 3;
const BATCH: usize = 4;
const RANKS: usize = 2;
const STEPS: usize = 2;
const LR: f32 = 0.1;

/// Each unit's parameters on the host: its weight, then its bias.
type Host = Vec<Vec<Vec<f32>>>;

/// Another device on `dev`'s adapter, backend and f16 mode.
fn twin(dev: &Device) -> Device {
    let info = dev.info();
    let opts = DeviceOptions::default()
        .backend(info.adapter.backend.clone())
        .adapter(info.adapter.name.clone())
        .force_packed_f16(!info.f16_native);
    Device::with_options(opts).expect("a second device on the same adapter")
}

/// The model of `host`'s values on `dev`.
fn model_from(dev: &Device, host: &Host) -> Result<Vec<Unit<Linear>>> {
    host.iter()
        .map(|u| {
            Ok(Unit::new(Linear {
                weight: Tensor::from_slice(dev, &u[0], &[W, W])?.with_requires_grad(),
                bias: Some(Tensor::from_slice(dev, &u[1], &[W])?.with_requires_grad()),
                in_features: W,
                out_features: W,
                lora: None,
                quantized: None,
            }))
        })
        .collect()
}

/// Rank `r`'s batch.
fn batch(dev: &Device, r: usize) -> Result<Tensor> {
    let x: Vec<f32> = (0..BATCH * W)
        .map(|k| ((k * 7 + r * 3) % 11) as f32 / 11.0 - 0.5)
        .collect();
    Tensor::from_slice(dev, &x, &[BATCH, W])
}

fn loss(m: &Vec<Unit<Linear>>, x: &Tensor) -> Result<Tensor> {
    let y = m.forward(x)?;
    y.mul(&y)?.mean()
}

/// Unit `u`'s parameters laid out flat over `RANKS` shards, rank `r`'s shard.
fn shard_of(unit: &[Vec<f32>], r: usize) -> Vec<f32> {
    let numels: Vec<usize> = unit.iter().map(Vec::len).collect();
    let l = ShardLayout::new(&numels, RANKS).unwrap();
    let mut flat = vec![0f32; l.padded_len()];
    for (v, &o) in unit.iter().zip(l.offsets()) {
        flat[o..o + v.len()].copy_from_slice(v);
    }
    flat[l.shard(r)].to_vec()
}

/// One process: per step, each rank's loss and the gradients summed in rank order; then the
/// SGD update. Returns the losses, the sums and the weights after each step.
fn reference(dev: &Device, mut host: Host) -> (Vec<Vec<f32>>, Vec<Host>, Vec<Host>) {
    let (mut losses, mut sums, mut weights) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..STEPS {
        let m = model_from(dev, &host).unwrap();
        let mut step_losses = Vec::new();
        let mut sum: Option<Host> = None;
        for r in 0..RANKS {
            let l = loss(&m, &batch(dev, r).unwrap()).unwrap();
            step_losses.push(l.item().unwrap());
            l.backward().unwrap();
            let g: Host = m
                .iter()
                .map(|u| {
                    u.parameters()
                        .iter()
                        .map(|p| p.grad().unwrap().to_vec_f32().unwrap())
                        .collect()
                })
                .collect();
            m.parameters()
                .iter()
                .for_each(|p| p.set_grad(None).unwrap());
            sum = Some(match sum {
                None => g,
                Some(mut s) => {
                    for (su, gu) in s.iter_mut().zip(&g) {
                        for (sp, gp) in su.iter_mut().zip(gu) {
                            sp.iter_mut().zip(gp).for_each(|(a, b)| *a += b);
                        }
                    }
                    s
                }
            });
        }
        let sum = sum.unwrap();
        for (hu, gu) in host.iter_mut().zip(&sum) {
            for (hp, gp) in hu.iter_mut().zip(gu) {
                hp.iter_mut().zip(gp).for_each(|(w, g)| *w -= LR * g);
            }
        }
        losses.push(step_losses);
        sums.push(sum);
        weights.push(host.clone());
    }
    (losses, sums, weights)
}

fn initial(dev: &Device) -> Host {
    (0..UNITS)
        .map(|i| {
            let l = Linear::new(dev, W, W, 10 + i as u64).unwrap();
            vec![
                l.weight.to_vec_f32().unwrap(),
                l.bias.as_ref().unwrap().to_vec_f32().unwrap(),
            ]
        })
        .collect()
}

fn stage_3_matches_one_process(dev: &Device) {
    let host = initial(dev);
    let (losses, sums, weights) = reference(dev, host.clone());
    on_ranks(dev, |r, comm, d| {
        let m = model_from(d, &host).unwrap();
        let param_bytes: u64 = m.parameters().iter().map(|p| p.numel() as u64 * 4).sum();
        let before = d.memory_stats().bytes_in_use;
        let (_streaming, shards) = start_stage3(d, m.units(), Arc::new(Mutex::new(comm))).unwrap();
        let freed = before - d.memory_stats().bytes_in_use;
        assert!(
            freed >= param_bytes,
            "rank {r}: {freed} of {param_bytes} freed"
        );
        let x = batch(d, r).unwrap();
        for step in 0..STEPS {
            let l = loss(&m, &x).unwrap();
            assert_eq!(l.item().unwrap().to_bits(), losses[step][r].to_bits());
            l.backward().unwrap();
            fitgrad::residency::finish(d, true).unwrap();
            let mut sh = shards.lock().unwrap();
            for u in 0..UNITS {
                let g = sh.take_grad(u).expect("a gradient shard");
                assert_eq!(g, shard_of(&sums[step][u], r), "rank {r} unit {u}");
                for (v, g) in sh.values_mut(u).iter_mut().zip(&g) {
                    *v -= LR * g;
                }
                assert_eq!(sh.values(u), shard_of(&weights[step][u], r));
            }
        }
        // Per step: units 0, 1, 2 gathered for the forward, 0 again for its
        // recomputation (1 and 2 are still resident then); each unit scattered once.
        let sh = shards.lock().unwrap();
        let steps = STEPS as u64;
        assert_eq!(sh.collectives(), (4 * steps, 3 * steps));
        let ring: Vec<u64> = (0..UNITS)
            .map(|u| ((RANKS - 1) * sh.layout(u).shard_len() * 4) as u64)
            .collect();
        let want = steps * (2 * ring[0] + ring[1] + ring[2] + ring.iter().sum::<u64>());
        assert_eq!(sh.bytes_sent(), want);
    });
}

/// Runs `f` on each of `RANKS` ranks of an in-process group, each with its member and a
/// device of its own on `dev`'s adapter, on threads of its own.
fn on_ranks(dev: &Device, f: impl Fn(usize, LocalComm, &Device) + Sync) {
    let (_group, comms) = LocalGroup::new(RANKS, Duration::from_secs(60)).unwrap();
    let devices: Vec<Device> = (0..RANKS).map(|_| twin(dev)).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .zip(&devices)
            .enumerate()
            .map(|(r, (comm, d))| {
                let f = &f;
                s.spawn(move || f(r, comm, d))
            })
            .collect();
        for h in handles {
            h.join().expect("a rank failed");
        }
    });
}

/// A member's communicator that logs each unit collective: `g` for an all-gather, `s` for a
/// reduce-scatter, each with whether its rank's device held recorded work not yet submitted
/// (work that a host-side wait holds back).
struct Watched<C> {
    inner: C,
    dev: Device,
    log: Arc<Mutex<Vec<(char, bool)>>>,
}

impl<C: Communicator> Communicator for Watched<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        self.inner.all_reduce_sum(buf)
    }
    fn broadcast(&mut self, buf: &mut [u8]) -> Result<()> {
        self.inner.broadcast(buf)
    }
    fn all_gather(&mut self, values: &[u64]) -> Result<Vec<u64>> {
        self.inner.all_gather(values)
    }
    fn reduce_scatter(&mut self, buf: &[f32], shard: &mut [f32]) -> Result<()> {
        let waiting = self.dev.has_unsubmitted_work();
        self.log.lock().unwrap().push(('s', waiting));
        self.inner.reduce_scatter(buf, shard)
    }
    fn all_gather_f32(&mut self, shard: &[f32], buf: &mut [f32]) -> Result<()> {
        let waiting = self.dev.has_unsubmitted_work();
        self.log.lock().unwrap().push(('g', waiting));
        self.inner.all_gather_f32(shard, buf)
    }
}

/// The next unit's gather overlaps the compute of the unit before: every gather finds the
/// device handed all the work recorded so far (the forward of the unit before, or its
/// recomputation), and in backward the gather of the unit to recompute next comes before the
/// reduce-scatter of the unit whose backward just ended (that one reads the gradients back,
/// which waits for the device). One step of three units: gathers 0, 1, 2 in the forward, 0
/// again before 2's reduce-scatter, then 1's and 0's at the end of the step.
fn a_units_gather_runs_while_the_device_computes(dev: &Device) {
    let host = initial(dev);
    on_ranks(dev, |r, comm, d| {
        let m = model_from(d, &host).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let watched = Watched {
            inner: comm,
            dev: d.clone(),
            log: log.clone(),
        };
        let (_streaming, _shards) =
            start_stage3(d, m.units(), Arc::new(Mutex::new(watched))).unwrap();
        let l = loss(&m, &batch(d, r).unwrap()).unwrap();
        l.backward().unwrap();
        fitgrad::residency::finish(d, true).unwrap();
        let log = log.lock().unwrap().clone();
        let order: String = log.iter().map(|&(c, _)| c).collect();
        assert_eq!(order, "ggggsss", "rank {r}: the units' collectives");
        for (k, &(c, waiting)) in log.iter().enumerate() {
            assert!(
                c != 'g' || !waiting,
                "rank {r}: gather {k} held recorded work back from the device"
            );
        }
    });
}

fn stage_3_without_units_is_refused(dev: &Device) {
    assert_eq!(Zero::stage(3).unwrap().number(), 3);
    assert_eq!(Zero::from_flag(Some("3")).unwrap().number(), 3);
    assert!(matches!(
        Zero::from_flag(Some("4")),
        Err(Error::InvalidArgument { .. })
    ));
    let (_group, mut comms) = LocalGroup::new(1, Duration::from_secs(5)).unwrap();
    let m = Linear::new(dev, 4, 4, 1).unwrap();
    let comm = Arc::new(Mutex::new(comms.remove(0)));
    match start_stage3(dev, m.units(), comm) {
        Err(Error::InvalidArgument { op, reason }) => {
            assert_eq!(op, "--zero 3");
            assert!(reason.contains("Unit"), "{reason}");
        }
        other => panic!("expected the no-units error, got {:?}", other.map(|_| ())),
    }
}

/// How a replica's GPT is made: whole on its device, or inside `born_on_host` (each block in
/// host memory as soon as it is made).
#[derive(Clone, Copy, PartialEq)]
enum Made {
    Whole,
    OnHost,
}

/// A GPT of `layers` blocks of width 32 with AdamW (or SGD with momentum, `sgd`), batches of
/// 8 in micro-batches of 2.
fn gpt_trainer(dev: &Device, made: Made, layers: usize, sgd: bool) -> Result<Trainer<Gpt>> {
    let mut cfg = GptConfig::new(23, 16, layers, 2, 32);
    cfg.seed = 3;
    let make = || Gpt::new(dev, cfg.clone());
    let model = match made {
        Made::Whole => make()?,
        Made::OnHost => born_on_host(dev, make)?,
    };
    let opt: Box<dyn Optimizer> = match sgd {
        true => Box::new(Sgd::new(model.parameters(), 3e-2)?.momentum(0.9)?),
        false => Box::new(AdamW::new(model.parameters(), 3e-3)?),
    };
    let config = TrainerConfig::default()
        .batch_size(8)
        .micro_batch(2)
        .lr(if sgd { 3e-2 } else { 3e-3 });
    Trainer::new(model, opt, config)
}

/// Every parameter's values after `steps` steps of two replicas at `zero`.
fn gpt_run(dev: &Device, zero: Zero, steps: usize) -> Vec<Vec<f32>> {
    gpt_run_made(dev, zero, steps, Made::Whole, 2, false).0
}

/// [`gpt_run`] with the replicas' models made as `made`, of `layers` blocks, trained by SGD
/// with `sgd`; also each replica's device peak in use before the first step, and the model's
/// parameter bytes.
fn gpt_run_made(
    dev: &Device,
    zero: Zero,
    steps: usize,
    made: Made,
    layers: usize,
    sgd: bool,
) -> (Vec<Vec<f32>>, Vec<u64>, u64) {
    let data = gpt_data();
    let devices = [twin(dev), twin(dev)];
    let build = |d: &Device| gpt_trainer(d, made, layers, sgd);
    let mut dp = DataParallel::with_zero(&devices, zero, build).unwrap();
    let start: Vec<u64> = devices
        .iter()
        .map(|d| d.memory_stats().peak_bytes_in_use)
        .collect();
    let model_bytes: u64 = dp
        .model()
        .parameters()
        .iter()
        .map(|p| p.numel() as u64 * 4)
        .sum();
    for s in 0..steps {
        let idx: Vec<usize> = (0..8).map(|k| (s * 8 + k) % 30).collect();
        dp.step(&data, &idx).unwrap();
    }
    dp.gather_parameters().unwrap();
    dp.check_identical().unwrap();
    let values = dp
        .model()
        .parameters()
        .iter()
        .map(|p| p.to_vec_f32().unwrap())
        .collect();
    (values, start, model_bytes)
}

/// Two replicas of a two-block GPT (micro-batches, so each unit is reduce-scattered twice a
/// step) at stage 3 end with stage 2's weights bit for bit, so as far from stage 0's as
/// stage 2 is, and the replicas agree bit for bit.
fn data_parallel_stage_3_matches_stage_2(dev: &Device) {
    let bits = |v: &[Vec<f32>]| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let got = gpt_run(dev, Zero::stage(3).unwrap(), 3);
    let two = gpt_run(dev, Zero::stage(2).unwrap(), 3);
    assert!(bits(&got) == bits(&two), "stage 3 differs from stage 2");
    let base = gpt_run(dev, Zero::OFF, 3);
    let worst = worst_rel_diff(&got, &base);
    let worst2 = worst_rel_diff(&two, &base);
    assert_eq!(worst, worst2);
    assert!(
        got != gpt_run(dev, Zero::OFF, 2),
        "the steps changed the weights"
    );
}

/// Two replicas of a six-block GPT made inside `born_on_host` at stage 3: before the first
/// step no replica's device has held the whole model (each the embeddings, the unit being
/// made and its shard of the blocks), while made whole each held it all; and after three steps
/// the weights are those of the model made whole, bit for bit.
fn stage_3_of_a_model_made_on_host(dev: &Device) {
    let stage3 = Zero::stage(3).unwrap();
    let (born, born_start, model_bytes) = gpt_run_made(dev, stage3, 3, Made::OnHost, 6, false);
    let (whole, whole_start, _) = gpt_run_made(dev, stage3, 3, Made::Whole, 6, false);
    eprintln!(
        "model {model_bytes} B; peak before the first step: made on host {born_start:?}, made \
         whole {whole_start:?}"
    );
    for &peak in &born_start {
        assert!(
            peak < model_bytes * 3 / 4,
            "made on host, a replica's device held {peak} B of a {model_bytes} B model"
        );
    }
    assert!(whole_start.iter().all(|&p| p >= model_bytes));
    let bits = |v: &[Vec<f32>]| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&born) == bits(&whole),
        "made on host, stage 3 trains otherwise"
    );
}

/// The token stream the GPT runs train on.
fn gpt_data() -> TextDataset {
    let tokens: Vec<u32> = (0..600u32).map(|i| (i * 7 + i / 5) % 23).collect();
    TextDataset::new(tokens, 16).unwrap()
}

/// With SGD (momentum), whose state stays on the device, a six-block GPT made inside
/// `born_on_host` at stage 3 is never whole on a replica's device either and trains to the
/// bits of the one made whole; a trainer of such a model outside ZeRO refuses to step with a
/// typed error that names stage 3 (its optimizer cannot update units in host memory).
fn stage_3_of_a_model_made_on_host_with_sgd(dev: &Device) {
    let stage3 = Zero::stage(3).unwrap();
    let (born, born_start, model_bytes) = gpt_run_made(dev, stage3, 2, Made::OnHost, 6, true);
    let (whole, _, _) = gpt_run_made(dev, stage3, 2, Made::Whole, 6, true);
    for &peak in &born_start {
        assert!(
            peak < model_bytes * 3 / 4,
            "made on host, a replica's device held {peak} B of a {model_bytes} B model"
        );
    }
    let bits = |v: &[Vec<f32>]| v.concat().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&born) == bits(&whole),
        "made on host, stage 3 trains otherwise with SGD"
    );
    let mut alone = gpt_trainer(dev, Made::OnHost, 2, true).unwrap();
    let before = alone.model.parameters()[0].to_vec_f32().unwrap();
    match alone.step(&gpt_data(), &[0, 1, 2, 3, 4, 5, 6, 7]) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("ZeRO stage 3"), "{reason}")
        }
        other => panic!("expected the refusal, got {:?}", other.map(|_| ())),
    }
    assert_eq!(alone.model.parameters()[0].to_vec_f32().unwrap(), before);
}

/// A trainer whose configuration asks for streamed parameters keeps them on the host: stage
/// 3 refuses it with a typed error (its units would stream from two places).
fn stage_3_refuses_asked_for_parameter_offload(dev: &Device) {
    let devices = [twin(dev), twin(dev)];
    let build = |d: &Device| {
        let model = Gpt::new(d, GptConfig::new(23, 16, 2, 2, 32))?;
        let opt = Box::new(AdamW::new(model.parameters(), 3e-3)?);
        let config = TrainerConfig::default()
            .batch_size(8)
            .offload_parameters(true);
        Trainer::new(model, opt, config)
    };
    match DataParallel::with_zero(&devices, Zero::stage(3).unwrap(), build) {
        Err(Error::InvalidArgument { op, reason }) => {
            assert_eq!(op, "--zero 3");
            assert!(reason.contains("offload_parameters"), "{reason}");
        }
        Err(e) => panic!("expected the refusal, got {e}"),
        Ok(_) => panic!("stage 3 took a trainer that streams from host memory as asked"),
    }
}

/// An MLP made inside `born_on_host` has its layers in host memory and names them as units
/// (what streaming and stage 3 move); made on the device it names none. Its f16 layers cannot
/// live on the host: a typed error.
fn mlp_made_on_host_names_its_layers(dev: &Device) {
    let widths = [16, 32, 32, 4];
    let act = fitgrad::Activation::Relu;
    let m = born_on_host(dev, || Mlp::new(dev, &widths, act, 1)).unwrap();
    assert_eq!(m.units().len(), 3);
    let whole = Mlp::new(dev, &widths, act, 1).unwrap();
    assert!(whole.units().is_empty());
    let same = m
        .parameters()
        .iter()
        .zip(whole.parameters())
        .all(|(a, b)| a.to_vec_f32().unwrap() == b.to_vec_f32().unwrap());
    assert!(same, "made on host, the MLP has other values");
    let f16 = born_on_host(dev, || {
        Mlp::with_dtype(dev, &widths, act, fitgrad::DType::F16, 1)
    });
    assert!(matches!(f16, Err(Error::InvalidArgument { .. })));
}
