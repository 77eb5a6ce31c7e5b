//! Parameters made in host memory. A model built inside [`born_on_host`] puts each unit's
//! parameters in host memory as soon as the unit is made (DeepSpeed's `zero.Init`), so a model
//! whose parameters pass the device's memory is never whole on it: the device holds the
//! embeddings and at most the one unit being made. Streaming numbers the units when it starts,
//! and a trainer given such a model streams it.

use crate::tensor::streamed::UNASSIGNED;
use crate::{Device, Error, Result, Tensor};

/// Per device: how many [`born_on_host`] calls are open, and the first failure of a move.
#[derive(Default)]
struct Birth {
    open: usize,
    error: Option<Error>,
}

/// Closes one [`born_on_host`] on drop (also when its closure panics).
struct Open<'a>(&'a Device);

impl Drop for Open<'_> {
    fn drop(&mut self) {
        self.0.with_ext(|b: &mut Birth| b.open -= 1);
    }
}

/// Runs `build` with every unit it makes put in host memory as it is made (see the module
/// docs); the first failure to move one is the result. On a device that only plans (or in
/// planning mode) `build` runs as it is: nothing exists to move.
pub fn born_on_host<T>(device: &Device, build: impl FnOnce() -> Result<T>) -> Result<T> {
    if device.is_planning() {
        return build();
    }
    device.with_ext(|b: &mut Birth| b.open += 1);
    let out = {
        let _open = Open(device);
        build()
    };
    let failed = device.with_ext(|b: &mut Birth| match b.open {
        0 => b.error.take(),
        _ => None,
    });
    match (out, failed) {
        (Ok(_), Some(e)) => Err(e),
        (out, _) => out,
    }
}

/// Called by a constructor with the parameters of a unit it has just made: inside
/// [`born_on_host`] they move to host memory now; elsewhere nothing happens.
pub fn born(params: &[Tensor]) {
    let Some(dev) = params.first().map(|p| p.device().clone()) else {
        return;
    };
    if !dev.with_ext(|b: &mut Birth| b.open > 0 && b.error.is_none()) {
        return;
    }
    for p in params {
        if let Err(e) = p.stream_to_host(UNASSIGNED) {
            dev.with_ext(|b: &mut Birth| b.error = Some(e));
            return;
        }
    }
}

/// Whether any of `params` was made in host memory and no streaming has numbered it yet.
pub fn made_on_host(params: &[Tensor]) -> bool {
    params.iter().any(|p| p.stream_unit() == Some(UNASSIGNED))
}
