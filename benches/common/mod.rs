//! What the benchmarks share.

use fitgrad::Device;

/// The default adapter, its description printed; `None` (said on stderr) where there is none,
/// so a machine without an adapter measures nothing rather than failing.
pub fn device() -> Option<Device> {
    match Device::new() {
        Ok(d) => {
            eprintln!("{}", d.info());
            Some(d)
        }
        Err(e) => {
            eprintln!("no adapter, nothing to measure: {e}");
            None
        }
    }
}
