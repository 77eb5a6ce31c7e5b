//! Matmul dispatch: C = op(A) · op(B) (+ bias) (activation), batched, any M, N, K, f32 or f16.
//!
//! Kernel variants, because the best one depends on the adapter:
//! - `Reg`: register-blocked and barrier-free (shaders/matmul_reg.wgsl); each invocation
//!   computes a TM x TN block straight from memory. Best on CPU adapters (lavapipe), where the
//!   caches tile and barriers are expensive. TM = 1 or 2 is the skinny path for small M.
//! - `Tiled`: workgroup-memory tiles with barriers (shaders/matmul_tiled.wgsl), each
//!   invocation a 4 x 4 block: the classic GPU kernel.
//! - `Subgroup`: a subgroup computes a TM x (SG * TN) block, each lane TN columns, loading
//!   each row of A once per subgroup and handing it to every lane with subgroupBroadcast
//!   (shaders/matmul_sg.wgsl). Needs SUBGROUP with a fixed subgroup size. The fastest kernel on
//!   lavapipe by 3x: there a per-lane buffer load is a scalar loop and a broadcast a shuffle.
//!   Its body is unrolled here (`expand_subgroup`) so the accumulators stay in registers.
//! - `Naive`: one invocation per output (shaders/matmul_naive.wgsl): the reference the
//!   benchmark reports ratios against.

use super::autotune;
use super::{Binding, Storage};
use crate::device::{lock, Device};
use crate::{DType, Result, Tensor};

/// An activation fused into the matmul's store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Activation {
    #[default]
    None,
    Relu,
    Gelu,
}

/// The shape of one matmul call, everything a kernel needs besides the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Problem {
    pub batch: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// A is stored (K, M) instead of (M, K).
    pub trans_a: bool,
    /// B is stored (N, K) instead of (K, N).
    pub trans_b: bool,
    /// Elements between batches of A and B; 0 when one matrix serves every batch.
    pub a_batch: usize,
    pub b_batch: usize,
    pub bias: bool,
    pub activation: Activation,
}

/// A kernel choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    Naive,
    /// Register-blocked: TM rows x TN columns per invocation, a WG_X x WG_Y workgroup.
    Reg {
        tm: u32,
        tn: u32,
        wg_x: u32,
        wg_y: u32,
    },
    /// Workgroup-tiled: a BM x BN block of C per workgroup, BK of k per stage.
    Tiled {
        bm: u32,
        bn: u32,
        bk: u32,
    },
    /// Subgroup broadcast: TM rows x (SG * TN) columns per subgroup of SG lanes, WGS subgroups
    /// per workgroup.
    Subgroup {
        sg: u32,
        tm: u32,
        tn: u32,
        wgs: u32,
    },
}

use super::{MATMUL_NAIVE, MATMUL_REG, MATMUL_SG, MATMUL_TILED};

const XYZW: [&str; 4] = ["x", "y", "z", "w"];

/// Expands the `//@` lines of shaders/matmul_sg.wgsl (already specialized to SG, TM and TN)
/// into straight-line code for a TM x TN block: one statement per row, column quad and k,
/// accumulators in variables `c{row}_{quad}`.
pub fn expand_subgroup(
    body: &str,
    sg: u32,
    tm: u32,
    tn: u32,
    trans_a: bool,
    trans_b: bool,
) -> String {
    let (loads, quads, row_quads) = (tm / sg, tn / 4, tm / 4);
    let mut out = String::with_capacity(body.len() + (tm * quads * 200) as usize);
    for line in body.lines() {
        let t = line.trim_start();
        let Some(what) = t.strip_prefix("//@ ") else {
            out += line;
            out.push('\n');
            continue;
        };
        let pad = &line[..line.len() - t.len()];
        let mut emit = |stmt: String| {
            out += pad;
            out += &stmt;
            out.push('\n');
        };
        match what.split(':').next().unwrap_or("") {
            "decl" => {
                for i in 0..loads {
                    if trans_a {
                        // Load i of lane l is pair p = SG i + l of (k offset, row quad), with
                        // p = kk * TM / 4 + quad.
                        emit(format!("let ak{i} = ({}u + lane) / {row_quads}u;", sg * i));
                        emit(format!(
                            "let am{i} = m0 + 4u * (({}u + lane) % {row_quads}u);",
                            sg * i
                        ));
                    }
                    emit(format!(
                        "let ra{i} = min(m0 + {}u + lane, p.m - 1u);",
                        sg * i
                    ));
                }
                for r in 0..tm {
                    for j in 0..quads {
                        emit(format!("var c{r}_{j} = vec4<f32>(0.0);"));
                    }
                }
            }
            "quad" => {
                for i in 0..loads {
                    emit(if trans_a {
                        format!("let qa{i} = at4(a_base, k + ak{i}, am{i});")
                    } else {
                        format!("let qa{i} = a4(a_base, ra{i}, k);")
                    });
                }
                // b{kk}_{j} = op(B)[k + kk, n0 + 4j .. n0 + 4j + 4]
                for j in 0..quads {
                    if trans_b {
                        for c in 0..4 {
                            emit(format!(
                                "let bc{c}_{j} = bt4(b_base, n0 + {}u, k);",
                                4 * j + c
                            ));
                        }
                        for (kk, x) in XYZW.iter().enumerate() {
                            emit(format!(
                                "let b{kk}_{j} = vec4<f32>(bc0_{j}.{x}, bc1_{j}.{x}, bc2_{j}.{x}, bc3_{j}.{x});"
                            ));
                        }
                    } else {
                        for kk in 0..4 {
                            emit(format!(
                                "let b{kk}_{j} = b4(b_base, k + {kk}u, n0 + {}u);",
                                4 * j
                            ));
                        }
                    }
                }
                if trans_a {
                    // y = op(A)[4q .. 4q + 4, k + kk], from lane p % SG's load p / SG.
                    for q in 0..row_quads {
                        for kk in 0..4 {
                            let p = kk * row_quads + q;
                            emit(format!(
                                "let y{q}_{kk} = subgroupBroadcast(qa{}, {}u);",
                                p / sg,
                                p % sg
                            ));
                        }
                        for (rr, x) in XYZW.iter().enumerate() {
                            let r = 4 * q + rr as u32;
                            for j in 0..quads {
                                for kk in 0..4 {
                                    emit(format!(
                                        "c{r}_{j} = fma(vec4<f32>(y{q}_{kk}.{x}), b{kk}_{j}, c{r}_{j});"
                                    ));
                                }
                            }
                        }
                    }
                } else {
                    // x = op(A)[r, k .. k + 4], from lane r % SG's load r / SG.
                    for r in 0..tm {
                        emit(format!(
                            "let x{r} = subgroupBroadcast(qa{}, {}u);",
                            r / sg,
                            r % sg
                        ));
                        for j in 0..quads {
                            for (kk, x) in XYZW.iter().enumerate() {
                                emit(format!(
                                    "c{r}_{j} = fma(vec4<f32>(x{r}.{x}), b{kk}_{j}, c{r}_{j});"
                                ));
                            }
                        }
                    }
                }
            }
            "single" => {
                for i in 0..loads {
                    emit(format!("let sa{i} = a1(a_base, ra{i}, k);"));
                }
                for j in 0..quads {
                    emit(format!("let b0_{j} = b4(b_base, k, n0 + {}u);", 4 * j));
                }
                for r in 0..tm {
                    emit(format!(
                        "let x{r} = vec4<f32>(subgroupBroadcast(sa{}, {}u));",
                        r / sg,
                        r % sg
                    ));
                    for j in 0..quads {
                        emit(format!("c{r}_{j} = fma(x{r}, b0_{j}, c{r}_{j});"));
                    }
                }
            }
            "store" => {
                for r in 0..tm {
                    for j in 0..quads {
                        emit(format!(
                            "store4(c_base, m0 + {r}u, n0 + {}u, c{r}_{j});",
                            4 * j
                        ));
                    }
                }
            }
            _ => emit(t.to_string()),
        }
    }
    out
}

/// Problems below this many flops are not worth timing: the built-in choice runs.
const TUNE_MIN_FLOPS: usize = 1 << 22;

fn is_cpu(dev: &Device) -> bool {
    dev.info().adapter.device_type == "Cpu"
}

/// Whether `v` is practical on this device for `dtype`: within its workgroup limits, and a
/// register block small enough to compile in reasonable time where compilers struggle with
/// large ones: Mesa's GLSL path needs 1.6 s for an 8 x 8 block, 7 s for 16 x 8 and minutes
/// beyond; lavapipe's f16 code for a 32 x 16 block does not finish in minutes either.
pub fn supported(dev: &Device, v: Variant, dtype: DType) -> bool {
    let l = &dev.info().limits;
    let small_only = dev.info().adapter.backend == "gl" || (dtype == DType::F16 && is_cpu(dev));
    match v {
        Variant::Reg { tm, tn, wg_x, wg_y } => {
            wg_x * wg_y <= l.max_compute_invocations_per_workgroup && (!small_only || tm * tn <= 32)
        }
        Variant::Tiled { bm, bn, bk } => {
            bm * bn / 16 <= l.max_compute_invocations_per_workgroup
                && bk * (bm + bn) * 4 <= l.max_compute_workgroup_storage_size
        }
        Variant::Subgroup { sg, tm, tn, wgs } => {
            dev.info().subgroup_size == Some(sg)
                && tm % sg == 0
                && tn % 4 == 0
                && sg * wgs <= l.max_compute_invocations_per_workgroup
                && (!small_only || tm * tn <= 128)
        }
        Variant::Naive => true,
    }
}

/// The variant to run when nothing was measured: on CPU adapters a 16 x 4 subgroup block where
/// there are subgroups and 16 rows or more, else a register block of up to 8 x 8; on GPUs
/// 64 x 64 workgroup tiles, or a small register block for skinny shapes.
pub fn default_variant(dev: &Device, pb: &Problem, dtype: DType) -> Variant {
    let rows = pb.m.next_power_of_two().clamp(1, 32) as u32;
    if is_cpu(dev) {
        // With subgroups, a 16 x 4 subgroup block (under a second to compile) beats the
        // register blocks on every shape of 16 rows or more: 2-3x on training-sized problems,
        // 25x on transposed-A ones such as a last layer's weight gradient (512 x 10 x 128:
        // 9.7 ms against 0.38 ms on lavapipe), where a register block's scalar loads of A
        // along M are slow.
        if let Some(sg) = dev.info().subgroup_size {
            let v = Variant::Subgroup {
                sg,
                tm: 16,
                tn: 4,
                wgs: 1,
            };
            if pb.m >= 16 && supported(dev, v, dtype) {
                return v;
            }
        }
        // 8 x 8: lavapipe compiles it in about 2 s, while 16 x 16 takes 25 s and 32 x 16 two
        // minutes (measured cold on the 2-core machine), and for training-sized problems it runs
        // as fast as they do. Bigger blocks are left to the autotuner, for big problems only.
        let v = Variant::Reg {
            tm: rows.min(8),
            tn: if pb.n >= 8 { 8 } else { 4 },
            wg_x: 16,
            wg_y: 1,
        };
        return if supported(dev, v, dtype) {
            v
        } else {
            Variant::Reg {
                tm: rows.min(8),
                tn: 4,
                wg_x: 16,
                wg_y: 1,
            }
        };
    }
    if pb.m >= 64 && pb.n >= 64 {
        Variant::Tiled {
            bm: 64,
            bn: 64,
            bk: 16,
        }
    } else {
        Variant::Reg {
            tm: rows.min(4),
            tn: 4,
            wg_x: 16,
            wg_y: 4,
        }
    }
}

/// Problems below this many flops (2·M·N·K) tune only register blocks of at most 128 outputs on
/// CPU adapters, which compile in seconds.
const BIG_BLOCK_MIN_FLOPS: usize = 1 << 30;

/// The kernels worth timing for this problem on this adapter.
pub fn candidates(dev: &Device, pb: &Problem, dtype: DType) -> Vec<Variant> {
    let m_cap = pb.m.next_power_of_two().max(1) as u32;
    let n_cap = pb.n.next_power_of_two().max(4) as u32;
    let mut v: Vec<Variant> = if is_cpu(dev) {
        // Barrier-free register blocks: CPU adapters pay per load instruction and per barrier.
        // With subgroups the subgroup kernel wins every shape with M >= 16 by 2-4x, so the big
        // register blocks (minutes to compile) are only tried without it; the small ones stay
        // for skinny shapes.
        let blocks: &[(u32, u32)] = if dev.info().subgroup_size.is_some() {
            &[(1, 16), (8, 4), (8, 8), (8, 16)]
        } else {
            &[
                (1, 16),
                (8, 4),
                (8, 8),
                (8, 16),
                (16, 16),
                (32, 16),
                (64, 16),
            ]
        };
        blocks
            .iter()
            .map(|&(tm, tn)| Variant::Reg {
                tm,
                tn,
                wg_x: 16,
                wg_y: 1,
            })
            .collect()
    } else {
        vec![
            Variant::Tiled {
                bm: 64,
                bn: 64,
                bk: 16,
            },
            Variant::Tiled {
                bm: 64,
                bn: 64,
                bk: 8,
            },
            Variant::Tiled {
                bm: 32,
                bn: 32,
                bk: 16,
            },
            Variant::Reg {
                tm: 4,
                tn: 4,
                wg_x: 16,
                wg_y: 4,
            },
            Variant::Reg {
                tm: 1,
                tn: 4,
                wg_x: 64,
                wg_y: 1,
            },
            Variant::Reg {
                tm: 2,
                tn: 8,
                wg_x: 16,
                wg_y: 4,
            },
        ]
    };
    if let Some(sg) = dev.info().subgroup_size {
        // Rows per subgroup are multiples of the subgroup size. CPU adapters (8 lanes) take tall
        // blocks: A is shared through broadcasts, B loaded per lane. On a GPU a lane holds
        // TM x TN accumulators, so one block of SG x 4 (128 registers at 32 lanes), two
        // subgroups per workgroup, where subgroups are at most 32 wide.
        if is_cpu(dev) {
            let blocks = [(16, 4), (32, 4), (64, 4), (32, 8), (64, 8)];
            v.extend(
                blocks
                    .iter()
                    .map(|&(tm, tn)| Variant::Subgroup { sg, tm, tn, wgs: 1 }),
            );
        } else if sg <= 32 {
            v.push(Variant::Subgroup {
                sg,
                tm: sg,
                tn: 4,
                wgs: 2,
            });
        }
    }
    // Compile time on a CPU adapter grows faster than the block: 0.3 s for 4 x 4, 2 s for
    // 8 x 8, 7 s for 8 x 16, 25 s for 16 x 16, about two minutes for 32 x 16 (lavapipe, cold
    // cache). Only problems big enough to repay that (a 1024-cube matmul) get the big blocks;
    // transposed operands, read with scalar loads that unroll into far more code, stop at 32 x 16
    // (64 x 16 did not compile in minutes).
    let flops = 2 * pb.batch * pb.m * pb.n * pb.k;
    let max_block = if flops < BIG_BLOCK_MIN_FLOPS {
        128
    } else if pb.trans_a || pb.trans_b {
        512
    } else {
        u32::MAX
    };
    // The subgroup kernel compiles about 5x faster than a register block of the same size
    // (1.4 s for 64 x 8 on lavapipe), so its blocks are allowed 4x larger.
    v.retain(|&c| {
        supported(dev, c, dtype)
            && !matches!(c, Variant::Reg { tm, tn, .. } if tm > m_cap || tn > n_cap || tm * tn > max_block)
            && !matches!(c, Variant::Subgroup { tm, tn, .. } if tm > m_cap.max(8) || tn > n_cap || tm * tn > max_block.saturating_mul(4))
    });
    let d = default_variant(dev, pb, dtype);
    if !v.contains(&d) {
        v.push(d);
    }
    v
}

/// The autotuner's key: problems in one class share a winner.
fn class_key(dev: &Device, pb: &Problem, a: &Tensor) -> String {
    let b = |x: usize| x.next_power_of_two();
    format!(
        "{:?} ta{} tb{} m{} n{} k{} batched{} n4{} k4{}",
        Storage::of(dev, a.dtype()),
        pb.trans_a as u8,
        pb.trans_b as u8,
        b(pb.m),
        b(pb.n),
        b(pb.k),
        (pb.batch > 1) as u8,
        pb.n.is_multiple_of(4) as u8,
        pb.k.is_multiple_of(4) as u8
    )
}

/// The variant for this problem: the cached winner of its class, or (for a problem big enough to
/// be worth it, with tuning on) the fastest candidate timed now on these very tensors, writing
/// into `out`, which the caller then overwrites.
pub(crate) fn select(
    dev: &Device,
    pb: &Problem,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<Variant> {
    let fallback = default_variant(dev, pb, a.dtype());
    if pb.batch * pb.m * pb.n * pb.k * 2 < TUNE_MIN_FLOPS || !autotune::enabled() {
        return Ok(fallback);
    }
    if dev.is_planning() {
        // No timing while planning: a cached winner or the built-in choice.
        let class = class_key(dev, pb, a);
        let path = autotune::cache_path(dev.info());
        if let Some(v) = lock(&dev.inner.tune).get(path.as_ref(), &class) {
            return Ok(v);
        }
        return Ok(fallback);
    }
    let class = class_key(dev, pb, a);
    let path = autotune::cache_path(dev.info());
    if let Some(v) = lock(&dev.inner.tune).get(path.as_ref(), &class) {
        return Ok(v);
    }
    let mut best = (f64::INFINITY, fallback);
    for cand in candidates(dev, pb, a.dtype()) {
        if let Ok(t) = time_variant(dev, cand, pb, a, b, bias, out) {
            if t < best.0 {
                best = (t, cand);
            }
        }
    }
    lock(&dev.inner.tune).put(path.as_ref(), class, best.1);
    Ok(best.1)
}

/// The variant `a.matmul_with(b, opts)` runs now (benchmark reports name it).
pub fn chosen(
    dev: &Device,
    a: &Tensor,
    b: &Tensor,
    opts: &crate::MatmulOptions,
) -> Result<Variant> {
    let (pb, dims) = a.matmul_problem(b, opts)?;
    let out = Tensor::uninit(dev, crate::Shape::new(&dims)?, a.dtype())?;
    select(dev, &pb, a, b, opts.bias, &out)
}

/// Seconds one run of `variant` takes: a warm-up run (which compiles the kernel), then the
/// median of 1 or, for quick kernels, 3 timed runs.
pub fn time_variant(
    dev: &Device,
    variant: Variant,
    pb: &Problem,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<f64> {
    run(dev, variant, pb, a, b, bias, out)?;
    dev.sync()?;
    let mut times = Vec::new();
    for _ in 0..3 {
        let t = std::time::Instant::now();
        run(dev, variant, pb, a, b, bias, out)?;
        dev.sync()?;
        times.push(t.elapsed().as_secs_f64());
        if times[0] > 0.05 {
            break;
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn act_code(a: Activation) -> u32 {
    match a {
        Activation::None => 0,
        Activation::Relu => 1,
        Activation::Gelu => 2,
    }
}

/// Runs `variant` on `a`, `b` (and `bias`) into `out` (shape (batch, M, N), contiguous).
pub(crate) fn run(
    dev: &Device,
    variant: Variant,
    pb: &Problem,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<()> {
    if pb.batch == 0 || pb.m == 0 || pb.n == 0 {
        return Ok(());
    }
    let s = |t: &Tensor| Storage::of(dev, t.dtype());
    // Packed f16 holds two elements per word: outputs written one element at a time would
    // race, so packed outputs need whole vec4 rows (N % 4 == 0), or go through f32.
    if s(out) == Storage::F16Packed && (!pb.n.is_multiple_of(4) || variant == Variant::Naive) {
        let tmp = Tensor::uninit(dev, out.shape().clone(), DType::F32)?;
        run(dev, variant, pb, a, b, bias, &tmp)?;
        return super::elementwise::unary(super::elementwise::UnaryOp::Identity, &tmp, 0.0, out);
    }
    let epilogue = u32::from(bias.is_some()) | (act_code(pb.activation) << 1);
    let params = [
        pb.m as u32,
        pb.n as u32,
        pb.k as u32,
        epilogue,
        pb.a_batch as u32,
        pb.b_batch as u32,
        (pb.m * pb.n) as u32,
        0,
    ];
    // bias is bound even when unused (bindings are fixed); `out` stands in for it.
    let bias_t = bias.unwrap_or(out);
    // vec4 access where every row a kernel touches starts on a 4-element boundary.
    let vec_a = !pb.trans_a && pb.k.is_multiple_of(4) && pb.a_batch.is_multiple_of(4);
    let vec_b = !pb.trans_b && pb.n.is_multiple_of(4) && pb.b_batch.is_multiple_of(4);
    let vec_c = pb.n.is_multiple_of(4);
    let binding = |name, t: &Tensor, write, vec4| Binding {
        name,
        storage: s(t),
        write,
        vec4,
    };
    let flag = |b: bool| if b { 1.0 } else { 0.0 };
    let (file, bind, consts, groups) = match variant {
        Variant::Naive => (
            &MATMUL_NAIVE,
            [false; 4],
            vec![],
            // 16 x 16 outputs per workgroup.
            [pb.n.div_ceil(16), pb.m.div_ceil(16)],
        ),
        Variant::Reg { tm, tn, wg_x, wg_y } => (
            &MATMUL_REG,
            [vec_a, vec_b, false, vec_c],
            vec![
                ("TM", tm),
                ("TN", tn),
                ("TN4", tn / 4),
                ("WG_X", wg_x),
                ("WG_Y", wg_y),
            ],
            [
                pb.n.div_ceil((tn * wg_x) as usize),
                pb.m.div_ceil((tm * wg_y) as usize),
            ],
        ),
        Variant::Subgroup { sg, tm, tn, wgs } => (
            &MATMUL_SG,
            // Transposed operands are read in quads along their contiguous dimension too.
            [
                vec_a || (pb.trans_a && pb.m.is_multiple_of(4) && pb.a_batch.is_multiple_of(4)),
                vec_b || (pb.trans_b && pb.k.is_multiple_of(4) && pb.b_batch.is_multiple_of(4)),
                false,
                vec_c,
            ],
            vec![("SG", sg), ("TM", tm), ("TN", tn), ("WGS", wgs)],
            [
                pb.n.div_ceil((sg * tn) as usize),
                pb.m.div_ceil((tm * wgs) as usize),
            ],
        ),
        Variant::Tiled { bm, bn, bk } => (
            &MATMUL_TILED,
            [false, false, false, vec_c],
            vec![
                ("BM", bm),
                ("BN", bn),
                ("BK", bk),
                ("THREADS", bm * bn / 16),
            ],
            [pb.n.div_ceil(bn as usize), pb.m.div_ceil(bm as usize)],
        ),
    };
    let bind = [
        binding("a", a, false, bind[0]),
        binding("b", b, false, bind[1]),
        binding("bias", bias_t, false, bind[2]),
        binding("c", out, true, bind[3]),
    ];
    let key = format!(
        "{}_{consts:?}_{:?}_{:?}_{}{}{}",
        file.name,
        bind.map(|b| b.storage),
        bind.map(|b| b.vec4),
        pb.trans_a,
        pb.trans_b,
        match variant {
            Variant::Subgroup { .. } => format!("_e{epilogue}"),
            _ => String::new(),
        }
    );
    let mut overrides = vec![("TRANS_A", flag(pb.trans_a)), ("TRANS_B", flag(pb.trans_b))];
    if variant != Variant::Naive {
        overrides.push(("VEC_C", flag(vec_c)));
    }
    if matches!(variant, Variant::Reg { .. } | Variant::Subgroup { .. }) {
        overrides.push(("VEC_B", flag(vec_b)));
    }
    if matches!(variant, Variant::Subgroup { .. }) {
        overrides.push(("EPILOGUE", epilogue as f64));
        overrides.push(("VEC_A", flag(bind[0].vec4)));
    }
    // The register, subgroup and tiled kernels clamp or guard every index (tests cover the
    // edges).
    let proven = variant != Variant::Naive;
    let k = dev.kernel(&key, &overrides, proven, || {
        let body = super::specialize(file.body, &consts);
        let body = match variant {
            Variant::Subgroup { sg, tm, tn, .. } => {
                expand_subgroup(&body, sg, tm, tn, pb.trans_a, pb.trans_b)
            }
            _ => body,
        };
        super::assemble(&body, &bind)
    })?;
    let groups = [groups[0] as u32, groups[1] as u32, pb.batch as u32];
    dev.dispatch3(
        &k,
        &params,
        &[a.block(), b.block(), bias_t.block(), out.block()],
        groups,
    )
}
