//! The measurements of `cargo xtask bench` on one device: each figure with its timing, its
//! work (the rate's unit) and the references measured beside it, pushed as soon as it is made.

use crate::bench_report::{Figure, Reference, Timing};
use fitgrad::MatmulVariant as Variant;
use fitgrad::{DType, Device, DeviceOptions, MatmulOptions, Tensor};
use std::time::Instant;

/// One matmul shape: C (m, n) = op(A) · op(B) with k inner.
#[derive(Clone, Copy)]
struct Mm {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
}

fn mm(name: &'static str, m: usize, n: usize, k: usize, ta: bool, tb: bool) -> Mm {
    Mm {
        name,
        m,
        n,
        k,
        ta,
        tb,
    }
}

/// The shapes of an MLP 784-512-512-10 training step at batch 128: forward X·W, and backward
/// dW = Xᵀ·dY and dX = dY·Wᵀ.
fn training_shapes() -> Vec<Mm> {
    let mut v = Vec::new();
    for (k, n) in [(784, 512), (512, 512), (512, 10)] {
        v.push(mm("train fwd", 128, n, k, false, false));
        v.push(mm("train dW=XᵀdY", k, n, 128, true, false));
        v.push(mm("train dX=dYWᵀ", 128, k, n, false, true));
    }
    v
}

/// `reps` timed runs of `f` after one warm-up run.
fn time(reps: usize, mut f: impl FnMut() -> fitgrad::Result<()>) -> fitgrad::Result<Timing> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    Ok(Timing::from_secs(t))
}

/// Single-threaded CPU sgemm of the same shape (f32).
fn cpu_sgemm(s: &Mm, reps: usize) -> Timing {
    let a = vec![0.5f32; s.m * s.k];
    let b = vec![0.25f32; s.k * s.n];
    let mut c = vec![0f32; s.m * s.n];
    // Row and column strides of op(A) (m x k) and op(B) (k x n) as stored.
    let (rsa, csa) = if s.ta {
        (1, s.m as isize)
    } else {
        (s.k as isize, 1)
    };
    let (rsb, csb) = if s.tb {
        (1, s.k as isize)
    } else {
        (s.n as isize, 1)
    };
    let mut run = || unsafe {
        matrixmultiply::sgemm(
            s.m,
            s.k,
            s.n,
            1.0,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            0.0,
            c.as_mut_ptr(),
            s.n as isize,
            1,
        );
    };
    run();
    let t = (0..reps.max(3))
        .map(|_| {
            let st = Instant::now();
            run();
            st.elapsed().as_secs_f64()
        })
        .collect();
    Timing::from_secs(t)
}

/// What one run of a figure does, in its unit: `amount` units (GFLOP, GB, M scores, samples).
#[derive(Clone, Copy)]
struct Work {
    amount: f64,
    unit: &'static str,
}

impl Work {
    fn rate_at(&self, ms: f64) -> f64 {
        self.amount / (ms / 1e3)
    }
}

/// One adapter's measurements: figures go to `out` as they are made, so a failure keeps them;
/// `doing` names what is being measured, for the error.
pub struct Bench<'a> {
    /// The device measured.
    pub dev: &'a Device,
    /// The adapter's [`AdapterRecord::id`](crate::bench_report::AdapterRecord).
    pub adapter: &'a str,
    /// Timed repetitions per figure.
    pub reps: usize,
    /// Where figures go, one by one.
    pub out: &'a mut Vec<Figure>,
    /// What is being measured now (for the error if it fails).
    pub doing: &'a mut String,
}

/// A figure's pieces before they become a [`Figure`].
struct Measured<'a> {
    op: String,
    shape: String,
    dtype: String,
    kernel: String,
    note: String,
    work: Work,
    time: Timing,
    /// Name, timing, and the work that timing did (its rate is in the figure's unit).
    references: Vec<(&'a str, Timing, Work)>,
}

impl Bench<'_> {
    fn doing(&mut self, what: String) {
        *self.doing = what;
    }

    fn push(&mut self, m: Measured) {
        let rate = m.work.rate_at(m.time.median_ms);
        let references = m
            .references
            .into_iter()
            .map(|(name, time, work)| {
                let r = work.rate_at(time.median_ms);
                Reference {
                    name: name.into(),
                    rate: r,
                    ratio: rate / r,
                    time,
                }
            })
            .collect();
        let f = Figure {
            adapter: self.adapter.into(),
            op: m.op,
            shape: m.shape,
            dtype: m.dtype,
            kernel: m.kernel,
            note: m.note,
            unit: m.work.unit.into(),
            rate,
            rate_at_max_ms: m.work.rate_at(m.time.max_ms),
            rate_at_min_ms: m.work.rate_at(m.time.min_ms),
            time: m.time,
            references,
        };
        eprintln!(
            "  {} {} {}: {:.3} ms",
            f.op, f.shape, f.dtype, f.time.median_ms
        );
        self.out.push(f);
    }

    /// Every benchmark (`train_only`: the training step alone); `quick`: no 2048³ matmul.
    pub fn all(&mut self, quick: bool, train_only: bool) -> fitgrad::Result<()> {
        if !train_only {
            self.matmuls(quick)?;
            self.softmax_and_copies()?;
            self.add()?;
            self.attention()?;
            self.gpt_step()?;
        }
        self.train_step()
    }

    fn matmuls(&mut self, quick: bool) -> fitgrad::Result<()> {
        let (dev, reps) = (self.dev, self.reps);
        let sizes: &[usize] = if quick {
            &[256, 512, 1024]
        } else {
            &[256, 512, 1024, 2048]
        };
        let mut shapes: Vec<Mm> = sizes
            .iter()
            .map(|&s| mm("square", s, s, s, false, false))
            .collect();
        shapes.extend(training_shapes());
        for dtype in [DType::F32, DType::F16] {
            for s in &shapes {
                let shape = format!(
                    "{}x{}x{}{}{}",
                    s.m,
                    s.n,
                    s.k,
                    if s.ta { " Aᵀ" } else { "" },
                    if s.tb { " Bᵀ" } else { "" }
                );
                self.doing(format!("matmul {} {shape} {dtype}", s.name));
                let ad = if s.ta { [s.k, s.m] } else { [s.m, s.k] };
                let bd = if s.tb { [s.n, s.k] } else { [s.k, s.n] };
                let a = Tensor::randn(dev, &ad, 0.0, 1.0, 1, dtype)?;
                let b = Tensor::randn(dev, &bd, 0.0, 1.0, 2, dtype)?;
                let opts = MatmulOptions::new().trans_a(s.ta).trans_b(s.tb);
                let flops = 2.0 * (s.m * s.n * s.k) as f64;
                let work = Work {
                    amount: flops / 1e9,
                    unit: "GFLOP/s",
                };
                // The first call tunes (or reads the tuning cache); the timed calls reuse the
                // winner.
                let t = time(reps, || {
                    a.matmul_with(&b, &opts)?;
                    dev.sync()
                })?;
                let variant = a.matmul_chosen(&b, &opts)?;
                // The naive kernel is slow: one timed run is enough for its ratio at large sizes.
                let naive_reps = if flops > 5e8 { 1 } else { reps };
                let naive = time(naive_reps, || {
                    a.matmul_variant(&b, &opts, Variant::Naive)?;
                    dev.sync()
                })?;
                let cpu = cpu_sgemm(s, reps);
                self.push(Measured {
                    op: format!("matmul {}", s.name),
                    shape,
                    dtype: dtype.to_string(),
                    kernel: variant.name(),
                    note: String::new(),
                    work,
                    time: t,
                    references: vec![
                        ("naive kernel", naive, work),
                        ("cpu sgemm 1 thread (host, f32)", cpu, work),
                    ],
                });
            }
        }
        Ok(())
    }

    /// Softmax 4096x1024 against a copy of the same bytes, by the copy engine and by a kernel.
    fn softmax_and_copies(&mut self) -> fitgrad::Result<()> {
        let (dev, reps) = (self.dev, self.reps);
        for dtype in [DType::F32, DType::F16] {
            self.doing(format!("softmax and copies 4096x1024 {dtype}"));
            let x = Tensor::randn(dev, &[4096, 1024], 0.0, 1.0, 3, dtype)?;
            // Read once and written once.
            let work = Work {
                amount: 2.0 * (4096 * 1024 * dtype.size()) as f64 / 1e9,
                unit: "GB/s",
            };
            let copy = time(reps, || {
                x.copy()?;
                dev.sync()
            })?;
            let copy_kernel = time(reps, || {
                x.to_dtype(dtype)?;
                dev.sync()
            })?;
            let sm = time(reps, || {
                x.softmax()?;
                dev.sync()
            })?;
            let refs = vec![
                ("copy engine (same bytes)", copy.clone(), work),
                ("copy kernel (same bytes)", copy_kernel.clone(), work),
            ];
            for (op, t, references) in [
                ("copy (copy_buffer_to_buffer)", copy, vec![]),
                ("copy (kernel)", copy_kernel, vec![]),
                ("softmax", sm, refs),
            ] {
                self.push(Measured {
                    op: op.into(),
                    shape: "4096x1024".into(),
                    dtype: dtype.to_string(),
                    kernel: String::new(),
                    note: String::new(),
                    work,
                    time: t,
                    references,
                });
            }
        }
        Ok(())
    }

    /// Elementwise add of 16M elements (two reads and a write) against a copy of one input.
    fn add(&mut self) -> fitgrad::Result<()> {
        let (dev, reps) = (self.dev, self.reps);
        self.doing("add 16M f32".into());
        let n = 16 << 20;
        let a = Tensor::randn(dev, &[n], 0.0, 1.0, 4, DType::F32)?;
        let b = Tensor::randn(dev, &[n], 0.0, 1.0, 5, DType::F32)?;
        let t = time(reps, || {
            a.add(&b)?;
            dev.sync()
        })?;
        let copy = time(reps, || {
            a.copy()?;
            dev.sync()
        })?;
        let gb = |words: usize| Work {
            amount: (words * 4 * n) as f64 / 1e9,
            unit: "GB/s",
        };
        self.push(Measured {
            op: "add".into(),
            shape: "16M".into(),
            dtype: "f32".into(),
            kernel: String::new(),
            note: String::new(),
            work: gb(3),
            time: t,
            references: vec![("copy engine (one input)", copy, gb(2))],
        });
        Ok(())
    }

    /// Causal self-attention forward + backward, fused against the composed ops (matmul,
    /// softmax_masked, matmul), with each one's peak memory above the inputs: (B, H, T, D) =
    /// (4, 4, 256, 64) in f32 and f16, and T = 256 to 2048 at (1, 4, T, 64) in f32, where the
    /// composed ops' (B, H, T, T) scores grow with T squared and the fused kernels' do not exist.
    fn attention(&mut self) -> fitgrad::Result<()> {
        let mut cases = vec![
            ([4usize, 4, 256, 64], DType::F32),
            ([4, 4, 256, 64], DType::F16),
        ];
        cases.extend([256, 512, 1024, 2048].map(|t| ([1, 4, t, 64], DType::F32)));
        for (dims, dtype) in cases {
            self.attention_at(dims, dtype)?;
        }
        Ok(())
    }

    fn attention_at(&mut self, dims: [usize; 4], dtype: DType) -> fitgrad::Result<()> {
        use fitgrad::{AttentionKind, AttentionOptions, Bytes};
        let (dev, reps) = (self.dev, self.reps);
        let shape = dims.map(|d| d.to_string()).join("x");
        let work = Work {
            amount: (dims[0] * dims[1] * dims[2] * (dims[2] + 1) / 2) as f64 / 1e6,
            unit: "M scores/s",
        };
        self.doing(format!("attention {shape} {dtype}"));
        let qkv = [6, 7, 8].map(|seed| {
            Tensor::randn(dev, &dims, 0.0, 1.0, seed, dtype).map(|t| t.with_requires_grad())
        });
        let [q, k, v] = qkv;
        let (q, k, v) = (q?, k?, v?);
        let mut runs = Vec::new();
        for kind in [AttentionKind::Fused, AttentionKind::Composed] {
            let opts = AttentionOptions::new().kind(kind);
            let step = || -> fitgrad::Result<()> {
                q.attention_with(&k, &v, &opts)?.sum()?.backward()?;
                for t in [&q, &k, &v] {
                    t.zero_grad();
                }
                dev.sync()
            };
            step()?;
            dev.reset_peak();
            let before = dev.memory_stats().bytes_in_use;
            let t = time(reps, step)?;
            let peak = dev.memory_stats().peak_bytes_in_use - before;
            runs.push((kind, t, peak));
        }
        let (composed, composed_peak) = (runs[1].1.clone(), runs[1].2);
        for (i, (kind, t, peak)) in runs.into_iter().enumerate() {
            let note = if i == 0 {
                format!(
                    "peak {} above the inputs = {:.3}x the composed ops' {}",
                    Bytes(peak),
                    peak as f64 / composed_peak.max(1) as f64,
                    Bytes(composed_peak)
                )
            } else {
                format!("peak {} above the inputs", Bytes(peak))
            };
            self.push(Measured {
                op: format!("attention fwd+bwd causal, {kind:?}").to_lowercase(),
                shape: shape.clone(),
                dtype: dtype.to_string(),
                kernel: String::new(),
                note,
                work,
                time: t,
                references: if i == 0 {
                    vec![("composed ops", composed.clone(), work)]
                } else {
                    vec![]
                },
            });
        }
        Ok(())
    }

    /// A training step of train_gpt's default GPT (2 blocks, width 64, 4 heads, context 32,
    /// batch 16; forward, backward, AdamW), with and without block checkpointing, and each
    /// one's peak above the parameters and optimizer state.
    fn gpt_step(&mut self) -> fitgrad::Result<()> {
        use fitgrad::nn::{Gpt, GptConfig, Module};
        use fitgrad::optim::{decay_groups, AdamW, Optimizer};
        use fitgrad::Bytes;
        let (dev, reps) = (self.dev, self.reps);
        let (vocab, batch, t) = (76usize, 16usize, 32usize);
        self.doing("train step GPT 2x64".into());
        let ids: Vec<u32> = (0..batch * t).map(|i| (i * 7919 % vocab) as u32).collect();
        let targets: Vec<u32> = (0..batch * t)
            .map(|i| (i * 104729 % vocab) as u32)
            .collect();
        let gpt = Gpt::new(dev, GptConfig::new(vocab, 64, 4, 2, t))?;
        let mut opt = AdamW::with_groups(decay_groups(gpt.named_parameters(), 0.1), 3e-3)?;
        let work = Work {
            amount: (batch * t) as f64,
            unit: "tokens/s",
        };
        let mut runs = Vec::new();
        for checkpointed in [false, true] {
            gpt.set_checkpoint_blocks(checkpointed);
            let mut step = || -> fitgrad::Result<()> {
                gpt.loss(&ids, &targets, batch, t)?.backward()?;
                opt.step()?;
                opt.zero_grad();
                dev.sync()
            };
            // The first step creates the optimizer state; then the peak counts one step.
            step()?;
            dev.reset_peak();
            let before = dev.memory_stats().bytes_in_use;
            let timing = time(reps, &mut step)?;
            let peak = dev.memory_stats().peak_bytes_in_use - before;
            runs.push((checkpointed, timing, peak));
        }
        gpt.set_checkpoint_blocks(false);
        let (plain, plain_peak) = (runs[0].1.clone(), runs[0].2);
        for (checkpointed, timing, peak) in runs {
            self.push(Measured {
                op: "train step GPT (train_gpt default) AdamW".into(),
                shape: format!("batch {batch} x context {t}"),
                dtype: "f32".into(),
                kernel: if checkpointed {
                    "checkpointed blocks"
                } else {
                    "plain"
                }
                .into(),
                note: format!(
                    "peak {} above parameters and optimizer state ({:.2}x plain)",
                    Bytes(peak),
                    peak as f64 / plain_peak.max(1) as f64
                ),
                work,
                time: timing,
                references: if checkpointed {
                    vec![("without checkpointing", plain.clone(), work)]
                } else {
                    vec![]
                },
            });
        }
        Ok(())
    }

    /// One full training step (forward, backward, AdamW) of an MLP 784-512-512-10 at batch 128,
    /// against the same step's matmuls alone, and the step's peak memory against its real need.
    fn train_step(&mut self) -> fitgrad::Result<()> {
        use fitgrad::train::bench::{step_fixture, StepMatmuls};
        self.doing("train step MLP 784-512-512-10".into());
        // A device of its own on the same adapter: segments cached by the other benchmarks
        // would otherwise count as the step's reserved memory.
        let a = &self.dev.info().adapter;
        let fresh = Device::with_options(
            DeviceOptions::default()
                .backend(a.backend.clone())
                .adapter(a.name.clone()),
        )?;
        let (dev, reps) = (&fresh, self.reps);
        const B: usize = 128;
        let widths = [784, 512, 512, 10];
        let (mut trainer, x, y) = step_fixture(dev, &widths, B)?;
        // Two steps create the optimizer state and tune the matmuls; then peaks count one step.
        trainer.step_rows(&x, &y)?;
        trainer.step_rows(&x, &y)?;
        dev.sync()?;
        dev.reset_peak();
        let step = time(reps, || {
            trainer.step_rows(&x, &y)?;
            dev.sync()
        })?;
        let mem = trainer.memory_summary();
        let mats = StepMatmuls::new(dev, &widths, B)?;
        let matmuls = time(reps, || {
            mats.run()?;
            dev.sync()
        })?;
        let work = Work {
            amount: B as f64,
            unit: "samples/s",
        };
        let need = mem.needed_bytes() as f64;
        self.push(Measured {
            op: "train step MLP 784-512-512-10 AdamW".into(),
            shape: format!("batch {B}"),
            dtype: "f32".into(),
            kernel: String::new(),
            note: format!(
                "peak reserved {:.2} MiB = {:.2}x need {:.2} MiB",
                mem.stats.peak_bytes_reserved as f64 / 1048576.0,
                mem.overhead(),
                need / 1048576.0
            ),
            work,
            time: step,
            references: vec![("its matmuls alone", matmuls.clone(), work)],
        });
        self.push(Measured {
            op: "train step: matmuls alone".into(),
            shape: format!("batch {B}"),
            dtype: "f32".into(),
            kernel: String::new(),
            note: String::new(),
            work,
            time: matmuls,
            references: vec![],
        });
        Ok(())
    }
}
