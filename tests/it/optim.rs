//! Optimizers against a plain-loop CPU reference of torch's SGD and AdamW, on every device: several
//! parameters (one element, odd, 1000+, 2-D, empty), several steps with changing gradients, a
//! parameter skipped now and then for lack of a gradient, f32 and f16 storage and f16 gradients of
//! f32 parameters. Also: state created lazily and then no allocation at all, hyperparameter and
//! parameter errors, state save / load.

use crate::common;

use common::*;
use fitgrad::optim::{AdamW, Optimizer, OptimizerState, Sgd};
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};

device_tests!(
    matches_torch_reference_f32,
    matches_torch_reference_f16_storage_and_f16_grads,
    a_parameter_without_grad_is_untouched,
    state_round_trips,
    bad_hyperparameters_are_errors,
    bad_parameter_lists_are_errors
);

/// Parameter shapes of every case: one element, odd, 1000+, 2-D, empty, and multiples of 4
/// (updated four elements per invocation).
const SHAPES: [&[usize]; 7] = [&[1], &[7], &[1025], &[3, 5], &[0], &[4], &[12, 20]];
const STEPS: u64 = 4;
/// The parameter that gets no gradient on odd steps.
const SOMETIMES: usize = 1;

#[derive(Clone, Copy, Debug)]
struct SgdCfg {
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    nesterov: bool,
}

#[derive(Clone, Copy, Debug)]
struct AdamWCfg {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
}

#[derive(Clone, Copy, Debug)]
enum Cfg {
    Sgd(SgdCfg),
    AdamW(AdamWCfg),
}

impl Cfg {
    fn build(&self, params: Vec<Tensor>) -> Box<dyn Optimizer> {
        match *self {
            Cfg::Sgd(c) => Box::new(
                Sgd::new(params, c.lr)
                    .and_then(|o| o.momentum(c.momentum))
                    .and_then(|o| o.dampening(c.dampening))
                    .and_then(|o| o.weight_decay(c.weight_decay))
                    .and_then(|o| o.nesterov(c.nesterov))
                    .unwrap(),
            ),
            Cfg::AdamW(c) => Box::new(
                AdamW::new(params, c.lr)
                    .and_then(|o| o.betas(c.beta1, c.beta2))
                    .and_then(|o| o.eps(c.eps))
                    .and_then(|o| o.weight_decay(c.weight_decay))
                    .unwrap(),
            ),
        }
    }

    /// State names per parameter, as the optimizer reports them.
    fn state_names(&self) -> Vec<&'static str> {
        match self {
            Cfg::Sgd(c) if c.momentum != 0.0 => vec!["momentum_buffer"],
            Cfg::Sgd(_) => vec![],
            Cfg::AdamW(_) => vec!["exp_avg", "exp_avg_sq"],
        }
    }
}

fn configs() -> Vec<Cfg> {
    let sgd = SgdCfg {
        lr: 0.1,
        momentum: 0.0,
        dampening: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    let adamw = AdamWCfg {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    vec![
        Cfg::Sgd(sgd),
        Cfg::Sgd(SgdCfg {
            momentum: 0.9,
            ..sgd
        }),
        Cfg::Sgd(SgdCfg {
            momentum: 0.8,
            dampening: 0.3,
            weight_decay: 0.05,
            ..sgd
        }),
        Cfg::Sgd(SgdCfg {
            momentum: 0.9,
            weight_decay: 0.01,
            nesterov: true,
            ..sgd
        }),
        Cfg::AdamW(adamw),
        Cfg::AdamW(AdamWCfg {
            lr: 0.05,
            beta1: 0.5,
            beta2: 0.9,
            eps: 1e-3,
            weight_decay: 0.2,
        }),
        Cfg::AdamW(AdamWCfg {
            weight_decay: 0.0,
            ..adamw
        }),
    ]
}

// ---------------------------------------------------------------------------------------------
// The CPU reference: torch's single-tensor loops, element by element, in f32 (bias corrections
// and the derived scalars in f64 as torch computes them on the host).
// ---------------------------------------------------------------------------------------------

/// One parameter's reference state.
#[derive(Clone, Default)]
struct RefState {
    /// SGD's momentum buffer or AdamW's first moment.
    m: Option<Vec<f32>>,
    /// AdamW's second moment.
    v: Option<Vec<f32>>,
    /// Updates so far.
    t: u64,
}

/// torch.optim.SGD on one parameter.
fn ref_sgd(c: &SgdCfg, p: &mut [f32], g: &[f32], st: &mut RefState) {
    let one_minus_damp = (1.0 - c.dampening as f64) as f32;
    let first = st.m.is_none();
    if c.momentum != 0.0 && first {
        st.m = Some(vec![0.0; p.len()]);
    }
    for j in 0..p.len() {
        let mut d = g[j];
        if c.weight_decay != 0.0 {
            d += c.weight_decay * p[j];
        }
        if c.momentum != 0.0 {
            let buf = st.m.as_mut().unwrap();
            buf[j] = if first {
                d
            } else {
                c.momentum * buf[j] + one_minus_damp * d
            };
            d = if c.nesterov {
                d + c.momentum * buf[j]
            } else {
                buf[j]
            };
        }
        p[j] -= c.lr * d;
    }
    st.t += 1;
}

/// torch.optim.AdamW on one parameter.
fn ref_adamw(c: &AdamWCfg, p: &mut [f32], g: &[f32], st: &mut RefState) {
    st.t += 1;
    let (lr, b1, b2) = (c.lr as f64, c.beta1 as f64, c.beta2 as f64);
    let t = st.t as f64;
    let bc1 = 1.0 - b1.powf(t);
    let bc2 = 1.0 - b2.powf(t);
    let decay = (1.0 - lr * c.weight_decay as f64) as f32;
    let step_size = (lr / bc1) as f32;
    let bc2_sqrt = bc2.sqrt() as f32;
    let (w1, w2) = ((1.0 - b1) as f32, (1.0 - b2) as f32);
    let m = st.m.get_or_insert_with(|| vec![0.0; p.len()]);
    let v = st.v.get_or_insert_with(|| vec![0.0; p.len()]);
    for j in 0..p.len() {
        p[j] *= decay;
        m[j] = c.beta1 * m[j] + w1 * g[j];
        v[j] = c.beta2 * v[j] + w2 * g[j] * g[j];
        let denom = v[j].sqrt() / bc2_sqrt + c.eps;
        p[j] -= step_size * (m[j] / denom);
    }
}

/// One reference step; with `state_dtype` F16, p and the state are rounded to f16 afterwards
/// (what the GPU stores).
fn ref_step(cfg: &Cfg, p: &mut Vec<f32>, g: &[f32], st: &mut RefState, dtype: DType) {
    match cfg {
        Cfg::Sgd(c) => ref_sgd(c, p, g, st),
        Cfg::AdamW(c) => ref_adamw(c, p, g, st),
    }
    // Parameters are stored in their dtype; the state is always f32.
    *p = as_dtype(p, dtype);
}

/// |got - want| <= 1e-6 * max|want| + 1e-5 |want| in f32 (values and state of every scale);
/// f16 storage gets a few f16 ulps.
fn tol_for(want: &[f32], dtype: DType) -> Tol {
    let scale = want.iter().fold(0.0f32, |a, &x| a.max(x.abs()));
    match dtype {
        DType::F32 => Tol {
            abs: 1e-6 * scale,
            rel: 1e-5,
            f16_ulps: 0.0,
        },
        DType::F16 => Tol {
            abs: 1e-4 * scale,
            rel: 2e-3,
            f16_ulps: 2.0,
        },
    }
}

/// Gradient of parameter `i` at `step`, or none (`SOMETIMES` on odd steps).
fn host_grad(i: usize, step: u64, n: usize) -> Option<Vec<f32>> {
    (i != SOMETIMES || step.is_multiple_of(2))
        .then(|| host_data(1000 * step + i as u64 + 7, n, -1.0, 1.0))
}

/// Runs `cfg` for STEPS steps with parameters of `dtype` and gradients of `grad_dtype`, checking
/// parameters after every step and the state at the end.
fn check_against_reference(dev: &fitgrad::Device, cfg: &Cfg, dtype: DType, grad_dtype: DType) {
    let what = |s: &str| {
        format!(
            "{cfg:?} {dtype} params, {grad_dtype} grads on {}: {s}",
            label(dev)
        )
    };
    let mut host: Vec<Vec<f32>> = SHAPES
        .iter()
        .enumerate()
        .map(|(i, d)| as_dtype(&host_data(i as u64 + 1, numel(d), -1.0, 1.0), dtype))
        .collect();
    let params: Vec<Tensor> = SHAPES
        .iter()
        .zip(&host)
        .map(|(d, h)| upload(dev, h, d, dtype).with_requires_grad())
        .collect();
    let mut opt = cfg.build(params.clone());
    assert!(opt.state_tensors().is_empty(), "{}", what("state before"));
    assert_eq!(opt.state_bytes(), 0);
    let mut states = vec![RefState::default(); SHAPES.len()];
    for step in 0..STEPS {
        for (i, d) in SHAPES.iter().enumerate() {
            let g = host_grad(i, step, numel(d)).map(|g| as_dtype(&g, grad_dtype));
            params[i]
                .set_grad(g.as_ref().map(|g| upload(dev, g, d, grad_dtype)))
                .unwrap();
            if let Some(g) = g {
                ref_step(cfg, &mut host[i], &g, &mut states[i], dtype);
            }
        }
        opt.step().unwrap();
        assert_eq!(opt.step_count(), step + 1);
        for (i, d) in SHAPES.iter().enumerate() {
            let got = download(&params[i], d, dtype).unwrap();
            let tol = tol_for(&host[i], dtype);
            if let Err(e) = check_close(&format!("param {i} {d:?}"), &got, &host[i], tol) {
                panic!("{}", what(&format!("step {step}: {e}")));
            }
        }
    }
    // The state: one set per parameter that had a gradient, matching the reference.
    let names = cfg.state_names();
    let state = opt.state();
    assert_eq!(state.step_count, STEPS);
    assert_eq!(
        state.param_steps,
        states.iter().map(|s| s.t).collect::<Vec<_>>(),
        "{}",
        what("per-parameter steps")
    );
    assert_eq!(state.tensors.len(), names.len() * SHAPES.len());
    let mut bytes = 0;
    for (key, t) in &state.tensors {
        let (i, name) = key.split_once('.').unwrap();
        let i: usize = i.parse().unwrap();
        let want = match names.iter().position(|n| *n == name) {
            Some(0) => states[i].m.clone().unwrap(),
            Some(1) => states[i].v.clone().unwrap(),
            _ => panic!("{}", what(&format!("unexpected state '{key}'"))),
        };
        assert_eq!(t.dtype(), DType::F32, "{}", what("state dtype"));
        let got = download(t, SHAPES[i], DType::F32).unwrap();
        if let Err(e) = check_close(key, &got, &want, tol_for(&want, dtype)) {
            panic!("{}", what(&e));
        }
        bytes += t.allocated_bytes();
    }
    assert_eq!(opt.state_bytes(), bytes);
    // zero_grad drops every gradient; a step then changes nothing.
    opt.zero_grad();
    assert!(params.iter().all(|p| p.grad().is_none()));
    opt.step().unwrap();
    for (i, d) in SHAPES.iter().enumerate() {
        let got = download(&params[i], d, dtype).unwrap();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            host[i].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{}",
            what(&format!("param {i} after a step without gradients"))
        );
    }
}

fn matches_torch_reference_f32(dev: &Device) {
    for cfg in configs() {
        check_against_reference(dev, &cfg, DType::F32, DType::F32);
    }
}

fn matches_torch_reference_f16_storage_and_f16_grads(dev: &Device) {
    for cfg in configs() {
        check_against_reference(dev, &cfg, DType::F16, DType::F16);
        // Mixed precision: f32 master weights and state, f16 gradients.
        check_against_reference(dev, &cfg, DType::F32, DType::F16);
    }
}

/// A parameter that never gets a gradient is left as it was and gets no state.
fn a_parameter_without_grad_is_untouched(dev: &Device) {
    for cfg in configs() {
        let a = upload(dev, &[1.0, -2.0, 3.0], &[3], DType::F32).with_requires_grad();
        let b = upload(dev, &[0.5, 0.25], &[2], DType::F32).with_requires_grad();
        let mut opt = cfg.build(vec![a.clone(), b.clone()]);
        for _ in 0..2 {
            b.set_grad(Some(upload(dev, &[1.0, 1.0], &[2], DType::F32)))
                .unwrap();
            opt.step().unwrap();
        }
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0, -2.0, 3.0], "{cfg:?}");
        assert_ne!(b.to_vec::<f32>().unwrap(), vec![0.5, 0.25], "{cfg:?}");
        let state = opt.state();
        assert_eq!(state.param_steps, vec![0, 2], "{cfg:?}");
        assert!(
            state.tensors.iter().all(|(k, _)| k.starts_with("1.")),
            "{cfg:?}"
        );
    }
}

/// State appears on the first step; later steps allocate nothing (no block, no buffer).
#[test]
fn steps_after_the_first_allocate_nothing() {
    let Some(dev) = fresh_device(DeviceOptions::default()) else {
        return;
    };
    for cfg in configs() {
        let params: Vec<Tensor> = SHAPES
            .iter()
            .enumerate()
            .map(|(i, d)| {
                upload(
                    &dev,
                    &host_data(i as u64, numel(d), -1.0, 1.0),
                    d,
                    DType::F32,
                )
                .with_requires_grad()
            })
            .collect();
        let grads: Vec<Vec<Tensor>> = (0..3)
            .map(|s| {
                SHAPES
                    .iter()
                    .enumerate()
                    .map(|(i, d)| {
                        let h = host_data(100 * s + i as u64, numel(d), -1.0, 1.0);
                        upload(&dev, &h, d, DType::F32)
                    })
                    .collect()
            })
            .collect();
        let mut opt = cfg.build(params.clone());
        let set = |s: usize| {
            for (p, g) in params.iter().zip(&grads[s]) {
                p.set_grad(Some(g.clone())).unwrap();
            }
        };
        set(0);
        let before = dev.memory_stats();
        opt.step().unwrap();
        dev.sync().unwrap();
        let first = dev.memory_stats();
        let n_state = cfg.state_names().len() as u64 * SHAPES.len() as u64;
        assert_eq!(
            first.allocations - before.allocations,
            n_state,
            "{cfg:?}: the first step creates the state: {first:?}"
        );
        let param_bytes: u64 = params.iter().map(|p| p.allocated_bytes()).sum();
        assert_eq!(
            opt.state_bytes(),
            cfg.state_names().len() as u64 * param_bytes,
            "{cfg:?}"
        );
        for s in [1, 2, 0] {
            set(s);
            opt.step().unwrap();
        }
        dev.sync().unwrap();
        let after = dev.memory_stats();
        assert_eq!(after.allocations, first.allocations, "{cfg:?}: {after:?}");
        assert_eq!(
            after.buffers_created, first.buffers_created,
            "{cfg:?}: {after:?}"
        );
        assert_eq!(after.bytes_in_use, first.bytes_in_use, "{cfg:?}");
    }
}

/// A state taken from one optimizer and loaded into another continues the same trajectory.
fn state_round_trips(dev: &Device) {
    for cfg in configs() {
        let what = format!("{cfg:?} on {}", label(dev));
        let mk = |seed: u64| {
            SHAPES
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let h = host_data(seed + i as u64, numel(d), -1.0, 1.0);
                    upload(dev, &h, d, DType::F32).with_requires_grad()
                })
                .collect::<Vec<_>>()
        };
        let pa = mk(1);
        let mut a = cfg.build(pa.clone());
        let grad_step = |params: &[Tensor], step: u64| {
            for (i, (p, d)) in params.iter().zip(SHAPES).enumerate() {
                let g = host_grad(i, step, numel(d)).map(|g| upload(dev, &g, d, DType::F32));
                p.set_grad(g).unwrap();
            }
        };
        for step in 0..3 {
            grad_step(&pa, step);
            a.step().unwrap();
        }
        // B: copies of A's parameters and state.
        let pb: Vec<Tensor> = pa
            .iter()
            .map(|p| p.detach().copy().unwrap().with_requires_grad())
            .collect();
        let mut b = cfg.build(pb.clone());
        let mut st = a.state();
        st.tensors = st
            .tensors
            .into_iter()
            .map(|(k, t)| (k, t.copy().unwrap()))
            .collect();
        b.load_state(st).unwrap();
        assert_eq!(b.step_count(), 3, "{what}");
        for step in 3..5 {
            grad_step(&pa, step);
            grad_step(&pb, step);
            a.step().unwrap();
            b.step().unwrap();
        }
        for (x, y) in pa.iter().zip(&pb) {
            assert_eq!(
                x.to_vec::<f32>().unwrap(),
                y.to_vec::<f32>().unwrap(),
                "{what}"
            );
        }
        // A state that does not fit is refused.
        let mut bad = |s: OptimizerState| b.load_state(s).is_err();
        let mut st = a.state();
        st.param_steps.pop();
        assert!(bad(st), "{what}: steps of too few parameters");
        if !cfg.state_names().is_empty() {
            let mut st = a.state();
            st.tensors[0].0 = "99.exp_avg".into();
            assert!(bad(st), "{what}: unknown parameter");
            let mut st = a.state();
            st.tensors.pop();
            if cfg.state_names().len() == 2 {
                assert!(bad(st), "{what}: half a state");
            }
            let mut st = a.state();
            st.tensors[0].1 = Tensor::zeros(dev, &[2, 2], DType::F32).unwrap();
            assert!(bad(st), "{what}: wrong shape");
        }
    }
}

fn invalid<T>(r: fitgrad::Result<T>) -> bool {
    matches!(r, Err(Error::InvalidArgument { .. }))
}

fn bad_hyperparameters_are_errors(dev: &Device) {
    let p = upload(dev, &[1.0, 2.0], &[2], DType::F32).with_requires_grad();
    p.set_grad(Some(upload(dev, &[1.0, 1.0], &[2], DType::F32)))
        .unwrap();
    let ps = || vec![p.clone()];
    for lr in [-0.1, f32::NAN, f32::INFINITY] {
        assert!(invalid(Sgd::new(ps(), lr)), "sgd lr {lr}");
        assert!(invalid(AdamW::new(ps(), lr)), "adamw lr {lr}");
    }
    // Builders check their own value at once.
    let sgd = || Sgd::new(ps(), 0.1).unwrap();
    assert!(invalid(sgd().momentum(-0.5)));
    assert!(invalid(sgd().momentum(f32::NAN)));
    assert!(invalid(sgd().weight_decay(-1.0)));
    assert!(invalid(sgd().weight_decay(f32::INFINITY)));
    assert!(invalid(sgd().dampening(f32::INFINITY)));
    let adamw = || AdamW::new(ps(), 0.1).unwrap();
    assert!(invalid(adamw().betas(1.0, 0.999)));
    assert!(invalid(adamw().betas(0.9, 1.0)));
    assert!(invalid(adamw().betas(-0.1, 0.999)));
    assert!(invalid(adamw().betas(0.9, f32::NAN)));
    assert!(invalid(adamw().eps(0.0)));
    assert!(invalid(adamw().eps(-1e-8)));
    assert!(invalid(adamw().eps(f32::NAN)));
    assert!(invalid(adamw().weight_decay(-0.01)));
    // Nesterov needs momentum and no dampening (as torch): checked by the step, whatever
    // the order of the builder calls.
    for mut o in [
        sgd().nesterov(true).unwrap(),
        sgd()
            .nesterov(true)
            .and_then(|o| o.momentum(0.9))
            .and_then(|o| o.dampening(0.1))
            .unwrap(),
    ] {
        assert!(invalid(o.step()));
    }
    // A bad learning rate set later is caught by the next step, before any update.
    let mut o = sgd();
    o.set_lr(-1.0);
    assert_eq!(o.lr(), -1.0);
    assert!(invalid(o.step()));
    let mut o = adamw();
    o.set_lr(f32::NAN);
    assert!(invalid(o.step()));
    assert_eq!(o.step_count(), 0);
    assert!(o.state_tensors().is_empty());
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    // Boundary values that are fine.
    let mut o = sgd().nesterov(true).and_then(|o| o.momentum(0.9)).unwrap();
    o.step().unwrap();
    let mut o = adamw()
        .betas(0.0, 0.0)
        .and_then(|o| o.weight_decay(0.0))
        .unwrap();
    o.step().unwrap();
    Sgd::new(ps(), 0.0).unwrap().step().unwrap();
}

fn bad_parameter_lists_are_errors(dev: &Device) {
    let plain = upload(dev, &[1.0], &[1], DType::F32);
    let leaf = plain.copy().unwrap().with_requires_grad();
    let non_leaf = leaf.mul_scalar(2.0).unwrap();
    assert!(non_leaf.requires_grad());
    for params in [
        vec![],
        vec![plain.clone()],
        vec![leaf.clone(), plain.clone()],
        vec![non_leaf.clone()],
        // The same tensor twice would be updated twice per step.
        vec![leaf.clone(), leaf.clone()],
    ] {
        assert!(invalid(Sgd::new(params.clone(), 0.1)), "{params:?}");
        assert!(invalid(AdamW::new(params.clone(), 0.1)), "{params:?}");
    }
    let ok = Sgd::new(vec![leaf.clone()], 0.1).unwrap();
    assert_eq!(ok.params().len(), 1);
    assert_eq!(ok.lr(), 0.1);
}
