//! Dispatch for fused self-attention (flash-attention style): the forward
//! (shaders/attention_fwd.wgsl) keeps only the output and one log-sum-exp per row; the backward
//! rebuilds the probabilities tile by tile, the queries' gradient and each row's
//! `delta = dO . O` first (shaders/attention_bwd_dq.wgsl), then the keys' and values' gradients
//! (shaders/attention_bwd_dkv.wgsl). Tile sizes are chosen per head dim from the adapter's
//! workgroup memory.

use super::attention_sg::{self, Blocks};
use super::Operand;
use super::{assemble, specialize, Storage};
use super::{ATTENTION_BWD_DKV, ATTENTION_BWD_DQ, ATTENTION_FWD};
use crate::device::{DeviceLimits, Kernel};
use crate::{Device, Result};
use std::sync::Arc;

/// Invocations per workgroup (R in shaders/include/attention_tiles.wgsl): a warp on most GPUs,
/// four 8-lane vectors on lavapipe. Causal workgroups compute the masked half of their last
/// rows' keys, so more rows per workgroup would waste more.
const ROWS: u32 = 32;

/// The largest head dim the kernels hold: a row is at most 128 / 4 quads in registers.
pub(crate) const MAX_HEAD_DIM: usize = 128;

/// Rows of the other side staged per tile, in order of preference (fewer barriers first).
const COLS: [u32; 3] = [32, 16, 8];

/// The kernels' tiles: `rows` invocations per workgroup holding `per_invocation` rows each,
/// `cols` rows of the other side staged per step, each row `quads` vec4s (the head dim's
/// bucket / 4). The three kernels share them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tiles {
    pub rows: u32,
    pub cols: u32,
    pub quads: u32,
    pub per_invocation: u32,
}

impl Tiles {
    /// Bytes of workgroup memory each kernel declares: two staged tiles of f32 quads (K and V,
    /// or Q and dO).
    pub(crate) fn workgroup_bytes(self) -> u32 {
        2 * self.cols * self.quads * 16
    }
}

/// The head-dim bucket rows are held in: 32, 64 or 128 elements (few buckets, few pipelines).
fn bucket(d: usize) -> Option<u32> {
    match d {
        1..=32 => Some(32),
        33..=64 => Some(64),
        65..=MAX_HEAD_DIM => Some(128),
        _ => None,
    }
}

/// Rows each invocation holds. GPUs keep one: a row and its accumulators already take 2-4 x D
/// registers. CPU adapters (lavapipe) load a workgroup-memory value once per lane whatever the
/// address and spill registers cheaply, so there each staged quad serves two rows up to D = 64:
/// at (4, 4, 256, 64) that ran forward + backward 1.5x faster than one row. Four were another
/// 1.25x faster but took 88 s instead of 16 s to compile (cold, the three kernels), and two
/// rows at D = 128 took 60 s.
fn rows_per_invocation(cpu: bool, quads: u32) -> u32 {
    match (cpu, quads) {
        (true, ..=16) => 2,
        _ => 1,
    }
}

/// Which kernels run a problem: the workgroup-tiled ones (shaders/attention_*.wgsl) or the
/// subgroup ones (shaders/attention_sg_*.wgsl, see [`attention_sg`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    Tiles(Tiles),
    Subgroup(Blocks),
}

/// The variant a caller asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Choice {
    /// Subgroup blocks on CPU adapters with subgroups, workgroup tiles elsewhere.
    Auto,
    /// Workgroup tiles, workgroup memory capped at the bytes given (tests run a smaller
    /// adapter's tiles).
    Tiles(Option<u32>),
    /// Subgroup blocks.
    Subgroup,
}

/// [`plan`] for `dev`'s limits and kind of adapter. GL on a CPU adapter keeps the GPU tiles:
/// big register blocks take minutes to compile through GLSL (and GL has no subgroups).
pub(crate) fn plan_for(
    dev: &Device,
    d: usize,
    choice: Choice,
) -> std::result::Result<Plan, String> {
    let a = &dev.info().adapter;
    let cpu = a.device_type == "Cpu" && a.backend != "gl";
    plan(&dev.info().limits, d, choice, cpu, dev.info().subgroup_size)
}

/// The kernels for head dim `d` on an adapter with `limits` (a CPU adapter if `cpu`, with
/// subgroups of `subgroup` lanes if any); otherwise the reason the fused kernels cannot run.
/// On CPU adapters with subgroups `Auto` takes the subgroup blocks: at T >= 512 they ran
/// forward + backward 3-5x faster than the tiles there (docs/design-notes.md has the figures).
pub(crate) fn plan(
    limits: &DeviceLimits,
    d: usize,
    choice: Choice,
    cpu: bool,
    subgroup: Option<u32>,
) -> std::result::Result<Plan, String> {
    match choice {
        Choice::Tiles(bytes) => tiles(limits, d, bytes, cpu).map(Plan::Tiles),
        Choice::Subgroup => blocks(limits, d, subgroup).map(Plan::Subgroup),
        Choice::Auto => match blocks(limits, d, subgroup) {
            Ok(b) if cpu => Ok(Plan::Subgroup(b)),
            _ => tiles(limits, d, None, cpu).map(Plan::Tiles),
        },
    }
}

/// The head dim's bucket, if the fused kernels hold it and the adapter binds their buffers.
fn checked_bucket(limits: &DeviceLimits, d: usize) -> std::result::Result<u32, String> {
    let Some(bucket) = bucket(d) else {
        return Err(format!(
            "head dim {d} is outside the fused kernels' 1..={MAX_HEAD_DIM}"
        ));
    };
    // Bindings: q, k, v, o, dO, lse, dQ, delta (the dQ pass has the most).
    if limits.max_storage_buffers_per_shader_stage < 8 {
        return Err(format!(
            "the backward binds 8 storage buffers, the adapter allows {}",
            limits.max_storage_buffers_per_shader_stage
        ));
    }
    Ok(bucket)
}

/// The subgroup blocks for head dim `d` on subgroups of `subgroup` lanes.
fn blocks(
    limits: &DeviceLimits,
    d: usize,
    subgroup: Option<u32>,
) -> std::result::Result<Blocks, String> {
    let bucket = checked_bucket(limits, d)?;
    let Some(sg) = subgroup else {
        return Err("the adapter has no subgroups of one fixed size".into());
    };
    if limits.max_compute_invocations_per_workgroup < sg {
        return Err(format!(
            "the subgroup kernels run {sg} invocations per workgroup, the adapter allows {}",
            limits.max_compute_invocations_per_workgroup
        ));
    }
    attention_sg::blocks(sg, bucket).ok_or_else(|| {
        format!("the subgroup kernels have no blocks for subgroups of {sg} lanes at head dim {d}")
    })
}

/// The workgroup tiles for head dim `d` (on a CPU adapter if `cpu`), with workgroup memory
/// capped at `workgroup_bytes` if given.
fn tiles(
    limits: &DeviceLimits,
    d: usize,
    workgroup_bytes: Option<u32>,
    cpu: bool,
) -> std::result::Result<Tiles, String> {
    let bucket = checked_bucket(limits, d)?;
    if limits.max_compute_invocations_per_workgroup < ROWS {
        return Err(format!(
            "the kernels run {ROWS} invocations per workgroup, the adapter allows {}",
            limits.max_compute_invocations_per_workgroup
        ));
    }
    let bytes = limits
        .max_compute_workgroup_storage_size
        .min(workgroup_bytes.unwrap_or(u32::MAX));
    let tiles = |cols| Tiles {
        rows: ROWS,
        cols,
        quads: bucket / 4,
        per_invocation: rows_per_invocation(cpu, bucket / 4),
    };
    COLS.iter()
        .map(|&c| tiles(c))
        .find(|t| t.workgroup_bytes() <= bytes)
        .ok_or_else(|| {
            format!(
                "head dim {d} needs {} bytes of workgroup memory at the smallest tiles, the \
                 adapter has {bytes}",
                tiles(COLS[COLS.len() - 1]).workgroup_bytes()
            )
        })
}

/// The scores' scale, 1 / sqrt(D): one copy for the fused kernels and the composed path.
pub(crate) fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

/// The problem: BH (batch * heads) query matrices of (T, D), scale 1 / sqrt(D), and
/// BH / `group` key and value matrices (grouped-query heads: query matrix m reads kv matrix
/// m / group; 1 is plain multi-head attention).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub bh: usize,
    pub t: usize,
    pub d: usize,
    pub causal: bool,
    pub group: usize,
}

impl Dims {
    /// The uniform words of include/attention_params.wgsl's `Params` for workgroups of
    /// `rows` rows each, and the workgroups: over the query matrices, or over the kv matrices
    /// for the dK / dV pass (each sums its group's query heads).
    fn launch(&self, rows: u32, pass: Pass) -> ([u32; 8], u32) {
        let row_tiles = self.t.div_ceil(rows as usize);
        let matrices = match pass {
            Pass::Dkv => self.bh / self.group,
            _ => self.bh,
        };
        // The caller checked that every element index, hence this product, fits u32.
        let groups = (row_tiles * matrices) as u32;
        (
            [
                groups,
                row_tiles as u32,
                self.t as u32,
                self.d as u32,
                u32::from(self.causal),
                scale(self.d).to_bits(),
                self.group as u32,
                0,
            ],
            groups,
        )
    }

    fn empty(&self) -> bool {
        self.bh == 0 || self.t == 0 || self.d == 0
    }
}

/// The forward (0), dQ (1) and dK / dV (2) passes.
#[derive(Clone, Copy)]
enum Pass {
    Fwd = 0,
    Dq = 1,
    Dkv = 2,
}

/// The kernel of `pass` under `plan` for these storages, its parameters and workgroups. Both
/// variants run without wgpu's bounds checks: every global index is clamped into its row or
/// guarded by the row's length (`quad_len`, `row_*` / `put_*`), and every workgroup-array index
/// is below its size by the loop bounds; tests cover T = 1, odd D and partial tiles.
fn pipeline(
    dev: &Device,
    pass: Pass,
    storage: &[Storage],
    plan: Plan,
    dims: Dims,
) -> Result<(Arc<Kernel>, [u32; 8], u32)> {
    let mut key = String::new();
    for s in storage {
        key += &format!("_{s:?}");
    }
    let (kernel, rows) = match plan {
        Plan::Tiles(tiles) => {
            let file = [&ATTENTION_FWD, &ATTENTION_BWD_DQ, &ATTENTION_BWD_DKV][pass as usize];
            let consts = consts(tiles);
            for (name, v) in consts {
                key += &format!("_{name}{v}");
            }
            let k = dev.kernel(&format!("{}_trusted{key}", file.name), &[], true, || {
                assemble(&specialize(file.body, &consts), &file.with_storage(storage))
            })?;
            (k, tiles.rows * tiles.per_invocation)
        }
        Plan::Subgroup(blocks) => {
            let file = attention_sg::file(pass as usize);
            let block = match pass {
                Pass::Dkv => blocks.keys,
                _ => blocks.queries,
            };
            // Rows start on quads when D % 4 == 0: q, k, v and the outputs are read and
            // written as quads.
            let vec = dims.d.is_multiple_of(4);
            let name = format!("{}_{block:?}_vec{vec}{key}", file.name);
            let k = dev.kernel(&name, &[], true, || {
                attention_sg::source(file, block, vec, storage)
            })?;
            (k, block.rows)
        }
    };
    let (params, groups) = dims.launch(rows, pass);
    Ok((kernel, params, groups))
}

fn consts(t: Tiles) -> [(&'static str, u32); 4] {
    [
        ("R", t.rows),
        ("C", t.cols),
        ("S", t.quads),
        ("RB", t.per_invocation),
    ]
}

/// o (BH, T, D) = attention of q (BH, T, D), k and v (BH / group, T, D; q's dtype) and lse (BH, T, f32) = each query's
/// log-sum-exp of its scaled scores. `o` may be an f32 staging tensor (packed f16 with D odd).
pub(crate) fn forward<T: Operand>(
    q: &T,
    k: &T,
    v: &T,
    dims: Dims,
    plan: Plan,
    o: &T,
    lse: &T,
) -> Result<()> {
    if dims.empty() {
        return Ok(());
    }
    let dev = q.device();
    let s = Storage::of(dev, q.dtype());
    let storage = [s, s, s, Storage::of(dev, o.dtype()), Storage::F32];
    let (kernel, params, groups) = pipeline(dev, Pass::Fwd, &storage, plan, dims)?;
    dev.dispatch(
        &kernel,
        &params,
        &[q.block(), k.block(), v.block(), o.block(), lse.block()],
        groups,
    )
}

/// Pass 1 of the backward: dq (BH, T, D; may be f32 staging) and delta (BH, T, f32) = dO . O per
/// row, from the forward's inputs, output o and lse, and the output's gradient dy (q's dtype).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_dq<T: Operand>(
    q: &T,
    k: &T,
    v: &T,
    o: &T,
    dy: &T,
    lse: &T,
    dims: Dims,
    plan: Plan,
    dq: &T,
    delta: &T,
) -> Result<()> {
    if dims.empty() {
        return Ok(());
    }
    let dev = q.device();
    let s = Storage::of(dev, q.dtype());
    let f = Storage::F32;
    let storage = [s, s, s, s, s, f, Storage::of(dev, dq.dtype()), f];
    let (kernel, params, groups) = pipeline(dev, Pass::Dq, &storage, plan, dims)?;
    dev.dispatch(
        &kernel,
        &params,
        &[
            q.block(),
            k.block(),
            v.block(),
            o.block(),
            dy.block(),
            lse.block(),
            dq.block(),
            delta.block(),
        ],
        groups,
    )
}

/// Pass 2 of the backward: dk and dv (k's shape, BH / group matrices; may be f32 staging)
/// from q, k, v, dy, lse and pass 1's delta, each summed over its group's query heads in order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_dkv<T: Operand>(
    q: &T,
    k: &T,
    v: &T,
    dy: &T,
    lse: &T,
    delta: &T,
    dims: Dims,
    plan: Plan,
    dk: &T,
    dv: &T,
) -> Result<()> {
    if dims.empty() {
        return Ok(());
    }
    let dev = q.device();
    debug_assert_eq!(dk.dtype(), dv.dtype());
    let s = Storage::of(dev, q.dtype());
    let f = Storage::F32;
    let storage = [
        s,
        s,
        s,
        s,
        f,
        f,
        Storage::of(dev, dk.dtype()),
        Storage::of(dev, dv.dtype()),
    ];
    let (kernel, params, groups) = pipeline(dev, Pass::Dkv, &storage, plan, dims)?;
    dev.dispatch(
        &kernel,
        &params,
        &[
            q.block(),
            k.block(),
            v.block(),
            dy.block(),
            lse.block(),
            delta.block(),
            dk.block(),
            dv.block(),
        ],
        groups,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{assemble, specialize, validate_wgsl};

    fn limits(workgroup: u32) -> DeviceLimits {
        DeviceLimits {
            max_storage_buffer_binding_size: 128 << 20,
            max_buffer_size: 256 << 20,
            max_compute_workgroup_storage_size: workgroup,
            max_compute_invocations_per_workgroup: 256,
            max_compute_workgroups_per_dimension: 65535,
            max_storage_buffers_per_shader_stage: 8,
            min_storage_buffer_offset_alignment: 256,
            min_uniform_buffer_offset_alignment: 256,
        }
    }

    fn plan_cpu(
        l: &DeviceLimits,
        d: usize,
        bytes: Option<u32>,
    ) -> std::result::Result<Tiles, String> {
        tiles(l, d, bytes, true)
    }

    #[test]
    fn tiles_fit_the_workgroup_memory() {
        for bytes in [16 << 10, 32 << 10, 48 << 10] {
            for d in [1, 16, 24, 32, 33, 40, 64, 65, 100, 128] {
                let t = plan_cpu(&limits(bytes), d, None).unwrap();
                assert!(t.workgroup_bytes() <= bytes, "{d} {t:?}");
                assert!(4 * t.quads as usize >= d);
            }
        }
        // D = 128 stages 32 rows per tile in lavapipe's 32 KiB, 16 in WebGPU's default 16 KiB.
        assert_eq!(plan_cpu(&limits(32 << 10), 128, None).unwrap().cols, 32);
        let small = plan_cpu(&limits(16 << 10), 128, None).unwrap();
        assert_eq!(small.cols, 16);
        assert_eq!(plan_cpu(&limits(16 << 10), 64, None).unwrap().cols, 32);
        // The cap applies below the adapter's own limit.
        assert_eq!(plan_cpu(&limits(32 << 10), 128, Some(16 << 10)), Ok(small));
        assert_eq!(
            plan_cpu(&limits(32 << 10), 100, Some(8 << 10))
                .unwrap()
                .cols,
            8
        );
    }

    #[test]
    fn unsupported_head_dims_and_adapters_say_why() {
        for d in [0, 129, 4096] {
            let e = plan_cpu(&limits(32 << 10), d, None).unwrap_err();
            assert!(e.contains("head dim"), "{e}");
        }
        let e = plan_cpu(&limits(4 << 10), 128, None).unwrap_err();
        assert!(e.contains("workgroup memory"), "{e}");
        let mut l = limits(32 << 10);
        l.max_storage_buffers_per_shader_stage = 4;
        assert!(plan_cpu(&l, 64, None)
            .unwrap_err()
            .contains("storage buffers"));
    }

    #[test]
    fn cpu_adapters_hold_several_rows() {
        let l = limits(32 << 10);
        assert_eq!(tiles(&l, 64, None, false).unwrap().per_invocation, 1);
        assert_eq!(tiles(&l, 128, None, false).unwrap().per_invocation, 1);
        assert_eq!(tiles(&l, 32, None, true).unwrap().per_invocation, 2);
        assert_eq!(tiles(&l, 64, None, true).unwrap().per_invocation, 2);
        assert_eq!(tiles(&l, 128, None, true).unwrap().per_invocation, 1);
    }

    /// CPU adapters with subgroups run the subgroup blocks; GPUs, GL and adapters without
    /// subgroups the tiles; forcing the subgroup blocks says why where they cannot run.
    #[test]
    fn the_plan_follows_the_adapter() {
        let l = limits(32 << 10);
        for d in [1, 32, 64, 100, 128] {
            assert!(matches!(
                plan(&l, d, Choice::Auto, true, Some(8)),
                Ok(Plan::Subgroup(_))
            ));
            for (cpu, sg) in [(false, Some(32)), (true, None), (false, None)] {
                assert!(matches!(
                    plan(&l, d, Choice::Auto, cpu, sg),
                    Ok(Plan::Tiles(_))
                ));
            }
            assert!(matches!(
                plan(&l, d, Choice::Tiles(None), true, Some(8)),
                Ok(Plan::Tiles(_))
            ));
        }
        let e = plan(&l, 64, Choice::Subgroup, true, None).unwrap_err();
        assert!(e.contains("subgroups"), "{e}");
        // 64 lanes cannot each own whole column quads of a 32-wide head.
        let e = plan(&l, 32, Choice::Subgroup, false, Some(64)).unwrap_err();
        assert!(e.contains("no blocks"), "{e}");
        let e = plan(&l, 129, Choice::Subgroup, true, Some(8)).unwrap_err();
        assert!(e.contains("head dim"), "{e}");
    }

    /// Every tile specialization the plans can choose parses and validates, in every storage.
    #[test]
    fn specialized_variants_validate() {
        let mut seen = Vec::new();
        for bytes in [8 << 10, 16 << 10, 32 << 10] {
            for d in [32, 64, 128] {
                for cpu in [false, true] {
                    let t = tiles(&limits(bytes), d, None, cpu).unwrap();
                    if !seen.contains(&t) {
                        seen.push(t);
                    }
                }
            }
        }
        for file in [&ATTENTION_FWD, &ATTENTION_BWD_DQ, &ATTENTION_BWD_DKV] {
            for &t in &seen {
                for storage in crate::kernels::storage_variants(file) {
                    let src = assemble(
                        &specialize(file.body, &consts(t)),
                        &file.with_storage(&storage),
                    );
                    if let Err(e) = validate_wgsl(&src) {
                        panic!("{} {t:?} {storage:?}: {e}", file.name);
                    }
                }
            }
        }
    }
}
