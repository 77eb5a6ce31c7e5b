//! Dispatch of shaders/adamw8bit.wgsl: the fused 8-bit AdamW update (a block of codes per
//! workgroup: dequantize, update, block absmax, requantize) and the block-wise quantize and
//! dequantize it is made of. Nothing is allocated here.

use super::optim::AdamWHyper;
use super::{assemble, specialize, wgsl_const, Binding, Operand, Storage, ADAMW8BIT};
use crate::Result;

/// Elements per block of codes (one f32 absmax each), read from
/// shaders/include/quant8_block.wgsl.
pub(crate) const BLOCK: usize = wgsl_const(include_str!("../../shaders/include/quant8_block.wgsl"));

/// `KIND` of the shader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Update = 0,
    Quantize = 1,
    Dequantize = 2,
}

/// One moment's block-wise 8-bit state: `codes` holds `ceil(n / 4)` u32 words (element i in
/// byte i % 4 of word i / 4), `absmax` one f32 per block of [`BLOCK`] elements.
pub(crate) struct Codes<'a, T> {
    pub codes: &'a T,
    pub absmax: &'a T,
}

/// u32 words of codes for `n` elements.
pub(crate) fn code_words(n: usize) -> usize {
    n.div_ceil(4)
}

/// Blocks (absmax values) for `n` elements.
pub(crate) fn blocks(n: usize) -> usize {
    n.div_ceil(BLOCK)
}

/// One AdamW update of `p` from its gradient `g`, with the first moment's codes `m` (signed
/// map) and the second's `v` (unsigned map), in place. `qmap` is the device table of
/// `optim::quant8::table` (1024 f32).
pub(crate) fn adamw8bit_step<T: Operand>(
    p: &T,
    g: &T,
    m: Codes<'_, T>,
    v: Codes<'_, T>,
    qmap: &T,
    hp: &AdamWHyper,
) -> Result<()> {
    assert_eq!(
        g.numel(),
        p.numel(),
        "the gradient must match the parameter"
    );
    dispatch(
        Kind::Update,
        true,
        p,
        g,
        m,
        v,
        qmap,
        &hp.coefficients_words(),
    )
}

/// Quantizes `x` (any dtype) block-wise into `q`, with the signed or the unsigned map.
pub(crate) fn quantize<T: Operand>(x: &T, q: Codes<'_, T>, qmap: &T, signed: bool) -> Result<()> {
    let alias = Codes {
        codes: q.codes,
        absmax: q.absmax,
    };
    dispatch(Kind::Quantize, signed, x, x, q, alias, qmap, &[0; 8])
}

/// Writes the values of `q` into `x` (any dtype).
pub(crate) fn dequantize<T: Operand>(q: Codes<'_, T>, x: &T, qmap: &T, signed: bool) -> Result<()> {
    let alias = Codes {
        codes: q.codes,
        absmax: q.absmax,
    };
    dispatch(Kind::Dequantize, signed, x, x, q, alias, qmap, &[0; 8])
}

impl AdamWHyper {
    /// The shader's `Params` after `n`: the coefficients, in declaration order.
    fn coefficients_words(&self) -> [u32; 8] {
        let c = self.coefficients();
        [
            c.decay,
            c.step_size,
            c.beta1,
            c.beta2,
            c.one_minus_beta1,
            c.one_minus_beta2,
            c.eps,
            c.bc2_sqrt,
        ]
        .map(f32::to_bits)
    }
}

#[allow(clippy::too_many_arguments)]
fn dispatch<T: Operand>(
    kind: Kind,
    signed: bool,
    p: &T,
    g: &T,
    m: Codes<'_, T>,
    v: Codes<'_, T>,
    qmap: &T,
    coefficients: &[u32; 8],
) -> Result<()> {
    let n = p.numel();
    for c in [&m, &v] {
        assert_eq!(
            c.codes.numel(),
            code_words(n),
            "code words must match the parameter"
        );
        assert_eq!(c.absmax.numel(), blocks(n), "one absmax per block");
    }
    assert_eq!(qmap.numel(), 1024, "the map table holds 1024 values");
    if n == 0 {
        return Ok(());
    }
    let dev = p.device();
    let (sp, sg) = (Storage::of(dev, p.dtype()), Storage::of(dev, g.dtype()));
    let vec = n.is_multiple_of(4);
    let key = format!(
        "adamw8bit_k{}_s{}_{}_{}{}",
        kind as u32,
        u32::from(signed),
        sp.tag(),
        sg.tag(),
        if vec { "_x4" } else { "" }
    );
    let k = dev.kernel(&key, &[], false, || {
        let body = specialize(
            ADAMW8BIT.body,
            &[
                ("KIND", kind as u32),
                ("SIGNED", u32::from(signed)),
                ("VEC", u32::from(vec)),
            ],
        );
        assemble(&body, &bindings(sp, sg, vec))
    })?;
    let mut params = [0u32; 12];
    params[0] = n as u32;
    params[1..9].copy_from_slice(coefficients);
    dev.dispatch(
        &k,
        &params,
        &[
            p.block(),
            g.block(),
            m.codes.block(),
            v.codes.block(),
            m.absmax.block(),
            v.absmax.block(),
            qmap.block(),
        ],
        blocks(n) as u32,
    )
}

fn bindings(sp: Storage, sg: Storage, vec: bool) -> Vec<Binding> {
    use Storage::*;
    ADAMW8BIT
        .with_storage(&[sp, sg, U32, U32, F32, F32, F32])
        .into_iter()
        .map(|b| Binding {
            vec4: vec && (b.name == "p" || b.name == "g"),
            ..b
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::validate_wgsl;
    use Storage::*;

    /// Every kind and map validates with every storage of p and g, scalar and vec4.
    #[test]
    fn every_kind_validates() {
        let combos = [
            (F32, F32),
            (F16, F16),
            (F16Packed, F16Packed),
            (F32, F16),
            (F32, F16Packed),
        ];
        for kind in [Kind::Update, Kind::Quantize, Kind::Dequantize] {
            for signed in [0, 1] {
                for vec in [false, true] {
                    let body = specialize(
                        ADAMW8BIT.body,
                        &[
                            ("KIND", kind as u32),
                            ("SIGNED", signed),
                            ("VEC", vec as u32),
                        ],
                    );
                    assert!(body.contains(&format!("const KIND: u32 = {}u;", kind as u32)));
                    for &(sp, sg) in &combos {
                        if let Err(e) = validate_wgsl(&assemble(&body, &bindings(sp, sg, vec))) {
                            panic!("{kind:?} signed {signed} {sp:?} {sg:?} vec {vec}: {e}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn block_is_four_codes_per_invocation() {
        assert_eq!(BLOCK, 256);
        // WG in the shader is BLOCK / 4: one code word per invocation.
        assert!(ADAMW8BIT
            .body
            .contains(&format!("const WG: u32 = {}u;", BLOCK / 4)));
        // 12 words = the shader's Params.
        let body = ADAMW8BIT.body;
        let start = body.find("struct Params").unwrap();
        let end = start + body[start..].find('}').unwrap();
        assert_eq!(
            body[start..end].matches(": u32").count() + body[start..end].matches(": f32").count(),
            12
        );
    }
}
