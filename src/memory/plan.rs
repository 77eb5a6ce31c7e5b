//! The memory planner: predicts the peak device bytes of one training step of an [`Mlp`] before
//! anything runs, broken down into parameters, gradients, optimizer state, activations and
//! workspace.
//!
//! It does not guess with formulas: it replays the allocations and frees one step makes (the
//! trainer's forward, the recorded backward rules in the order the tape runs them, gradient
//! accumulation, the optimizer), block sizes rounded as the arena rounds them, and takes the
//! highest point. When an op changes what it allocates, this replay must change with it; the
//! planner test (tests/plan.rs) compares it with the measured peak on several configurations.
//!
//! [`Mlp`]: crate::nn::Mlp

use super::Arena;
use crate::error::Bytes;
use crate::nn::Act;
use crate::DType;
use std::fmt;

/// Numeric precision of training.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// Parameters, activations and optimizer state in f16.
    F16,
    /// f32 parameters and optimizer state; f16 activations and matmuls; loss scaling.
    Mixed,
}

impl Precision {
    /// The dtype the matmuls and activations use.
    pub fn compute_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::F16 | Precision::Mixed => DType::F16,
        }
    }

    /// The dtype of parameters, gradients and optimizer state.
    pub fn param_dtype(self) -> DType {
        match self {
            Precision::F16 => DType::F16,
            Precision::F32 | Precision::Mixed => DType::F32,
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Precision> {
        match s {
            "f32" => Ok(Precision::F32),
            "f16" => Ok(Precision::F16),
            "mixed" => Ok(Precision::Mixed),
            _ => Err(crate::Error::InvalidArgument {
                op: "precision",
                reason: format!("unknown precision '{s}' (f32, f16, mixed)"),
            }),
        }
    }
}

/// Which optimizer state exists per parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    Sgd { momentum: bool },
    AdamW,
}

impl OptimizerKind {
    fn state_tensors(self) -> u64 {
        match self {
            OptimizerKind::Sgd { momentum } => momentum as u64,
            OptimizerKind::AdamW => 2,
        }
    }
}

/// What one training step looks like.
#[derive(Clone, Debug)]
pub struct PlanConfig {
    /// MLP widths, input first, classes last.
    pub widths: Vec<usize>,
    pub act: Act,
    /// Samples per forward/backward.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step (gradients add up in place).
    pub micro_steps: usize,
    pub precision: Precision,
    pub optimizer: OptimizerKind,
    pub checkpoint_activations: bool,
}

/// The predicted peak of a step and what it is made of.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    /// Activations and their gradients alive at the peak.
    pub activations: u64,
    /// Everything else alive at the peak: input batch, casts of the weights, targets, scalars.
    pub workspace: u64,
    /// The peak: the sum of the above at the worst point of the step.
    pub peak: u64,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "planned peak of a training step:")?;
        writeln!(f, "  parameters        {:>12}", Bytes(self.parameters))?;
        writeln!(f, "  gradients         {:>12}", Bytes(self.gradients))?;
        writeln!(f, "  optimizer state   {:>12}", Bytes(self.optimizer_state))?;
        writeln!(f, "  activations       {:>12}", Bytes(self.activations))?;
        writeln!(f, "  workspace         {:>12}", Bytes(self.workspace))?;
        writeln!(f, "  = peak            {:>12}", Bytes(self.peak))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Cat {
    Grad,
    Act,
    Work,
}

/// Live bytes by category, with the breakdown at the highest point.
struct Sim {
    fixed: u64,
    live: [u64; 3],
    best: (u64, [u64; 3]),
}

/// A simulated tensor: its arena block size and category.
#[derive(Clone, Copy)]
struct T(u64, Cat);

impl Sim {
    fn alloc(&mut self, elems: usize, dtype: DType, cat: Cat) -> T {
        let size = Arena::block_size((elems * dtype.size()) as u64);
        self.live[cat as usize] += size;
        let total = self.fixed + self.live.iter().sum::<u64>();
        if total > self.best.0 {
            self.best = (total, self.live);
        }
        T(size, cat)
    }

    fn free(&mut self, t: T) {
        self.live[t.1 as usize] -= t.0;
    }
}

/// Predicts the peak bytes in use during one training step (after the first, when the
/// optimizer state exists).
pub fn plan(cfg: &PlanConfig) -> Plan {
    let w = &cfg.widths;
    let pd = cfg.precision.param_dtype();
    let layers: Vec<(usize, usize)> = w.windows(2).map(|p| (p[0], p[1])).collect();
    let tensor = |n: usize, d: DType| Arena::block_size((n * d.size()) as u64);
    let parameters: u64 = layers
        .iter()
        .map(|&(i, o)| tensor(i * o, pd) + tensor(o, pd))
        .sum();
    let optimizer_state = parameters * cfg.optimizer.state_tensors();
    // The trainer's running loss and step loss (f32 scalars) live all along.
    let loss_sum = 2 * tensor(1, DType::F32);
    let mut s = Sim {
        fixed: parameters + optimizer_state + loss_sum,
        live: [0; 3],
        best: (0, [0; 3]),
    };
    let mut grads: Vec<Option<(T, T)>> = vec![None; layers.len()];
    for _ in 0..cfg.micro_steps.max(1) {
        micro_step(&mut s, cfg, &layers, &mut grads);
    }
    let (peak, live) = s.best;
    let gradients = live[Cat::Grad as usize];
    let activations = live[Cat::Act as usize];
    let workspace = live[Cat::Work as usize] + loss_sum;
    Plan {
        parameters,
        gradients,
        optimizer_state,
        activations,
        workspace,
        peak,
    }
}

/// Whether hidden layers run as checkpointed segments (see [`crate::nn::Mlp`]: only gelu layers
/// are, the others keep nothing a recomputation would drop).
fn checkpointed(cfg: &PlanConfig) -> bool {
    cfg.checkpoint_activations && matches!(cfg.act, Act::Gelu)
}

/// One forward/backward of `cfg.micro_batch` samples, as the trainer runs it.
fn micro_step(
    s: &mut Sim,
    cfg: &PlanConfig,
    layers: &[(usize, usize)],
    grads: &mut [Option<(T, T)>],
) {
    let pd = cfg.precision.param_dtype();
    let cd = cfg.precision.compute_dtype();
    let cast = pd != cd;
    let m = cfg.micro_batch;
    let classes = layers.last().map_or(1, |l| l.1);
    let last = layers.len() - 1;
    let relu = matches!(cfg.act, Act::Relu);
    let gelu = matches!(cfg.act, Act::Gelu);

    // ---- forward ----
    let x = s.alloc(m * layers[0].0, DType::F32, Cat::Work);
    let x_in = if cast {
        s.alloc(m * layers[0].0, cd, Cat::Work)
    } else {
        x
    };
    // Per layer: (input, weight cast, gelu pre-activation, output).
    let mut saved: Vec<(T, Option<T>, Option<T>, T)> = Vec::new();
    let mut h = x_in;
    for (li, &(fin, fout)) in layers.iter().enumerate() {
        let hidden = li != last;
        let ckpt = hidden && checkpointed(cfg);
        let wc = cast.then(|| s.alloc(fin * fout, cd, Cat::Work));
        let bc = cast.then(|| s.alloc(fout, cd, Cat::Work));
        let mut pre = None;
        let out = if !hidden || ckpt || relu {
            // One dispatch: plain, fused relu, or anything under no_grad (fused gelu too).
            s.alloc(m * fout, cd, Cat::Act)
        } else {
            let p = s.alloc(m * fout, cd, Cat::Act);
            let o = s.alloc(m * fout, cd, Cat::Act);
            if gelu {
                pre = Some(p); // gelu keeps its input
            } else {
                s.free(p); // tanh / sigmoid keep their output
            }
            o
        };
        if let Some(b) = bc {
            s.free(b); // the matmul keeps no bias
        }
        let wc = match (ckpt, wc) {
            (true, Some(w)) => {
                s.free(w); // a checkpointed segment keeps only its input
                None
            }
            (_, w) => w,
        };
        saved.push((h, wc, pre, out));
        h = out;
    }
    if cast {
        s.free(x); // the trainer drops its f32 batch after the forward
    }
    let mut logits = h;
    if cast {
        let l32 = s.alloc(m * classes, DType::F32, Cat::Act);
        s.free(logits);
        logits = l32;
    }
    // ---- cross-entropy: row losses, the saved gradient, the targets, the mean ----
    let rows = s.alloc(m, DType::F32, Cat::Work);
    let ce_grad = s.alloc(m * classes, DType::F32, Cat::Act);
    let targets = s.alloc(m, DType::F32, Cat::Work);
    s.free(targets);
    let loss = s.alloc(1, DType::F32, Cat::Work);
    s.free(rows);
    s.free(logits); // the trainer drops the logits once the loss exists
    let scaled = s.alloc(1, DType::F32, Cat::Work); // share of the batch and / or loss scale
                                                    // ---- backward ----
    let seed = s.alloc(1, DType::F32, Cat::Work);
    let g1 = s.alloc(1, DType::F32, Cat::Work);
    s.free(seed);
    let mut g = s.alloc(m * classes, DType::F32, Cat::Act); // saved gradient * g
    s.free(ce_grad);
    s.free(g1);
    if cast {
        let g16 = s.alloc(m * classes, cd, Cat::Act);
        s.free(g);
        g = g16;
    }
    for li in (0..layers.len()).rev() {
        let (fin, fout) = layers[li];
        let hidden = li != last;
        let ckpt = hidden && checkpointed(cfg);
        let (input, wc, pre, out) = saved.pop().expect("one entry per layer");
        let mut temps = Vec::new();
        // The gradient the matmul's rule receives, when an activation rule made a new one.
        let mut g_act: Option<T> = None;
        let mut g_freed = false;
        let mut wc = wc;
        if ckpt {
            // The segment runs again with recording on; its backward runs right away, seeded
            // with `g`, which the outer rule holds until it returns.
            wc = cast.then(|| s.alloc(fin * fout, cd, Cat::Work));
            let bc = cast.then(|| s.alloc(fout, cd, Cat::Work));
            if relu {
                temps.push(s.alloc(m * fout, cd, Cat::Act));
            } else {
                let p = s.alloc(m * fout, cd, Cat::Act);
                let o = s.alloc(m * fout, cd, Cat::Act);
                if gelu {
                    s.free(o); // the recomputed output itself is dropped before backward
                } else {
                    s.free(p); // tanh / sigmoid keep their output, not the pre-activation
                    temps.push(o);
                }
                g_act = Some(s.alloc(m * fout, cd, Cat::Act)); // the activation's rule
                if gelu {
                    s.free(p); // gelu's saved input goes with its rule
                }
            }
            if let Some(b) = bc {
                s.free(b);
            }
        } else if hidden && !relu {
            g_act = Some(s.alloc(m * fout, cd, Cat::Act)); // the activation's rule
            match pre {
                Some(p) => s.free(p), // gelu's saved input
                None => s.free(out),  // tanh / sigmoid's saved output, the last reference
            }
            s.free(g);
            g_freed = true;
        }
        // The matmul's rule: relu mask, dX, dW, db.
        let masked = (hidden && relu).then(|| s.alloc(m * fout, cd, Cat::Act));
        let ga = (li > 0).then(|| s.alloc(m * fin, cd, Cat::Act));
        let gw = s.alloc(fout * fin, cd, Cat::Grad);
        let mut gb = s.alloc(fout, DType::F32, Cat::Grad);
        if cd != DType::F32 {
            let b16 = s.alloc(fout, cd, Cat::Grad);
            s.free(gb);
            gb = b16;
        }
        if let Some(mk) = masked {
            s.free(mk);
        }
        if let Some(w) = wc {
            s.free(w);
        }
        for t in temps {
            s.free(t);
        }
        if let Some(ga2) = g_act {
            s.free(ga2);
        }
        if !g_freed {
            s.free(g);
        }
        // The rule is dropped: a fused relu's output (kept for its mask) goes now; so does this
        // layer's input when nothing else holds it (the batch, or an output that its own layer
        // did not keep).
        if hidden && relu && !ckpt {
            s.free(out);
        }
        let producer_keeps = li > 0 && relu && !checkpointed(cfg);
        let producer_freed = li > 0 && !relu && !gelu && !checkpointed(cfg);
        if !producer_keeps && !producer_freed {
            s.free(input);
        }
        // The parameters' gradients, cast back to their dtype, then kept or added in place.
        let (gw, gb) = if cast {
            let gb32 = s.alloc(fout, pd, Cat::Grad);
            s.free(gb);
            let gw32 = s.alloc(fout * fin, pd, Cat::Grad);
            s.free(gw);
            (gw32, gb32)
        } else {
            (gw, gb)
        };
        if grads[li].is_some() {
            s.free(gw);
            s.free(gb);
        } else {
            grads[li] = Some((gw, gb));
        }
        g = ga.unwrap_or(T(0, Cat::Act));
    }
    s.free(scaled);
    s.free(loss);
}
