//! Dispatch for conv2d as implicit GEMM: the forward (shaders/conv2d_fwd.wgsl), the input's
//! gradient as a transposed convolution (shaders/conv2d_dx.wgsl) and the weight's gradient as
//! fixed-range partial sums over the positions (shaders/conv2d_dw.wgsl, then the reduce kernel).
//! Every kernel gathers its operand from the NCHW tensor itself: no column buffer exists.

use super::{
    assemble, matmul, reduce, specialize, Operand, ShaderFile, Storage, CONV2D_DW, CONV2D_DX,
    CONV2D_FWD,
};
use crate::device::{Device, Kernel};
use crate::Result;
use std::sync::Arc;

/// Invocations per workgroup, as in the shaders: lanes span positions (or weight columns).
const WG_X: usize = 64;
/// Positions (forward, dx) or weight columns (dw) per invocation; even, so a packed f16 word
/// of an even plane is written by one invocation.
const TN: usize = 4;
/// The fewest positions one weight-gradient partial sums: below it the partials' second pass
/// costs more than the parallel work gains.
const MIN_CHUNK: usize = 64;
/// The most bytes of weight-gradient partial sums (f32): the one workspace the backward uses,
/// small and fixed whatever the batch.
pub(crate) const MAX_PARTIAL_BYTES: usize = 512 << 10;

/// The geometry of one conv2d, everything the kernels need besides the data: x is (n, c, h, w),
/// the weight (oc, c / groups, kh, kw), the output (n, oc, oh, ow). Sizes are checked by the
/// caller (output >= 1, groups dividing both channel counts, every index within u32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub n: usize,
    pub c: usize,
    pub h: usize,
    pub w: usize,
    pub oc: usize,
    pub kh: usize,
    pub kw: usize,
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub groups: usize,
    pub oh: usize,
    pub ow: usize,
}

impl Geometry {
    /// Input channels per group.
    pub fn cg(&self) -> usize {
        self.c / self.groups
    }

    /// Output channels per group.
    pub fn ocg(&self) -> usize {
        self.oc / self.groups
    }

    /// The weight's element count, oc cg kh kw.
    pub fn weight_numel(&self) -> usize {
        self.oc * self.cg() * self.kh * self.kw
    }

    /// The uniform words of include/conv2d_params.wgsl, with `m_blocks` blocks of rows per
    /// group and the weight gradient's chunking.
    fn params(&self, m_blocks: usize, has_bias: bool, chunk: usize, chunks: usize) -> [u32; 24] {
        self.params_dw(m_blocks, has_bias, chunk, chunks, 1, false)
    }

    /// [`params`](Self::params) with the weight gradient's `k_lanes` (see [`dw_k_lanes`]) and
    /// whether its one chunk continues from the gradient held (`onto`).
    fn params_dw(
        &self,
        m_blocks: usize,
        has_bias: bool,
        chunk: usize,
        chunks: usize,
        k_lanes: usize,
        onto: bool,
    ) -> [u32; 24] {
        let v = [
            self.n,
            self.c,
            self.h,
            self.w,
            self.oc,
            self.oh,
            self.ow,
            self.groups,
            self.kh,
            self.kw,
            self.stride[0],
            self.stride[1],
            self.padding[0],
            self.padding[1],
            self.dilation[0],
            self.dilation[1],
            self.cg(),
            self.ocg(),
            m_blocks,
            usize::from(has_bias),
            chunk,
            chunks,
            k_lanes,
            usize::from(onto),
        ];
        v.map(|x| x as u32)
    }

    /// The weight gradient's partial sums: (positions per chunk, chunks). Chunks of at least
    /// MIN_CHUNK positions, as many as MAX_PARTIAL_BYTES of partials allow; a function of the
    /// shape alone, so the order of additions is too.
    pub fn dw_chunks(&self) -> (usize, usize) {
        let total = self.n * self.oh * self.ow;
        let by_bytes = (MAX_PARTIAL_BYTES / (4 * self.weight_numel().max(1))).max(1);
        let want = (total / MIN_CHUNK).clamp(1, by_bytes.min(65_535));
        let chunk = total.div_ceil(want).max(1);
        (chunk, total.div_ceil(chunk).max(1))
    }
}

/// The lanes of a weight-gradient workgroup that span blocks of TN weight columns, the rest of
/// its WG_X lanes spanning chunks: the widest power of two that leaves at most an eighth of
/// the `kblocks` blocks' lanes idle past the end, so a small kdim fills the workgroup with
/// chunks rather than idle lanes.
fn dw_k_lanes(kblocks: usize) -> usize {
    [64, 32, 16, 8, 4, 2, 1]
        .into_iter()
        .find(|&l| kblocks.next_multiple_of(l) - kblocks <= kblocks / 8)
        .unwrap_or(1)
}

/// Rows per invocation for `rows` output channels (or input channels, for dx) per group: 32
/// where the group's blocks of 32 leave at most an eighth of their rows idle, else the largest
/// of 16, 8, 4 that a group fills, else one (depthwise), so few lanes compute rows they drop.
/// Each gathered input value feeds this many rows: on lavapipe 32 rows ran the stride-2 bench
/// shape's forward + backward 1.13x faster than 16 and the 56x56 one 1.23x; 64 ran slower.
fn tile_rows(rows: usize) -> usize {
    match rows {
        32.. if rows.next_multiple_of(32) - rows <= rows / 8 => 32,
        16.. => 16,
        8.. => 8,
        4.. => 4,
        _ => 1,
    }
}

/// The rows per invocation of one conv2d kernel (`which`: fwd, dx or dw) over a GEMM of
/// `[rows, cols, k]` per group (rows: channels per group; cols: what the lanes span; k: the
/// terms of each sum): through the autotuner ([`matmul::select_named`], one class per kernel,
/// storage, subgroup size, stride and power-of-two buckets of the three sizes), whose
/// candidates are 32, 16, 8, 4 and 1 rows up to what a group fills and whose built-in choice is
/// [`tile_rows`]. `run` dispatches the kernel with a candidate, on the real operands.
fn choose_rows(
    dev: &Device,
    which: &str,
    s: Storage,
    geo: &Geometry,
    [rows, cols, k]: [usize; 3],
    run: impl Fn(usize) -> Result<()>,
) -> Result<usize> {
    let cands: Vec<usize> = [32, 16, 8, 4, 1]
        .into_iter()
        .filter(|&t| t <= rows.max(1))
        .collect();
    let fallback = cands
        .iter()
        .position(|&t| t == tile_rows(rows))
        .unwrap_or(0);
    let b = |v: usize| v.next_power_of_two();
    let class = format!(
        "conv2d_{which} {s:?} sg{:?} s{}x{} rows{} cols{} k{}",
        subgroups(dev),
        geo.stride[0],
        geo.stride[1],
        b(rows),
        b(cols),
        b(k)
    );
    let names: Vec<String> = cands.iter().map(|t| format!("rows{t}")).collect();
    let flops = 2 * geo.groups * rows * cols * k;
    let i = matmul::select_named(dev, class, flops, &names, fallback, |i| run(cands[i]))?;
    Ok(cands[i])
}

/// Expands the `//@` lines of a conv2d shader (already specialized) for a `tm`-row tile:
/// `//@row STMT` into STMT per row with `{r}` its index; `//@uni NAME EXPR` into the rows' base
/// offsets (`{r}` in EXPR a u32 row); `//@get NAME VAR LOAD OFF` into `VAR{r}`, row r's value at
/// `NAME{r} + OFF`; `//@lane` into the subgroup lane builtin. With `sg` (the adapter's fixed
/// subgroup size) the uniform rows are loaded one per lane (lane l: rows l, l + sg, ...) and
/// handed out with subgroupBroadcast; without, every lane loads each row itself. Accumulators
/// and offsets are plain variables, which CPU compilers keep in registers.
pub fn expand_rows(body: &str, tm: usize, sg: Option<usize>) -> String {
    let mut out = String::with_capacity(body.len() + tm * 400);
    let loads = sg.map_or(0, |sg| tm.div_ceil(sg));
    for line in body.lines() {
        let t = line.trim_start();
        let pad = &line[..line.len() - t.len()];
        let mut emit = |stmt: String| {
            out += pad;
            out += &stmt;
            out.push('\n');
        };
        if t.starts_with("const SUBGROUPS: bool =") {
            emit(format!("const SUBGROUPS: bool = {};", sg.is_some()));
        } else if let Some(stmt) = t.strip_prefix("//@row ") {
            for r in 0..tm {
                emit(stmt.replace("{r}", &r.to_string()));
            }
        } else if let Some(rest) = t.strip_prefix("//@uni ") {
            let (name, expr) = rest.split_once(' ').expect("//@uni NAME EXPR");
            match sg {
                Some(sg) => {
                    for i in 0..loads {
                        let row = format!("({}u + lane)", i * sg);
                        emit(format!("let {name}{i} = {};", expr.replace("{r}", &row)));
                    }
                }
                None => {
                    for r in 0..tm {
                        let row = format!("{r}u");
                        emit(format!("let {name}{r} = {};", expr.replace("{r}", &row)));
                    }
                }
            }
        } else if let Some(rest) = t.strip_prefix("//@get ") {
            let f: Vec<&str> = rest.split_whitespace().collect();
            let [name, var, load, off] = f[..] else {
                panic!("//@get NAME VAR LOAD OFFSET");
            };
            match sg {
                Some(sg) => {
                    for i in 0..loads {
                        emit(format!("let {var}_l{i} = f32({load}({name}{i} + {off}));"));
                    }
                    for r in 0..tm {
                        emit(format!(
                            "let {var}{r} = subgroupBroadcast({var}_l{}, {}u);",
                            r / sg,
                            r % sg
                        ));
                    }
                }
                None => {
                    for r in 0..tm {
                        emit(format!("let {var}{r} = f32({load}({name}{r} + {off}));"));
                    }
                }
            }
        } else if t.starts_with("//@lane") {
            if sg.is_some() {
                emit("@builtin(subgroup_invocation_id) lane: u32,".into());
            }
        } else {
            out += line;
            out.push('\n');
        }
    }
    out
}

/// The WGSL of a conv2d shader for a `tm`-row tile, expanded (see [`expand_rows`]).
pub fn source(file: &ShaderFile, storage: &[Storage], tm: usize, sg: Option<usize>) -> String {
    let body = specialize(
        file.body,
        &[("TM", tm as u32), ("TN", TN as u32), ("WG_X", WG_X as u32)],
    );
    assemble(&expand_rows(&body, tm, sg), &file.with_storage(storage))
}

/// The adapter's fixed subgroup size, where it has subgroups and it divides the workgroup.
fn subgroups(dev: &Device) -> Option<usize> {
    let sg = dev.info().subgroup_size? as usize;
    WG_X.is_multiple_of(sg).then_some(sg)
}

/// The compiled kernel of a conv2d shader for a `tm`-row tile, cached on the device.
fn kernel(
    file: &ShaderFile,
    dev: &Device,
    storage: &[Storage],
    tm: usize,
    sg: Option<usize>,
) -> Result<Arc<Kernel>> {
    let mut key = format!("{}_rows{tm}_tn{TN}_wg{}_sg{sg:?}", file.name, WG_X);
    for s in storage {
        key.push('_');
        key.push_str(s.tag());
    }
    dev.kernel(&key, &[], false, || source(file, storage, tm, sg))
}

/// y (n, oc, oh, ow) = conv2d(x, wt) + bias (oc, x's dtype, optional). y needs no f32 staging
/// ([`super::softmax::needs_f32_staging`] of the plane oh ow).
pub(crate) fn forward<T: Operand>(
    x: &T,
    wt: &T,
    bias: Option<&T>,
    geo: &Geometry,
    y: &T,
) -> Result<()> {
    let total = geo.n * geo.oh * geo.ow;
    if total == 0 || geo.oc == 0 {
        return Ok(());
    }
    let dev = x.device();
    let s = Storage::of(dev, x.dtype());
    let storage = [s, s, s, Storage::of(dev, y.dtype())];
    let b = bias.unwrap_or(wt);
    let run = |tm: usize| {
        let m_blocks = geo.ocg().div_ceil(tm);
        let k = kernel(&CONV2D_FWD, dev, &storage, tm, subgroups(dev))?;
        dev.dispatch3(
            &k,
            &geo.params(m_blocks, bias.is_some(), 0, 0),
            &[x.block(), wt.block(), b.block(), y.block()],
            [
                total.div_ceil(TN * WG_X) as u32,
                (geo.groups * m_blocks) as u32,
                1,
            ],
        )
    };
    let kdim = geo.cg() * geo.kh * geo.kw;
    let tm = choose_rows(dev, "fwd", s, geo, [geo.ocg(), total, kdim], run)?;
    run(tm)
}

/// dx (n, c, h, w) = the gradient of conv2d's input from the output's gradient dy (n, oc, oh,
/// ow) and the weight, both in x's dtype, one stride phase per grid z. dx needs f32 staging
/// where [`dx_needs_staging`] says so.
pub(crate) fn backward_dx<T: Operand>(dy: &T, wt: &T, geo: &Geometry, dx: &T) -> Result<()> {
    let total = geo.n * geo.h * geo.w;
    if total == 0 || geo.c == 0 {
        return Ok(());
    }
    let dev = dy.device();
    let s = Storage::of(dev, dy.dtype());
    let storage = [s, s, Storage::of(dev, dx.dtype())];
    // The largest phase, (0, 0), has ceil(h / sh) ceil(w / sw) positions per sample.
    let [sh, sw] = geo.stride;
    let phase = geo.n * geo.h.div_ceil(sh) * geo.w.div_ceil(sw);
    let run = |tm: usize| {
        let m_blocks = geo.cg().div_ceil(tm);
        let k = kernel(&CONV2D_DX, dev, &storage, tm, subgroups(dev))?;
        dev.dispatch3(
            &k,
            &geo.params(m_blocks, false, 0, 0),
            &[dy.block(), wt.block(), dx.block()],
            [
                phase.div_ceil(TN * WG_X) as u32,
                (geo.groups * m_blocks) as u32,
                (sh.min(geo.h) * sw.min(geo.w)) as u32,
            ],
        )
    };
    // Each position takes about ocg kh kw / (sh sw) terms.
    let kdim = (geo.ocg() * geo.kh * geo.kw).div_ceil(sh * sw);
    let tm = choose_rows(dev, "dx", s, geo, [geo.cg(), total, kdim], run)?;
    run(tm)
}

/// Whether dx of dtype `dt` must be written to f32 first: packed f16 words are written whole
/// only for unit stride and an even plane (a strided phase holds every other element).
pub(crate) fn dx_needs_staging(dev: &Device, dt: crate::DType, geo: &Geometry) -> bool {
    Storage::of(dev, dt) == Storage::F16Packed
        && (!(geo.h * geo.w).is_multiple_of(2) || geo.stride != [1, 1])
}

/// The dims of the f32 partial sums [`backward_dw`] needs: (chunks, weight elements) with
/// several chunks, `None` when one chunk writes the gradient directly.
pub(crate) fn dw_partials(geo: &Geometry) -> Option<[usize; 2]> {
    let (_, chunks) = geo.dw_chunks();
    (chunks > 1 && geo.weight_numel() > 0).then_some([chunks, geo.weight_numel()])
}

/// dw (the weight's elements, f32) = the gradient of conv2d's weight from dy (n, oc, oh, ow)
/// and x (n, c, h, w), both in one dtype. `partials` are f32 of the dims [`dw_partials`] gives
/// (where it gives any). With no positions (n = 0) the gradient is zero.
pub(crate) fn backward_dw<T: Operand>(
    dy: &T,
    x: &T,
    geo: &Geometry,
    partials: Option<&T>,
    dw: &T,
) -> Result<()> {
    if geo.weight_numel() == 0 {
        return Ok(());
    }
    debug_assert_eq!(
        partials.map(|p| p.dims().to_vec()),
        dw_partials(geo).map(|d| d.to_vec())
    );
    let (chunk, chunks) = geo.dw_chunks();
    run_dw(
        dy,
        x,
        geo,
        (chunk, chunks),
        false,
        partials.unwrap_or(dw),
        true,
    )?;
    if let Some(p) = partials {
        reduce::reduce(p, 1, chunks, geo.weight_numel(), 1.0, dw)?;
    }
    Ok(())
}

/// The batch-invariant weight gradient: as [`backward_dw`] with every position added in order
/// (n, oh, ow) by one sum per weight element, no partials, from zero or (`onto`) continuing
/// from what dw holds, so folding a batch's consecutive runs of samples one after another gives
/// the whole batch's bits.
pub(crate) fn backward_dw_fold<T: Operand>(
    dy: &T,
    x: &T,
    geo: &Geometry,
    onto: bool,
    dw: &T,
) -> Result<()> {
    if geo.weight_numel() == 0 {
        return Ok(());
    }
    let total = geo.n * geo.oh * geo.ow;
    // No tuning: a timed try would fold the batch in more than once.
    run_dw(dy, x, geo, (total.max(1), 1), onto, dw, false)
}

/// One dispatch of shaders/conv2d_dw.wgsl over `chunks` of `chunk` positions into `part`,
/// its rows per invocation autotuned where `tune`.
fn run_dw<T: Operand>(
    dy: &T,
    x: &T,
    geo: &Geometry,
    (chunk, chunks): (usize, usize),
    onto: bool,
    part: &T,
    tune: bool,
) -> Result<()> {
    let kdim = geo.cg() * geo.kh * geo.kw;
    let dev = x.device();
    let s = Storage::of(dev, x.dtype());
    let kblocks = kdim.div_ceil(TN);
    // One chunk leaves no chunks for a workgroup's other lanes: all of them span kk.
    let k_lanes = if chunks == 1 {
        WG_X
    } else {
        dw_k_lanes(kblocks)
    };
    // Subgroup broadcasts of dy only where every subgroup lies within one chunk.
    let sg = subgroups(dev).filter(|&sg| k_lanes.is_multiple_of(sg));
    let run = |tm: usize| {
        let m_blocks = geo.ocg().div_ceil(tm);
        let k = kernel(&CONV2D_DW, dev, &[s, s, Storage::F32], tm, sg)?;
        dev.dispatch3(
            &k,
            &geo.params_dw(m_blocks, false, chunk, chunks, k_lanes, onto),
            &[dy.block(), x.block(), part.block()],
            [
                kblocks.div_ceil(k_lanes) as u32,
                (geo.groups * m_blocks) as u32,
                chunks.div_ceil(WG_X / k_lanes) as u32,
            ],
        )
    };
    let positions = geo.n * geo.oh * geo.ow;
    let tm = if tune {
        choose_rows(dev, "dw", s, geo, [geo.ocg(), kdim, positions], run)?
    } else {
        tile_rows(geo.ocg())
    };
    run(tm)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo(n: usize, oh: usize, ow: usize, oc: usize, c: usize) -> Geometry {
        Geometry {
            n,
            c,
            h: oh,
            w: ow,
            oc,
            kh: 3,
            kw: 3,
            stride: [1, 1],
            padding: [1, 1],
            dilation: [1, 1],
            groups: 1,
            oh,
            ow,
        }
    }

    #[test]
    fn weight_partials_stay_small_and_cover_every_position() {
        for g in [
            geo(1, 1, 1, 1, 1),
            geo(2, 5, 7, 3, 2),
            geo(32, 56, 56, 64, 64),
            geo(32, 28, 28, 256, 128),
            geo(0, 4, 4, 2, 2),
        ] {
            let (chunk, chunks) = g.dw_chunks();
            let total = g.n * g.oh * g.ow;
            assert!(chunk * chunks >= total, "{g:?}");
            assert!(chunk * (chunks - 1) < total.max(1), "{g:?}: an empty chunk");
            if chunks > 1 {
                assert!(chunk >= MIN_CHUNK);
                assert!(chunks * g.weight_numel() * 4 <= MAX_PARTIAL_BYTES, "{g:?}");
            }
        }
        // 64 -> 64 channels, 3x3: 36,864 weights, so 3 chunks in 512 KiB.
        assert_eq!(geo(32, 56, 56, 64, 64).dw_chunks().1, 3);
    }

    #[test]
    fn weight_gradient_lanes_leave_few_idle() {
        // (blocks of TN weight columns, k_lanes): one input channel 3x3 is 3 blocks, each lane
        // its own chunk; 16 -> 32 channels 1x1 is 4; 3x3 over 16, 32 and 64 channels is 36, 72
        // and 144 blocks.
        for (kblocks, lanes) in [
            (1, 1),
            (3, 1),
            (4, 4),
            (8, 8),
            (36, 8),
            (72, 16),
            (144, 32),
            (256, 64),
        ] {
            assert_eq!(dw_k_lanes(kblocks), lanes, "{kblocks} blocks");
        }
        for kblocks in 1..600 {
            let l = dw_k_lanes(kblocks);
            assert!(WG_X.is_multiple_of(l) && kblocks.next_multiple_of(l) - kblocks <= kblocks / 8);
        }
    }
}
