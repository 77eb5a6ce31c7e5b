//! The safetensors layer under checkpoints and quantized models: a tensor's host bytes
//! ([`HostTensor`]), the parse of a file with every check a damaged or foreign one can fail, and
//! the bytes of a file written.

use super::*;

/// A tensor's bytes on the host: little-endian, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// The element type of `bytes`.
    pub dtype: DType,
    /// The tensor's dims.
    pub dims: Vec<usize>,
    /// `numel * dtype.size()` bytes, little-endian, row-major.
    pub bytes: Vec<u8>,
}

impl HostTensor {
    /// Checks that `bytes` holds exactly `dims` elements of `dtype`.
    pub fn new(dtype: DType, dims: &[usize], bytes: Vec<u8>) -> Result<HostTensor> {
        let want = dims.iter().try_fold(dtype.size(), |n, &d| n.checked_mul(d));
        if want != Some(bytes.len()) {
            return Err(Error::InvalidArgument {
                op: "HostTensor::new",
                reason: format!(
                    "{} bytes do not hold a {dtype} tensor of shape {dims:?}",
                    bytes.len()
                ),
            });
        }
        Ok(HostTensor {
            dtype,
            dims: dims.to_vec(),
            bytes,
        })
    }

    /// Reads a tensor back from its device (after all recorded work).
    pub fn read(t: &Tensor) -> Result<HostTensor> {
        let bytes = t.read_bytes()?;
        HostTensor::new(t.dtype(), t.dims(), bytes)
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    /// The first element that is NaN or infinite, with its index, read on its bits.
    pub fn first_nonfinite(&self) -> Option<(usize, NonFinite)> {
        let width = match self.dtype {
            DType::F32 => Width::F32,
            DType::F16 => Width::F16,
        };
        first_nonfinite(width, &self.bytes)
    }

    /// The values as f32 whatever the dtype.
    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            DType::F32 => bytemuck::pod_collect_to_vec::<u8, f32>(&self.bytes),
            DType::F16 => bytemuck::pod_collect_to_vec::<u8, half::f16>(&self.bytes)
                .into_iter()
                .map(f32::from)
                .collect(),
        }
    }

    /// A new tensor on `device` with these bytes.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        match self.dtype {
            DType::F32 => Tensor::from_slice(
                device,
                &bytemuck::pod_collect_to_vec::<u8, f32>(&self.bytes),
                &self.dims,
            ),
            DType::F16 => Tensor::from_slice(
                device,
                &bytemuck::pod_collect_to_vec::<u8, half::f16>(&self.bytes),
                &self.dims,
            ),
        }
    }
}

/// What a non-finite element is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonFinite {
    /// Not a number.
    NaN,
    /// Positive infinity.
    Inf,
    /// Negative infinity.
    NegInf,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            NonFinite::NaN => "NaN",
            NonFinite::Inf => "inf",
            NonFinite::NegInf => "-inf",
        })
    }
}

/// A float layout whose special values [`first_nonfinite`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Width {
    F32,
    F16,
    BF16,
}

/// The first NaN or infinity among little-endian floats of `width` in `bytes`, found on the
/// bits (all-ones exponent; a zero mantissa is an infinity), not by float compares.
pub(crate) fn first_nonfinite(width: Width, bytes: &[u8]) -> Option<(usize, NonFinite)> {
    // (bytes per element, exponent mask, mantissa mask, sign bit) of each layout.
    let (size, exp, man, sign): (usize, u32, u32, u32) = match width {
        Width::F32 => (4, 0x7f80_0000, 0x007f_ffff, 0x8000_0000),
        Width::F16 => (2, 0x7c00, 0x03ff, 0x8000),
        Width::BF16 => (2, 0x7f80, 0x007f, 0x8000),
    };
    bytes.chunks_exact(size).enumerate().find_map(|(i, b)| {
        let bits = match size {
            4 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            _ => u32::from(u16::from_le_bytes([b[0], b[1]])),
        };
        (bits & exp == exp).then(|| {
            let kind = if bits & man != 0 {
                NonFinite::NaN
            } else if bits & sign != 0 {
                NonFinite::NegInf
            } else {
                NonFinite::Inf
            };
            (i, kind)
        })
    })
}

impl safetensors::View for &HostTensor {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            DType::F32 => safetensors::Dtype::F32,
            DType::F16 => safetensors::Dtype::F16,
        }
    }
    fn shape(&self) -> &[usize] {
        &self.dims
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// A safetensors file's tensors (any dtype) and string metadata, after the checks a damaged or
/// foreign file can fail (each an [`Error::Data`] naming `source` and what is wrong; never a
/// panic). [`Checkpoint::from_bytes`] and the quantized models (`compress`) read through it.
pub(crate) fn parse_safetensors<'a>(
    bytes: &'a [u8],
    source: &str,
) -> Result<(safetensors::SafeTensors<'a>, BTreeMap<String, String>)> {
    let bad = |reason: String| Error::Data {
        path: source.to_string(),
        reason,
    };
    let len = bytes.len() as u64;
    // The checks safetensors makes too, with messages that say what is wrong; the integer
    // scan keeps its offset arithmetic from overflowing (which would panic).
    let Some(head) = bytes.get(..8) else {
        return Err(bad(format!(
            "{len} bytes is too short for a safetensors file (it starts with an 8-byte header length): empty or truncated"
        )));
    };
    let n = u64::from_le_bytes(head.try_into().expect("8 bytes"));
    if n > MAX_HEADER {
        return Err(bad(format!(
            "the header claims {n} bytes, past safetensors' limit of {MAX_HEADER}: not a safetensors file"
        )));
    }
    if 8 + n > len {
        return Err(bad(format!(
            "the header claims {n} bytes but only {} follow the length: truncated",
            len - 8
        )));
    }
    let header = &bytes[8..8 + n as usize];
    let data_len = len - 8 - n;
    if let Some(v) = bare_integer_above(header, MAX_NUMBER) {
        return Err(bad(format!(
            "the header holds the number {v}: no shape or data offset is that large"
        )));
    }
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| {
        use safetensors::SafeTensorError as E;
        bad(match e {
            E::InvalidHeader(_) => "the header is not UTF-8: not a safetensors file".into(),
            E::InvalidHeaderDeserialization(e) => {
                format!("the header is not valid safetensors JSON: {e}")
            }
            E::MetadataIncompleteBuffer => format!(
                "the tensors' data offsets do not end where the file does ({data_len} bytes of data): truncated, or offsets out of range"
            ),
            E::InvalidOffset(name) => format!(
                "tensor '{name}': data offsets out of order, overlapping or out of range"
            ),
            E::TensorInvalidInfo => {
                "a tensor's data offsets do not match its shape and dtype".into()
            }
            e => format!("not a valid safetensors file: {e}"),
        })
    })?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| bad(e.to_string()))?;
    let metadata = meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    Ok((st, metadata))
}

/// A tensor of any safetensors dtype, for [`safetensors_bytes`].
pub(crate) struct RawTensor<'a> {
    pub name: &'a str,
    pub dtype: safetensors::Dtype,
    pub dims: &'a [usize],
    /// Little-endian, row-major.
    pub bytes: &'a [u8],
}

/// The bytes of a safetensors file of `tensors` and `metadata`, laid out as
/// [`Checkpoint::to_bytes`] says (the same bytes for the same input); `source` names the file
/// in errors. Checkpoints and quantized models (`compress`) are both written through it.
pub(crate) fn safetensors_bytes(
    tensors: &[RawTensor],
    metadata: &BTreeMap<String, String>,
    source: &str,
) -> Result<Vec<u8>> {
    let bad = |reason: String| Error::Data {
        path: source.to_string(),
        reason: format!("cannot write a safetensors file: {reason}"),
    };
    let json_err = |e: serde_json::Error| bad(e.to_string());
    let mut order: Vec<&RawTensor> = tensors.iter().collect();
    order.sort_by(|a, b| b.dtype.cmp(&a.dtype).then(a.name.cmp(b.name)));
    let mut header = String::from("{");
    if !metadata.is_empty() {
        // A BTreeMap serializes in key order.
        header += "\"__metadata__\":";
        header += &serde_json::to_string(metadata).map_err(json_err)?;
    }
    let mut offset = 0usize;
    for t in &order {
        let name = t.name;
        // Whole bytes per element: fitgrad writes no sub-byte dtype.
        let want = t.dims.iter().product::<usize>() * t.dtype.bitsize() / 8;
        if t.bytes.len() != want {
            return Err(bad(format!(
                "tensor '{name}' holds {} bytes, its {} shape {:?} needs {want}",
                t.bytes.len(),
                t.dtype,
                t.dims
            )));
        }
        if header.len() > 1 {
            header.push(',');
        }
        // Display writes safetensors' own names ("F32", "I8").
        let dtype = t.dtype;
        header += &format!(
            "{}:{{\"dtype\":\"{dtype}\",\"shape\":{},\"data_offsets\":[{offset},{}]}}",
            serde_json::to_string(name).map_err(json_err)?,
            serde_json::to_string(&t.dims).map_err(json_err)?,
            offset + want
        );
        offset += want;
    }
    header.push('}');
    let padded = header.len().next_multiple_of(8);
    if padded as u64 > MAX_HEADER {
        return Err(bad(format!(
            "the header would take {padded} bytes, past safetensors' limit of {MAX_HEADER}"
        )));
    }
    let mut out = Vec::with_capacity(8 + padded + offset);
    out.extend_from_slice(&(padded as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.resize(8 + padded, b' ');
    for t in &order {
        out.extend_from_slice(t.bytes);
    }
    Ok(out)
}

/// `'a', 'b', 'c'`, at most eight names.
pub(crate) fn list(names: &[String]) -> String {
    let mut s: Vec<String> = names.iter().take(8).map(|n| format!("'{n}'")).collect();
    if names.len() > 8 {
        s.push(format!("and {} more", names.len() - 8));
    }
    s.join(", ")
}

/// The first integer written outside a string in a JSON header that is greater than `limit`
/// (in a safetensors header: the shapes and data offsets).
fn bare_integer_above(header: &[u8], limit: u64) -> Option<String> {
    let (mut in_string, mut escaped) = (false, false);
    let mut i = 0;
    while i < header.len() {
        let c = header[i];
        if in_string {
            match c {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if c == b'"' {
            in_string = true;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < header.len() && header[i].is_ascii_digit() {
                i += 1;
            }
            let digits = std::str::from_utf8(&header[start..i]).expect("ASCII digits");
            if digits.parse::<u64>().map_or(true, |v| v > limit) {
                return Some(digits.to_string());
            }
            continue;
        }
        i += 1;
    }
    None
}
