//! Optimizer offload (ZeRO-Offload's idea, `AdamW::offload`): f32 master weights and both
//! AdamW moments live in host memory; the device keeps only the parameters and their
//! gradients. Each step reads the gradients back, updates on the host with several threads,
//! and uploads the new parameters.
//!
//! **Overlap.** The tensors are cut into chunks of [`CHUNK`] elements, run as a three-stage
//! pipeline on scoped threads: a reader thread downloads the gradient of chunk k + 1 while the
//! host updates chunk k, and a writer thread uploads chunk k - 1's parameters meanwhile (two
//! chunks in flight at most per stage, bounded channels). A chunk's update is split over the
//! machine's cores.
//!
//! **The same numbers as the device.** [`adamw_host`] is the formula of
//! shaders/include/adamw.wgsl, in f32, from the same f64 coefficients
//! (`AdamWHyper::coefficients`), written as one loop over slices that LLVM vectorizes (sqrt and
//! division included). A device may contract `a * b + c` into one fused multiply-add, so the
//! two agree within a rounding or two (1e-6 relative), not bit for bit.
//!
//! **While planning** nothing is read or written: the device holds no optimizer state, so the
//! step allocates nothing there and the plan is exact without running it.

use super::{HostTensorState, OptimizerState};
use crate::kernels::optim::AdamWCoefficients;
use crate::{Error, Result, Tensor};
use std::sync::mpsc::sync_channel;

/// Elements per transfer chunk (1 MiB of f32): large enough that a transfer's fixed cost (a
/// submit and a map) is small beside its bytes, small enough to overlap.
pub const CHUNK: usize = 1 << 18;

/// Elements under which a chunk's update runs on one thread (a thread start costs more).
const PER_THREAD_MIN: usize = 1 << 15;

/// Host bytes per parameter element: the f32 master weight and the two f32 moments.
pub const HOST_BYTES_PER_ELEMENT: u64 = 12;

/// One parameter's state in host memory.
#[derive(Clone, Debug, Default)]
pub(crate) struct HostState {
    /// The f32 master weights: read from the device once, then uploaded after every update.
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

impl HostState {
    /// Zero moments; the master weights are read from the device at the first update.
    pub fn zeros(n: usize) -> HostState {
        HostState {
            master: Vec::new(),
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }
}

/// The moments of each parameter that has them, named `"{i}.{names[k]}"` (the names of
/// AdamW's device state, so a checkpoint is the same file either way).
pub(crate) fn host_state(
    params: &[Tensor],
    host: &[Option<HostState>],
    names: &[&str; 2],
) -> Vec<HostTensorState> {
    let mut out = Vec::new();
    for (i, st) in host.iter().enumerate() {
        if let Some(st) = st {
            for (name, values) in names.iter().zip([&st.m, &st.v]) {
                out.push(HostTensorState {
                    name: format!("{i}.{name}"),
                    dims: params[i].dims().to_vec(),
                    values: values.clone(),
                });
            }
        }
    }
    out
}

/// Host state from a loaded [`OptimizerState`]'s `host` entries, checked against `params`:
/// both moments of a parameter's shape, or none. Master weights are read again from the
/// parameters at the next update (the checkpoint's model is loaded into them).
pub(crate) fn load_host(
    op: &'static str,
    params: &[Tensor],
    names: &[&str; 2],
    state: OptimizerState,
) -> Result<Vec<Option<HostState>>> {
    let invalid = |reason: String| Error::InvalidArgument { op, reason };
    if state.param_steps.len() != params.len() {
        return Err(invalid(format!(
            "the state has steps for {} parameters, the optimizer has {}",
            state.param_steps.len(),
            params.len()
        )));
    }
    if let Some((k, _)) = state.tensors.first() {
        return Err(invalid(format!(
            "device state tensor '{k}' given to an optimizer with its state in host memory"
        )));
    }
    if let Some(c) = state.codes.first() {
        return Err(invalid(format!(
            "8-bit state '{}' given to an optimizer with f32 state in host memory",
            c.name
        )));
    }
    let mut slots: Vec<[Option<Vec<f32>>; 2]> = vec![Default::default(); params.len()];
    for h in state.host {
        let parsed = h.name.split_once('.').and_then(|(i, name)| {
            let i: usize = i.parse().ok()?;
            let j = names.iter().position(|n| *n == name)?;
            (i < params.len()).then_some((i, j))
        });
        let Some((i, j)) = parsed else {
            return Err(invalid(format!("unknown state tensor '{}'", h.name)));
        };
        if h.dims != params[i].dims() || h.values.len() != params[i].numel() {
            return Err(Error::Shape {
                op,
                lhs: params[i].dims().to_vec(),
                rhs: h.dims,
                reason: format!("state tensor '{}' does not fit its parameter", h.name),
            });
        }
        if slots[i][j].replace(h.values).is_some() {
            return Err(invalid(format!("state tensor '{}' given twice", h.name)));
        }
    }
    slots
        .into_iter()
        .enumerate()
        .map(|(i, [m, v])| match (m, v) {
            (Some(m), Some(v)) => Ok(Some(HostState {
                master: Vec::new(),
                m,
                v,
            })),
            (None, None) => Ok(None),
            _ => Err(invalid(format!("parameter {i} has only part of its state"))),
        })
        .collect()
}

/// AdamW on host slices of equal length, as shaders/include/adamw.wgsl computes it.
pub(crate) fn adamw_host(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: &AdamWCoefficients,
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let m1 = c.beta1 * m[i] + c.one_minus_beta1 * g[i];
        let v1 = c.beta2 * v[i] + c.one_minus_beta2 * g[i] * g[i];
        let denom = v1.sqrt() / c.bc2_sqrt + c.eps;
        p[i] = p[i] * c.decay - c.step_size * (m1 / denom);
        m[i] = m1;
        v[i] = v1;
    }
}

/// [`adamw_host`] split over `threads` scoped threads.
fn adamw_threads(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    c: &AdamWCoefficients,
    threads: usize,
) {
    let per = p.len().div_ceil(threads.max(1)).max(PER_THREAD_MIN);
    if per >= p.len() {
        return adamw_host(p, g, m, v, c);
    }
    std::thread::scope(|s| {
        for (((p, g), m), v) in p
            .chunks_mut(per)
            .zip(g.chunks(per))
            .zip(m.chunks_mut(per))
            .zip(v.chunks_mut(per))
        {
            s.spawn(move || adamw_host(p, g, m, v, c));
        }
    });
}

/// Where a parameter's gradient is at the update.
pub(crate) enum Grad<'a> {
    /// On the device (read back chunk by chunk).
    Device(&'a Tensor),
    /// Already summed in host memory (a streamed parameter, src/residency/).
    Host(Vec<f32>),
}

impl Grad<'_> {
    fn read(&self, a: usize, b: usize) -> Result<Vec<f32>> {
        match self {
            Grad::Device(g) => g.read_range_f32(a, b),
            Grad::Host(v) => Ok(v[a..b].to_vec()),
        }
    }
}

/// One parameter's part of an offloaded step.
pub(crate) struct Job<'a> {
    pub param: &'a Tensor,
    pub grad: Grad<'a>,
    pub state: &'a mut HostState,
    pub coefficients: AdamWCoefficients,
}

/// Updates every job's parameter from its gradient through the chunk pipeline (see the module
/// docs). A failed transfer stops the pipeline and is returned; chunks already uploaded stay
/// updated.
pub(crate) fn step(jobs: Vec<Job<'_>>) -> Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // (job, start, end) of every chunk, in order; starts are multiples of CHUNK (even).
    let chunks: Vec<(usize, usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, job)| {
            let n = job.param.numel();
            (0..n.div_ceil(CHUNK)).map(move |k| (j, k * CHUNK, ((k + 1) * CHUNK).min(n)))
        })
        .collect();
    let params: Vec<&Tensor> = jobs.iter().map(|j| j.param).collect();
    let mut grads = Vec::with_capacity(jobs.len());
    let mut states: Vec<(&mut HostState, AdamWCoefficients)> = Vec::with_capacity(jobs.len());
    for j in jobs {
        grads.push(j.grad);
        states.push((j.state, j.coefficients));
    }
    std::thread::scope(|s| {
        let (gtx, grx) = sync_channel::<Result<Vec<f32>>>(2);
        let (ptx, prx) = sync_channel::<(usize, usize, Vec<f32>)>(2);
        let reader_chunks = chunks.clone();
        let grads = &grads;
        s.spawn(move || {
            for (j, a, b) in reader_chunks {
                let r = grads[j].read(a, b);
                let failed = r.is_err();
                if gtx.send(r).is_err() || failed {
                    break;
                }
            }
        });
        let params = &params;
        let writer = s.spawn(move || -> Result<()> {
            for (j, a, values) in prx {
                params[j].write_range_f32(a, &values)?;
            }
            Ok(())
        });
        let mut result = Ok(());
        for &(j, a, b) in &chunks {
            let g = match grx.recv() {
                Ok(Ok(g)) => g,
                Ok(Err(e)) => {
                    result = Err(e);
                    break;
                }
                Err(_) => {
                    result = Err(Error::Readback("the gradient reader stopped".into()));
                    break;
                }
            };
            let (st, c) = &mut states[j];
            adamw_threads(
                &mut st.master[a..b],
                &g,
                &mut st.m[a..b],
                &mut st.v[a..b],
                c,
                threads,
            );
            if ptx.send((j, a, st.master[a..b].to_vec())).is_err() {
                break; // the writer failed: its error is returned below
            }
        }
        drop(ptx);
        drop(grx);
        let written = writer.join().expect("the parameter writer does not panic");
        result.and(written)
    })
}

/// MemAvailable of /proc/meminfo in bytes, where the system has one (Linux).
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `Err(HostMemory)` when MemAvailable is known and under `needed`.
pub(crate) fn check_host_memory(what: &str, needed: u64) -> Result<()> {
    match mem_available() {
        Some(available) if available < needed => Err(Error::HostMemory {
            what: what.to_string(),
            needed,
            available,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_available() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12345 kB\n";
        assert_eq!(parse_mem_available(text), Some(12345 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots kB\n"), None);
    }

    /// The threaded update is the single-threaded loop, bit for bit, for any split.
    #[test]
    fn threads_change_nothing() {
        let n = 3 * PER_THREAD_MIN + 17;
        let c = AdamWCoefficients {
            decay: 0.999,
            step_size: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            one_minus_beta1: 0.1,
            one_minus_beta2: 0.001,
            eps: 1e-8,
            bc2_sqrt: 0.05,
        };
        let g: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut one = (vec![0.5f32; n], vec![0.01f32; n], vec![0.001f32; n]);
        let mut many = one.clone();
        adamw_host(&mut one.0, &g, &mut one.1, &mut one.2, &c);
        adamw_threads(&mut many.0, &g, &mut many.1, &mut many.2, &c, 4);
        assert_eq!(one.0, many.0);
        assert_eq!(one.1, many.1);
        assert_eq!(one.2, many.2);
        assert!(one.0.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn a_shortfall_is_a_typed_error() {
        if let Some(avail) = mem_available() {
            let e = check_host_memory("optimizer offload", avail * 2 + 1).unwrap_err();
            assert!(matches!(e, Error::HostMemory { needed, available, .. } if needed > available));
            assert!(check_host_memory("optimizer offload", 1).is_ok());
        }
    }
}
