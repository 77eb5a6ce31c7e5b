//! How a run ends: the planned peaks beside the measured ones, the report's files, and the
//! JSON fields every command's `--json` line shares.

use super::build::Joined;
use crate::distributed::Job;
use crate::error::Bytes;
use crate::nn::Module;
use crate::optim::quant8::f32_adamw_state_bytes;
use crate::report::TrainingReport;
use crate::train::{MemorySummary, Plan, RunPlan, Trainer};
use crate::{Device, Result};
use serde_json::Value;
use std::path::Path;

/// `planned peak in use P / measured M`: the step's plan beside training's measured peak.
pub fn print_step_peak(plan: &Plan, summary: &MemorySummary) {
    println!(
        "planned peak in use {} / measured {}",
        Bytes(plan.peak),
        Bytes(summary.stats.peak_bytes_in_use)
    );
}

/// `peak in use: planned P / measured M (+x%), peak reached at OP`: the step's plan beside
/// training's measured peak, with the difference and the op where the plan peaks.
pub fn print_step_peak_detail(plan: &Plan, measured: u64) {
    println!(
        "peak in use: planned {} / measured {} ({:+.2}%), peak reached at {}",
        Bytes(plan.peak),
        Bytes(measured),
        100.0 * (plan.peak as f64 / measured.max(1) as f64 - 1.0),
        plan.peak_op.as_deref().unwrap_or("?")
    );
}

/// `whole run: peak reserved planned P / measured M`: the whole run's peak, evaluation
/// included, beside its plan.
pub fn print_whole_run(run: &RunPlan, device: &Device) {
    println!(
        "whole run: peak reserved planned {} / measured {}",
        Bytes(run.peak_reserved),
        Bytes(device.memory_stats().peak_bytes_reserved)
    );
}

/// Writes the report as `--report` (HTML) and `--report-json` ask, saying where.
pub fn write_reports(
    report: &TrainingReport,
    html: Option<&Path>,
    json: Option<&Path>,
) -> Result<()> {
    if let Some(path) = html {
        report.write_html(path)?;
        println!("report: {}", path.display());
    }
    if let Some(path) = json {
        report.write_json(path)?;
        println!("report data: {}", path.display());
    }
    Ok(())
}

/// Each rank's weights hashed, under MPI (the report shows whether the replicas hold the same
/// bits); `None` for one process. Call it on every rank at the same point.
pub fn rank_hashes(dist: &Job, model: &dyn Module) -> Result<Option<Vec<u64>>> {
    match dist.size() > 1 {
        true => Ok(Some(dist.weight_hashes(model)?)),
        false => Ok(None),
    }
}

/// `j`'s fields with `more`'s added (both JSON objects).
pub fn extend(mut j: Value, more: Value) -> Value {
    if let (Value::Object(a), Value::Object(b)) = (&mut j, more) {
        a.extend(b);
    }
    j
}

/// The `--json` fields every training command shares: the adapter, the micro-batch, the
/// plan of the step and of the whole run beside the measured peaks, the state's bytes and
/// where it lives (`offload`: the flag), steps and skipped steps.
pub fn memory_json<M: Module>(
    trainer: &Trainer<M>,
    run: &RunPlan,
    summary: &MemorySummary,
    offload: &str,
) -> Value {
    let info = trainer.device().info();
    let measured = trainer.device().memory_stats();
    let plan = &run.step;
    serde_json::json!({
        "adapter": info.adapter.name,
        "backend": info.adapter.backend,
        "micro_batch": trainer.micro_batch(),
        "planned_peak_bytes": plan.peak,
        "planned_host_bytes": plan.host_bytes,
        "planned_bytes_moved": plan.bytes_moved,
        "planned_peak_reserved": plan.peak_reserved,
        "planned_run_peak_reserved": run.peak_reserved,
        "peak_bytes": measured.peak_bytes_reserved,
        "peak_bytes_in_use": measured.peak_bytes_in_use,
        "step_peak_bytes": summary.stats.peak_bytes_reserved,
        "buffers_created": measured.buffers_created,
        "optimizer_state_bytes": summary.optimizer_state_bytes,
        "offload": offload,
        "host_bytes": summary.host_bytes,
        "optimizer_state_bytes_f32": f32_adamw_state_bytes(&trainer.model.parameters()),
        "skipped_steps": trainer.scaler().map_or(0, |s| s.skipped_steps()),
        "steps": trainer.steps(),
    })
}

/// Adds what the job knows to `j`: the exchange's statistics and traffic under MPI, the ZeRO
/// stage, every rank's memory at start, and each rank's weight hash ([`rank_hashes`]).
pub fn add_job_json<M: Module>(
    j: &mut Value,
    dist: &Job,
    job: &Joined,
    trainer: &Trainer<M>,
    hashes: Option<Vec<u64>>,
) -> Result<()> {
    dist.add_to_json(j, job.all_reduce.as_ref());
    dist.add_traffic_to_json(j, trainer, job.zero)?;
    j["zero_stage"] = job.zero.number().into();
    j["start"] = job.start_memory.clone();
    j["rank_weight_hashes"] = hashes.into();
    Ok(())
}

/// The pruner's sparsity by layer, printed (`pruned to S% sparsity:` and the table); the
/// whole model's sparsity for the JSON.
pub fn print_sparsity(pruner: Option<&crate::compress::Pruner>) -> Result<Option<f64>> {
    let Some(p) = pruner else {
        return Ok(None);
    };
    let report = p.report()?;
    println!(
        "\npruned to {:.2}% sparsity:\n{report}",
        100.0 * report.sparsity()
    );
    Ok(Some(report.sparsity()))
}

/// What `--fit auto` chose, as the JSON line's `fit` (null without it): the micro-batch,
/// checkpointing, precision, where the state lives, and how many candidates were planned.
pub fn fit_json(choice: Option<&crate::train::FitChoice>) -> Value {
    choice
        .map(|c| {
            serde_json::json!({
                "micro_batch": c.micro_batch,
                "checkpointing": c.checkpointing,
                "precision": c.precision.name(),
                "residence": format!("{:?}", c.residence),
                "candidates_planned": c.candidates.len(),
            })
        })
        .into()
}
