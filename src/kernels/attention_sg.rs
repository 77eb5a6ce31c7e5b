//! The subgroup variant of fused attention, for CPU adapters with subgroups (lavapipe): its
//! blocks, and the expansion of the `//@` lines of shaders/attention_sg_{fwd,dq,dkv}.wgsl into
//! straight-line code (one statement per block row, lane slot and column quad), as
//! `matmul::expand_subgroup` does for the subgroup matmul.

use super::{assemble, specialize, Binding, ShaderFile, Storage};
use super::{ATTENTION_SG_DKV, ATTENTION_SG_DQ, ATTENTION_SG_FWD};

/// One pass's block: a subgroup of `sg` lanes owns `rows` rows (queries, or keys for dK / dV)
/// and walks the other side in tiles of `sg * per_lane`; each lane holds `col_quads` quads of
/// every row's head dim in its accumulators.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub sg: u32,
    pub rows: u32,
    pub per_lane: u32,
    pub col_quads: u32,
}

impl Block {
    fn consts(self, vec: bool) -> [(&'static str, u32); 5] {
        [
            ("SG", self.sg),
            ("BR", self.rows),
            ("TC", self.per_lane),
            ("CQ", self.col_quads),
            ("VEC", u32::from(vec)),
        ]
    }
}

/// The three passes' blocks: the forward and dQ share one (they walk the same tiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Blocks {
    pub queries: Block,
    pub keys: Block,
}

/// Rows per subgroup, and rows of the other side per lane and tile, in every pass: 16 rows
/// against tiles of 32 (8 lanes x 4). On lavapipe at (1, 4, 1024, 64) blocks of 8 rows, or 2
/// per lane, ran 1.5-2x slower; 32 rows up to 1.5x faster but took twice as long to compile
/// (docs/design-notes.md has the figures).
const ROWS: u32 = 16;
const PER_LANE: u32 = 4;

/// The fewest lanes the blocks are built for. Below 8 each lane holds more of every row's
/// accumulators (`col_quads` = quads / sg) in straight-line code: at 4 lanes (SwiftShader) one
/// fused-attention test ran for minutes, mostly compiling, where the workgroup tiles take
/// seconds, so such an adapter gets the tiles (`Choice::Auto`), and forcing the subgroup
/// kernels there is refused.
const MIN_SG: u32 = 8;

/// The blocks for head-dim bucket `bucket` (32, 64 or 128) on subgroups of `sg` lanes, or None
/// where the block does not split into whole subgroups or a lane cannot own whole column quads
/// (the bucket's quads are not a multiple of `sg`).
pub(crate) fn blocks(sg: u32, bucket: u32) -> Option<Blocks> {
    let quads = bucket / 4;
    if sg < MIN_SG || !ROWS.is_multiple_of(sg) || !quads.is_multiple_of(sg) {
        return None;
    }
    let block = Block {
        sg,
        rows: ROWS,
        per_lane: PER_LANE,
        col_quads: quads / sg,
    };
    Some(Blocks {
        queries: block,
        keys: block,
    })
}

/// The shader file of each pass (forward, dQ, dK / dV).
pub(crate) fn file(pass: usize) -> &'static ShaderFile {
    [&ATTENTION_SG_FWD, &ATTENTION_SG_DQ, &ATTENTION_SG_DKV][pass]
}

/// Bindings: quads for the (BH, T, D) tensors where `vec`, scalars for lse and delta.
pub(crate) fn bindings(file: &ShaderFile, storage: &[Storage], vec: bool) -> Vec<Binding> {
    file.with_storage(storage)
        .into_iter()
        .map(|b| Binding {
            vec4: vec && b.name != "lse" && b.name != "delta",
            ..b
        })
        .collect()
}

/// The complete WGSL of `file` for `block`, `vec` (D % 4 == 0) and `storage`.
pub(crate) fn source(file: &ShaderFile, block: Block, vec: bool, storage: &[Storage]) -> String {
    let body = expand(&specialize(file.body, &block.consts(vec)), block);
    assemble(&body, &bindings(file, storage, vec))
}

/// `row_NAME(base, row, qd)`: quad qd (< ceil(D / 4)) of a row of a (T, D) matrix at `base`,
/// zero past D; rows past T read row T - 1 (their results are masked or never stored).
fn row_fn(n: &str) -> String {
    format!(
        "fn row_{n}(base: u32, row: u32, qd: u32) -> vec4<f32> {{
    let i = base + min(row, p.t - 1u) * p.d + 4u * qd;
    let len = min(4u, p.d - 4u * qd);
    if (VEC == 1u || len == 4u) {{
        return ld4_{n}(i);
    }}
    var v = vec4<f32>(0.0);
    for (var e = 0u; e < len; e++) {{
        v[e] = ld_{n}(i + e);
    }}
    return v;
}}
"
    )
}

/// `put_NAME(base, row, qd, v)`: stores quad qd of a row (row < T, qd < ceil(D / 4)). With D
/// even every pair is a whole packed word; packed f16 with D odd is written to f32 (the host
/// stages it).
fn put_fn(n: &str) -> String {
    format!(
        "fn put_{n}(base: u32, row: u32, qd: u32, v: vec4<f32>) {{
    let i = base + row * p.d + 4u * qd;
    if (VEC == 1u) {{
        st4_{n}(i, v);
        return;
    }}
    let len = min(4u, p.d - 4u * qd);
    if ((p.d & 1u) == 0u) {{
        for (var e = 0u; e < len; e += 2u) {{
            st2_{n}((i + e) >> 1u, v[e], v[e + 1u], i + len);
        }}
    }} else {{
        for (var e = 0u; e < len; e++) {{
            st_{n}(i + e, v[e]);
        }}
    }}
}}
"
    )
}

/// The variable holding the element offset of binding `n`'s (T, D) matrix in the shaders: `kvb`
/// for keys, values and their gradients (kv matrix m / G under grouped-query heads), `base` for
/// the queries' side.
fn base_of(n: &str) -> &'static str {
    match n {
        "k" | "v" | "dk" | "dv" => "kvb",
        _ => "base",
    }
}

/// Expands the `//@` lines of an attention_sg shader (already specialized to `b`).
pub(crate) fn expand(body: &str, b: Block) -> String {
    let (sg, br, tc, cq) = (b.sg, b.rows, b.per_lane, b.col_quads);
    let mut out = String::with_capacity(body.len() + (br * tc * sg * 120) as usize);
    for line in body.lines() {
        let t = line.trim_start();
        let Some(what) = t.strip_prefix("//@ ") else {
            out += line;
            out.push('\n');
            continue;
        };
        let pad = line[..line.len() - t.len()].to_string();
        let (name, args) = what.split_once(':').unwrap_or((what, ""));
        let args: Vec<&str> = args.split_whitespace().collect();
        let mut code: Vec<String> = Vec::new();
        let mut emit = |s: String| code.push(s);
        match name {
            "rows" => args.iter().for_each(|n| emit(row_fn(n))),
            "puts" => args.iter().for_each(|n| emit(put_fn(n))),
            // The lane's column quads (clamped into the row: those past D are never stored or
            // summed), and whether each exists.
            "cols" => {
                for c in 0..cq {
                    emit(format!("let cq{c} = min(lane + {}u, d4 - 1u);", sg * c));
                    emit(format!("let cl{c} = lane + {}u < d4;", sg * c));
                }
            }
            "zero" => {
                for n in &args {
                    for r in 0..br {
                        for c in 0..cq {
                            emit(format!("var {n}{r}_{c} = vec4<f32>(0.0);"));
                        }
                    }
                }
            }
            "s_init" => {
                for n in &args {
                    for r in 0..br {
                        for t in 0..tc {
                            emit(format!("var {n}{r}_{t} = 0.0;"));
                        }
                    }
                }
            }
            // acc{r}_{t} += A[r0 + r, qd] . B[c0 + lane + SG t, qd]: the block's quads loaded
            // SG to a lane and broadcast, the lane's own rows loaded per lane.
            "s_quad" => {
                let [a, bn, acc] = args[..] else {
                    panic!("s_quad: A B ACC")
                };
                for u in 0..br / sg {
                    emit(format!(
                        "let {acc}a{u} = row_{a}({}, r0 + lane + {}u, qd);",
                        base_of(a),
                        sg * u
                    ));
                }
                for t in 0..tc {
                    emit(format!(
                        "let {acc}b{t} = row_{bn}({}, c0 + lane + {}u, qd);",
                        base_of(bn),
                        sg * t
                    ));
                }
                for r in 0..br {
                    emit(format!(
                        "let {acc}x{r} = subgroupBroadcast({acc}a{}, {}u);",
                        r / sg,
                        r % sg
                    ));
                    for t in 0..tc {
                        emit(format!(
                            "{acc}{r}_{t} = {acc}{r}_{t} + dot({acc}x{r}, {acc}b{t});"
                        ));
                    }
                }
            }
            // acc{r}_{c} += sum over the SG rows ct + src of w{r}_0 (held by lane src) times
            // the lane's column quads of B's row: each accumulator's adds in one chain.
            "acc" => {
                let [bn, w, acc] = args[..] else {
                    panic!("acc: B W ACC")
                };
                for src in 0..sg {
                    for c in 0..cq {
                        emit(format!(
                            "let {acc}c{src}_{c} = row_{bn}({}, ct + {src}u, cq{c});",
                            base_of(bn)
                        ));
                    }
                }
                for r in 0..br {
                    for src in 0..sg {
                        emit(format!(
                            "let {acc}w{r}_{src} = vec4<f32>(subgroupBroadcast({w}{r}_0, {src}u));"
                        ));
                    }
                    for c in 0..cq {
                        for src in 0..sg {
                            emit(format!(
                                "{acc}{r}_{c} = fma({acc}w{r}_{src}, {acc}c{src}_{c}, {acc}{r}_{c});"
                            ));
                        }
                    }
                }
            }
            // Slot t + 1's values move into slot t, so the loop over t always reads slot 0.
            "rotate" => {
                for n in &args {
                    for r in 0..br {
                        for t in 0..tc - 1 {
                            emit(format!("{n}{r}_{t} = {n}{r}_{};", t + 1));
                        }
                    }
                }
            }
            "fwd_init" => {
                for r in 0..br {
                    emit(format!("var mx{r} = ninf;"));
                    emit(format!("var l{r} = 0.0;"));
                }
            }
            // The online softmax over the tile: per query the tile's max (subgroupMax), the
            // rescale a of what came before, and the probabilities p{r}_{t} of the lane's keys.
            // A masked key (or a row with nothing visible yet, m = -inf) gives exp(-inf) = 0.
            "fwd_softmax" => {
                for t in 0..tc {
                    emit(format!("let j{t} = c0 + lane + {}u;", sg * t));
                    emit(format!("let kv{t} = j{t} < p.t;"));
                }
                for r in 0..br {
                    for t in 0..tc {
                        emit(format!(
                            "let sc{r}_{t} = select(ninf, p.scale * s{r}_{t}, kv{t} && (p.causal == 0u || j{t} <= r0 + {r}u));"
                        ));
                    }
                    let maxes =
                        (1..tc).fold(format!("sc{r}_0"), |m, t| format!("max({m}, sc{r}_{t})"));
                    emit(format!("let m2_{r} = max(mx{r}, subgroupMax({maxes}));"));
                    emit(format!("let mu{r} = select(m2_{r}, 0.0, m2_{r} == ninf);"));
                    emit(format!("let a{r} = exp(mx{r} - mu{r});"));
                    for t in 0..tc {
                        emit(format!("var p{r}_{t} = exp(sc{r}_{t} - mu{r});"));
                    }
                    let sum = (1..tc).fold(format!("p{r}_0"), |s, t| format!("{s} + p{r}_{t}"));
                    emit(format!("l{r} = l{r} * a{r} + ({sum});"));
                    for c in 0..cq {
                        emit(format!("o{r}_{c} = o{r}_{c} * a{r};"));
                    }
                    emit(format!("mx{r} = m2_{r};"));
                }
            }
            "fwd_store" => {
                for r in 0..br {
                    emit(format!("let lt{r} = subgroupAdd(l{r});"));
                    emit(format!("if (r0 + {r}u < p.t) {{"));
                    for c in 0..cq {
                        emit(format!(
                            "    if (cl{c}) {{ put_o(base, r0 + {r}u, lane + {}u, o{r}_{c} * (1.0 / lt{r})); }}",
                            sg * c
                        ));
                    }
                    emit(format!(
                        "    if (lane == 0u) {{ st_lse(m * p.t + r0 + {r}u, mx{r} + log(lt{r})); }}"
                    ));
                    emit("}".into());
                }
            }
            // Each query's lse, and delta = dO . O from the lane's column quads (one
            // subgroupAdd), written for pass 2.
            "dq_init" => {
                for r in 0..br {
                    emit(format!(
                        "let ls{r} = ld_lse(stats + min(r0 + {r}u, p.t - 1u));"
                    ));
                    let terms: Vec<String> = (0..cq)
                        .map(|c| {
                            format!(
                                "select(0.0, dot(row_dy(base, r0 + {r}u, cq{c}), row_o(base, r0 + {r}u, cq{c})), cl{c})"
                            )
                        })
                        .collect();
                    emit(format!("let dl{r} = subgroupAdd({});", terms.join(" + ")));
                    emit(format!(
                        "if (lane == 0u && r0 + {r}u < p.t) {{ st_delta(stats + r0 + {r}u, dl{r}); }}"
                    ));
                }
            }
            // dS = P (dP - delta) scale for the lane's keys, zero where masked.
            "dq_ds" => {
                for t in 0..tc {
                    emit(format!("let j{t} = c0 + lane + {}u;", sg * t));
                    emit(format!("let kv{t} = j{t} < p.t;"));
                }
                for r in 0..br {
                    for t in 0..tc {
                        emit(format!(
                            "var ds{r}_{t} = select(0.0, exp(p.scale * s{r}_{t} - ls{r}) * (dp{r}_{t} - dl{r}) * p.scale, kv{t} && (p.causal == 0u || j{t} <= r0 + {r}u));"
                        ));
                    }
                }
            }
            // The lane's queries' lse and delta.
            "kv_stats" => {
                for t in 0..tc {
                    emit(format!("let i{t} = c0 + lane + {}u;", sg * t));
                    emit(format!("let iv{t} = i{t} < p.t;"));
                    emit(format!("let ls{t} = ld_lse(stats + min(i{t}, p.t - 1u));"));
                    emit(format!(
                        "let dl{t} = ld_delta(stats + min(i{t}, p.t - 1u));"
                    ));
                }
            }
            // P and dS of key r against the lane's queries, zero where masked.
            "kv_p" => {
                for r in 0..br {
                    for t in 0..tc {
                        emit(format!(
                            "var p{r}_{t} = select(0.0, exp(p.scale * s{r}_{t} - ls{t}), iv{t} && (p.causal == 0u || r0 + {r}u <= i{t}));"
                        ));
                        emit(format!(
                            "var ds{r}_{t} = p{r}_{t} * (dp{r}_{t} - dl{t}) * p.scale;"
                        ));
                    }
                }
            }
            "store" => {
                for r in 0..br {
                    emit(format!("if (r0 + {r}u < p.t) {{"));
                    for n in &args {
                        for c in 0..cq {
                            emit(format!(
                                "    if (cl{c}) {{ put_{n}({}, r0 + {r}u, lane + {}u, {n}{r}_{c}); }}",
                                base_of(n),
                                sg * c
                            ));
                        }
                    }
                    emit("}".into());
                }
            }
            other => panic!("unknown attention_sg marker {other}"),
        }
        for s in code {
            for l in s.lines() {
                out += &pad;
                out += l;
                out.push('\n');
            }
        }
    }
    out
}

/// Every expanded form the registry validates for `file` (naga, no GPU): each bucket's blocks
/// on 8-lane subgroups, with quads and scalars, in every storage combination.
pub(crate) fn validation_sources(file: &ShaderFile) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for bucket in [32, 64, 128] {
        let Some(b) = blocks(8, bucket) else {
            continue;
        };
        let block = if file.name.ends_with("dkv") {
            b.keys
        } else {
            b.queries
        };
        for storage in super::storage_variants(file) {
            for vec in [false, true] {
                out.push((
                    format!("{} {block:?} vec {vec} {storage:?}", file.name),
                    source(file, block, vec, &storage),
                ));
            }
        }
    }
    out
}
