//! Dispatch for fused self-attention (flash-attention style): the forward
//! (shaders/attention_fwd.wgsl) keeps only the output and one log-sum-exp per row; the backward
//! rebuilds the probabilities tile by tile, the queries' gradient and each row's
//! `delta = dO . O` first (shaders/attention_bwd_dq.wgsl), then the keys' and values' gradients
//! (shaders/attention_bwd_dkv.wgsl). Tile sizes are chosen per head dim from the adapter's
//! workgroup memory.

use super::Operand;
use super::{Storage, ATTENTION_BWD_DKV, ATTENTION_BWD_DQ, ATTENTION_FWD};
use crate::device::DeviceLimits;
use crate::Result;

/// Lanes per row (G in shaders/include/attention_tiles.wgsl): they split a row's score columns
/// and its output quads, so G divides every tile size and every bucket / 4.
const LANES: u32 = 4;

/// The largest head dim the kernels hold: a row is staged as at most 128 / 4 quads.
pub(crate) const MAX_HEAD_DIM: usize = 128;

/// (rows per workgroup, rows of the other side per tile), in order of preference: more rows per
/// workgroup reuse each staged tile more; bigger tiles mean fewer barriers.
const TILES: [(u32, u32); 6] = [(32, 32), (32, 16), (16, 16), (16, 8), (8, 16), (8, 8)];

/// The three kernels, whose workgroup memory differs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Q (R rows), one K / V tile (C rows), the (R, C) scores.
    Forward,
    /// Q and dO (R rows each), one K / V tile, the (R, C) dS.
    Dq,
    /// K and V (R rows each), one Q / dO tile, the (R, C) P and dS.
    Dkv,
}

/// One kernel's tile: `rows` per workgroup, `cols` rows of the other side per step, each row
/// staged as `quads` vec4s (the head dim's bucket / 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tiles {
    pub rows: u32,
    pub cols: u32,
    pub quads: u32,
}

impl Tiles {
    /// Bytes of workgroup memory `pass` declares with these tiles.
    pub(crate) fn workgroup_bytes(self, pass: Pass) -> u32 {
        let (r, c, row) = (self.rows, self.cols, 4 * self.quads);
        let floats = match pass {
            Pass::Forward => (r + c) * row + r * c,
            Pass::Dq => (2 * r + c) * row + r * c,
            Pass::Dkv => (2 * r + c) * row + 2 * r * c,
        };
        4 * floats
    }

    fn invocations(self) -> u32 {
        self.rows * LANES
    }
}

/// The tiles of the three kernels for one head dim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub forward: Tiles,
    pub dq: Tiles,
    pub dkv: Tiles,
}

/// The head-dim bucket rows are staged in: 32, 64 or 128 elements (few buckets, few pipelines).
fn bucket(d: usize) -> Option<u32> {
    match d {
        1..=32 => Some(32),
        33..=64 => Some(64),
        65..=MAX_HEAD_DIM => Some(128),
        _ => None,
    }
}

/// The tiles for head dim `d` on an adapter with `limits`, with workgroup memory capped at
/// `workgroup_bytes` if given (tests run the small-memory tiles on a larger adapter); the
/// reason the fused kernels cannot run otherwise.
pub(crate) fn plan(
    limits: &DeviceLimits,
    d: usize,
    workgroup_bytes: Option<u32>,
) -> std::result::Result<Plan, String> {
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
    let bytes = limits
        .max_compute_workgroup_storage_size
        .min(workgroup_bytes.unwrap_or(u32::MAX));
    let pick = |pass: Pass| {
        TILES
            .iter()
            .map(|&(rows, cols)| Tiles {
                rows,
                cols,
                quads: bucket / 4,
            })
            .find(|t| {
                t.workgroup_bytes(pass) <= bytes
                    && t.invocations() <= limits.max_compute_invocations_per_workgroup
            })
            .ok_or_else(|| {
                format!(
                    "head dim {d} needs {} bytes of workgroup memory in the {pass:?} pass at the \
                     smallest tiles, the adapter has {bytes}",
                    Tiles {
                        rows: 8,
                        cols: 8,
                        quads: bucket / 4
                    }
                    .workgroup_bytes(pass)
                )
            })
    };
    Ok(Plan {
        forward: pick(Pass::Forward)?,
        dq: pick(Pass::Dq)?,
        dkv: pick(Pass::Dkv)?,
    })
}

/// Every storage combination the attention shaders are built in (the registry's validation).
pub(crate) fn storage_variants(name: &str) -> Vec<Vec<Storage>> {
    use Storage::*;
    let f = F32;
    let mut out: Vec<Vec<Storage>> = Vec::new();
    for (s, o) in [(F32, F32), (F16, F16), (F16Packed, F16Packed), (F16Packed, F32)] {
        out.push(match name {
            // q, k, v, o, lse
            "attention_fwd" => vec![s, s, s, o, f],
            // q, k, v, o, dO, lse, dQ, delta
            "attention_bwd_dq" => vec![s, s, s, s, s, f, o, f],
            // q, k, v, dO, lse, delta, dK, dV
            _ => vec![s, s, s, s, f, f, o, o],
        });
    }
    out
}

/// The scores' scale, 1 / sqrt(D): one copy for the fused kernels and the composed path.
pub(crate) fn scale(d: usize) -> f32 {
    1.0 / (d as f32).sqrt()
}

/// The problem: BH (batch * heads) matrices of (T, D), scale 1 / sqrt(D).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub bh: usize,
    pub t: usize,
    pub d: usize,
    pub causal: bool,
}

impl Dims {
    /// The uniform words of include/attention_tiles.wgsl's `Params`, and the workgroups.
    fn launch(&self, tiles: Tiles) -> ([u32; 8], u32) {
        let row_tiles = self.t.div_ceil(tiles.rows as usize);
        // The caller checked that every element index, hence this product, fits u32.
        let groups = (row_tiles * self.bh) as u32;
        (
            [
                groups,
                row_tiles as u32,
                self.t as u32,
                self.d as u32,
                self.d.div_ceil(4) as u32,
                u32::from(self.causal),
                scale(self.d).to_bits(),
                0,
            ],
            groups,
        )
    }

    fn empty(&self) -> bool {
        self.bh == 0 || self.t == 0 || self.d == 0
    }
}

fn consts(t: Tiles) -> [(&'static str, u32); 3] {
    [("R", t.rows), ("C", t.cols), ("S", t.quads)]
}

/// o (BH, T, D) = attention of q, k, v (BH, T, D, one dtype) and lse (BH, T, f32) = each query's
/// log-sum-exp of its scaled scores. `o` may be an f32 staging tensor (packed f16 with D odd).
pub(crate) fn forward<T: Operand>(
    q: &T,
    k: &T,
    v: &T,
    dims: Dims,
    tiles: Tiles,
    o: &T,
    lse: &T,
) -> Result<()> {
    if dims.empty() {
        return Ok(());
    }
    let dev = q.device();
    let s = Storage::of(dev, q.dtype());
    let storage = [s, s, s, Storage::of(dev, o.dtype()), Storage::F32];
    let kernel = ATTENTION_FWD.kernel_with(dev, &storage, &consts(tiles))?;
    let (params, groups) = dims.launch(tiles);
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
    tiles: Tiles,
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
    let kernel = ATTENTION_BWD_DQ.kernel_with(dev, &storage, &consts(tiles))?;
    let (params, groups) = dims.launch(tiles);
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

/// Pass 2 of the backward: dk and dv (BH, T, D; may be f32 staging) from q, k, v, dy, lse and
/// pass 1's delta.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_dkv<T: Operand>(
    q: &T,
    k: &T,
    v: &T,
    dy: &T,
    lse: &T,
    delta: &T,
    dims: Dims,
    tiles: Tiles,
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
    let storage = [s, s, s, s, f, f, Storage::of(dev, dk.dtype()), Storage::of(dev, dv.dtype())];
    let kernel = ATTENTION_BWD_DKV.kernel_with(dev, &storage, &consts(tiles))?;
    let (params, groups) = dims.launch(tiles);
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
    use crate::kernels::{assemble, specialize, validate_wgsl, ShaderFile};

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

    #[test]
    fn tiles_fit_the_workgroup_memory() {
        for bytes in [16 << 10, 32 << 10, 48 << 10] {
            for d in [1, 16, 24, 32, 33, 40, 64, 65, 100, 128] {
                let p = plan(&limits(bytes), d, None).unwrap();
                for (pass, t) in [(Pass::Forward, p.forward), (Pass::Dq, p.dq), (Pass::Dkv, p.dkv)]
                {
                    assert!(t.workgroup_bytes(pass) <= bytes, "{d} {pass:?} {t:?}");
                    assert_eq!(t.quads % LANES, 0);
                    assert_eq!(t.cols % LANES, 0);
                    assert!(4 * t.quads as usize >= d);
                }
            }
        }
        // lavapipe's 32 KiB: the forward at D = 64 takes 32 x 32 tiles (20 KiB), at D = 128
        // 32 x 16 (26 KiB); 16 KiB halves them.
        let p = plan(&limits(32 << 10), 64, None).unwrap();
        assert_eq!((p.forward.rows, p.forward.cols), (32, 32));
        let p = plan(&limits(32 << 10), 128, None).unwrap();
        assert_eq!((p.forward.rows, p.forward.cols), (32, 16));
        assert_eq!((p.dq.rows, p.dq.cols), (16, 16));
        let p = plan(&limits(16 << 10), 128, None).unwrap();
        assert_eq!((p.forward.rows, p.forward.cols), (16, 8));
        assert_eq!((p.dkv.rows, p.dkv.cols), (8, 8));
        // The cap applies below the adapter's own limit.
        assert_eq!(plan(&limits(32 << 10), 128, Some(16 << 10)), Ok(p));
    }

    #[test]
    fn unsupported_head_dims_and_adapters_say_why() {
        for d in [0, 129, 4096] {
            let e = plan(&limits(32 << 10), d, None).unwrap_err();
            assert!(e.contains("head dim"), "{e}");
        }
        let e = plan(&limits(8 << 10), 128, None).unwrap_err();
        assert!(e.contains("workgroup memory"), "{e}");
        let mut l = limits(32 << 10);
        l.max_storage_buffers_per_shader_stage = 4;
        assert!(plan(&l, 64, None).unwrap_err().contains("storage buffers"));
    }

    /// Every tile specialization the plans can choose parses and validates, in every storage.
    #[test]
    fn specialized_variants_validate() {
        let files: [(&ShaderFile, Pass); 3] = [
            (&ATTENTION_FWD, Pass::Forward),
            (&ATTENTION_BWD_DQ, Pass::Dq),
            (&ATTENTION_BWD_DKV, Pass::Dkv),
        ];
        for (file, pass) in files {
            let mut seen = Vec::new();
            for bytes in [16 << 10, 32 << 10] {
                for d in [32, 64, 128] {
                    let p = plan(&limits(bytes), d, None).unwrap();
                    let t = match pass {
                        Pass::Forward => p.forward,
                        Pass::Dq => p.dq,
                        Pass::Dkv => p.dkv,
                    };
                    if !seen.contains(&t) {
                        seen.push(t);
                    }
                }
            }
            for t in seen {
                for storage in storage_variants(file.name) {
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
