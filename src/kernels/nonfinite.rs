//! Dispatch for the NaN / inf check that mixed-precision loss scaling runs over gradients.

use super::Operand;
use super::{Binding, Storage, NONFINITE, WG};
use crate::Result;

/// Sets `flag` (one f32, zeroed by the caller) to 1 if `x` holds a NaN or an infinity; leaves it
/// alone otherwise.
pub(crate) fn nonfinite<T: Operand>(x: &T, flag: &T) -> Result<()> {
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = x.device();
    // 16-byte loads when every quad is whole (a tensor's block starts 256-byte aligned).
    let vec4 = n.is_multiple_of(4);
    let s = Storage::of(dev, x.dtype());
    let bind = [
        Binding {
            name: "x",
            storage: s,
            write: false,
            vec4,
            split: None,
        },
        Binding {
            name: "flag",
            storage: Storage::F32,
            write: true,
            vec4: false,
            split: None,
        },
    ];
    let blocks = [x.block(), flag.block()];
    let splits = super::Splits::of(dev, &blocks)?;
    let key = format!(
        "nonfinite_{}{}{}",
        s.tag(),
        if vec4 { "x4" } else { "" },
        splits.key()
    );
    let k = dev.kernel(&key, &[], false, || {
        super::assemble(NONFINITE.body, &splits.apply(bind.to_vec()))
    })?;
    let quads = n.div_ceil(4);
    dev.dispatch(
        &k,
        &[n as u32, quads as u32, 0, 0],
        &blocks,
        (quads as u32).div_ceil(WG),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{assemble, validate_wgsl, variants};

    #[test]
    fn vec4_variants_validate() {
        for plain in variants(&NONFINITE) {
            let bind: Vec<Binding> = plain
                .iter()
                .map(|b| Binding {
                    vec4: b.name == "x",
                    ..*b
                })
                .collect();
            if let Err(e) = validate_wgsl(&assemble(NONFINITE.body, &bind)) {
                panic!("{bind:?}: {e}");
            }
        }
    }
}
