//! One error type for everything a user can cause: shapes, dtypes, memory, adapters, the driver.

use std::fmt;

/// Bytes shown the way people read memory sizes ("1.50 MiB").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut v = self.0 as f64;
        let mut unit = 0;
        while v >= 1024.0 && unit + 1 < UNITS.len() {
            v /= 1024.0;
            unit += 1;
        }
        if unit == 0 {
            write!(f, "{} B", self.0)
        } else {
            write!(f, "{v:.2} {}", UNITS[unit])
        }
    }
}

/// A size shown rounded *up* to two decimals, with the exact bytes beside it ("2.07 MiB
/// (2162688 bytes)"): a smallest-budget figure that works when passed back as it is printed,
/// rounded or exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtLeast(pub u64);

impl fmt::Display for AtLeast {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut unit = 0;
        while unit + 1 < UNITS.len() && self.0 >= 1u64 << (10 * (unit + 1)) {
            unit += 1;
        }
        if unit == 0 {
            return write!(f, "{} B", self.0);
        }
        // Hundredths of the unit, rounded up in integers (a float could round 2.0625 down).
        let hundredths = (u128::from(self.0) * 100).div_ceil(1u128 << (10 * unit));
        write!(
            f,
            "{}.{:02} {} ({} bytes)",
            hundredths / 100,
            hundredths % 100,
            UNITS[unit],
            self.0
        )
    }
}

impl std::str::FromStr for Bytes {
    type Err = Error;
    /// "48MiB", "1.5 GiB", "512KB", "1000000" (plain bytes). KB/MB/GB are read as powers of 1024,
    /// as memory sizes usually are.
    fn from_str(s: &str) -> Result<Bytes> {
        let t = s.trim();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let bad = || Error::InvalidArgument {
            op: "memory size",
            reason: format!("cannot read '{s}' as a size (e.g. 48MiB, 1.5GiB, 1000000)"),
        };
        let v: f64 = num.parse().map_err(|_| bad())?;
        let mult = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1u64,
            "k" | "kb" | "kib" => 1 << 10,
            "m" | "mb" | "mib" => 1 << 20,
            "g" | "gb" | "gib" => 1 << 30,
            "t" | "tb" | "tib" => 1 << 40,
            _ => return Err(bad()),
        };
        let bytes = v * mult as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(bad());
        }
        Ok(Bytes(bytes.round() as u64))
    }
}

/// Renders the optional budget of an out-of-memory error.
fn budget_text(budget: &Option<u64>) -> String {
    match budget {
        Some(b) => format!("budget {}", Bytes(*b)),
        None => "no budget set: the driver itself ran out".to_string(),
    }
}

/// Everything a fitgrad call can fail with, each kind with the op and the values that were wrong.
/// New kinds may be added, so a `match` outside the crate needs a `_` arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No adapter matched the request (or the machine has none).
    #[error("no GPU adapter found{}: {reason}. {hint}", if .wanted.is_empty() { String::new() } else { format!(" for {}", .wanted) })]
    NoAdapter {
        /// What was asked for (backend, adapter name), empty when nothing was.
        wanted: String,
        /// What was found instead.
        reason: String,
        /// What to do about it: install a driver when there is no adapter at all, pick
        /// another name when adapters exist but none matches.
        hint: String,
    },

    /// The adapter refused to create a device.
    #[error("could not open the device on adapter '{adapter}': {reason}")]
    RequestDevice {
        /// The adapter's name.
        adapter: String,
        /// What the driver said.
        reason: String,
    },

    /// An allocation would pass the budget, or the driver reported out-of-memory.
    #[error(
        "out of GPU memory: asked for {} while {} is in use and {} is reserved ({}). \
         Try a smaller batch size, gradient accumulation with smaller micro-batches, \
         mixed precision (f16 halves activations), or call empty_cache() to return cached blocks",
        Bytes(*.requested), Bytes(*.in_use), Bytes(*.reserved), budget_text(.budget)
    )]
    OutOfMemory {
        /// Bytes the failed allocation asked for.
        requested: u64,
        /// Bytes held by live tensors at that moment.
        in_use: u64,
        /// Bytes the arena had reserved from the driver (in use plus cached).
        reserved: u64,
        /// The device's memory budget, if one was set.
        budget: Option<u64>,
    },

    /// Host memory is short of what an offload keeps there (checked before training starts,
    /// against MemAvailable of /proc/meminfo).
    #[error(
        "{what} needs {} of host memory, and only {} is available (MemAvailable in /proc/meminfo). \
         Free host memory, or keep the optimizer state on the device (8-bit AdamW takes a quarter of it)",
        Bytes(*.needed), Bytes(*.available)
    )]
    HostMemory {
        /// What needs it (optimizer offload).
        what: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
    },

    /// A memory budget too small for even the smallest configuration (a micro-batch of one).
    #[error(
        "the memory budget of {} is too small: {what} needs at least {}. \
         Raise the budget, lower what a step keeps (mixed precision, activation checkpointing, a smaller model), \
         or what the device holds (8-bit optimizer state, the optimizer offloaded to host memory, parameters streamed by unit)",
        Bytes(*.budget), AtLeast(*.minimum)
    )]
    BudgetTooSmall {
        /// The budget that was given.
        budget: u64,
        /// The smallest budget that works (a run with exactly this budget succeeds).
        minimum: u64,
        /// What needs it (the model, a step at micro-batch 1, ...).
        what: String,
    },

    /// Training diverged: a loss, gradient or parameter became NaN or infinite, or loss
    /// scaling skipped too many steps in a row. The weights are those before that step.
    #[error("training diverged at step {step}: {what}; {remedy}")]
    NonFinite {
        /// The optimizer step (0-based) that could not be taken.
        step: u64,
        /// What was not finite, or overflowed.
        what: String,
        /// What to change.
        remedy: String,
    },

    /// Shapes that do not fit together for an op.
    #[error("{op}: shapes do not fit: {lhs:?} and {rhs:?}{}", if .reason.is_empty() { String::new() } else { format!(" ({})", .reason) })]
    Shape {
        /// The op that refused.
        op: &'static str,
        /// The first operand's dims.
        lhs: Vec<usize>,
        /// The second operand's dims (or the shape asked for).
        rhs: Vec<usize>,
        /// Which rule they break; may be empty.
        reason: String,
    },

    /// Tensors of different dtypes, or a host slice of the wrong element type.
    #[error("{op}: dtype mismatch: expected {expected}, got {got}")]
    DType {
        /// The op that refused.
        op: &'static str,
        /// The dtype it needed.
        expected: crate::DType,
        /// The dtype it was given.
        got: crate::DType,
    },

    /// Any other argument that cannot be used (an axis out of range, a bad option).
    #[error("{op}: {reason}")]
    InvalidArgument {
        /// The op, option or function that refused.
        op: &'static str,
        /// What is wrong and what to pass instead.
        reason: String,
    },

    /// Two tensors live on different devices.
    #[error("{op}: tensors are on different devices")]
    DeviceMismatch {
        /// The op that refused.
        op: &'static str,
    },

    /// A limit of the adapter (buffer size, binding size, dispatch size) would be passed.
    #[error("{op}: {what} of {value} passes the adapter's limit of {limit}")]
    Limit {
        /// The op that would pass it.
        op: &'static str,
        /// Which limit (buffer size, binding size, workgroups per dimension).
        what: &'static str,
        /// What was needed.
        value: u64,
        /// The adapter's limit.
        limit: u64,
    },

    /// A model's tensor passes what one buffer of this adapter holds: checked before the model
    /// is made (a device that only plans has no such limit).
    #[error(
        "tensor '{tensor}' needs {}, past this adapter's largest buffer of {}: store the model in \
         f16, or use an adapter with larger buffers (--plan on a device that only plans has no \
         such limit)",
        Bytes(*.bytes), Bytes(*.limit)
    )]
    TensorLimit {
        /// The tensor's name, as the model names its parameters.
        tensor: String,
        /// The bytes of the buffer it needs.
        bytes: u64,
        /// The adapter's largest buffer.
        limit: u64,
    },

    /// The device was lost (driver reset, GPU removed).
    #[error("the GPU device was lost: {0}")]
    DeviceLost(String),

    /// A validation or internal error that wgpu reported outside an error scope.
    #[error("GPU error: {0}")]
    Gpu(String),

    /// Reading a buffer back to the host failed.
    #[error("reading GPU memory back failed: {0}")]
    Readback(String),

    /// A data or checkpoint file that is malformed, truncated, or not what it claims to be.
    #[error("{path}: {reason}")]
    Data {
        /// The file (or `<memory>` for bytes without one).
        path: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A backward pass that cannot run: nothing requires grad, a graph already freed by an
    /// earlier backward, or a gradient of the wrong shape.
    #[error("autograd: {0}")]
    Autograd(String),

    /// Data-parallel training cannot go on: a replica or rank failed, stopped answering within
    /// the timeout, or holds another model than the others.
    #[error("distributed training, rank {rank}: {reason}")]
    Distributed {
        /// The replica (or MPI rank) that reports it.
        rank: usize,
        /// What happened, naming the other rank where one is to blame.
        reason: String,
    },

    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

/// `Result` with fitgrad's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An [`Error::Data`] naming the file `path`.
pub(crate) fn data_err(path: &std::path::Path, reason: impl Into<String>) -> Error {
    Error::Data {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}
