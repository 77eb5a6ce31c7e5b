//! Matmul dispatch: C = op(A) · op(B) (+ bias) (activation), batched, any M, N, K, f32 or f16.
//!
//! Kernel variants, because the best one depends on the adapter:
//! - `Reg`: register-blocked and barrier-free (shaders/matmul_reg.wgsl); each invocation
//!   computes a TM x TN block straight from memory. Best on CPU adapters (lavapipe), where the
//!   caches tile and barriers are expensive. TM = 1 or 2 is the skinny path for small M.
//! - `Tiled`: workgroup-memory tiles with barriers (shaders/matmul_tiled.wgsl), each
//!   invocation a 4 x 4 block: the classic GPU kernel.
//! - `Naive`: one invocation per output (shaders/matmul_naive.wgsl): the reference the
//!   benchmark reports ratios against.

use super::{Binding, Storage};
use crate::device::Device;
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
}

use super::{MATMUL_NAIVE, MATMUL_REG, MATMUL_TILED};

/// The variant to run when the autotuner has no measurement: register-blocked, with fewer rows
/// per invocation for skinny problems.
pub(crate) fn choose(_dev: &Device, pb: &Problem) -> Variant {
    let tm = if pb.m <= 2 {
        1
    } else if pb.m <= 8 {
        2
    } else {
        4
    };
    Variant::Reg {
        tm,
        tn: 4,
        wg_x: 16,
        wg_y: 4,
    }
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
        "{}_{consts:?}_{:?}_{:?}_{}{}",
        file.name,
        bind.map(|b| b.storage),
        bind.map(|b| b.vec4),
        pb.trans_a,
        pb.trans_b
    );
    let mut overrides = vec![("TRANS_A", flag(pb.trans_a)), ("TRANS_B", flag(pb.trans_b))];
    if variant != Variant::Naive {
        overrides.push(("VEC_C", flag(vec_c)));
    }
    if matches!(variant, Variant::Reg { .. }) {
        overrides.push(("VEC_B", flag(vec_b)));
    }
    // The register and tiled kernels clamp or guard every index (tests cover the edges).
    let proven = variant != Variant::Naive;
    let k = dev.kernel(&key, &overrides, proven, || {
        super::assemble(&super::specialize(file.body, &consts), &bind)
    })?;
    let groups = [groups[0] as u32, groups[1] as u32, pb.batch as u32];
    dev.dispatch3(
        &k,
        &params,
        &[a.block(), b.block(), bias_t.block(), out.block()],
        groups,
    )
}
