//! Parameter groups of AdamW and SGD against torch's algorithms written as plain loops, on every
//! device: a decayed group, a group without decay at half the learning rate, and a group that
//! takes the optimizer's own weight decay; `decay_groups`' rule; `fresh()` keeping the groups;
//! the state round trip through a checkpoint; and the errors.

use crate::common;

use common::*;
use fitgrad::checkpoint::{Checkpoint, TrainingState};
use fitgrad::nn::Module;
use fitgrad::optim::{decay_groups, AdamW, Optimizer, ParamGroup, Sgd};
use fitgrad::{DType, Device, Error, Tensor};

device_tests!(groups_match_the_reference);

/// Shapes per group: [decayed], [no decay, lr x 0.5], [the optimizer's decay].
const GROUPS: [&[&[usize]]; 3] = [&[&[3, 5], &[12]], &[&[7], &[1]], &[&[2, 2]]];
/// Per group: (weight decay, lr scale).
const HYPER: [(Option<f32>, f32); 3] = [(Some(0.1), 1.0), (Some(0.0), 0.5), (None, 1.0)];
/// The optimizer's own weight decay (the third group's).
const DEFAULT_WD: f32 = 0.03;
const STEPS: u64 = 3;

#[derive(Clone, Copy, Debug)]
enum Kind {
    AdamW,
    Sgd,
}

const LR: f32 = 0.05;
const MOMENTUM: f32 = 0.9;

fn build(kind: Kind, groups: Vec<ParamGroup>) -> Box<dyn Optimizer> {
    match kind {
        Kind::AdamW => Box::new(
            AdamW::with_groups(groups, LR)
                .and_then(|o| o.weight_decay(DEFAULT_WD))
                .unwrap(),
        ),
        Kind::Sgd => Box::new(
            Sgd::with_groups(groups, LR)
                .and_then(|o| o.momentum(MOMENTUM))
                .and_then(|o| o.weight_decay(DEFAULT_WD))
                .unwrap(),
        ),
    }
}

/// One parameter's reference state.
#[derive(Clone, Default)]
struct RefState {
    m: Option<Vec<f32>>,
    v: Option<Vec<f32>>,
    t: u64,
}

/// torch.optim.AdamW's single-tensor step with this parameter's lr and weight decay.
fn ref_adamw(lr: f32, wd: f32, p: &mut [f32], g: &[f32], st: &mut RefState) {
    let (b1, b2, eps) = (0.9f32, 0.999f32, 1e-8f32);
    st.t += 1;
    let t = st.t as f64;
    let bc1 = 1.0 - (b1 as f64).powf(t);
    let bc2 = 1.0 - (b2 as f64).powf(t);
    let decay = (1.0 - lr as f64 * wd as f64) as f32;
    let step_size = (lr as f64 / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let (w1, w2) = ((1.0 - b1 as f64) as f32, (1.0 - b2 as f64) as f32);
    let m = st.m.get_or_insert_with(|| vec![0.0; p.len()]);
    let v = st.v.get_or_insert_with(|| vec![0.0; p.len()]);
    for j in 0..p.len() {
        p[j] *= decay;
        m[j] = b1 * m[j] + w1 * g[j];
        v[j] = b2 * v[j] + w2 * g[j] * g[j];
        let denom = v[j].sqrt() / bc2_sqrt + eps;
        p[j] -= step_size * (m[j] / denom);
    }
}

/// torch.optim.SGD's single-tensor step (momentum, no dampening) with this parameter's lr and
/// L2 weight decay.
fn ref_sgd(lr: f32, wd: f32, p: &mut [f32], g: &[f32], st: &mut RefState) {
    let first = st.m.is_none();
    let buf = st.m.get_or_insert_with(|| vec![0.0; p.len()]);
    for j in 0..p.len() {
        let mut d = g[j];
        if wd != 0.0 {
            d += wd * p[j];
        }
        buf[j] = if first { d } else { MOMENTUM * buf[j] + d };
        p[j] -= lr * buf[j];
    }
    st.t += 1;
}

/// Every parameter's shape, flattened in group order, with its (lr, weight decay).
fn flat() -> Vec<(&'static [usize], f32, f32)> {
    let mut out = Vec::new();
    for (shapes, (wd, scale)) in GROUPS.iter().zip(HYPER) {
        let lr = if scale == 1.0 {
            LR
        } else {
            (LR as f64 * scale as f64) as f32
        };
        for d in shapes.iter() {
            out.push((*d, lr, wd.unwrap_or(DEFAULT_WD)));
        }
    }
    out
}

/// Parameters of every group from `seed`, and their host values.
fn make_params(dev: &Device, seed: u64) -> (Vec<Vec<Tensor>>, Vec<Vec<f32>>) {
    let mut host = Vec::new();
    let mut groups = Vec::new();
    let mut k = 0;
    for shapes in GROUPS {
        let mut g = Vec::new();
        for d in shapes {
            let h = host_data(seed + k, numel(d), -1.0, 1.0);
            g.push(upload(dev, &h, d, DType::F32).with_requires_grad());
            host.push(h);
            k += 1;
        }
        groups.push(g);
    }
    (groups, host)
}

fn param_groups(params: &[Vec<Tensor>]) -> Vec<ParamGroup> {
    params
        .iter()
        .zip(HYPER)
        .map(|(p, (wd, scale))| {
            let g = ParamGroup::new(p.clone()).lr_scale(scale);
            match wd {
                Some(wd) => g.weight_decay(wd),
                None => g,
            }
        })
        .collect()
}

/// Sets step `step`'s gradients on the flattened parameters and returns them.
fn set_grads(dev: &Device, params: &[Tensor], step: u64) -> Vec<Vec<f32>> {
    params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let g = host_data(100 * step + i as u64, p.numel(), -1.0, 1.0);
            p.set_grad(Some(upload(dev, &g, p.dims(), DType::F32)))
                .unwrap();
            g
        })
        .collect()
}

fn ref_step(kind: Kind, host: &mut [Vec<f32>], grads: &[Vec<f32>], states: &mut [RefState]) {
    for (i, (_, lr, wd)) in flat().into_iter().enumerate() {
        match kind {
            Kind::AdamW => ref_adamw(lr, wd, &mut host[i], &grads[i], &mut states[i]),
            Kind::Sgd => ref_sgd(lr, wd, &mut host[i], &grads[i], &mut states[i]),
        }
    }
}

fn check_params(what: &str, params: &[Tensor], host: &[Vec<f32>]) {
    for (i, (p, h)) in params.iter().zip(host).enumerate() {
        let got = p.to_vec_f32().unwrap();
        let tol = Tol {
            abs: 1e-6,
            rel: 1e-5,
            f16_ulps: 0.0,
        };
        assert_close(&format!("{what}: parameter {i}"), &got, h, tol);
    }
}

fn groups_match_the_reference(dev: &Device) {
    for kind in [Kind::AdamW, Kind::Sgd] {
        let what = format!("{kind:?} on {}", label(dev));
        let (groups, mut host) = make_params(dev, 1);
        let mut opt = build(kind, param_groups(&groups));
        let params: Vec<Tensor> = groups.concat();
        assert_eq!(opt.params().len(), params.len());
        let mut states = vec![RefState::default(); params.len()];
        for step in 0..STEPS {
            let grads = set_grads(dev, opt.params(), step);
            ref_step(kind, &mut host, &grads, &mut states);
            opt.step().unwrap();
            check_params(&format!("{what} step {step}"), &params, &host);
        }
    }
}

/// `fresh()` keeps the groups (its step is the reference's first step) and leaves the original's
/// state alone.
#[test]
fn fresh_keeps_the_groups() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    for kind in [Kind::AdamW, Kind::Sgd] {
        let (groups, mut host) = make_params(&dev, 7);
        let opt = build(kind, param_groups(&groups));
        let mut fresh = opt.fresh();
        let grads = set_grads(&dev, fresh.params(), 0);
        let mut states = vec![RefState::default(); host.len()];
        ref_step(kind, &mut host, &grads, &mut states);
        fresh.step().unwrap();
        check_params(&format!("{kind:?} fresh"), &groups.concat(), &host);
        assert_eq!(opt.step_count(), 0);
        assert!(opt.state_tensors().is_empty());
    }
}

/// The model for a checkpoint: the parameters of every group, named.
struct Params(Vec<(String, Tensor)>);

impl Module for Params {
    fn forward(&self, x: &Tensor) -> fitgrad::Result<Tensor> {
        Ok(x.clone())
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.0.clone()
    }
}

/// State saved from an optimizer with groups loads into a new one over the same groups, and both
/// then take the same step, bit for bit.
#[test]
fn checkpoint_round_trip_with_groups() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    for kind in [Kind::AdamW, Kind::Sgd] {
        let (groups, _) = make_params(&dev, 3);
        let mut opt = build(kind, param_groups(&groups));
        for step in 0..2 {
            set_grads(&dev, opt.params(), step);
            opt.step().unwrap();
        }
        let named: Vec<(String, Tensor)> = groups
            .concat()
            .into_iter()
            .enumerate()
            .map(|(i, t)| (format!("p{i}"), t))
            .collect();
        let model = Params(named);
        let bytes = Checkpoint::capture(&model, Some(opt.as_ref()), &TrainingState::default())
            .unwrap()
            .to_bytes()
            .unwrap();
        let ckpt = Checkpoint::from_bytes(&bytes, "memory").unwrap();

        // A second model and optimizer with the same groups, restored from the checkpoint.
        let (groups2, _) = make_params(&dev, 99);
        let model2 = Params(
            groups2
                .concat()
                .into_iter()
                .enumerate()
                .map(|(i, t)| (format!("p{i}"), t))
                .collect(),
        );
        ckpt.apply_model(&model2).unwrap();
        let mut opt2 = build(kind, param_groups(&groups2));
        ckpt.apply_optimizer(opt2.as_mut()).unwrap();
        assert_eq!(opt2.step_count(), 2);
        for o in [&mut opt, &mut opt2] {
            set_grads(&dev, o.params(), 2);
            o.step().unwrap();
        }
        for (a, b) in groups.concat().iter().zip(groups2.concat().iter()) {
            let bits = |t: &Tensor| {
                t.to_vec_f32()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            };
            assert_eq!(bits(a), bits(b), "{kind:?} after the restored step");
        }
    }
}

#[test]
fn decay_groups_rule() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let t = |dims: &[usize]| {
        Tensor::zeros(&dev, dims, DType::F32)
            .unwrap()
            .with_requires_grad()
    };
    let named = vec![
        ("embedding.weight".to_string(), t(&[10, 4])),
        ("layers.0.weight".to_string(), t(&[4, 4])),
        ("layers.0.bias".to_string(), t(&[4])),
        ("ln_f.weight".to_string(), t(&[4])),
        ("head.bias".to_string(), t(&[1, 4])),
        ("temperature".to_string(), t(&[])),
        ("conv.weight".to_string(), t(&[2, 3, 3, 3])),
    ];
    let groups = decay_groups(named.clone(), 0.1);
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[0].weight_decay, Some(0.1));
    assert_eq!(groups[1].weight_decay, Some(0.0));
    assert!(groups.iter().all(|g| g.lr_scale == 1.0));
    let dims = |g: &ParamGroup| {
        g.params
            .iter()
            .map(|p| p.dims().to_vec())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        dims(&groups[0]),
        vec![vec![10, 4], vec![4, 4], vec![2, 3, 3, 3]]
    );
    assert_eq!(dims(&groups[1]), vec![vec![4], vec![4], vec![1, 4], vec![]]);
    // Either group may be empty, and the optimizers take it.
    let only_matrices = decay_groups(vec![named[1].clone()], 0.1);
    assert!(only_matrices[1].params.is_empty());
    AdamW::with_groups(only_matrices.clone(), 1e-3).unwrap();
    Sgd::with_groups(only_matrices, 1e-3).unwrap();
}

#[test]
fn group_errors() {
    let Some(dev) = devices().into_iter().next() else {
        return;
    };
    let p = || {
        Tensor::zeros(&dev, &[3], DType::F32)
            .unwrap()
            .with_requires_grad()
    };
    let a = p();
    let bad: Vec<Vec<ParamGroup>> = vec![
        vec![ParamGroup::new(vec![p()]).weight_decay(-0.1)],
        vec![ParamGroup::new(vec![p()]).weight_decay(f32::NAN)],
        vec![ParamGroup::new(vec![p()]).lr_scale(-1.0)],
        vec![ParamGroup::new(vec![p()]).lr_scale(f32::INFINITY)],
        // A tensor in two groups would be updated twice per step.
        vec![
            ParamGroup::new(vec![a.clone()]),
            ParamGroup::new(vec![a.clone()]),
        ],
        // Nothing to optimize.
        vec![ParamGroup::new(vec![]), ParamGroup::new(vec![])],
        vec![],
    ];
    for groups in bad {
        let what = format!("{groups:?}");
        let e = AdamW::with_groups(groups.clone(), 1e-3).err().unwrap();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{what}: {e}");
        let e = Sgd::with_groups(groups, 1e-3).err().unwrap();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{what}: {e}");
    }
}
