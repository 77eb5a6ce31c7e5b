//! Which matmul variants an adapter runs: what it can compile in reasonable time
//! (`supported`), the built-in choice when nothing was measured (`default_variant`), and the
//! candidates the autotuner times (`candidates`).

use super::{Problem, Variant};
use crate::{DType, Device};

fn is_cpu(dev: &Device) -> bool {
    dev.info().adapter.is_cpu()
}

/// Whether `v` is practical on this device for `dtype`: within its workgroup limits, and a
/// register block small enough to compile in reasonable time where compilers struggle with
/// large ones (Mesa's GLSL path and lavapipe's f16 code: compile times in docs/design-notes.md,
/// "Measurements behind the constants").
pub fn supported(dev: &Device, v: Variant, dtype: DType) -> bool {
    let l = &dev.info().limits;
    let small_only = dev.info().adapter.wgpu_backend == wgpu::Backend::Gl
        || (dtype == DType::F16 && is_cpu(dev));
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
        // With subgroups, a 16 x 4 subgroup block (quick to compile) beats the register blocks
        // on every shape of 16 rows or more, most of all on transposed-A ones such as a last
        // layer's weight gradient, where a register block's scalar loads of A along M are slow
        // (figures in docs/design-notes.md). Taller blocks win some classes when timed but lose
        // others badly (docs/design-notes.md), so they are left to the autotuner.
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
        // 8 x 8: lavapipe compiles it far faster than 16 x 16 or 32 x 16 (docs/design-notes.md has
        // the cold-cache figures), and for training-sized problems it runs as fast as they do. Bigger blocks are left to the autotuner, for big problems only.
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
            if pb.m >= 16 {
                // No register block comes near the subgroup kernel here; timing them would
                // only cost first-run compile time.
                &[]
            } else {
                &[(1, 16), (8, 4), (8, 8), (8, 16)]
            }
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
            // The winners measured on digits-sized training steps are 32 x 4, 64 x 4 and
            // 64 x 8; 32 x 8 never won, and every candidate is a cold compile on a first run.
            let blocks = [(16, 4), (32, 4), (64, 4), (64, 8)];
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
