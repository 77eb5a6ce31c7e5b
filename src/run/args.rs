//! The flags training commands share, defined once for clap (feature `cli`): a command
//! flattens the groups it takes into its own flags (`#[command(flatten)]`), so each flag has
//! one name, one meaning and one help text in every command.

use std::path::PathBuf;

/// What every training command takes: the adapter, the budget, the plan, the JSON line, the
/// accumulation, the precision and the seed.
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    /// Substring of the adapter name to use.
    #[arg(long)]
    pub adapter: Option<String>,
    /// Hard limit on device memory (e.g. 48MiB). The micro-batch is chosen to fit, with
    /// gradient accumulation keeping the effective batch.
    #[arg(long)]
    pub memory_budget: Option<String>,
    /// Batches whose gradients add up before each optimizer step.
    #[arg(long, default_value_t = 1)]
    pub accum_steps: usize,
    /// f32, f16 (where the command takes it: f16 weights) or mixed (f32 master weights and
    /// optimizer state, f16 activations and matmuls, dynamic loss scaling).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Seeds everything random: the weights, the data's split and order, dropout,
    /// augmentation and sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the planned peak memory of a training step, by category, and exit.
    #[arg(long)]
    pub plan: bool,
    /// End stdout with one JSON object describing the run.
    #[arg(long)]
    pub json: bool,
}

/// `--fit auto` and the checkpointing it chooses.
#[derive(clap::Args, Debug, Clone)]
pub struct FitArgs {
    /// `auto`: let --memory-budget choose the micro-batch, activation checkpointing and mixed
    /// precision (cheapest first), and print each planned candidate.
    #[arg(long)]
    pub fit: Option<String>,
    /// Recompute activations in backward instead of keeping them (what each model can
    /// recompute: gelu layers, each block's halves, each residual block).
    #[arg(long)]
    pub checkpoint_activations: bool,
}

/// A run's checkpoints and its memory reserved up front.
#[derive(clap::Args, Debug, Clone)]
pub struct CheckpointArgs {
    /// Reserve the planned peak before training, so no buffer is created afterwards.
    #[arg(long)]
    pub prealloc: bool,
    /// Save a checkpoint (safetensors, written atomically) as the run goes: after every
    /// epoch, or at every evaluation and at the end.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Resume from a checkpoint written by --save (same model and training flags), or from a
    /// sharded checkpoint's folder (--save-sharded), on any number of ranks.
    #[arg(long)]
    pub resume: Option<PathBuf>,
}

/// The run's report.
#[derive(clap::Args, Debug, Clone)]
pub struct ReportArgs {
    /// Write an HTML report (memory timeline of a step, loss / accuracy / throughput curves,
    /// memory table) to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Write the report's data as JSON to this file.
    #[arg(long)]
    pub report_json: Option<PathBuf>,
}

impl FitArgs {
    /// Whether `--fit auto` is asked for ([`parse_fit`](super::parse_fit)): with a `budget`,
    /// without `--checkpoint-activations` (fit auto chooses `checkpointing` itself).
    pub fn auto(
        &self,
        op: &'static str,
        budget: Option<u64>,
        checkpointing: &str,
    ) -> crate::Result<bool> {
        let fit = self.fit.as_deref();
        super::parse_fit(op, fit, budget, self.checkpoint_activations, checkpointing)
    }
}

impl ReportArgs {
    /// Whether a report is written.
    pub fn any(&self) -> bool {
        self.report.is_some() || self.report_json.is_some()
    }
}

/// Data-parallel training over MPI and its ZeRO stage.
#[derive(clap::Args, Debug, Clone)]
pub struct JobArgs {
    /// `mpi`: this process is one rank of data-parallel training started by mpirun (built with
    /// `--features mpi`). The batch flags give the whole job's batch, split across the ranks;
    /// rank 0 prints, evaluates and saves. Without dropout the weights are those of one
    /// process with the same flags.
    #[arg(long)]
    pub distributed: Option<String>,
    /// ZeRO stage under --distributed mpi: 0 replicates everything (plain data parallelism),
    /// 1 keeps each rank's shard of the optimizer state only, 2 also its shard of the summed
    /// gradients, 3 also its shard of each unit's parameters (gathered around its forward and
    /// backward); the weights are those of stage 0. One process holds every shard, so the
    /// stage changes nothing there.
    #[arg(long)]
    pub zero: Option<String>,
}

/// The flags of a training command with checkpoints, a report and data-parallel ranks: the
/// groups above, together.
#[derive(clap::Args, Debug, Clone)]
pub struct TrainArgs {
    /// The adapter, the budget, the plan, the JSON line, the accumulation.
    #[command(flatten)]
    pub run: RunArgs,
    /// `--prealloc`, `--save`, `--resume`.
    #[command(flatten)]
    pub checkpoint: CheckpointArgs,
    /// `--report`, `--report-json`.
    #[command(flatten)]
    pub report: ReportArgs,
    /// `--distributed`, `--zero`.
    #[command(flatten)]
    pub job: JobArgs,
}

/// The command's flags from the command line: `Err` with the exit code when they are wrong
/// (1, clap's message on stderr) or when `--help` or `--version` printed (0).
pub fn parse<A: clap::Parser>() -> Result<A, std::process::ExitCode> {
    try_parse_from::<A>(std::env::args_os().collect()).map_err(|e| {
        if e.use_stderr() {
            eprint!("{e}");
            return std::process::ExitCode::FAILURE;
        }
        let _ = e.print();
        std::process::ExitCode::SUCCESS
    })
}

/// The command's flags from `argv`, as [`parse`] reads them: a negative number given to a
/// flag (which clap takes for an unknown flag, "unexpected argument '-1'") is refused naming
/// the flag and saying it takes a positive number.
pub fn try_parse_from<A: clap::Parser>(argv: Vec<std::ffi::OsString>) -> Result<A, clap::Error> {
    A::try_parse_from(&argv).map_err(|e| negative_number(e, &argv))
}

/// clap's "unexpected argument '-N'" for a negative number `-N` after a flag, as that flag's
/// error; any other error as it is.
fn negative_number(error: clap::Error, argv: &[std::ffi::OsString]) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if error.kind() != ErrorKind::UnknownArgument {
        return error;
    }
    let Some(ContextValue::String(given)) = error.get(ContextKind::InvalidArg) else {
        return error;
    };
    if !given.starts_with('-') || given[1..].parse::<f64>().is_err() {
        return error;
    }
    let flag = argv
        .iter()
        .position(|a| a.to_str() == Some(given.as_str()))
        .and_then(|i| i.checked_sub(1))
        .and_then(|i| argv[i].to_str())
        .filter(|f| f.starts_with("--"));
    let msg = match flag {
        Some(f) => format!("{f} takes a positive number, got {given}\n"),
        None => format!("{given}: numbers given to flags are positive\n"),
    };
    clap::Error::raw(ErrorKind::ValueValidation, msg)
}

impl TrainArgs {
    /// `files` with what these flags read and write: the checkpoint resumed from, and the
    /// checkpoint, report and report data written.
    pub fn files<'a>(&'a self, files: super::Files<'a>) -> super::Files<'a> {
        files
            .input("--resume", self.checkpoint.resume.as_deref())
            .output("--save", self.checkpoint.save.as_deref())
            .output("--report", self.report.report.as_deref())
            .output("--report-json", self.report.report_json.as_deref())
    }
}

/// Every flag of command `A` as `argv` resolves it (given, or its default), as `(flag,
/// value)` pairs in the command's order, for [`agree_flags`]: a value naming a file gets its
/// size beside it (the data a rank reads, not only its name). What only rank 0 writes
/// (`--save`, `--report`, `--report-json`), the adapter each node picks and the job flag
/// itself are left out.
pub fn flag_settings<A: clap::CommandFactory>(
    argv: impl IntoIterator<Item = std::ffi::OsString>,
) -> Result<Vec<(String, String)>, clap::Error> {
    let matches = A::command().try_get_matches_from(argv)?;
    // The adapter picked on each node need not match; it changes no collective.
    let own = ["save", "report", "report-json", "distributed", "adapter"];
    let mut settings = Vec::new();
    for arg in A::command().get_arguments() {
        let Some(long) = arg.get_long().filter(|l| !own.contains(l)) else {
            continue;
        };
        let Ok(Some(raw)) = matches.try_get_raw(arg.get_id().as_str()) else {
            continue;
        };
        let values: Vec<String> = raw
            .map(|v| {
                let v = v.to_string_lossy().into_owned();
                match std::fs::metadata(&v) {
                    Ok(m) if m.is_file() => format!("{v} ({} bytes)", m.len()),
                    _ => v,
                }
            })
            .collect();
        settings.push((format!("--{long}"), values.join(" ")));
    }
    Ok(settings)
}

/// Agrees, before any other collective, on every flag of command `A` as this rank's command
/// line resolves it ([`flag_settings`], then [`Job::agree_settings`](crate::distributed::Job::agree_settings)):
/// ranks started with different steps, batch, accumulation, model, data, precision, ZeRO
/// stage, seed, budget or any other flag all end with one message naming the first flag that
/// differs. One process agrees with itself.
pub fn agree_flags<A: clap::CommandFactory>(dist: &crate::distributed::Job) -> crate::Result<()> {
    if dist.size() < 2 {
        return Ok(());
    }
    let settings =
        flag_settings::<A>(std::env::args_os()).map_err(|e| crate::Error::InvalidArgument {
            op: "agree_flags",
            reason: e.to_string(),
        })?;
    let pairs: Vec<(&str, String)> = settings
        .iter()
        .map(|(f, v)| (f.as_str(), v.clone()))
        .collect();
    dist.agree_settings(&pairs)
}
