//! The shader registry: every WGSL file as a [`ShaderFile`] (its name, its body with the
//! includes it needs, and its bindings), and [`SHADERS`], the list validation walks.

/// A shader file: its name (cache key prefix) and body.
pub struct ShaderFile {
    pub name: &'static str,
    pub body: &'static str,
    /// Binding names in order, with whether each is written.
    pub bindings: &'static [(&'static str, bool)],
}

pub const BINARY: ShaderFile = ShaderFile {
    name: "binary",
    body: concat!(
        include_str!("../../shaders/include/activations.wgsl"),
        include_str!("../../shaders/include/broadcast.wgsl"),
        include_str!("../../shaders/binary.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("out", true)],
};
pub const UNARY: ShaderFile = ShaderFile {
    name: "unary",
    body: concat!(
        include_str!("../../shaders/include/activations.wgsl"),
        include_str!("../../shaders/unary.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};
pub const WHERE: ShaderFile = ShaderFile {
    name: "where",
    body: concat!(
        include_str!("../../shaders/include/broadcast.wgsl"),
        include_str!("../../shaders/where.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("c", false), ("a", false), ("b", false), ("out", true)],
};
pub const PERMUTE: ShaderFile = ShaderFile {
    name: "permute",
    body: concat!(
        include_str!("../../shaders/include/broadcast.wgsl"),
        include_str!("../../shaders/permute.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};
pub const STRIDED_COPY: ShaderFile = ShaderFile {
    name: "strided_copy",
    body: include_str!("../../shaders/strided_copy.wgsl"),
    bindings: &[("x", false), ("out", true)],
};
pub const FILL: ShaderFile = ShaderFile {
    name: "fill",
    body: include_str!("../../shaders/fill.wgsl"),
    bindings: &[("out", true)],
};
pub const REDUCE: ShaderFile = ShaderFile {
    name: "reduce",
    body: include_str!("../../shaders/reduce.wgsl"),
    bindings: &[("x", false), ("out", true)],
};
pub const TRANSPOSE: ShaderFile = ShaderFile {
    name: "transpose",
    body: concat!(
        include_str!("../../shaders/transpose.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};
pub const REDUCE_MAX: ShaderFile = ShaderFile {
    name: "reduce_max",
    body: concat!(
        include_str!("../../shaders/include/lanes.wgsl"),
        include_str!("../../shaders/reduce_max.wgsl")
    ),
    bindings: &[("x", false), ("out", true), ("idx", true)],
};
pub const SOFTMAX: ShaderFile = ShaderFile {
    name: "softmax",
    body: concat!(
        include_str!("../../shaders/include/lanes.wgsl"),
        include_str!("../../shaders/include/softmax_rows.wgsl"),
        include_str!("../../shaders/include/softmax_mask.wgsl"),
        include_str!("../../shaders/softmax.wgsl")
    ),
    // Without a mask, x is bound as `mask` too (never read).
    bindings: &[("x", false), ("out", true), ("mask", false)],
};
pub const SOFTMAX_SG: ShaderFile = ShaderFile {
    name: "softmax_sg",
    body: concat!(
        include_str!("../../shaders/include/lanes.wgsl"),
        include_str!("../../shaders/include/softmax_rows.wgsl"),
        include_str!("../../shaders/include/softmax_mask.wgsl"),
        include_str!("../../shaders/softmax_sg.wgsl")
    ),
    // Without a mask, x is bound as `mask` too (never read).
    bindings: &[("x", false), ("out", true), ("mask", false)],
};
pub const CROSS_ENTROPY: ShaderFile = ShaderFile {
    name: "cross_entropy",
    body: concat!(
        include_str!("../../shaders/include/lanes.wgsl"),
        include_str!("../../shaders/include/softmax_rows.wgsl"),
        include_str!("../../shaders/cross_entropy.wgsl")
    ),
    // out is the gradient.
    bindings: &[("x", false), ("t", false), ("out", true), ("loss", true)],
};
pub const NONFINITE: ShaderFile = ShaderFile {
    name: "nonfinite",
    body: include_str!("../../shaders/nonfinite.wgsl"),
    bindings: &[("x", false), ("flag", true)],
};

pub const GRAD_NORM: ShaderFile = ShaderFile {
    name: "grad_norm",
    body: include_str!("../../shaders/grad_norm.wgsl"),
    bindings: &[("g", true), ("acc", true), ("norm", true)],
};

pub const OPTIM: ShaderFile = ShaderFile {
    name: "optim",
    body: concat!(
        include_str!("../../shaders/include/adamw.wgsl"),
        include_str!("../../shaders/optim.wgsl")
    ),
    bindings: &[("p", true), ("g", false), ("m", true), ("sq", true)],
};

pub const ADAMW8BIT: ShaderFile = ShaderFile {
    name: "adamw8bit",
    body: concat!(
        include_str!("../../shaders/include/quant8_block.wgsl"),
        include_str!("../../shaders/include/adamw.wgsl"),
        include_str!("../../shaders/adamw8bit.wgsl")
    ),
    // qm and qv are raw u32 code words; am, av and qmap are f32.
    bindings: &[
        ("p", true),
        ("g", false),
        ("qm", true),
        ("qv", true),
        ("am", true),
        ("av", true),
        ("qmap", false),
    ],
};

pub const MATMUL_REG: ShaderFile = ShaderFile {
    name: "matmul_reg",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/include/matmul_loads.wgsl"),
        include_str!("../../shaders/matmul_reg.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("bias", false), ("c", true)],
};
pub const MATMUL_TILED: ShaderFile = ShaderFile {
    name: "matmul_tiled",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/matmul_tiled.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("bias", false), ("c", true)],
};
pub const MATMUL_SG: ShaderFile = ShaderFile {
    name: "matmul_sg",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/include/matmul_loads.wgsl"),
        include_str!("../../shaders/matmul_sg.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("bias", false), ("c", true)],
};
pub const MATMUL_NAIVE: ShaderFile = ShaderFile {
    name: "matmul_naive",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/matmul_naive.wgsl")
    ),
    bindings: &[("a", false), ("b", false), ("bias", false), ("c", true)],
};
pub const INDEX_SELECT: ShaderFile = ShaderFile {
    name: "index_select",
    body: concat!(
        include_str!("../../shaders/index_select.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("idx", false), ("x", false), ("out", true)],
};
pub const LAYER_NORM: ShaderFile = ShaderFile {
    name: "layer_norm",
    body: concat!(
        include_str!("../../shaders/include/layer_norm_rows.wgsl"),
        include_str!("../../shaders/layer_norm.wgsl")
    ),
    bindings: &[
        ("x", false),
        ("w", false),
        ("b", false),
        ("y", true),
        ("mean", true),
        ("rstd", true),
    ],
};
pub const LAYER_NORM_DX: ShaderFile = ShaderFile {
    name: "layer_norm_dx",
    body: concat!(
        include_str!("../../shaders/include/layer_norm_rows.wgsl"),
        include_str!("../../shaders/layer_norm_dx.wgsl")
    ),
    bindings: &[
        ("dy", false),
        ("x", false),
        ("w", false),
        ("mean", false),
        ("rstd", false),
        ("dx", true),
    ],
};
pub const LAYER_NORM_DWDB: ShaderFile = ShaderFile {
    name: "layer_norm_dwdb",
    body: include_str!("../../shaders/layer_norm_dwdb.wgsl"),
    bindings: &[
        ("dy", false),
        ("x", false),
        ("mean", false),
        ("rstd", false),
        ("dw", true),
        ("db", true),
    ],
};
pub const ROPE: ShaderFile = ShaderFile {
    name: "rope",
    body: include_str!("../../shaders/rope.wgsl"),
    bindings: &[("x", false), ("cs", false), ("y", true)],
};
pub const DROPOUT: ShaderFile = ShaderFile {
    name: "dropout",
    body: concat!(
        include_str!("../../shaders/dropout.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};

pub const QMATMUL: ShaderFile = ShaderFile {
    name: "qmatmul",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/include/qmatmul_common.wgsl"),
        include_str!("../../shaders/qmatmul.wgsl")
    ),
    // w holds the int8 weights as raw u32 words; scale and bias are f32.
    bindings: &[
        ("a", false),
        ("w", false),
        ("scale", false),
        ("bias", false),
        ("c", true),
    ],
};
pub const QMATMUL_SG: ShaderFile = ShaderFile {
    name: "qmatmul_sg",
    body: concat!(
        include_str!("../../shaders/include/matmul_common.wgsl"),
        include_str!("../../shaders/include/qmatmul_common.wgsl"),
        include_str!("../../shaders/qmatmul_sg.wgsl")
    ),
    bindings: QMATMUL.bindings,
};
pub const DQMATMUL: ShaderFile = ShaderFile {
    name: "dqmatmul",
    body: include_str!("../../shaders/dqmatmul.wgsl"),
    // w and qa hold codes as raw u32 words; scale, dq and bias are f32.
    bindings: &[
        ("a", false),
        ("w", false),
        ("scale", false),
        ("qa", false),
        ("dq", false),
        ("bias", false),
        ("c", true),
    ],
};
pub const ATTENTION_FWD: ShaderFile = ShaderFile {
    name: "attention_fwd",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/include/attention_tiles.wgsl"),
        include_str!("../../shaders/attention_fwd.wgsl")
    ),
    bindings: &[
        ("q", false),
        ("k", false),
        ("v", false),
        ("o", true),
        ("lse", true),
    ],
};
pub const ATTENTION_BWD_DQ: ShaderFile = ShaderFile {
    name: "attention_bwd_dq",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/include/attention_tiles.wgsl"),
        include_str!("../../shaders/attention_bwd_dq.wgsl")
    ),
    bindings: &[
        ("q", false),
        ("k", false),
        ("v", false),
        ("o", false),
        ("dy", false),
        ("lse", false),
        ("dq", true),
        ("delta", true),
    ],
};
pub const ATTENTION_BWD_DKV: ShaderFile = ShaderFile {
    name: "attention_bwd_dkv",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/include/attention_tiles.wgsl"),
        include_str!("../../shaders/attention_bwd_dkv.wgsl")
    ),
    bindings: &[
        ("q", false),
        ("k", false),
        ("v", false),
        ("dy", false),
        ("lse", false),
        ("delta", false),
        ("dk", true),
        ("dv", true),
    ],
};

pub const ATTENTION_SG_FWD: ShaderFile = ShaderFile {
    name: "attention_sg_fwd",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/attention_sg_fwd.wgsl")
    ),
    bindings: ATTENTION_FWD.bindings,
};
pub const ATTENTION_SG_DQ: ShaderFile = ShaderFile {
    name: "attention_sg_dq",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/attention_sg_dq.wgsl")
    ),
    bindings: ATTENTION_BWD_DQ.bindings,
};
pub const ATTENTION_SG_DKV: ShaderFile = ShaderFile {
    name: "attention_sg_dkv",
    body: concat!(
        include_str!("../../shaders/include/attention_params.wgsl"),
        include_str!("../../shaders/attention_sg_dkv.wgsl")
    ),
    bindings: ATTENTION_BWD_DKV.bindings,
};

pub const CONV2D_FWD: ShaderFile = ShaderFile {
    name: "conv2d_fwd",
    body: concat!(
        include_str!("../../shaders/include/conv2d_params.wgsl"),
        include_str!("../../shaders/conv2d_fwd.wgsl")
    ),
    // Without a bias, the weight is bound as `b` too (never read).
    bindings: &[("x", false), ("wt", false), ("b", false), ("y", true)],
};
pub const CONV2D_DX: ShaderFile = ShaderFile {
    name: "conv2d_dx",
    body: concat!(
        include_str!("../../shaders/include/conv2d_params.wgsl"),
        include_str!("../../shaders/conv2d_dx.wgsl")
    ),
    bindings: &[("dy", false), ("wt", false), ("dx", true)],
};
pub const CONV2D_DW: ShaderFile = ShaderFile {
    name: "conv2d_dw",
    body: concat!(
        include_str!("../../shaders/include/conv2d_params.wgsl"),
        include_str!("../../shaders/conv2d_dw.wgsl")
    ),
    bindings: &[("dy", false), ("x", false), ("part", true)],
};

pub const POOL2D_FWD: ShaderFile = ShaderFile {
    name: "pool2d_fwd",
    body: concat!(
        include_str!("../../shaders/include/pool2d_window.wgsl"),
        include_str!("../../shaders/pool2d_fwd.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("out", true)],
};
pub const POOL2D_BWD: ShaderFile = ShaderFile {
    name: "pool2d_bwd",
    body: concat!(
        include_str!("../../shaders/include/pool2d_window.wgsl"),
        include_str!("../../shaders/pool2d_bwd.wgsl"),
        include_str!("../../shaders/include/pairs.wgsl")
    ),
    bindings: &[("x", false), ("dy", false), ("out", true)],
};
pub const BATCH_NORM_STATS: ShaderFile = ShaderFile {
    name: "batch_norm_stats",
    body: concat!(
        include_str!("../../shaders/include/batch_norm_channels.wgsl"),
        include_str!("../../shaders/batch_norm_stats.wgsl")
    ),
    // Without running statistics, stats is bound as rmean and rvar too (never written).
    bindings: &[
        ("x", false),
        ("stats", true),
        ("rmean", true),
        ("rvar", true),
    ],
};
pub const BATCH_NORM: ShaderFile = ShaderFile {
    name: "batch_norm",
    body: concat!(
        include_str!("../../shaders/include/batch_norm_channels.wgsl"),
        include_str!("../../shaders/batch_norm.wgsl"),
        include_str!("../../shaders/include/batch_norm_pairs.wgsl")
    ),
    bindings: &[
        ("x", false),
        ("wt", false),
        ("b", false),
        ("stats", false),
        ("out", true),
    ],
};
pub const BATCH_NORM_SUMS: ShaderFile = ShaderFile {
    name: "batch_norm_sums",
    body: concat!(
        include_str!("../../shaders/include/batch_norm_channels.wgsl"),
        include_str!("../../shaders/batch_norm_sums.wgsl")
    ),
    bindings: &[
        ("dy", false),
        ("x", false),
        ("stats", false),
        ("sums", true),
    ],
};
pub const BATCH_NORM_DX: ShaderFile = ShaderFile {
    name: "batch_norm_dx",
    body: concat!(
        include_str!("../../shaders/include/batch_norm_channels.wgsl"),
        include_str!("../../shaders/batch_norm_dx.wgsl"),
        include_str!("../../shaders/include/batch_norm_pairs.wgsl")
    ),
    bindings: &[
        ("dy", false),
        ("x", false),
        ("wt", false),
        ("stats", false),
        ("sums", false),
        ("out", true),
    ],
};

/// Every shader file, for validation without a GPU (unit test and `cargo xtask shaders`).
pub const SHADERS: &[ShaderFile] = &[
    BINARY,
    UNARY,
    FILL,
    REDUCE,
    TRANSPOSE,
    MATMUL_REG,
    MATMUL_TILED,
    MATMUL_SG,
    MATMUL_NAIVE,
    REDUCE_MAX,
    SOFTMAX,
    SOFTMAX_SG,
    CROSS_ENTROPY,
    NONFINITE,
    OPTIM,
    ADAMW8BIT,
    INDEX_SELECT,
    LAYER_NORM,
    LAYER_NORM_DX,
    LAYER_NORM_DWDB,
    ROPE,
    DROPOUT,
    WHERE,
    PERMUTE,
    STRIDED_COPY,
    GRAD_NORM,
    QMATMUL,
    QMATMUL_SG,
    DQMATMUL,
    ATTENTION_FWD,
    ATTENTION_BWD_DQ,
    ATTENTION_BWD_DKV,
    ATTENTION_SG_FWD,
    ATTENTION_SG_DQ,
    ATTENTION_SG_DKV,
    CONV2D_FWD,
    CONV2D_DX,
    CONV2D_DW,
    POOL2D_FWD,
    POOL2D_BWD,
    BATCH_NORM_STATS,
    BATCH_NORM,
    BATCH_NORM_SUMS,
    BATCH_NORM_DX,
];
