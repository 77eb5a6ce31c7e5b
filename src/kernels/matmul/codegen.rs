//! The matmul kernels' source and pipelines: which shader file and specialization a variant
//! runs, its pipeline overrides and cache key, its grid, and the unrolled body of the subgroup
//! kernel (`expand_subgroup`).

use super::{Problem, Variant};
use crate::device::{Device, Kernel};
use crate::kernels::{
    assemble, specialize, Binding, Splits, Storage, MATMUL_NAIVE, MATMUL_REG, MATMUL_SG,
    MATMUL_TILED,
};
use crate::memory::Block;
use crate::Result;
use std::sync::Arc;

const XYZW: [&str; 4] = ["x", "y", "z", "w"];

/// The rows of a block of k (K_MASK in shaders/include/matmul_common.wgsl) where
/// `Problem::k_blocks`: a power of two.
const K_BLOCK: u32 = 16;

/// The forms of a problem the unrolled subgroup kernel is written for: operand layouts, k in
/// blocks, the sum starting from C.
#[derive(Clone, Copy, Debug, Default)]
pub struct Forms {
    pub trans_a: bool,
    pub trans_b: bool,
    pub k_blocks: bool,
    pub onto: bool,
}

/// Expands the `//@` lines of shaders/matmul_sg.wgsl (already specialized to SG, TM and TN)
/// into straight-line code for a TM x TN block: one statement per row, column quad and k,
/// accumulators in variables `c{row}_{quad}` and, with `k_blocks`, the blocks before k's in
/// `s{row}_{quad}` (K_MASK in shaders/include/matmul_common.wgsl). The block and `onto` code is
/// written only for the forms that use it: unrolled, it is most of what a CPU compiler spends
/// on the kernel.
pub fn expand_subgroup(body: &str, [sg, tm, tn]: [u32; 3], forms: Forms) -> String {
    let Forms {
        trans_a,
        trans_b,
        k_blocks,
        onto,
    } = forms;
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
                        emit(if onto {
                            format!("var c{r}_{j} = start4(c_base, m0 + {r}u, n0 + {}u);", 4 * j)
                        } else {
                            format!("var c{r}_{j} = vec4<f32>(0.0);")
                        });
                        if k_blocks {
                            emit(format!("var s{r}_{j} = vec4<f32>(0.0);"));
                        }
                    }
                }
            }
            "quad" => {
                if k_blocks {
                    block_start(&mut emit, tm, quads);
                }
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
                if k_blocks {
                    block_start(&mut emit, tm, quads);
                }
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
                        let sum = if k_blocks {
                            format!("s{r}_{j} + c{r}_{j}")
                        } else {
                            format!("c{r}_{j}")
                        };
                        emit(format!(
                            "store4(c_base, m0 + {r}u, n0 + {}u, {sum});",
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

/// Where k starts a block: the sums so far take the block's, which starts again from zero.
fn block_start(emit: &mut impl FnMut(String), tm: u32, quads: u32) {
    emit("if (block_starts(k)) {".into());
    for r in 0..tm {
        for j in 0..quads {
            emit(format!("    s{r}_{j} += c{r}_{j};"));
            emit(format!("    c{r}_{j} = vec4<f32>(0.0);"));
        }
    }
    emit("}".into());
}

/// The pipeline of `variant` for `pb`, with `storage` the storages of a, b, bias and c and
/// `epilogue` the store's bias / activation code, and its grid of workgroups.
pub(super) fn pipeline(
    dev: &Device,
    variant: Variant,
    pb: &Problem,
    storage: [Storage; 4],
    epilogue: u32,
    blocks: &[&Block; 4],
) -> Result<(Arc<Kernel>, [u32; 3])> {
    // A, B or C past the binding limit (a head over a large vocabulary) is bound as windows.
    let splits = Splits::of(dev, blocks)?;
    // vec4 access where every row a kernel touches starts on a 4-element boundary.
    let vec_a = !pb.trans_a && pb.k.is_multiple_of(4) && pb.a_batch.is_multiple_of(4);
    let vec_b = !pb.trans_b && pb.n.is_multiple_of(4) && pb.b_batch.is_multiple_of(4);
    let vec_c = pb.n.is_multiple_of(4);
    let binding = |name, storage, write, vec4| Binding {
        name,
        storage,
        write,
        vec4,
        split: None,
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
        binding("a", storage[0], false, bind[0]),
        binding("b", storage[1], false, bind[1]),
        binding("bias", storage[2], false, bind[2]),
        binding("c", storage[3], true, bind[3]),
    ];
    let key = format!(
        "{}_{consts:?}_{:?}_{:?}_{}{}{}{}{}",
        file.name,
        bind.map(|b| b.storage),
        bind.map(|b| b.vec4),
        pb.trans_a,
        pb.trans_b,
        match (pb.k_blocks, pb.onto) {
            (false, false) => "",
            (true, false) => "_kb",
            (false, true) => "_onto",
            (true, true) => "_kb_onto",
        },
        match variant {
            Variant::Subgroup { .. } => format!("_e{epilogue}"),
            _ => String::new(),
        },
        splits.key()
    );
    let mut overrides = vec![
        ("TRANS_A", flag(pb.trans_a)),
        ("TRANS_B", flag(pb.trans_b)),
        ("ONTO", flag(pb.onto)),
        (
            "K_MASK",
            f64::from(if pb.k_blocks { K_BLOCK - 1 } else { u32::MAX }),
        ),
    ];
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
        let body = specialize(file.body, &consts);
        let body = match variant {
            Variant::Subgroup { sg, tm, tn, .. } => {
                let forms = Forms {
                    trans_a: pb.trans_a,
                    trans_b: pb.trans_b,
                    k_blocks: pb.k_blocks,
                    onto: pb.onto,
                };
                expand_subgroup(&body, [sg, tm, tn], forms)
            }
            _ => body,
        };
        assemble(&body, &splits.apply(bind.to_vec()))
    })?;
    Ok((k, [groups[0] as u32, groups[1] as u32, pb.batch as u32]))
}
