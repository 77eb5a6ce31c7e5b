//! Every storage combination each shader file is built in at run time ([`variants`]), and their
//! validation without a GPU through naga ([`validate_all`]: a unit test and `cargo xtask
//! shaders`).

use super::*;

/// Every binding combination a shader file is built in at run time.
pub fn variants(file: &ShaderFile) -> Vec<Vec<Binding>> {
    let mut out: Vec<Vec<Binding>> = storage_variants(file)
        .iter()
        .map(|st| file.with_storage(st))
        .collect();
    if file.name.starts_with("qmatmul") {
        // The weights are always read as vec4<u32> (rows padded to whole quads of words).
        for b in out.iter_mut().flatten().filter(|b| b.name == "w") {
            b.vec4 = true;
        }
    }
    if file.name == "adamw8bit" {
        // With n % 4 == 0 the parameter and gradient are read and written as vec4.
        let vectorized: Vec<Vec<Binding>> = out
            .iter()
            .map(|b| {
                b.iter()
                    .map(|&x| Binding {
                        vec4: x.name == "p" || x.name == "g",
                        ..x
                    })
                    .collect()
            })
            .collect();
        out.extend(vectorized);
    }
    if file.name.starts_with("matmul_") {
        // With 16-byte aligned rows, A, B and C are read and written as vec4.
        let vectorized: Vec<Vec<Binding>> = out
            .iter()
            .map(|b| {
                b.iter()
                    .map(|&x| Binding {
                        vec4: x.name != "bias",
                        ..x
                    })
                    .collect()
            })
            .collect();
        out.extend(vectorized);
    }
    out
}

/// Every storage combination `file` is built in (the registry's validation and the kernels'
/// own tests).
pub(crate) fn storage_variants(file: &ShaderFile) -> Vec<Vec<Storage>> {
    use Storage::*;
    let n = file.bindings.len();
    match file.name {
        // The reduction accumulates and writes f32 whatever it reads.
        "reduce" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32])
            .collect(),
        // Unary ops also cast.
        "unary" => vec![
            vec![F32, F32],
            vec![F16, F16],
            vec![F16Packed, F16Packed],
            vec![F32, F16],
            vec![F16, F32],
            vec![F32, F16Packed],
            vec![F16Packed, F32],
        ],
        // The condition may have another dtype than the values (an f32 mask on f16 data).
        "where" => [
            (F32, F32),
            (F16, F16),
            (F16Packed, F16Packed),
            (F32, F16),
            (F16, F32),
            (F32, F16Packed),
            (F16Packed, F32),
        ]
        .iter()
        .map(|&(c, s)| vec![c, s, s, s])
        .collect(),
        // Max and argmax are written in f32; nonfinite's flag is f32.
        "reduce_max" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, F32])
            .collect(),
        "nonfinite" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32])
            .collect(),
        // The slots and the norm are f32.
        "grad_norm" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, F32])
            .collect(),
        // Packed f16 rows of odd length are written to f32 first; the mask has x's dtype.
        "softmax" | "softmax_sg" => vec![
            vec![F32, F32, F32],
            vec![F16, F16, F16],
            vec![F16Packed, F16Packed, F16Packed],
            vec![F16Packed, F32, F16Packed],
        ],
        // Targets and row losses are f32.
        "cross_entropy" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, s, F32])
            .chain([vec![F16Packed, F32, F32, F32]])
            .collect(),
        // Indices are raw u32 words.
        "index_select" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![U32, s, s])
            .collect(),
        // Row statistics are f32; packed f16 rows of odd length are written to f32 first.
        "layer_norm" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, s, s, F32, F32])
            .chain([vec![F16Packed, F16Packed, F16Packed, F32, F32, F32]])
            .collect(),
        "layer_norm_dx" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, s, F32, F32, s])
            .chain([vec![F16Packed, F16Packed, F16Packed, F32, F32, F32]])
            .collect(),
        // Weights are raw u32 words, scales and bias f32; packed f16 rows of N % 4 != 0 are
        // written to f32 first.
        "qmatmul" | "qmatmul_sg" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, U32, F32, F32, s])
            .chain([vec![F16Packed, U32, F32, F32, F32]])
            .collect(),
        // Codes are raw words; A, C, the statistics and the bias f32.
        "dqmatmul" => vec![vec![F32, U32, F32, U32, F32, F32, F32]],
        // The parameter and its gradient in any storage (f16 gradients beside f32 master
        // weights under mixed precision); codes are raw words, absmax and the map f32.
        "adamw8bit" => [
            [F32, F32],
            [F16, F16],
            [F16Packed, F16Packed],
            [F32, F16],
            [F32, F16Packed],
        ]
        .iter()
        .map(|&[p, g]| vec![p, g, U32, U32, F32, F32, F32])
        .collect(),
        // The angles are f32; packed f16 rows whose halves start on odd elements are written
        // to f32 first.
        "rope" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, s])
            .chain([vec![F16Packed, F32, F32]])
            .collect(),
        // Column partial sums are f32.
        "layer_norm_dwdb" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, F32, F32, F32, F32])
            .collect(),
        // Attention's row statistics are f32; packed f16 outputs with D odd are written to f32.
        "attention_fwd" | "attention_bwd_dq" | "attention_bwd_dkv" | "attention_sg_fwd"
        | "attention_sg_dq" | "attention_sg_dkv" => attention_storage(file.name),
        // Outputs of packed f16 with odd planes are written to f32 first; weight partials are f32.
        "conv2d_fwd" | "conv2d_dx" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s; n])
            .chain([[vec![F16Packed; n - 1], vec![F32]].concat()])
            .collect(),
        "conv2d_dw" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, F32])
            .collect(),
        // Batch norm's statistics, running statistics and sums are f32.
        "batch_norm_stats" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, F32, F32, F32])
            .collect(),
        "batch_norm" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, s, F32, s])
            .collect(),
        "batch_norm_sums" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, F32, F32])
            .collect(),
        "batch_norm_dx" => [F32, F16, F16Packed]
            .iter()
            .map(|&s| vec![s, s, s, F32, F32, s])
            .collect(),
        _ => [F32, F16, F16Packed].iter().map(|&s| vec![s; n]).collect(),
    }
}

/// The attention passes' storage combinations; the workgroup and subgroup variants of a pass
/// bind the same tensors.
fn attention_storage(name: &str) -> Vec<Vec<Storage>> {
    use Storage::*;
    let f = F32;
    let mut out: Vec<Vec<Storage>> = Vec::new();
    for (s, o) in [
        (F32, F32),
        (F16, F16),
        (F16Packed, F16Packed),
        (F16Packed, F32),
    ] {
        out.push(if name.ends_with("fwd") {
            // q, k, v, o, lse
            vec![s, s, s, o, f]
        } else if name.ends_with("dq") {
            // q, k, v, o, dO, lse, dQ, delta
            vec![s, s, s, s, s, f, o, f]
        } else {
            // q, k, v, dO, lse, delta, dK, dV
            vec![s, s, s, s, f, f, o, o]
        });
    }
    out
}

/// Parses and validates `src` with naga, with the capabilities fitgrad's shaders rely on
/// (f16 and subgroup operations where the adapter offers them, and pack/unpack of f16 pairs in
/// f32 everywhere).
pub fn validate_wgsl(src: &str) -> std::result::Result<(), String> {
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    Validator::new(
        ValidationFlags::all(),
        Capabilities::SHADER_FLOAT16
            | Capabilities::SHADER_FLOAT16_IN_FLOAT32
            | Capabilities::SUBGROUP,
    )
    .validate(&module)
    .map_err(|e| format!("{e:?}"))?;
    Ok(())
}

/// Validates every variant of every shader file without a GPU: one line per variant, with the
/// error where one fails.
pub fn validate_all() -> Vec<(String, std::result::Result<(), String>)> {
    let mut out = Vec::new();
    for file in SHADERS {
        // The subgroup attention shaders are templates: only their expansions are kernels.
        if file.name.starts_with("attention_sg") {
            let forms = attention_sg::validation_sources(file);
            out.extend(forms.into_iter().map(|(n, src)| (n, validate_wgsl(&src))));
            continue;
        }
        // The subgroup matmul is validated as written and expanded (a 16 x 8 block, in its
        // plain form and transposed with k in blocks from C).
        let mut bodies = vec![(String::new(), file.body.to_string())];
        if file.name == "matmul_sg" {
            let body = specialize(file.body, &[("SG", 8), ("TM", 16), ("TN", 8)]);
            for on in [false, true] {
                let forms = matmul::Forms {
                    trans_a: on,
                    trans_b: on,
                    k_blocks: on,
                    onto: on,
                };
                bodies.push((
                    format!(" expanded 16x8 {forms:?}"),
                    matmul::expand_subgroup(&body, [8, 16, 8], forms),
                ));
            }
        }
        if file.name.starts_with("conv2d_") {
            // The conv2d shaders' `//@row` lines expanded, at the largest tile.
            let body = specialize(file.body, &[("TM", 32)]);
            bodies.push((
                " expanded 32 rows".into(),
                conv2d::expand_rows(&body, 32, None),
            ));
            bodies.push((
                " expanded 32 rows subgroups 8".into(),
                conv2d::expand_rows(&body, 32, Some(8)),
            ));
        }
        for (bindings, (form, body)) in variants(file)
            .into_iter()
            .flat_map(|b| bodies.iter().map(move |x| (b.clone(), x)))
        {
            let src = assemble(body, &bindings);
            let desc: Vec<String> = bindings
                .iter()
                .map(|b| {
                    format!(
                        "{}:{}{}",
                        b.name,
                        b.storage.tag(),
                        if b.vec4 { "x4" } else { "" }
                    )
                })
                .collect();
            out.push((
                format!("{}{form} {}", file.name, desc.join(" ")),
                validate_wgsl(&src),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file in shaders/ is registered, and every variant of it parses and validates.
    #[test]
    fn every_shader_validates_with_naga() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/shaders");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".wgsl"))
            .collect();
        on_disk.sort();
        let mut registered: Vec<String> =
            SHADERS.iter().map(|s| format!("{}.wgsl", s.name)).collect();
        registered.sort();
        assert_eq!(
            on_disk, registered,
            "every shader file must be registered in SHADERS"
        );
        let results = validate_all();
        // f32, native f16 and packed f16 of each file at least.
        assert!(results.len() >= 3 * SHADERS.len());
        for (name, r) in results {
            if let Err(e) = r {
                panic!("{name} does not validate:\n{e}");
            }
        }
    }

    #[test]
    fn a_broken_shader_is_reported() {
        assert!(validate_wgsl("fn main() { let x: u32 = 1.5; }").is_err());
    }
}
