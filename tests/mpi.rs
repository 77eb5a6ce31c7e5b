//! Data parallelism over MPI (the `mpi` feature), through the real examples under mpirun:
//! `mpirun -np 2` and `-np 4 <example> --distributed mpi` end with the weights and optimizer
//! state of one process with the same flags (within 1e-5 relative)
//! for train_mlp, custom_model and train_gpt at ZeRO stages 0 to 3 (and train_gpt's stage 3
//! plan against its run); `--fit auto` picks the first stage that fits; and a rank that is killed, or stopped without dying, brings the others down
//! with an error within 30 s instead of a hang, at every stage.
//!
//! The examples must be built first with the same profile and feature:
//! `cargo build --features mpi --example train_mlp --example custom_model --example train_gpt
//! && cargo test --features mpi --test mpi` (what .ci/run does).
#![cfg(feature = "mpi")]

use std::io::{BufRead, BufReader};
use std::ops::Range;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod mpirun;
use mpirun::*;

/// How long a job may take to end after one of its ranks is killed or stopped.
const STOP_WITHIN: Duration = Duration::from_secs(30);

/// A small, quick run of train_mlp (its weights depend on nothing else).
fn flags(epochs: u32) -> Vec<String> {
    let epochs = epochs.to_string();
    strings(&[
        "--hidden",
        "32",
        "--epochs",
        &epochs,
        "--batch-size",
        "64",
        "--seed",
        "5",
    ])
}

/// mpirun with 2 ranks of the example `name`; `env` reaches every rank.
fn mpirun(name: &str, args: &[String], env: &[(&str, &str)]) -> Command {
    mpirun_np(2, name, args, env)
}

/// max |a - b| / max |b| over one tensor.
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let scale = b
        .iter()
        .fold(0.0f64, |m, v| m.max(v.abs() as f64))
        .max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).abs() / scale)
        .fold(0.0, f64::max)
}

/// Runs the example `name` with `args` as one process and as 2 and 4 MPI ranks at each ZeRO
/// stage of `stages` (`--zero`), each saving a checkpoint (`--save`), and asserts that each
/// job's file holds the tensors of one process's (model and the whole optimizer state) within
/// 1e-5 relative and the same step, that every rank ends with the
/// same bits (the hashes of their weights, in rank 0's JSON), and that stages 1 and 2 report
/// the bytes per step of stage 0 up to the shards' padding.
///
/// `rounding_only` names elements (tensor, range) whose gradient is zero in exact arithmetic:
/// AdamW turns their rounding, which any other order of additions changes, into updates, so
/// they are not compared; each run must keep them below 1% of their tensor's largest value.
/// Returns each job's ranks, stage and output.
fn two_ranks_match_one_process(
    name: &str,
    args: &[String],
    rounding_only: &[(&str, Range<usize>)],
    stages: &[u8],
) -> Vec<(usize, u8, String)> {
    let _one = one_job_at_a_time();
    let tmp = TempDir::new(name);
    let single = tmp.0.join("single.safetensors");
    let mut one = Command::new(example(name));
    one.args(args).arg("--save").arg(&single);
    run_ok(one, &format!("{name}, one process"));
    let mut jobs = Vec::new();
    for np in [2, 4] {
        let mut sent = Vec::new();
        for &stage in stages {
            let dist = tmp.0.join(format!("np{np}-zero{stage}.safetensors"));
            let mut job = args.to_vec();
            job.extend(["--zero".into(), stage.to_string()]);
            job.extend(["--json".into(), "--save".into(), dist.display().to_string()]);
            let started = Instant::now();
            let json = compare_job(name, &job, &single, &dist, rounding_only, (stage, np));
            eprintln!(
                "{name} --zero {stage}: mpirun -np {np} took {:.1} s",
                started.elapsed().as_secs_f64()
            );
            sent.push((stage, json_u64(&json, "bytes_sent_per_step"), json));
        }
        check_bytes_sent(name, np, &sent);
        jobs.extend(sent.into_iter().map(|(stage, _, json)| (np, stage, json)));
    }
    jobs
}

/// The number after `"key":` in `text` (0 when absent).
fn json_u64(text: &str, key: &str) -> u64 {
    let k = format!("\"{key}\":");
    text.find(&k).map_or(0, |at| {
        let rest = &text[at + k.len()..];
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        rest[..end].parse().unwrap_or(0)
    })
}

/// Stages 1 and 2 send alike, and what stage 0 sends up to the padding of the shards: the
/// difference is at most the padding's share of a reduce-scatter and an all-gather (2(N-1)/N
/// of its f32 bytes) and the few words of the checks and flags.
fn check_bytes_sent(name: &str, np: usize, sent: &[(u8, u64, String)]) {
    let of = |stage: u8| sent.iter().find(|s| s.0 == stage).map(|s| s.1);
    for (stage, bytes, _) in sent {
        assert!(
            *bytes > 0,
            "{name} np {np} --zero {stage}: no bytes_sent_per_step"
        );
    }
    let (Some(s0), Some(s1), Some(s2)) = (of(0), of(1), of(2)) else {
        return;
    };
    assert_eq!(s1, s2, "{name} np {np}: stages 1 and 2 send alike");
    let params = json_u64(&sent[0].2, "parameter_elements");
    let padded = json_u64(&sent[1].2, "padded_elements");
    assert!(
        padded >= params && params > 0,
        "{name}: {padded} padded, {params} parameters"
    );
    let n = np as u64;
    let slack = 2 * (n - 1) * (padded - params) * 4 / n + 64 * n;
    assert!(
        s1 <= s0 + slack,
        "{name} np {np}: stage 1 sends {s1} bytes per step, stage 0 {s0} (padding allows {slack})"
    );
    eprintln!("{name} np {np}: bytes sent per step, stage 0 {s0}, stages 1 and 2 {s1}");
}

/// One `np`-rank job of `example_name` with `args` (which save to `dist`) against one
/// process's file `single`; returns the job's output.
fn compare_job(
    example_name: &str,
    args: &[String],
    single: &Path,
    dist: &Path,
    rounding_only: &[(&str, Range<usize>)],
    (stage, np): (u8, usize),
) -> String {
    let tol = 1e-5;
    let name = &format!("{example_name} -np {np} --zero {stage}");
    // A loaded machine may keep one rank compiling kernels for a while: no timeout here.
    let text = run_ok(
        mpirun_np(np, example_name, args, &[("FITGRAD_DIST_TIMEOUT", "300")]),
        &format!("{name}, mpirun"),
    );
    eprintln!("{text}");
    assert!(
        text.contains(&format!("\"ranks\":{np}")),
        "rank 0 of {name} reports {np} ranks:\n{text}"
    );
    assert!(
        text.contains(&format!("\"zero_stage\":{stage}")),
        "rank 0 of {name} reports its stage:\n{text}"
    );
    let hashes = rank_hashes(&text);
    assert_eq!(
        hashes.len(),
        np,
        "{name}: one weight hash per rank:\n{text}"
    );
    assert!(
        hashes.iter().all(|&h| h == hashes[0]),
        "{name}: the ranks' weights are not the same bits: {hashes:?}"
    );

    let a = fitgrad::checkpoint::load(dist).unwrap();
    let b = fitgrad::checkpoint::load(single).unwrap();
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>()
    );
    let mut worst = 0.0f64;
    let mut differ = Vec::new();
    for (tensor, t) in &b.tensors {
        let (mut x, mut y) = (a.tensors[tensor].to_f32(), t.to_f32());
        let scale = y.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (_, range) in rounding_only.iter().filter(|(n, _)| n == tensor) {
            for v in x[range.clone()].iter_mut().chain(&mut y[range.clone()]) {
                assert!(
                    v.abs() <= 0.01 * scale,
                    "{name}: {tensor}[{range:?}] holds {v}, not rounding-sized beside {scale}"
                );
                *v = 0.0;
            }
        }
        let d = rel_diff(&x, &y);
        eprintln!("{name} {tensor}: {d:e}");
        if d > tol {
            differ.push(format!("{tensor} by {d:e}"));
        }
        worst = worst.max(d);
    }
    assert!(
        differ.is_empty(),
        "{name}: tensors differ by more than {tol:e} relative (max |a-b| / max |b|): {differ:?}"
    );
    eprintln!(
        "{name}: worst relative difference over {} tensors of model and optimizer state: {worst:e}",
        b.tensors.len()
    );
    assert!(a.metadata.contains_key("step"), "{name}: no step saved");
    assert_eq!(a.metadata.get("step"), b.metadata.get("step"));
    text
}

/// The ranks' weight hashes of rank 0's JSON line (`"rank_weight_hashes":[..]`).
fn rank_hashes(text: &str) -> Vec<u64> {
    let key = "\"rank_weight_hashes\":[";
    let Some(at) = text.find(key) else {
        return Vec::new();
    };
    let rest = &text[at + key.len()..];
    rest[..rest.find(']').unwrap_or(0)]
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

/// Two and four ranks and one process with the same flags save the same model and optimizer
/// state, at ZeRO stages 0 to 3 (at 3 each of the MLP's layers a unit sharded over the ranks,
/// none of its parameters left outside the units).
#[test]
fn two_ranks_give_the_weights_of_one_process() {
    two_ranks_match_one_process("train_mlp", &flags(2), &[], &[0, 1, 2, 3]);
}

/// What stage 3 does not do yet (pruning) is refused on custom_model's ranks with a typed
/// error before any device work, as a model without units (`--blocks 0`).
#[test]
fn custom_model_zero_3_refusals_come_before_device_work() {
    let _one = one_job_at_a_time();
    let base = strings(&["--dataset", "digits", "--width", "16", "--zero", "3"]);
    for (extra, says) in [
        (&["--prune", "0.5"][..], "--prune is not built yet"),
        (&["--blocks", "0"][..], "nn::Unit"),
    ] {
        let mut args = base.clone();
        args.extend(strings(extra));
        let out = mpirun("custom_model", &args, &[]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{extra:?} ran:\n{err}");
        assert!(err.contains(says), "{extra:?}: not the refusal:\n{err}");
        assert!(
            !err.contains("adapter"),
            "{extra:?}: device work first:\n{err}"
        );
    }
}

/// `--fit auto --zero 3` plans at stage 3 on the ranks of train_gpt and train_mlp (the
/// ladder's device rungs at that stage, each rank joining at it), while what stage 3 lacks
/// (`--prune`) is still refused before any device work; one process runs it too.
#[test]
fn fit_auto_at_zero_3_plans_at_stage_3() {
    let _one = one_job_at_a_time();
    let tmp = TempDir::new("gpt-fit3");
    let text = tmp.0.join("text.txt");
    std::fs::write(&text, "to be, or not to be. ".repeat(40)).unwrap();
    let text = text.display().to_string();
    let fit3 = [
        "--zero",
        "3",
        "--fit",
        "auto",
        "--memory-budget",
        "64MiB",
        "--plan",
        "--json",
    ];
    for (name, extra) in [
        ("train_mlp", &["--hidden", "64,64"][..]),
        (
            "train_gpt",
            &[
                "--text", &text, "--layers", "2", "--dim", "32", "--heads", "2",
            ][..],
        ),
    ] {
        let mut args = strings(extra);
        args.extend(strings(&fit3));
        let out = run_ok(
            mpirun(name, &args, &[]),
            &format!("{name} --zero 3 --fit auto"),
        );
        assert!(
            out.lines()
                .any(|l| l.contains("ZeRO stage 3, micro-batch") && l.ends_with(" fits")),
            "{name}: stage 3's ladder:\n{out}"
        );
        assert_eq!(
            out.matches("ZeRO stage 3, training on its share").count(),
            2,
            "{name}: both ranks at stage 3:\n{out}"
        );
    }
    let mut args = strings(&["--hidden", "64,64", "--prune", "0.5"]);
    args.extend(strings(&fit3));
    let out = mpirun("train_mlp", &args, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "--prune ran at stage 3:\n{err}");
    assert!(
        err.contains("--prune is not built yet at ZeRO stage 3"),
        "not the refusal:\n{err}"
    );
    assert!(!err.contains("adapter"), "device work first:\n{err}");
    // One process holds every shard: the same flags plan there.
    let mut one = Command::new(example("train_mlp"));
    one.args(strings(&["--hidden", "64,64"])).args(fit3);
    run_ok(one, "train_mlp --zero 3 --fit auto, one process");
}

/// The same for the residual MLP defined in custom_model: the digits' last batch of 29 gives
/// uneven shares (15 and 14); dropout 0, since each rank draws its own masks. Stages 0 to 3
/// (at 3 its block an `nn::Unit` sharded over the ranks).
#[test]
fn custom_model_on_two_ranks_gives_the_weights_of_one_process() {
    let args = strings(&[
        "--dataset",
        "digits",
        "--width",
        "32",
        "--blocks",
        "1",
        "--dropout",
        "0",
        "--epochs",
        "1",
        "--batch-size",
        "64",
        "--seed",
        "3",
    ]);
    two_ranks_match_one_process("custom_model", &args, &[], &[0, 1, 2, 3]);
}

/// The same for train_gpt on a short text: clipping, an evaluation and a checkpoint mid-run
/// (rank 0 writes, every rank joins), and the sample at the end. The key bias (the middle third of qkv.bias) has a
/// zero gradient, softmax ignoring what all scores of a row share, so it is left out. Both
/// runs accumulate two micro-batches of 4 (split among the ranks).
#[test]
fn train_gpt_on_two_ranks_gives_the_weights_of_one_process() {
    let tmp = TempDir::new("gpt-text");
    let text = tmp.0.join("text.txt");
    let line = "to be, or not to be, that is the question: whether 'tis nobler in the mind. ";
    std::fs::write(&text, line.repeat(30)).unwrap();
    let text = text.display().to_string();
    let args = strings(&[
        "--text",
        &text,
        "--steps",
        "6",
        "--layers",
        "1",
        "--dim",
        "32",
        "--heads",
        "2",
        "--context",
        "16",
        "--batch-size",
        "4",
        "--accum-steps",
        "2",
        "--eval-every",
        "3",
        "--sample-len",
        "20",
    ]);
    // dim 32: q, k and v biases are elements 0..32, 32..64 and 64..96.
    let key_bias = [("model.blocks.0.attn.qkv.bias", 32..64)];
    // At 4 ranks each rank's micro-batch is one sample (16 rows): its weight gradients are one
    // 16-row block of one process's, with the same bits (`MatmulOptions::k_blocks`), and only the
    // additions of the blocks round differently.
    let jobs = two_ranks_match_one_process("train_gpt", &args, &key_bias, &[0, 1, 2, 3]);
    // Stage 3's plan: every rank's planned peak, and the collectives as its run made them.
    let (_, _, run) = jobs.iter().find(|(np, s, _)| (*np, *s) == (2, 3)).unwrap();
    let mut plan = args.clone();
    plan.extend(strings(&["--zero", "3", "--plan", "--json"]));
    let text = run_ok(mpirun("train_gpt", &plan, &[]), "train_gpt --zero 3 --plan");
    check_stage_3_plan(&text, run);
}

/// A stage 3 job's `--plan --json` (`plan`) against its run's JSON (`run`, 2 ranks): a planned
/// peak per rank, the units' all-gathers and reduce-scatters among the collectives, and the
/// bytes sent per step and each rank's planned state bytes those of the run.
fn check_stage_3_plan(plan: &str, run: &str) {
    let line = |t: &str, key: &str| {
        let l = t
            .lines()
            .find(|l| l.starts_with('{') && l.contains(key))
            .unwrap_or_else(|| panic!("no JSON line with {key}:\n{t}"));
        serde_json::from_str::<serde_json::Value>(l).unwrap()
    };
    let p = line(plan, "\"per_rank\"")["per_rank"].clone();
    let r = line(run, "\"rank_weight_hashes\"");
    eprintln!("stage 3 plan: {p}\nrun: {r}");
    assert_eq!(p["zero_stage"], 3);
    let ranks = p["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    let kinds: Vec<String> = p["collectives"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["what"].as_str().unwrap().starts_with("units"))
        .map(|c| format!("{} {}", c["kind"], c["buffer_bytes"]))
        .collect();
    assert_eq!(kinds.len(), 2, "the units' collectives: {p}");
    assert!(!kinds.iter().any(|k| k.ends_with(" 0")), "{kinds:?}");
    assert_eq!(
        p["bytes_sent_per_step"], r["bytes_sent_per_step"],
        "planned and run bytes per step"
    );
    assert_eq!(p["collectives"], r["collectives"]);
    for (planned, run) in ranks
        .iter()
        .zip(r["per_rank_state_bytes"].as_array().unwrap())
    {
        assert!(planned["peak"].as_u64().unwrap() > 0);
        let state = ["parameters", "gradients", "optimizer_state"]
            .iter()
            .map(|k| planned[*k].as_u64().unwrap())
            .sum::<u64>();
        assert_eq!(state, run["planned"].as_u64().unwrap(), "{planned} {run}");
    }
}

/// Sends `sig` to `pid` through the shell's own `kill` (no procps needed); whether it was sent.
fn kill(sig: &str, pid: u32) -> bool {
    Command::new("sh")
        .args(["-c", &format!("kill {sig} {pid} 2>/dev/null")])
        .status()
        .is_ok_and(|s| s.success())
}

/// A running 2-rank job: mpirun, the ranks' pids (from their start-up line) and everything
/// the job wrote to stderr so far.
struct Job {
    child: Child,
    pids: Vec<u32>,
    lines: mpsc::Receiver<String>,
    log: Vec<String>,
}

impl Job {
    /// train_mlp at stages 0-2; custom_model (one block, an `nn::Unit`) at stage 3, whose
    /// units train_mlp's MLP does not have.
    fn start(env: &[(&str, &str)], stage: u8) -> Job {
        let (name, mut args) = match stage {
            3 => (
                "custom_model",
                strings(&[
                    "--dataset",
                    "digits",
                    "--width",
                    "16",
                    "--blocks",
                    "1",
                    "--epochs",
                    "100000",
                    "--batch-size",
                    "64",
                    "--seed",
                    "5",
                ]),
            ),
            _ => ("train_mlp", flags(100_000)),
        };
        args.extend(["--zero".into(), stage.to_string()]);
        let mut child = mpirun(name, &args, env)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("mpirun starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut job = Job {
            child,
            pids: vec![0; 2],
            lines,
            log: Vec::new(),
        };
        // "rank R of 2: pid P, ..." once a rank has joined training.
        let deadline = Instant::now() + Duration::from_secs(300);
        while job.pids.contains(&0) {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = job
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("the ranks did not start:\n{}", job.log.join("\n")));
            if let Some(rest) = line.strip_prefix("rank ") {
                let parsed = (|| {
                    let rank: usize = rest.split(' ').next()?.parse().ok()?;
                    let pid = rest.split("pid ").nth(1)?.split(',').next()?.parse().ok()?;
                    Some((rank, pid))
                })();
                let (rank, pid) = parsed.unwrap_or_else(|| {
                    panic!("not a start-up line: {line:?}\n{}", job.log.join("\n"))
                });
                job.pids[rank] = pid;
            }
            job.log.push(line);
        }
        job
    }

    fn signal(&self, sig: &str, rank: usize) {
        assert!(kill(sig, self.pids[rank]), "kill {sig} {}", self.pids[rank]);
    }

    /// Waits up to `limit` for mpirun to end; its status and the whole stderr.
    fn wait(&mut self, limit: Duration) -> (Option<std::process::ExitStatus>, String) {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break Some(s);
            }
            if Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        // The reader ends when every process holding the pipe is gone.
        let drain = Instant::now() + Duration::from_secs(5);
        while let Ok(l) = self
            .lines
            .recv_timeout(drain.saturating_duration_since(Instant::now()))
        {
            self.log.push(l);
        }
        (status, self.log.join("\n"))
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Nothing outlives the test, whatever it found.
        for pid in &self.pids {
            if *pid != 0 {
                kill("-KILL", *pid);
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// SIGKILL of rank 1 mid-run: the job ends with an error within 30 s and the log names the
/// rank, at every ZeRO stage.
#[test]
fn a_killed_rank_stops_the_other_within_30_s() {
    let _one = one_job_at_a_time();
    for stage in 0..=3 {
        let mut job = Job::start(&[], stage);
        std::thread::sleep(Duration::from_secs(2));
        let killed = Instant::now();
        job.signal("-KILL", 1);
        let before = job.log.len();
        let (status, log) = job.wait(STOP_WITHIN);
        let after = job.log[before..].join("\n");
        let status = status.unwrap_or_else(|| {
            panic!(
                "--zero {stage}: the job still ran {STOP_WITHIN:?} after rank 1 was killed:\n{log}"
            )
        });
        assert!(
            !status.success(),
            "--zero {stage}: the job must fail:\n{log}"
        );
        // Said after the kill (the start-up lines name every rank too).
        assert!(
            after.contains("rank 1"),
            "--zero {stage}: the log names the killed rank after the kill:\n{log}"
        );
        eprintln!(
            "--zero {stage}: the job ended {:?} after the kill ({status}):\n{log}",
            killed.elapsed()
        );
    }
}

/// SIGSTOP of rank 1 mid-run (alive, but never answering): rank 0's collective times out, it
/// says so and aborts every rank, within 30 s, at every ZeRO stage.
#[test]
fn a_stopped_rank_times_out_and_stops_every_rank() {
    let _one = one_job_at_a_time();
    for stage in 0..=3 {
        let mut job = Job::start(&[("FITGRAD_DIST_TIMEOUT", "5")], stage);
        std::thread::sleep(Duration::from_secs(2));
        let stopped = Instant::now();
        job.signal("-STOP", 1);
        let (status, log) = job.wait(STOP_WITHIN);
        let status = status.unwrap_or_else(|| {
            panic!("--zero {stage}: the job still ran {STOP_WITHIN:?} after rank 1 was stopped:\n{log}")
        });
        assert!(
            !status.success(),
            "--zero {stage}: the job must fail:\n{log}"
        );
        assert!(
            log.contains("rank 0 of 2") && log.contains("did not complete within 5 s"),
            "--zero {stage}: rank 0 must say which collective timed out:\n{log}"
        );
        eprintln!(
            "--zero {stage}: the job ended {:?} after the stop ({status}):\n{log}",
            stopped.elapsed()
        );
    }
}

/// The largest `peak_reserved` over the ranks of a `--plan --json` job's `per_rank`.
fn per_rank_peak_reserved(text: &str) -> (u8, u64) {
    let line = text
        .lines()
        .find(|l| l.starts_with('{') && l.contains("\"per_rank\""))
        .unwrap_or_else(|| panic!("no plan JSON with per_rank:\n{text}"));
    let j: serde_json::Value = serde_json::from_str(line).unwrap();
    let r = &j["per_rank"];
    let stage = r["zero_stage"].as_u64().unwrap() as u8;
    let peak = r["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["peak_reserved"].as_u64().unwrap())
        .max()
        .unwrap();
    (stage, peak)
}

/// `--fit auto` under MPI without `--zero` takes the first stage that fits on every rank. The
/// budget is one byte under the smallest that stage 0 works with at this model's rank share
/// (named by stage 0's own error; the planner's minimums are exact), on a model whose
/// parameters, gradients and AdamW state outweigh its activations: stage 0 cannot fit, a
/// later stage does, both ranks take it and its planned step stays within the budget. Plans
/// only: nothing trains.
#[test]
fn fit_auto_under_mpi_takes_the_first_stage_that_fits() {
    let _one = one_job_at_a_time();
    let base = strings(&["--hidden", "1024,1024", "--batch-size", "16", "--seed", "5"]);
    // One process's planned step: a budget one process works with.
    let mut one = Command::new(example("train_mlp"));
    one.args(&base).args(["--plan", "--json"]);
    let text = run_ok(one, "one process's plan");
    let line = text.lines().find(|l| l.starts_with('{')).unwrap();
    let single: serde_json::Value = serde_json::from_str(line).unwrap();
    let roomy = single["peak_reserved"].as_u64().unwrap().to_string();
    // Stage 0 at the ranks' shares under it (the all-reduce buffer comes on top): refused,
    // naming its smallest budget.
    let mut a = base.clone();
    a.extend(strings(&[
        "--zero",
        "0",
        "--memory-budget",
        &roomy,
        "--plan",
    ]));
    let out = mpirun("train_mlp", &a, &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "stage 0 fits {roomy} bytes:\n{err}");
    let minimum: u64 = err
        .split("needs at least ")
        .nth(1)
        .and_then(|r| r.split('(').nth(1))
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no smallest budget in:\n{err}"));
    let budget = minimum - 1;
    let mut a = base.clone();
    a.extend(strings(&[
        "--fit",
        "auto",
        "--memory-budget",
        &budget.to_string(),
        "--plan",
        "--json",
    ]));
    let text = run_ok(mpirun("train_mlp", &a, &[]), "fit auto over the stages");
    eprintln!("{text}");
    let (chosen, peak) = per_rank_peak_reserved(&text);
    assert!(chosen >= 1, "stage 0 cannot fit {budget} bytes:\n{text}");
    assert!(
        peak <= budget,
        "the chosen plan holds {peak} bytes over {budget}"
    );
    for stage in 0..chosen {
        let line = text
            .lines()
            .find(|l| l.contains(&format!("ZeRO stage {stage},")))
            .unwrap_or_else(|| panic!("stage {stage} is a candidate:\n{text}"));
        assert!(line.ends_with("does not fit"), "{line}");
    }
    let line = text
        .lines()
        .find(|l| l.contains(&format!("ZeRO stage {chosen},")))
        .unwrap();
    assert!(line.ends_with(" fits"), "{line}");
    assert_eq!(
        text.matches("training on its share").count(),
        2,
        "both ranks joined at the stage chosen:\n{text}"
    );
}

/// Ranks started with different flags (an MPMD mpirun: `--epochs 1` on rank 0, `--epochs 2`
/// on rank 1) end together, before any device work, each with one message naming the flag,
/// not a corrupted heap or a silent exit (issue 43 item 3).
#[test]
fn ranks_started_with_different_flags_end_naming_the_flag() {
    let _one = one_job_at_a_time();
    let exe = example("train_mlp");
    let rank = |epochs: &str| {
        let exe = exe.display().to_string();
        strings(&["-np", "1", &exe, "--epochs", epochs, "--distributed", "mpi"])
    };
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe"])
        .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
        .args(rank("1"))
        .arg(":")
        .args(rank("2"));
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "ran:\n{err}");
    for r in 0..2 {
        let line = format!("rank {r}: --epochs differs between the ranks");
        assert!(
            err.contains(&line),
            "rank {r} did not name --epochs:\n{err}"
        );
    }
    assert!(!err.contains("adapter") && !err.contains("malloc"), "{err}");
}
