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
//!
//! By file: `codegen` (shader source, pipelines, grids), `policy` (which variants an adapter
//! runs), `tune` (timing the candidates, caching the winners). Kernels see their operands as
//! [`Operand`]s, and an output that needs an f32 temporary ([`needs_f32_staging`]) gets it from
//! the caller.

mod codegen;
mod policy;
mod tune;

pub use codegen::{expand_subgroup, Forms};
pub use policy::{candidates, default_variant, supported};
pub(crate) use tune::{env_settings, select, select_named};

use super::{Operand, Storage};
use crate::{DType, Device, Result};

/// What the matmul's store applies after the optional bias: the activations it can fuse
/// (the caller applies the others as their own ops).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Epilogue {
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
    /// K is summed in blocks of 16 (`MatmulOptions::k_blocks`).
    pub k_blocks: bool,
    /// The sum over K starts from what C holds instead of zero: the products fold onto C in k
    /// order (batch-invariant weight gradients; no bias, no activation).
    pub onto: bool,
    /// Elements between batches of A and B; 0 when one matrix serves every batch.
    pub a_batch: usize,
    pub b_batch: usize,
    pub bias: bool,
    pub epilogue: Epilogue,
}

/// A kernel choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// One output per invocation, straight from memory: the reference.
    Naive,
    /// Register-blocked: TM rows x TN columns per invocation, a WG_X x WG_Y workgroup.
    Reg {
        /// Rows per invocation.
        tm: u32,
        /// Columns per invocation (in vec4s for the register kernel).
        tn: u32,
        /// Workgroup width, in invocations.
        wg_x: u32,
        /// Workgroup height, in invocations.
        wg_y: u32,
    },
    /// Workgroup-tiled: a BM x BN block of C per workgroup, BK of k per stage.
    Tiled {
        /// Rows of C per workgroup.
        bm: u32,
        /// Columns of C per workgroup.
        bn: u32,
        /// Depth of one staged tile of A and B.
        bk: u32,
    },
    /// Subgroup broadcast: TM rows x (SG * TN) columns per subgroup of SG lanes, WGS subgroups
    /// per workgroup.
    Subgroup {
        /// Subgroup size the kernel is written for.
        sg: u32,
        /// Rows per lane.
        tm: u32,
        /// Columns per lane, in vec4s.
        tn: u32,
        /// Subgroups per workgroup.
        wgs: u32,
    },
}

impl Variant {
    /// Whether this variant runs on `dev` for `dtype` (the autotuner only tries those).
    pub fn supported_on(self, dev: &Device, dtype: DType) -> bool {
        supported(dev, self, dtype)
    }

    /// A stable text form (cache files, benchmark reports).
    pub fn name(&self) -> String {
        match *self {
            Variant::Naive => "naive".into(),
            Variant::Reg { tm, tn, wg_x, wg_y } => format!("reg-{tm}x{tn}-{wg_x}x{wg_y}"),
            Variant::Tiled { bm, bn, bk } => format!("tiled-{bm}x{bn}x{bk}"),
            Variant::Subgroup { sg, tm, tn, wgs } => format!("sg{sg}-{tm}x{tn}-{wgs}"),
        }
    }

    /// Reads [`Variant::name`]'s form back.
    pub fn parse(s: &str) -> Option<Variant> {
        let nums =
            |t: &str| -> Option<Vec<u32>> { t.split(['x', '-']).map(|n| n.parse().ok()).collect() };
        if s == "naive" {
            return Some(Variant::Naive);
        }
        if let Some(rest) = s.strip_prefix("reg-") {
            if let [tm, tn, wg_x, wg_y] = nums(rest)?[..] {
                return Some(Variant::Reg { tm, tn, wg_x, wg_y });
            }
        }
        if let Some(rest) = s.strip_prefix("sg") {
            if let [sg, tm, tn, wgs] = nums(rest)?[..] {
                return Some(Variant::Subgroup { sg, tm, tn, wgs });
            }
        }
        if let Some(rest) = s.strip_prefix("tiled-") {
            if let [bm, bn, bk] = nums(rest)?[..] {
                return Some(Variant::Tiled { bm, bn, bk });
            }
        }
        None
    }
}

/// The activation bits of the epilogue word (shaders/include/matmul_common.wgsl), shared with
/// the quantized matmul.
pub(crate) fn act_code(e: Epilogue) -> u32 {
    match e {
        Epilogue::None => 0,
        Epilogue::Relu => 1,
        Epilogue::Gelu => 2,
    }
}

/// Packed f16 holds two elements per word: outputs written one element at a time would race,
/// so packed outputs need whole vec4 rows (N % 4 == 0), or go through an f32 temporary that the
/// caller casts.
pub(crate) fn needs_f32_staging(dev: &Device, variant: Variant, pb: &Problem, out: DType) -> bool {
    Storage::of(dev, out) == Storage::F16Packed
        && (!pb.n.is_multiple_of(4) || variant == Variant::Naive)
}

/// Runs `variant` on `a`, `b` (and `bias`) into `out` (shape (batch, M, N), contiguous), which
/// needs no f32 staging (see [`needs_f32_staging`]).
pub(crate) fn run<T: Operand>(
    dev: &Device,
    variant: Variant,
    pb: &Problem,
    a: &T,
    b: &T,
    bias: Option<&T>,
    out: &T,
) -> Result<()> {
    if pb.batch == 0 || pb.m == 0 || pb.n == 0 {
        return Ok(());
    }
    debug_assert!(
        !needs_f32_staging(dev, variant, pb, out.dtype()),
        "stage packed rows"
    );
    let epilogue = u32::from(bias.is_some()) | (act_code(pb.epilogue) << 1);
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
    let storage = [a, b, bias_t, out].map(|t| Storage::of(dev, t.dtype()));
    let blocks = [a.block(), b.block(), bias_t.block(), out.block()];
    let (k, groups) = codegen::pipeline(dev, variant, pb, storage, epilogue, &blocks)?;
    dev.dispatch3(&k, &params, &blocks, groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variant_names_round_trip() {
        for v in [
            Variant::Naive,
            Variant::Reg {
                tm: 32,
                tn: 16,
                wg_x: 16,
                wg_y: 1,
            },
            Variant::Tiled {
                bm: 64,
                bn: 64,
                bk: 16,
            },
            Variant::Subgroup {
                sg: 8,
                tm: 64,
                tn: 8,
                wgs: 1,
            },
        ] {
            assert_eq!(Variant::parse(&v.name()), Some(v));
        }
        assert_eq!(Variant::parse("reg-1x2"), None);
        assert_eq!(Variant::parse("bogus"), None);
    }
}
