//! The page of a [`TrainingReport`]: the memory of one step (stacked by role over its ops,
//! the peak marked with its op, the planner's prediction beside it, the budget), loss,
//! accuracy and throughput, what the trainer changed, the memory table, adapter and settings.

use super::html::Page;
use super::svg::{Axis, LineChart, PALETTE};
use super::training::{StepMemory, TrainingReport};
use crate::memory::{Category, OpPoint, Role, RoleBytes, Timeline};
use crate::{Bytes, Result};
use std::path::Path;

impl TrainingReport {
    /// The report as one self-contained HTML page.
    pub fn to_html(&self) -> String {
        render(self)
    }

    /// Writes [`TrainingReport::to_html`] to `path`, atomically.
    pub fn write_html(&self, path: &Path) -> Result<()> {
        crate::write_atomic(path, self.to_html().as_bytes())
    }
}

/// Most points a chart over the ops draws; longer steps are reduced to the highest point of
/// each run of ops (so the peak stays).
const MAX_POINTS: usize = 2000;

/// The colour of each role in the stacked chart.
fn role_color(r: Role) -> &'static str {
    match r {
        Role::Parameter => "#0072b2",
        Role::Gradient => "#56b4e9",
        Role::OptimizerState => "#009e73",
        Role::Activation => "#e69f00",
        Role::Workspace => "#999999",
        Role::Staging => "#cc79a7",
        Role::Communication => "#f0e442",
    }
}

/// Bottom to top: what lasts the whole run first (so those bands stay flat), then what a step
/// makes and frees.
const STACK: [Role; 7] = [
    Role::Parameter,
    Role::OptimizerState,
    Role::Gradient,
    Role::Communication,
    Role::Activation,
    Role::Workspace,
    Role::Staging,
];

const PEAK: &str = "#d55e00";
const PLANNED: &str = "#222222";
const BUDGET: &str = "#c00000";

/// The page.
fn render(r: &TrainingReport) -> String {
    let mut page = Page::new(format!("fitgrad report: {}", r.title));
    page.heading(1, &r.title);
    let adapter = r
        .adapter
        .iter()
        .find(|(k, _)| k == "name")
        .map_or("?", |(_, v)| v.as_str());
    page.subtitle(&format!(
        "fitgrad {} on {adapter}{}",
        r.fitgrad_version,
        summary_line(r)
    ));

    page.heading(2, "Memory of one training step");
    match &r.step_memory {
        Some(m) => memory_section(&mut page, r, m),
        None => {
            page.paragraph("No step was recorded (the run had fewer than two steps, or none ran).");
        }
    }

    page.heading(2, "Training");
    training_section(&mut page, r);

    page.heading(2, "What the trainer changed");
    changes_section(&mut page, r);

    page.heading(2, "Memory table");
    memory_table(&mut page, r);

    page.heading(2, "Adapter");
    page.key_values(&r.adapter);
    page.heading(2, "Settings");
    page.key_values(&r.settings);
    if !r.results.is_empty() {
        page.heading(2, "Results");
        page.key_values(&r.results);
    }
    page.finish()
}

/// ", peak 1.5 MiB, 20 epochs, test accuracy 97%": the headline figures.
fn summary_line(r: &TrainingReport) -> String {
    let mut parts = Vec::new();
    if let Some(m) = &r.step_memory {
        parts.push(format!("step peak {}", Bytes(m.measured.peak())));
    }
    if let Some(e) = r.epochs.last() {
        parts.push(format!("{} epochs, {} steps", r.epochs.len(), e.steps));
    } else if let Some(s) = r.steps.last() {
        parts.push(format!("{} steps", s.step));
    }
    if let Some(acc) = r.evals.iter().rev().find_map(|e| e.accuracy) {
        parts.push(format!("test accuracy {:.2}%", 100.0 * acc));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" · {}", parts.join(" · "))
    }
}

/// An op's name without its specialization (`matmul_sg_[("SG", 8), ...]_[F32, ...]` is
/// `matmul_sg`), with the phase of event `e`.
fn op_label(t: &Timeline, e: usize) -> Option<String> {
    let op = t.op_of(e)?;
    let short = op.split("_[").next().unwrap_or(op);
    Some(match t.phase_of(e) {
        Some(p) => format!("{short} ({p})"),
        None => short.to_string(),
    })
}

/// Points of a chart over the ops: (x, bytes by role, reserved), at most [`MAX_POINTS`].
fn op_series(t: &Timeline) -> Vec<(f64, RoleBytes, u64)> {
    let points: Vec<OpPoint> = t.per_op();
    // Reserved bytes at each point: those of its event, or the last known where it has none.
    let mut last = t.start_reserved;
    let reserved: Vec<u64> = points
        .iter()
        .map(|p| {
            if let Some(e) = p.event {
                last = t.events[e].reserved;
            }
            last
        })
        .collect();
    let per = points.len().div_ceil(MAX_POINTS).max(1);
    points
        .chunks(per)
        .zip(reserved.chunks(per))
        .enumerate()
        .map(|(k, (c, r))| {
            let best = c
                .iter()
                .max_by_key(|p| p.bytes.total())
                .expect("chunks are not empty");
            (
                (k * per) as f64,
                best.bytes,
                r.iter().copied().max().unwrap_or(0),
            )
        })
        .collect()
}

fn memory_section(page: &mut Page, r: &TrainingReport, m: &StepMemory) {
    let t = &m.measured;
    let series = op_series(t);
    let planned = op_series(&m.planned);
    let peak = t.peak();
    let peak_x = series
        .iter()
        .find(|p| p.1.total() == peak)
        .map_or(0.0, |p| p.0);
    let peak_event = t.peak_event();
    let peak_op = peak_event
        .and_then(|e| op_label(t, e))
        .unwrap_or_else(|| "the step's start".into());
    let op_index = peak_event.and_then(|e| t.events[e].op);
    let roles: Vec<Role> = STACK
        .into_iter()
        .filter(|&role| series.iter().any(|p| p.1.get(role) > 0))
        .collect();
    let xs: Vec<f64> = series.iter().map(|p| p.0).collect();
    let layers = roles
        .iter()
        .map(|&role| {
            (
                role.name().to_string(),
                role_color(role).to_string(),
                series.iter().map(|p| p.1.get(role) as f64).collect(),
            )
        })
        .collect();
    let mut chart = LineChart::new(format!(
        "Bytes in use during step {} by role, over its {} ops",
        m.step + 1,
        t.ops.len()
    ))
    .id("memory-timeline")
    .size(920.0, 400.0)
    .x_axis(
        Axis::number("op of the step (kernels, copies, uploads, readbacks, in order)").integer(),
    )
    .y_axis(Axis::bytes("bytes in use"));
    for (i, span) in t.phases().iter().enumerate() {
        chart = chart.band(&span.name, span.start as f64, span.end as f64, i % 2 == 0);
    }
    chart = chart.stacked(xs, layers, true).dashed_steps(
        "planned by the dry-run planner before the step ran",
        PLANNED,
        planned.iter().map(|p| (p.0, p.1.total() as f64)).collect(),
    );
    if let Some(b) = &r.budget {
        chart = chart
            .line(
                "reserved from the driver (what the budget limits)",
                PALETTE[3],
                series.iter().map(|p| (p.0, p.2 as f64)).collect(),
            )
            .hline(
                format!("budget {}", Bytes(b.budget)),
                BUDGET,
                b.budget as f64,
                false,
            );
    }
    let label = format!(
        "peak {} at {}{}",
        Bytes(peak),
        peak_op,
        op_index.map_or(String::new(), |i| format!(", op {}", i + 1))
    );
    chart = chart.point(label, PEAK, peak_x, peak as f64);
    page.chart(&chart.to_svg());

    let planned_peak = m.planned.peak();
    page.paragraph(&format!(
        "Peak in use {} at {} ({}). The dry-run planner, running the same step on the \
         device's planning mode before it ran, predicted {} ({:+.2}%), peak at {}.",
        Bytes(peak),
        peak_op,
        op_index.map_or("before any op".into(), |i| {
            let full = &t.ops[i];
            if full.contains("_[") {
                format!("op {} of {}, kernel {full}", i + 1, t.ops.len())
            } else {
                format!("op {} of {}", i + 1, t.ops.len())
            }
        }),
        Bytes(planned_peak),
        100.0 * (m.ratio() - 1.0),
        m.planned
            .peak_event()
            .and_then(|e| op_label(&m.planned, e))
            .unwrap_or_else(|| "?".into())
    ));
    page.note(
        "Each op's column is the highest bytes in use between the previous op and it (an op \
         allocates its outputs before it is recorded). Shaded bands are the step's phases. \
         Parameters, gradients and optimizer state stay for the whole run; activations rise \
         through the forward and fall through the backward.",
    );
    // Bytes by role at the peak: measured beside planned.
    let at_peak =
        |tl: &Timeline| -> RoleBytes { tl.peak_event().map_or(tl.start, |e| tl.replay()[e]) };
    let (mp, pp) = (at_peak(t), at_peak(&m.planned));
    let mut rows: Vec<Vec<String>> = Role::ALL
        .iter()
        .filter(|&&role| mp.get(role) > 0 || pp.get(role) > 0)
        .map(|&role| {
            vec![
                role.name().to_string(),
                Bytes(mp.get(role)).to_string(),
                Bytes(pp.get(role)).to_string(),
            ]
        })
        .collect();
    rows.push(vec![
        "total (peak in use)".into(),
        Bytes(peak).to_string(),
        Bytes(planned_peak).to_string(),
    ]);
    page.heading(3, "At the peak, by role");
    page.table(&["role", "measured", "planned"], &rows);
    if m.host_bytes > 0 || m.plan.host_bytes > 0 || m.bytes_moved > 0 || m.plan.bytes_moved > 0 {
        page.heading(3, "Host memory and transfers");
        page.table(
            &["", "measured", "planned"],
            &[
                vec![
                    "host memory (not in the device peak)".into(),
                    Bytes(m.host_bytes).to_string(),
                    Bytes(m.plan.host_bytes).to_string(),
                ],
                vec![
                    "moved per step (host ↔ device)".into(),
                    Bytes(m.bytes_moved).to_string(),
                    Bytes(m.plan.bytes_moved).to_string(),
                ],
            ],
        );
    }
}

fn training_section(page: &mut Page, r: &TrainingReport) {
    if r.steps.is_empty() && r.evals.is_empty() {
        page.paragraph("No step was logged.");
        return;
    }
    let mut loss = LineChart::new("Loss")
        .id("loss-curve")
        .x_axis(Axis::number("optimizer step").integer())
        .y_axis(Axis::number("loss (nats)"))
        .line(
            "training loss (mean since the previous point)",
            PALETTE[0],
            r.steps
                .iter()
                .map(|s| (s.step as f64, s.loss as f64))
                .collect(),
        );
    let mut splits: Vec<&str> = r.evals.iter().map(|e| e.split.as_str()).collect();
    splits.dedup();
    for (k, split) in splits.iter().enumerate() {
        loss = loss.dotted_line(
            format!("{split} loss"),
            PALETTE[1 + k % 3],
            r.evals
                .iter()
                .filter(|e| e.split == *split)
                .map(|e| (e.step as f64, e.loss as f64))
                .collect(),
        );
    }
    for e in &r.events {
        loss = loss.vline(e.to_string(), PEAK, e.step() as f64);
    }
    page.chart(&loss.to_svg());
    let acc: Vec<(f64, f64)> = r
        .evals
        .iter()
        .filter_map(|e| {
            e.accuracy
                .map(|a| (e.epoch.map_or(e.step, |ep| ep + 1) as f64, a as f64))
        })
        .collect();
    if !acc.is_empty() {
        let per_epoch = r.evals.iter().all(|e| e.epoch.is_some());
        let chart = LineChart::new("Test accuracy")
            .id("accuracy-curve")
            .size(920.0, 280.0)
            .x_axis(Axis::number(if per_epoch { "epoch" } else { "optimizer step" }).integer())
            .y_axis(Axis::percent("accuracy"))
            .dotted_line("test accuracy", PALETTE[2], acc);
        page.chart(&chart.to_svg());
    }
    let unit = &r.throughput_unit;
    let per_epoch: Vec<(f64, f64)> = r
        .epochs
        .iter()
        .filter_map(|e| e.throughput.map(|t| ((e.epoch + 1) as f64, t)))
        .collect();
    let chart = if per_epoch.is_empty() {
        LineChart::new(format!("Throughput ({unit})"))
            .x_axis(Axis::number("optimizer step").integer())
            .line(
                unit.clone(),
                PALETTE[4],
                r.steps
                    .iter()
                    .filter_map(|s| s.throughput.map(|t| (s.step as f64, t)))
                    .collect(),
            )
    } else {
        LineChart::new(format!("Throughput per epoch ({unit})"))
            .x_axis(Axis::number("epoch").integer())
            .dotted_line(unit.clone(), PALETTE[4], per_epoch)
    };
    page.chart(
        &chart
            .id("throughput")
            .size(920.0, 260.0)
            .y_axis(Axis::number(unit.clone()))
            .to_svg(),
    );
    page.note(
        "Throughput includes the first steps' kernel compilation (seconds on CPU adapters) and \
         the loss readbacks; evaluations are not counted.",
    );
}

fn changes_section(page: &mut Page, r: &TrainingReport) {
    match &r.budget {
        Some(b) => {
            page.paragraph(&format!(
                "Memory budget {}: {}.",
                Bytes(b.budget),
                b.strategy
            ));
            if let Some(fit) = &b.fit {
                let rows: Vec<Vec<String>> = fit
                    .candidates
                    .iter()
                    .map(|c| {
                        vec![
                            c.description.clone(),
                            Bytes(c.planned_peak).to_string(),
                            Bytes(c.planned_reserved).to_string(),
                            if c.fits { "fits" } else { "does not fit" }.into(),
                        ]
                    })
                    .collect();
                page.note("Every strategy --fit auto planned, cheapest first; the last is the one chosen.");
                page.table(
                    &[
                        "candidate",
                        "planned peak in use",
                        "planned peak reserved",
                        "budget",
                    ],
                    &rows,
                );
            }
        }
        None => {
            page.paragraph("No memory budget was given: nothing had to fit.");
        }
    }
    if r.events.is_empty() {
        page.paragraph(
            "During training the trainer changed nothing on its own: no out-of-memory retry, \
             no step skipped or scale changed by loss scaling.",
        );
    } else {
        let rows: Vec<Vec<String>> = r
            .events
            .iter()
            .map(|e| vec![e.step().to_string(), e.mechanism().into(), e.to_string()])
            .collect();
        page.table(&["step", "what stepped in", "what it changed"], &rows);
    }
}

fn memory_table(page: &mut Page, r: &TrainingReport) {
    let Some(s) = &r.memory else {
        page.paragraph("No statistics were recorded.");
        return;
    };
    let b = |v: u64| Bytes(v).to_string();
    let mut rows = vec![
        vec!["in use".into(), b(s.bytes_in_use), b(s.peak_bytes_in_use)],
        vec![
            "reserved".into(),
            b(s.bytes_reserved),
            b(s.peak_bytes_reserved),
        ],
        vec!["cached (free)".into(), b(s.bytes_cached()), String::new()],
        vec![
            "budget".into(),
            s.budget.map_or("none".into(), b),
            String::new(),
        ],
    ];
    for cat in Category::ALL {
        rows.push(vec![
            format!("  {}", cat.name()),
            b(s.in_use_by_category.get(cat)),
            b(s.peak_by_category.get(cat)),
        ]);
    }
    page.note("The arena at the end of training (peaks over the whole run).");
    page.table(&["memory", "now", "peak"], &rows);
    page.key_values(&[
        ("allocations".into(), s.allocations.to_string()),
        ("frees".into(), s.frees.to_string()),
        ("reuse hits".into(), s.reuse_hits.to_string()),
        ("buffers created".into(), s.buffers_created.to_string()),
        ("buffers released".into(), s.buffers_released.to_string()),
        ("live segments".into(), s.segments.to_string()),
        ("largest free block".into(), b(s.largest_free_block)),
        ("allocations refused".into(), s.oom_errors.to_string()),
    ]);
    if let Some(p) = &r.plan {
        page.heading(3, "Planned before training");
        page.table(
            &["", "planned"],
            &[
                vec!["parameters".into(), b(p.parameters)],
                vec!["gradients".into(), b(p.gradients)],
                vec!["optimizer state".into(), b(p.optimizer_state)],
                vec!["activations".into(), b(p.activations)],
                vec!["workspace".into(), b(p.workspace)],
                vec!["peak in use".into(), b(p.peak)],
                vec!["peak reserved".into(), b(p.peak_reserved)],
                vec!["host memory".into(), b(p.host_bytes)],
                vec!["moved per step".into(), b(p.bytes_moved)],
                vec![
                    "micro-batch".into(),
                    format!("{} ({} per step)", p.micro_batch, p.micro_batches),
                ],
                vec![
                    "peak reached at".into(),
                    p.peak_op.clone().unwrap_or_else(|| "?".into()),
                ],
            ],
        );
    }
}
