//! Datasets on the host: the embedded digits, MNIST / Fashion-MNIST IDX files, CSV; seeded
//! splits, per-epoch shuffles, and batch gathering into reused buffers.
//!
//! Everything here is plain host code. A training loop asks for `shuffled_order(seed, epoch)`,
//! then `gather`s each batch into the same two vectors and uploads them, so nothing is allocated
//! per step and the same seed gives the same batches on every machine.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::csv_file::{parse_csv, CsvTable};
use super::order::{epoch_permutation, permutation};
pub(super) use crate::error::data_err;
use crate::tensor::Rng;
use crate::{Error, Result};

/// The UCI digits (1,797 rows of 64 pixels 0..16, then the label), gzipped CSV; see data/README.md.
const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const IDX_IMAGES_MAGIC: u32 = 0x0000_0803; // unsigned bytes, 3 dims (n, rows, cols)
const IDX_LABELS_MAGIC: u32 = 0x0000_0801; // unsigned bytes, 1 dim (n)

/// Where Debian's dataset-fashion-mnist package puts its files.
const FASHION_MNIST_DIR: &str = "/usr/share/datasets/fashion-mnist";
const MNIST_DIR: &str = "/usr/share/datasets/mnist";

/// The share of a single file that `load` holds out for testing.
const TEST_FRACTION: f64 = 0.2;

/// A labelled dataset held on the host: `features` is (len, dim) row-major, one label per row.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// A name for reports (the file or the built-in set).
    pub name: String,
    /// (len, dim), row-major.
    pub features: Vec<f32>,
    /// One per row, each < `classes`.
    pub labels: Vec<u32>,
    /// Features per row.
    pub dim: usize,
    /// The model's output width. A split keeps its parent's, so train and test agree even when
    /// one of them happens to miss a class.
    pub classes: usize,
}

impl Dataset {
    /// A hash of the rows (the features' bits, the labels) and the shape: the data a
    /// checkpoint was trained on, whatever its file is called.
    pub fn hash(&self) -> u64 {
        crate::hash::Fnv1a::default()
            .words(self.features.iter().map(|f| u64::from(f.to_bits())))
            .words(self.labels.iter().map(|&l| u64::from(l)))
            .words([self.len() as u64, self.dim as u64, self.classes as u64])
            .finish()
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// No rows.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Rows per class, indexed by label.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.classes];
        for &l in &self.labels {
            if let Some(c) = counts.get_mut(l as usize) {
                *c += 1;
            }
        }
        counts
    }

    /// The UCI handwritten digits shipped inside the crate: 1,797 rows of 8x8 = 64 pixels
    /// scaled to [0, 1], 10 classes.
    pub fn digits() -> Dataset {
        // The bytes are the crate's own and a test parses them, so a failure is a build defect.
        let path = Path::new("digits.csv.gz (embedded)");
        let mut d = gunzip_if_gz(path, DIGITS_CSV_GZ.to_vec())
            .and_then(|csv| parse_csv(path, &csv, None, None))
            .and_then(|table| csv_dataset(path, table))
            .expect("the embedded digits.csv.gz parses");
        d.name = "digits".to_string();
        d.classes = 10;
        for x in &mut d.features {
            *x /= 16.0; // each pixel counts the set bits of a 4x4 block
        }
        d
    }

    /// A pair of IDX files (MNIST layout): images `(n, rows, cols)` of unsigned bytes and `n`
    /// labels. Either may be gzipped (detected by its magic bytes, not its name). Pixels are
    /// scaled to [0, 1]; `classes` is the largest label + 1.
    pub fn from_idx(images: &Path, labels: &Path) -> Result<Dataset> {
        let img_bytes = read_maybe_gz(images)?;
        let (idims, pixels) = parse_idx(images, &img_bytes, IDX_IMAGES_MAGIC, "pixel")?;
        let lab_bytes = read_maybe_gz(labels)?;
        let (ldims, labs) = parse_idx(labels, &lab_bytes, IDX_LABELS_MAGIC, "label")?;
        let (n, dim) = (idims[0], idims[1] * idims[2]);
        if ldims[0] != n {
            return Err(data_err(
                labels,
                format!(
                    "holds {} labels but {} holds {n} images",
                    ldims[0],
                    images.display()
                ),
            ));
        }
        let classes = labs.iter().map(|&l| l as usize + 1).max().unwrap_or(0);
        let name = images
            .parent()
            .and_then(Path::file_name)
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "idx".to_string());
        Ok(Dataset {
            name,
            features: pixels.iter().map(|&p| f32::from(p) / 255.0).collect(),
            labels: labs.iter().map(|&l| u32::from(l)).collect(),
            dim,
            classes,
        })
    }

    /// Fashion-MNIST (train, test) from `dir`, by default where `apt-get install
    /// dataset-fashion-mnist` puts it.
    pub fn fashion_mnist(dir: Option<&Path>) -> Result<(Dataset, Dataset)> {
        let hint = "install it with `apt-get install dataset-fashion-mnist`, \
                    or pass a directory that holds the four IDX files";
        idx_pair(
            dir.unwrap_or(Path::new(FASHION_MNIST_DIR)),
            "fashion-mnist",
            hint,
        )
    }

    /// MNIST (train, test) from `dir`, by default /usr/share/datasets/mnist.
    pub fn mnist(dir: Option<&Path>) -> Result<(Dataset, Dataset)> {
        let hint = "download the four IDX files (for example from \
                    https://ossci-datasets.s3.amazonaws.com/mnist/) into it, \
                    or pass a directory that holds them";
        idx_pair(dir.unwrap_or(Path::new(MNIST_DIR)), "mnist", hint)
    }

    /// A CSV of numbers, optionally gzipped (detected by its magic bytes). Fields are split at
    /// the delimiter that occurs most often outside quotes in the first non-blank line: tab,
    /// `;` or `,` (a tie goes to tab, then `;`; see [`Dataset::from_csv_delimited`] to choose
    /// it). Fields may be quoted (`"a, b"`, `""` for a quote) and are trimmed; blank lines are
    /// skipped. The first row is a header when any of its fields is not a number. The label
    /// column is `label_column`, else the header's "label", else the last column. Labels must
    /// be non-negative integers and `classes` is the largest + 1; a label far above the others
    /// (see [`load`]) is an error. Features are kept as they are; see `normalize_max`.
    pub fn from_csv(path: &Path, label_column: Option<&str>) -> Result<Dataset> {
        let bytes = read_maybe_gz(path)?;
        csv_dataset(path, parse_csv(path, &bytes, label_column, None)?)
    }

    /// [`Dataset::from_csv`] with fields split at `delimiter` (an ASCII byte such as `b';'`).
    pub fn from_csv_delimited(
        path: &Path,
        label_column: Option<&str>,
        delimiter: u8,
    ) -> Result<Dataset> {
        if !delimiter.is_ascii() || delimiter == b'"' || delimiter == b'\n' {
            return Err(Error::InvalidArgument {
                op: "Dataset::from_csv_delimited",
                reason: format!(
                    "delimiter {:?} must be an ASCII byte other than a quote or a line end",
                    char::from(delimiter)
                ),
            });
        }
        let bytes = read_maybe_gz(path)?;
        csv_dataset(
            path,
            parse_csv(path, &bytes, label_column, Some(delimiter))?,
        )
    }

    /// Divides every feature by the largest absolute feature, so the data lies in [-1, 1]
    /// (one factor for all columns keeps images' relative intensities). Returns the divisor,
    /// 1 when all features are 0, so a second dataset can be scaled the same way.
    pub fn normalize_max(&mut self) -> f32 {
        let max = self.features.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let div = if max > 0.0 { max } else { 1.0 };
        for x in &mut self.features {
            *x /= div;
        }
        div
    }

    /// A seeded random split into (train, test) with `round(len * test_fraction)` test rows;
    /// `test_fraction` is clamped to [0, 1] (NaN counts as 0). Rows keep the shuffled order.
    pub fn split(&self, test_fraction: f64, seed: u64) -> (Dataset, Dataset) {
        let f = if test_fraction.is_nan() {
            0.0
        } else {
            test_fraction.clamp(0.0, 1.0)
        };
        let n_test = ((self.len() as f64 * f).round() as usize).min(self.len());
        let order = permutation(self.len(), &mut Rng::new(seed));
        let (test_idx, train_idx) = order.split_at(n_test);
        (
            self.subset(train_idx, "train"),
            self.subset(test_idx, "test"),
        )
    }

    /// The row order for one epoch: a permutation of 0..len that depends only on (seed, epoch).
    pub fn shuffled_order(&self, seed: u64, epoch: u64) -> Vec<usize> {
        epoch_permutation(self.len(), seed, epoch)
    }

    /// Copies the rows `indices` into `features_out` ((indices.len(), dim)) and `labels_out`,
    /// clearing them first; their capacity is reused, so a loop allocates only on the first
    /// batch. Panics if an index is out of range (indices come from `shuffled_order`).
    pub fn gather(
        &self,
        indices: &[usize],
        features_out: &mut Vec<f32>,
        labels_out: &mut Vec<u32>,
    ) {
        features_out.clear();
        labels_out.clear();
        features_out.reserve(indices.len() * self.dim);
        labels_out.reserve(indices.len());
        for &i in indices {
            assert!(
                i < self.len(),
                "gather: row {i} out of range for {} rows",
                self.len()
            );
            features_out.extend_from_slice(&self.features[i * self.dim..(i + 1) * self.dim]);
            labels_out.push(self.labels[i]);
        }
    }

    fn subset(&self, indices: &[usize], part: &str) -> Dataset {
        let mut d = Dataset {
            name: format!("{}/{part}", self.name),
            features: Vec::new(),
            labels: Vec::new(),
            dim: self.dim,
            classes: self.classes,
        };
        self.gather(indices, &mut d.features, &mut d.labels);
        d
    }
}

/// (train, test) from a spec: "digits" (80/20 seeded split), "fashion-mnist", "mnist" (their own
/// train and test files), or a path: a directory of IDX files, or a CSV file (80/20 seeded split).
///
/// A dataset that would train to a meaningless score is an [`Error::Data`] naming the spec:
/// an empty training split, one with fewer than 2 distinct labels (every model scores 100%),
/// or an empty test split (a file too small to hold a 20% test split). A CSV label that would
/// blow up the output layer is refused by [`Dataset::from_csv`] with its line: a label
/// ≥ 1000 x the number of distinct labels, or > 255 and more than 10x the next largest label
/// (usually the wrong column taken as the label). Classes with no training row, and test labels
/// that no training row has, are logged with `log::warn!`.
pub fn load(spec: &str, seed: u64) -> Result<(Dataset, Dataset)> {
    load_with_label(spec, seed, None)
}

/// [`load`], with a CSV file's label column chosen by its header name (`None`: the header's
/// "label", else the last column). A label column for a dataset that
/// is not a CSV file is an [`Error::InvalidArgument`].
pub fn load_with_label(
    spec: &str,
    seed: u64,
    label_column: Option<&str>,
) -> Result<(Dataset, Dataset)> {
    if label_column.is_some() && !Path::new(spec).is_file() {
        return Err(Error::InvalidArgument {
            op: "--label-column",
            reason: format!("'{spec}' is not a CSV file: only a CSV file has a label column"),
        });
    }
    let (train, test) = load_unchecked(spec, seed, label_column)?;
    check_splits(Path::new(spec), &train, &test)?;
    Ok((train, test))
}

/// The files [`load`] reads for `spec` (none for the embedded digits; for a folder, each name
/// it looks for, gzipped or not, whether or not it is there): what an output must not be.
pub fn input_files(spec: &str) -> Vec<PathBuf> {
    let dir = match spec {
        "digits" => return Vec::new(),
        "fashion-mnist" | "fashion_mnist" => Path::new(FASHION_MNIST_DIR),
        "mnist" => Path::new(MNIST_DIR),
        _ if !Path::new(spec).is_dir() => return vec![PathBuf::from(spec)],
        _ => Path::new(spec),
    };
    IDX_FILES
        .iter()
        .flat_map(|base| [dir.join(base), dir.join(format!("{base}.gz"))])
        .collect()
}

fn load_unchecked(spec: &str, seed: u64, label_column: Option<&str>) -> Result<(Dataset, Dataset)> {
    match spec {
        "digits" => Ok(Dataset::digits().split(TEST_FRACTION, seed)),
        "fashion-mnist" | "fashion_mnist" => Dataset::fashion_mnist(None),
        "mnist" => Dataset::mnist(None),
        _ => {
            let path = Path::new(spec);
            if path.is_dir() {
                let hint = "expected train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], \
                            t10k-images-idx3-ubyte[.gz] and t10k-labels-idx1-ubyte[.gz]";
                let name = path
                    .file_name()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_else(|| spec.to_string());
                idx_pair(path, &name, hint)
            } else if path.is_file() {
                Ok(Dataset::from_csv(path, label_column)?.split(TEST_FRACTION, seed))
            } else {
                Err(Error::InvalidArgument {
                    op: "--dataset",
                    reason: format!(
                        "'{spec}' is neither a known dataset (digits, mnist, fashion-mnist) \
                         nor an existing file or directory"
                    ),
                })
            }
        }
    }
}

/// The checks of [`load`] on a (train, test) pair; `source` names it in errors.
fn check_splits(source: &Path, train: &Dataset, test: &Dataset) -> Result<()> {
    if train.is_empty() {
        return Err(data_err(source, "the training split is empty"));
    }
    if test.is_empty() {
        return Err(data_err(
            source,
            format!(
                "the test split is empty ({} training rows): a file needs at least 3 rows for \
                 a {}% test split",
                train.len(),
                TEST_FRACTION * 100.0
            ),
        ));
    }
    let counts = train.class_counts();
    let present: Vec<usize> = (0..counts.len()).filter(|&c| counts[c] > 0).collect();
    if let [only] = present[..] {
        return Err(data_err(
            source,
            format!(
                "every one of the {} training rows has label {only}: with a single class any \
                 model scores 100%; is the label column right?",
                train.len()
            ),
        ));
    }
    let empty: Vec<usize> = (0..counts.len()).filter(|&c| counts[c] == 0).collect();
    if !empty.is_empty() {
        log::warn!(
            "{}: {} of {} classes have no training rows ({}); labels should run 0..classes",
            source.display(),
            empty.len(),
            counts.len(),
            first_few(&empty)
        );
    }
    let mut unseen: Vec<usize> = test
        .labels
        .iter()
        .map(|&l| l as usize)
        .filter(|&l| counts.get(l).is_none_or(|&n| n == 0))
        .collect();
    unseen.sort_unstable();
    unseen.dedup();
    if !unseen.is_empty() {
        log::warn!(
            "{}: the test split has labels no training row has ({}): the model cannot learn them",
            source.display(),
            first_few(&unseen)
        );
    }
    Ok(())
}

/// `1, 2, 3` with at most eight values, then how many more.
fn first_few(v: &[usize]) -> String {
    let mut s: Vec<String> = v.iter().take(8).map(usize::to_string).collect();
    if v.len() > 8 {
        s.push(format!("and {} more", v.len() - 8));
    }
    s.join(", ")
}

/// A parsed CSV as a dataset: labels checked for outliers, classes the largest label + 1,
/// named after the file without its extensions.
fn csv_dataset(path: &Path, t: CsvTable) -> Result<Dataset> {
    check_labels(path, &t.labels, &t.column, |row| {
        format!("line {}", t.lines[row])
    })?;
    let classes = t.labels.iter().map(|&l| l as usize + 1).max().unwrap_or(0);
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let name = name.strip_suffix(".gz").unwrap_or(&name);
    let name = [".csv", ".tsv"]
        .iter()
        .find_map(|ext| name.strip_suffix(ext))
        .unwrap_or(name)
        .to_string();
    Ok(Dataset {
        name,
        features: t.features,
        labels: t.labels,
        dim: t.dim,
        classes,
    })
}

/// Refuses a label far outside the others: the model's output layer would get `label + 1`
/// classes, almost all of them never seen. That is a label ≥ 1000 x the number of distinct
/// labels, or one above 255 and more than 10x the next largest distinct label. `column` names
/// the label column and `locate(row)` the row ("line 7") in the message. (IDX labels are bytes,
/// at most 255, so neither can happen there.)
fn check_labels(
    path: &Path,
    labels: &[u32],
    column: &str,
    locate: impl Fn(usize) -> String,
) -> Result<()> {
    let mut distinct = labels.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let Some(&max) = distinct.last() else {
        return Ok(());
    };
    let k = distinct.len() as u64;
    let next = distinct.len().checked_sub(2).map(|i| distinct[i]);
    let why = if u64::from(max) >= 1000 * k {
        format!("at least 1000x the number of distinct labels ({k})")
    } else {
        match next {
            Some(n) if max > 255 && u64::from(max) > 10 * u64::from(n) => {
                format!("more than 10x the next largest label ({n})")
            }
            _ => return Ok(()),
        }
    };
    let row = labels
        .iter()
        .position(|&l| l == max)
        .expect("max is a label");
    Err(data_err(
        path,
        format!(
            "{}: label {max} is {why}, so the model would get {} output classes; is the label \
             column ({column}) the right one? (choose it by its header name: \
             --label-column in the examples)",
            locate(row),
            u64::from(max) + 1
        ),
    ))
}

fn io_err(path: &Path, source: io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The file's bytes, gunzipped when it starts with the gzip magic. The name is not trusted:
/// browsers and proxies often store decompressed files under a .gz name.
pub(super) fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let raw = fs::read(path).map_err(|e| io_err(path, e))?;
    gunzip_if_gz(path, raw)
}

pub(super) fn gunzip_if_gz(path: &Path, raw: Vec<u8>) -> Result<Vec<u8>> {
    if !raw.starts_with(&GZIP_MAGIC) {
        return Ok(raw);
    }
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(raw.as_slice())
        .read_to_end(&mut out)
        .map_err(|e| data_err(path, format!("gzip data is corrupt or truncated: {e}")))?;
    Ok(out)
}

/// Checks an IDX header of unsigned bytes with `magic` and returns (dims, payload). The payload
/// must be exactly the product of the dims: a short file is truncated, a long one is not IDX.
fn parse_idx<'a>(
    path: &Path,
    bytes: &'a [u8],
    magic: u32,
    what: &str,
) -> Result<(Vec<usize>, &'a [u8])> {
    let kind = |m: u32| match m {
        IDX_IMAGES_MAGIC => " (an IDX image file)",
        IDX_LABELS_MAGIC => " (an IDX label file)",
        _ => "",
    };
    let be_u32 =
        |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    if bytes.len() < 4 {
        return Err(data_err(
            path,
            format!("{} bytes is too short for an IDX header", bytes.len()),
        ));
    }
    let found = be_u32(0);
    if found != magic {
        return Err(data_err(
            path,
            format!(
                "magic number 0x{found:08x}{} is not the expected 0x{magic:08x}{}",
                kind(found),
                kind(magic)
            ),
        ));
    }
    let ndims = (magic & 0xff) as usize;
    let header = 4 + 4 * ndims;
    if bytes.len() < header {
        return Err(data_err(
            path,
            format!(
                "truncated IDX header: expected {header} bytes, found {}",
                bytes.len()
            ),
        ));
    }
    let dims: Vec<usize> = (0..ndims).map(|d| be_u32(4 + 4 * d) as usize).collect();
    if let Some(d) = dims.iter().position(|&d| d == 0) {
        return Err(data_err(path, format!("dimension {d} of {dims:?} is 0")));
    }
    let expected = dims
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| data_err(path, format!("dimensions {dims:?} overflow")))?;
    let payload = &bytes[header..];
    if payload.len() != expected {
        let why = if payload.len() < expected {
            "truncated"
        } else {
            "extra data after the end"
        };
        return Err(data_err(
            path,
            format!(
                "expected {expected} {what} bytes for dimensions {dims:?}, found {} ({why})",
                payload.len()
            ),
        ));
    }
    Ok((dims, payload))
}

/// The standard MNIST file names, each accepted with or without .gz.
const IDX_FILES: [&str; 4] = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
];

/// (train, test) from the four MNIST-named files in `dir`; `hint` says how to get them.
fn idx_pair(dir: &Path, name: &str, hint: &str) -> Result<(Dataset, Dataset)> {
    if !dir.is_dir() {
        let msg = format!("no such directory; {hint}");
        return Err(io_err(dir, io::Error::new(io::ErrorKind::NotFound, msg)));
    }
    let find = |base: &str| -> Result<PathBuf> {
        let gz = dir.join(format!("{base}.gz"));
        let raw = dir.join(base);
        if gz.is_file() {
            Ok(gz)
        } else if raw.is_file() {
            Ok(raw)
        } else {
            let msg = format!("neither {base}.gz nor {base} is here; {hint}");
            Err(io_err(dir, io::Error::new(io::ErrorKind::NotFound, msg)))
        }
    };
    let [tri, trl, tei, tel] = IDX_FILES.map(find);
    let mut train = Dataset::from_idx(&tri?, &trl?)?;
    let mut test = Dataset::from_idx(&tei?, &tel?)?;
    // One output width for both, as with `split`.
    let classes = train.classes.max(test.classes);
    train.classes = classes;
    test.classes = classes;
    train.name = format!("{name}/train");
    test.name = format!("{name}/test");
    Ok((train, test))
}
