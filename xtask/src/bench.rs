//! `cargo xtask bench [--quick] [--train-only] [--adapter NAME]`: the cross-vendor benchmark.
//!
//! Runs one set of kernels on every adapter wgpu finds (or those whose name contains NAME) and
//! writes target/bench/report.md and target/bench/report.json. Each matmul figure comes with two
//! references measured in the same run, so it reads as a ratio: a naive one-invocation-per-output
//! matmul on the same adapter, and a single-threaded CPU sgemm (the `matrixmultiply` crate).
//! Softmax is compared with a plain buffer copy of the same bytes on the same adapter, fused
//! attention with the same math composed from matmul and softmax.

use fitgrad::MatmulVariant as Variant;
use fitgrad::{DType, Device, DeviceOptions, MatmulOptions, Tensor};
use serde_json::json;
use std::time::Instant;

struct Opts {
    quick: bool,
    /// Only the training-step entry.
    train_only: bool,
    adapter: Option<String>,
}

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

/// Median seconds of `reps` runs of `f` (after one warm-up run).
fn median_secs(reps: usize, mut f: impl FnMut() -> fitgrad::Result<()>) -> fitgrad::Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Single-threaded CPU sgemm of the same shape (f32), seconds.
fn cpu_sgemm_secs(s: &Mm, reps: usize) -> f64 {
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
    let mut t: Vec<f64> = (0..reps.max(3))
        .map(|_| {
            let st = Instant::now();
            run();
            st.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

struct Row {
    op: String,
    shape: String,
    dtype: String,
    variant: String,
    ms: f64,
    rate: f64,
    unit: &'static str,
    vs: Vec<(String, f64)>,
}

/// The cargo profile this binary (and the fitgrad code it measures) was built with.
const PROFILE: &str = if cfg!(debug_assertions) {
    "dev (unoptimized)"
} else {
    "release"
};

fn bench_adapter(dev: &Device, o: &Opts) -> fitgrad::Result<Vec<Row>> {
    let mut rows = Vec::new();
    let reps = if o.quick { 3 } else { 10 };
    if o.train_only {
        return bench_train_step(dev, reps);
    }
    let mut shapes: Vec<Mm> = if o.quick {
        vec![256, 512, 1024]
    } else {
        vec![256, 512, 1024, 2048]
    }
    .into_iter()
    .map(|s| mm("square", s, s, s, false, false))
    .collect();
    shapes.extend(training_shapes());
    for dtype in [DType::F32, DType::F16] {
        for s in &shapes {
            let ad = if s.ta { [s.k, s.m] } else { [s.m, s.k] };
            let bd = if s.tb { [s.n, s.k] } else { [s.k, s.n] };
            let a = Tensor::randn(dev, &ad, 0.0, 1.0, 1, dtype)?;
            let b = Tensor::randn(dev, &bd, 0.0, 1.0, 2, dtype)?;
            let opts = MatmulOptions::new().trans_a(s.ta).trans_b(s.tb);
            let flops = 2.0 * (s.m * s.n * s.k) as f64;
            // The first call tunes (or reads the tuning cache); the timed calls reuse the winner.
            let t = median_secs(reps, || {
                a.matmul_with(&b, &opts)?;
                dev.sync()
            })?;
            let variant = a.matmul_chosen(&b, &opts)?;
            // The naive kernel is slow: one timed run is enough for its ratio at large sizes.
            let naive_reps = if flops > 5e8 { 1 } else { reps };
            let naive = median_secs(naive_reps, || {
                a.matmul_variant(&b, &opts, Variant::Naive)?;
                dev.sync()
            })?;
            let cpu = cpu_sgemm_secs(s, reps);
            rows.push(Row {
                op: format!("matmul {}", s.name),
                shape: format!(
                    "{}x{}x{}{}{}",
                    s.m,
                    s.n,
                    s.k,
                    if s.ta { " Aᵀ" } else { "" },
                    if s.tb { " Bᵀ" } else { "" }
                ),
                dtype: dtype.to_string(),
                variant: variant.name(),
                ms: t * 1e3,
                rate: flops / t / 1e9,
                unit: "GFLOP/s",
                vs: vec![
                    ("naive".into(), naive / t),
                    ("cpu sgemm 1 thread".into(), cpu / t),
                ],
            });
            eprintln!(
                "  {} {} {dtype}: {:.2} ms",
                rows.last().unwrap().op,
                rows.last().unwrap().shape,
                t * 1e3
            );
        }
    }
    // Softmax 4096x1024 against a copy of the same bytes.
    for dtype in [DType::F32, DType::F16] {
        let x = Tensor::randn(dev, &[4096, 1024], 0.0, 1.0, 3, dtype)?;
        let bytes = (4096 * 1024 * dtype.size()) as f64;
        let copy = median_secs(reps, || {
            x.copy()?;
            dev.sync()
        })?;
        let copy_kernel = median_secs(reps, || {
            x.to_dtype(dtype)?;
            dev.sync()
        })?;
        let sm = median_secs(reps, || {
            x.softmax()?;
            dev.sync()
        })?;
        let ratios = vec![
            ("copy engine (time ratio)".to_string(), sm / copy),
            ("copy kernel (time ratio)".to_string(), sm / copy_kernel),
        ];
        for (op, t, vs) in [
            ("copy (copy_buffer_to_buffer)", copy, vec![]),
            ("copy (kernel)", copy_kernel, vec![]),
            ("softmax", sm, ratios),
        ] {
            rows.push(Row {
                op: op.into(),
                shape: "4096x1024".into(),
                dtype: dtype.to_string(),
                variant: String::new(),
                ms: t * 1e3,
                // Read once and written once.
                rate: 2.0 * bytes / t / 1e9,
                unit: "GB/s",
                vs,
            });
        }
    }
    // Elementwise add of 16M elements: two reads and a write.
    let n = 16 << 20;
    let a = Tensor::randn(dev, &[n], 0.0, 1.0, 4, DType::F32)?;
    let b = Tensor::randn(dev, &[n], 0.0, 1.0, 5, DType::F32)?;
    let t = median_secs(reps, || {
        a.add(&b)?;
        dev.sync()
    })?;
    rows.push(Row {
        op: "add".into(),
        shape: "16M".into(),
        dtype: "f32".into(),
        variant: String::new(),
        ms: t * 1e3,
        rate: 3.0 * 4.0 * n as f64 / t / 1e9,
        unit: "GB/s",
        vs: vec![],
    });
    drop((a, b));
    rows.extend(bench_attention(dev, reps)?);
    rows.extend(bench_train_step(dev, reps)?);
    Ok(rows)
}

/// Causal self-attention forward + backward at (B, H, D) = (1, 4, 64) and T = 256 to 2048 (f32;
/// f16 at T = 1024), fused against the composed ops (matmul, softmax_masked, matmul), with
/// each one's peak memory above the inputs and the fused one's ratios to composed.
fn bench_attention(dev: &Device, reps: usize) -> fitgrad::Result<Vec<Row>> {
    use fitgrad::{AttentionKind, AttentionOptions, Bytes};
    let mut cases: Vec<(DType, usize)> = [256, 512, 1024, 2048]
        .iter()
        .map(|&t| (DType::F32, t))
        .collect();
    cases.push((DType::F16, 1024));
    let mut rows = Vec::new();
    for (dtype, t) in cases {
        let dims = [1usize, 4, t, 64];
        let scores = (dims[0] * dims[1] * t * (t + 1) / 2) as f64;
        let qkv = [6, 7, 8].map(|seed| {
            Tensor::randn(dev, &dims, 0.0, 1.0, seed, dtype).map(|t| t.with_requires_grad())
        });
        let [q, k, v] = qkv;
        let (q, k, v) = (q?, k?, v?);
        let mut seen = Vec::new();
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
            let secs = median_secs(reps, step)?;
            let peak = dev.memory_stats().peak_bytes_in_use - before;
            seen.push((secs, peak));
            rows.push(Row {
                op: format!("attention fwd+bwd causal, {kind:?}").to_lowercase(),
                shape: format!("1x4x{t}x64"),
                dtype: dtype.to_string(),
                variant: format!("peak {} above the inputs", Bytes(peak)),
                ms: secs * 1e3,
                rate: scores / secs / 1e6,
                unit: "M scores/s",
                vs: vec![],
            });
        }
        let n = rows.len();
        rows[n - 2].vs = vec![
            ("composed (time ratio)".into(), seen[0].0 / seen[1].0),
            (
                "composed (peak ratio)".into(),
                seen[0].1 as f64 / seen[1].1 as f64,
            ),
        ];
    }
    Ok(rows)
}

/// One full training step (forward, backward, AdamW) of an MLP 784-512-512-10 at batch 128,
/// against the same step's matmuls alone, and the step's peak memory against its real need.
fn bench_train_step(shared: &Device, reps: usize) -> fitgrad::Result<Vec<Row>> {
    use fitgrad::train::bench::{step_fixture, StepMatmuls};
    // A device of its own on the same adapter: segments cached by the other benchmarks would
    // otherwise count as the step's reserved memory.
    let a = &shared.info().adapter;
    let fresh = Device::with_options(
        DeviceOptions::default()
            .backend(a.backend.clone())
            .adapter(a.name.clone()),
    )?;
    let dev = &fresh;
    const B: usize = 128;
    let widths = [784, 512, 512, 10];
    let (mut trainer, x, y) = step_fixture(dev, &widths, B)?;
    // Two steps create the optimizer state and tune the matmuls; then peaks count one step.
    trainer.step_rows(&x, &y)?;
    trainer.step_rows(&x, &y)?;
    dev.sync()?;
    dev.reset_peak();
    let step = median_secs(reps, || {
        trainer.step_rows(&x, &y)?;
        dev.sync()
    })?;
    let mem = trainer.memory_summary();
    let mats = StepMatmuls::new(dev, &widths, B)?;
    let matmuls = median_secs(reps, || {
        mats.run()?;
        dev.sync()
    })?;
    let need = mem.needed_bytes() as f64;
    Ok(vec![
        Row {
            op: "train step MLP 784-512-512-10 AdamW".into(),
            shape: format!("batch {B}"),
            dtype: "f32".into(),
            variant: format!(
                "peak reserved {:.2} MiB = {:.2}x need {:.2} MiB",
                mem.stats.peak_bytes_reserved as f64 / 1048576.0,
                mem.overhead(),
                need / 1048576.0
            ),
            ms: step * 1e3,
            rate: B as f64 / step,
            unit: "samples/s",
            vs: vec![("its matmuls alone (time ratio)".into(), step / matmuls)],
        },
        Row {
            op: "train step: matmuls alone".into(),
            shape: format!("batch {B}"),
            dtype: "f32".into(),
            variant: String::new(),
            ms: matmuls * 1e3,
            rate: B as f64 / matmuls,
            unit: "samples/s",
            vs: vec![],
        },
    ])
}

pub fn run(args: &[String]) -> Result<(), String> {
    let mut o = Opts {
        quick: false,
        train_only: false,
        adapter: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => o.quick = true,
            "--train-only" => o.train_only = true,
            "--adapter" => o.adapter = Some(it.next().ok_or("--adapter needs a name")?.clone()),
            other => {
                return Err(format!(
                    "unknown argument {other}; use [--quick] [--train-only] [--adapter NAME]"
                ))
            }
        }
    }
    // A benchmark measures tuned kernels on every adapter, CPU ones included (where a normal
    // run tunes only on request, as their candidates compile for seconds each).
    if std::env::var_os("FITGRAD_AUTOTUNE_BUDGET").is_none() {
        std::env::set_var("FITGRAD_AUTOTUNE_BUDGET", "1e9");
    }
    let mut adapters = Device::adapters();
    if let Some(want) = &o.adapter {
        adapters.retain(|a| a.name.to_lowercase().contains(&want.to_lowercase()));
    }
    if o.quick {
        // One backend per physical adapter (the list is best first).
        let mut seen = std::collections::HashSet::new();
        adapters.retain(|a| seen.insert(a.name.clone()));
    }
    if adapters.is_empty() {
        return Err("no adapter to benchmark".into());
    }
    let started = Instant::now();
    let mut md = format!("profile: {PROFILE} (the measured code's optimization)\n\n");
    md += &String::from("| adapter | vendor | backend | driver | op | shape | dtype | kernel | median ms | rate | vs references |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    let mut records = Vec::new();
    for a in &adapters {
        eprintln!("benchmarking {a}");
        let dev = Device::with_options(
            DeviceOptions::default()
                .backend(a.backend.clone())
                .adapter(a.name.clone()),
        )
        .map_err(|e| e.to_string())?;
        let rows = bench_adapter(&dev, &o).map_err(|e| format!("{}: {e}", a.name))?;
        for r in rows {
            let vs: Vec<String> = r.vs.iter().map(|(k, v)| format!("{v:.2}x {k}")).collect();
            md += &format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.2} {} | {} |\n",
                a.name,
                a.vendor_name,
                a.backend,
                a.driver,
                r.op,
                r.shape,
                r.dtype,
                r.variant,
                r.ms,
                r.rate,
                r.unit,
                vs.join(", ")
            );
            records.push(json!({
                "adapter": a.name, "vendor": a.vendor_name, "backend": a.backend, "driver": a.driver,
                "driver_info": a.driver_info, "op": r.op, "shape": r.shape, "dtype": r.dtype,
                "kernel": r.variant, "median_ms": r.ms, "rate": r.rate, "unit": r.unit,
                "ratios": r.vs.iter().map(|(k, v)| json!({"vs": k, "ratio": v})).collect::<Vec<_>>(),
            }));
        }
    }
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../target/bench");
    let dir = std::path::Path::new(dir);
    let report = json!({ "quick": o.quick, "profile": PROFILE, "seconds": started.elapsed().as_secs_f64(), "results": records });
    fitgrad::write_atomic(&dir.join("report.md"), md.as_bytes()).map_err(|e| e.to_string())?;
    let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
    fitgrad::write_atomic(&dir.join("report.json"), text.as_bytes()).map_err(|e| e.to_string())?;
    println!("{md}");
    println!(
        "wrote {} and report.json in {:.0} s",
        dir.join("report.md").display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
