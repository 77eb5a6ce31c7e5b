//! Dispatch of shaders/dqmatmul.wgsl: the matmuls of a frozen quantized weight W (R, K), int8
//! per row or NF4 in blocks of 64 (optionally with double-quantized statistics), dequantized
//! in the shader once per element of W and [`TM`] rows of the output, A's values handed
//! between lanes by subgroup broadcasts where the adapter has a fixed subgroup size. The forward C = A · Wᵀ (+ bias) and the input gradient
//! C = A · W; the layouts are described in the shader.

use super::{specialize, Operand, Storage, DQMATMUL};
use crate::{Error, Result};

/// Invocations per workgroup (WG in the shader).
const WG: usize = 64;
/// Row groups per y slice of the grid (ROWS_Y in the shader).
const ROWS_Y: usize = 65535;
/// Rows of C per invocation (TM in the shader).
const TM: usize = 8;
/// Terms per step of the reduction without subgroups (SG in the shader).
const STEP: usize = 8;

/// The weight format, FMT in the shader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    /// int8 rows of `kw` words, one scale per row.
    Int8 { kw: usize },
    /// NF4, one f32 absmax per block of 64.
    Nf4,
    /// NF4 with 8-bit absmax codes (`qa`), one f32 per 256 blocks (`scale`) and the dynamic
    /// map with the offset after it (`dq`, 257 f32).
    Nf4Double,
}

impl Format {
    fn code(self) -> u32 {
        match self {
            Format::Int8 { .. } => 0,
            Format::Nf4 => 1,
            Format::Nf4Double => 2,
        }
    }
}

/// The weight's device buffers: codes `w`, statistics `scale`, and for double quantization the
/// absmax codes `qa` and the table `dq` (others stand in for them when unused).
pub(crate) struct Weight<'a, T: Operand> {
    pub w: &'a T,
    pub scale: &'a T,
    pub qa: &'a T,
    pub dq: &'a T,
    pub format: Format,
    /// (R, K)
    pub rows: usize,
    pub cols: usize,
}

/// `c` = `a` · Wᵀ (+ `bias`) when `!trans` (a (M, K), c (M, R)), else `c` = `a` · W (a (M, R),
/// c (M, K)); f32 throughout. Shapes are checked by the caller.
pub(crate) fn dqmatmul<T: Operand>(
    a: &T,
    wt: &Weight<'_, T>,
    bias: Option<&T>,
    trans: bool,
    m: usize,
    c: &T,
) -> Result<()> {
    let (n, red) = if trans {
        (wt.cols, wt.rows)
    } else {
        (wt.rows, wt.cols)
    };
    if m == 0 || n == 0 {
        return Ok(());
    }
    if wt
        .rows
        .checked_mul(wt.cols)
        .is_none_or(|e| e > u32::MAX as usize)
        || m.checked_mul(n.max(red))
            .is_none_or(|e| e > u32::MAX as usize)
    {
        return Err(Error::Limit {
            op: "dqmatmul",
            what: "elements of a quantized matmul's operand (indices are u32)",
            value: (wt.rows * wt.cols).max(m * n.max(red)) as u64,
            limit: u32::MAX as u64,
        });
    }
    let dev = c.device();
    let sg = dev
        .info()
        .subgroup_size
        .map(|s| s as usize)
        .filter(|&s| WG.is_multiple_of(s));
    let key = format!(
        "dqmatmul_t{}_f{}_tm{TM}_sg{sg:?}",
        u32::from(trans),
        wt.format.code()
    );
    let kern = dev.kernel(&key, &[], false, || source(trans, wt.format.code(), sg))?;
    let kw = match wt.format {
        Format::Int8 { kw } => kw,
        _ => 0,
    };
    let params = [
        m as u32,
        n as u32,
        red as u32,
        wt.cols as u32,
        kw as u32,
        u32::from(bias.is_some() && !trans),
        0,
        0,
    ];
    // bias is bound even when unused (bindings are fixed); the statistics stand in for it.
    let bias = bias.unwrap_or(wt.scale);
    let row_groups = m.div_ceil(TM);
    let groups = [
        n.div_ceil(WG) as u32,
        row_groups.min(ROWS_Y) as u32,
        row_groups.div_ceil(ROWS_Y) as u32,
    ];
    dev.dispatch3(
        &kern,
        &params,
        &[
            a.block(),
            wt.w.block(),
            wt.scale.block(),
            wt.qa.block(),
            wt.dq.block(),
            bias.block(),
            c.block(),
        ],
        groups,
    )
}

/// The shader for direction `trans` and format `fmt`, its `//@` lines expanded for [`TM`] rows
/// and, with `sg`, subgroups of that size (see the shader).
fn source(trans: bool, fmt: u32, sg: Option<usize>) -> String {
    let step = sg.unwrap_or(STEP);
    let consts = [
        ("TRANS", u32::from(trans)),
        ("FMT", fmt),
        ("TM", TM as u32),
        ("SG", step as u32),
    ];
    let body = specialize(DQMATMUL.body, &consts);
    let mut out = String::new();
    for line in body.lines() {
        let t = line.trim_start();
        let indent = &line[..line.len() - t.len()];
        let mut emit = |text: String| {
            out.push_str(indent);
            out.push_str(&text);
            out.push('\n');
        };
        if let Some(text) = t.strip_prefix("//@row ") {
            for r in 0..TM {
                emit(text.replace("{r}", &r.to_string()));
            }
        } else if t == "//@lane" {
            if sg.is_some() {
                emit("@builtin(subgroup_invocation_id) lane: u32,".into());
            }
        } else if t == "//@load" {
            if sg.is_some() {
                emit("let jl = min(j0 + lane, p.red - 1u);".into());
                for r in 0..TM {
                    emit(format!("let x{r} = ld_a(a{r} + jl);"));
                }
            }
        } else if t == "//@terms" {
            for k in 0..step {
                // The condition is uniform: j0 and k are the same in every lane.
                emit(format!("if (j0 + {k}u < p.red) {{"));
                emit(format!("    let v = weight(col, j0 + {k}u, &word, &amax);"));
                for r in 0..TM {
                    let x = match sg {
                        Some(_) => format!("subgroupBroadcast(x{r}, {k}u)"),
                        None => format!("ld_a(a{r} + j0 + {k}u)"),
                    };
                    emit(format!("    s{r} = fma({x}, v, s{r});"));
                }
                emit("}".into());
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    super::assemble(&out, &DQMATMUL.with_storage(&storage()))
}

/// The one storage combination: f32 data, u32 codes.
fn storage() -> [Storage; 7] {
    use Storage::*;
    [F32, U32, F32, U32, F32, F32, F32]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::validate_wgsl;

    /// Every direction and format validates.
    #[test]
    fn every_form_validates() {
        for trans in [false, true] {
            for fmt in 0..3 {
                for sg in [None, Some(8), Some(32)] {
                    if let Err(e) = validate_wgsl(&source(trans, fmt, sg)) {
                        panic!("dqmatmul trans {trans} fmt {fmt} subgroups {sg:?}: {e}");
                    }
                }
            }
        }
    }
}
