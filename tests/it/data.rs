//! Datasets: the embedded digits, IDX and CSV loading (good files and every kind of bad one),
//! seeded splits and shuffles, batch gathering. Host only; no device needed.

use std::io::Write;
use std::path::{Path, PathBuf};

use fitgrad::train::data::{load, Dataset};
use fitgrad::Error;

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("fitgrad-data-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn write_gz(&self, name: &str, bytes: &[u8]) -> PathBuf {
        self.write(name, &gzip(bytes))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// IDX images (n, rows, cols) with pixel (i, p) = (i * 7 + p) % 256.
fn idx_images(n: u32, rows: u32, cols: u32) -> Vec<u8> {
    let mut b = 0x0000_0803u32.to_be_bytes().to_vec();
    for d in [n, rows, cols] {
        b.extend(d.to_be_bytes());
    }
    let dim = (rows * cols) as usize;
    b.extend((0..n as usize * dim).map(|k| ((k / dim * 7 + k % dim) % 256) as u8));
    b
}

/// IDX labels 0..n with label i = i % classes.
fn idx_labels(n: u32, classes: u32) -> Vec<u8> {
    let mut b = 0x0000_0801u32.to_be_bytes().to_vec();
    b.extend(n.to_be_bytes());
    b.extend((0..n).map(|i| (i % classes) as u8));
    b
}

/// Asserts `Error::Data` whose message names `file` and contains `needle`.
fn expect_data_err<T: std::fmt::Debug>(r: fitgrad::Result<T>, file: &Path, needle: &str) {
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    match r {
        Err(e @ Error::Data { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&name), "message does not name {name}: {msg}");
            assert!(msg.contains(needle), "message lacks '{needle}': {msg}");
        }
        other => panic!("expected Error::Data for {name}, got {other:?}"),
    }
}

#[test]
fn digits_loads_with_balanced_classes() {
    let d = Dataset::digits();
    assert_eq!((d.len(), d.dim, d.classes), (1797, 64, 10));
    assert_eq!(d.features.len(), 1797 * 64);
    assert!(d.features.iter().all(|&x| (0.0..=1.0).contains(&x)));
    assert!(d.features.contains(&1.0), "16/16 pixels exist");
    // The first row of the file: 0,0,5,13,9,1,0,0,... label 0.
    assert_eq!(&d.features[..4], &[0.0, 0.0, 5.0 / 16.0, 13.0 / 16.0]);
    assert_eq!(d.labels[0], 0);
    let counts = d.class_counts();
    assert_eq!(counts.iter().sum::<usize>(), 1797);
    for (c, &n) in counts.iter().enumerate() {
        assert!((170..=190).contains(&n), "class {c} has {n} rows");
    }
}

#[test]
fn split_is_disjoint_complete_and_seeded() {
    let d = Dataset::digits();
    // Tag each row by its index so the parts can be traced back.
    let tagged = Dataset {
        name: "tagged".into(),
        features: (0..d.len()).map(|i| i as f32).collect(),
        labels: d.labels.clone(),
        dim: 1,
        classes: 10,
    };
    let (train, test) = tagged.split(0.2, 7);
    assert_eq!((train.len(), test.len()), (1438, 359));
    assert_eq!((train.dim, train.classes, test.classes), (1, 10, 10));
    let mut seen: Vec<usize> = train
        .features
        .iter()
        .chain(&test.features)
        .map(|&x| x as usize)
        .collect();
    for (k, &i) in seen.iter().enumerate() {
        let part = if k < train.len() { &train } else { &test };
        let row = if k < train.len() { k } else { k - train.len() };
        assert_eq!(
            part.labels[row], d.labels[i],
            "labels travel with their rows"
        );
    }
    seen.sort_unstable();
    assert_eq!(
        seen,
        (0..d.len()).collect::<Vec<_>>(),
        "disjoint and complete"
    );

    assert_eq!(
        tagged.split(0.2, 7),
        (train.clone(), test.clone()),
        "same seed, same split"
    );
    assert_ne!(tagged.split(0.2, 8).1, test, "another seed, another split");

    let (all, none) = tagged.split(f64::NAN, 1);
    assert_eq!((all.len(), none.len()), (1797, 0));
    let (none, all) = tagged.split(5.0, 1);
    assert_eq!((none.len(), all.len()), (0, 1797));
}

#[test]
fn shuffled_order_is_a_seeded_permutation_per_epoch() {
    let d = Dataset::digits();
    let a = d.shuffled_order(3, 0);
    assert_eq!(a, d.shuffled_order(3, 0));
    assert_ne!(a, d.shuffled_order(3, 1));
    assert_ne!(a, d.shuffled_order(4, 0));
    assert_ne!(a, (0..d.len()).collect::<Vec<_>>());
    let mut sorted = a.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..d.len()).collect::<Vec<_>>());
}

#[test]
fn gather_fills_and_reuses_buffers() {
    let d = Dataset::digits();
    let (mut x, mut y) = (Vec::new(), Vec::new());
    d.gather(&[5, 0, 1796], &mut x, &mut y);
    assert_eq!(x.len(), 3 * 64);
    assert_eq!(&x[..64], &d.features[5 * 64..6 * 64]);
    assert_eq!(&x[128..], &d.features[1796 * 64..]);
    assert_eq!(y, vec![d.labels[5], d.labels[0], d.labels[1796]]);
    let (px, py) = (x.as_ptr(), y.as_ptr());
    d.gather(&[2, 3], &mut x, &mut y);
    assert_eq!((x.len(), y.len()), (128, 2));
    assert_eq!(
        (x.as_ptr(), y.as_ptr()),
        (px, py),
        "a smaller batch reuses the buffers"
    );
}

#[test]
fn load_digits_and_unknown_spec() {
    let (train, test) = load("digits", 1).unwrap();
    assert_eq!((train.len(), test.len()), (1438, 359));
    assert_eq!(
        (train.name.as_str(), test.name.as_str()),
        ("digits/train", "digits/test")
    );
    assert!(matches!(
        load("no-such-dataset-or-file", 1),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn fashion_mnist_loads_when_installed() {
    let dir = Path::new("/usr/share/datasets/fashion-mnist");
    if !dir.is_dir() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but {} is missing: CI installs dataset-fashion-mnist",
            dir.display()
        );
        eprintln!(
            "skipping: {} absent (apt-get install dataset-fashion-mnist)",
            dir.display()
        );
        return;
    }
    let (train, test) = load("fashion-mnist", 0).unwrap();
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
    assert_eq!(
        (train.dim, train.classes, test.dim, test.classes),
        (784, 10, 784, 10)
    );
    assert_eq!(train.features.len(), 60_000 * 784);
    assert!(train.features.iter().all(|&x| (0.0..=1.0).contains(&x)));
    assert_eq!(train.class_counts(), vec![6000; 10]);
    assert_eq!(test.class_counts(), vec![1000; 10]);
}

#[test]
fn missing_dataset_dir_says_how_to_get_it() {
    let dir = std::env::temp_dir().join("fitgrad-data-no-such-dir");
    let msg = Dataset::fashion_mnist(Some(&dir)).unwrap_err().to_string();
    assert!(
        msg.contains("apt-get install dataset-fashion-mnist"),
        "{msg}"
    );
    assert!(msg.contains("fitgrad-data-no-such-dir"), "{msg}");
    let msg = Dataset::mnist(Some(&dir)).unwrap_err().to_string();
    assert!(msg.contains("fitgrad-data-no-such-dir"), "{msg}");
}

#[test]
fn idx_gz_and_raw_load() {
    let t = TempDir::new("idx-ok");
    let images = idx_images(12, 3, 4);
    let labels = idx_labels(12, 5);
    let d = Dataset::from_idx(
        &t.write_gz("train-images-idx3-ubyte.gz", &images),
        &t.write("train-labels-idx1-ubyte", &labels),
    )
    .unwrap();
    assert_eq!((d.len(), d.dim, d.classes), (12, 12, 5));
    assert_eq!(d.labels[..6], [0, 1, 2, 3, 4, 0]);
    assert_eq!(d.features[12 + 3], (7.0 + 3.0) / 255.0, "row 1, pixel 3");
    // The same files in the other encodings give the same data; the name does not decide.
    let raw = Dataset::from_idx(
        &t.write("raw-images", &images),
        &t.write("labels.gz", &gzip(&labels)),
    )
    .unwrap();
    assert_eq!(
        (raw.features, raw.labels),
        (d.features.clone(), d.labels.clone())
    );

    // A directory of the four standard names is a dataset spec.
    t.write("t10k-images-idx3-ubyte", &idx_images(4, 3, 4));
    t.write_gz("t10k-labels-idx1-ubyte.gz", &idx_labels(4, 3));
    let (train, test) = load(t.0.to_str().unwrap(), 0).unwrap();
    assert_eq!((train.len(), test.len(), train.dim), (12, 4, 12));
    assert_eq!(
        (train.classes, test.classes),
        (5, 5),
        "one output width for both"
    );
}

#[test]
fn bad_idx_files_are_data_errors_naming_the_file() {
    let t = TempDir::new("idx-bad");
    let labels = t.write("labels-idx1-ubyte", &idx_labels(10, 10));
    let images = idx_images(10, 28, 28);

    let short = t.write("short-images.gz", &gzip(&images[..images.len() - 100]));
    expect_data_err(
        Dataset::from_idx(&short, &labels),
        &short,
        "expected 7840 pixel bytes for dimensions [10, 28, 28], found 7740",
    );
    let long = t.write("long-images", &[images.as_slice(), &[0]].concat());
    expect_data_err(Dataset::from_idx(&long, &labels), &long, "found 7841");
    let header = t.write("header-only", &images[..9]);
    expect_data_err(
        Dataset::from_idx(&header, &labels),
        &header,
        "truncated IDX header",
    );
    let tiny = t.write("tiny", &[0, 0]);
    expect_data_err(Dataset::from_idx(&tiny, &labels), &tiny, "too short");

    // Labels passed as images, and a file that is not IDX at all.
    expect_data_err(Dataset::from_idx(&labels, &labels), &labels, "0x00000801");
    let html = t.write("page.html", b"<html>not found</html>");
    expect_data_err(Dataset::from_idx(&html, &labels), &html, "magic number");
    let good = t.write("images-idx3-ubyte", &images);
    expect_data_err(Dataset::from_idx(&good, &good), &good, "0x00000803");

    let few = t.write("few-labels", &idx_labels(9, 10));
    expect_data_err(Dataset::from_idx(&good, &few), &few, "holds 9 labels but");

    let mut gz = gzip(&images);
    gz.truncate(gz.len() / 2);
    let cut = t.write("cut.gz", &gz);
    expect_data_err(Dataset::from_idx(&cut, &labels), &cut, "gzip");

    let zero = t.write("zero", &idx_images(0, 28, 28));
    expect_data_err(Dataset::from_idx(&zero, &labels), &zero, "is 0");

    assert!(matches!(
        Dataset::from_idx(&t.0.join("absent"), &labels),
        Err(Error::Io { .. })
    ));
}

#[test]
fn csv_with_and_without_header() {
    let t = TempDir::new("csv-ok");
    let plain = t.write("plain.csv", b"1,2,3,0\n4,5,6,2\n\n7,8,9,1\n");
    let d = Dataset::from_csv(&plain, None).unwrap();
    assert_eq!((d.len(), d.dim, d.classes), (3, 3, 3));
    assert_eq!(d.features, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    assert_eq!(d.labels, [0, 2, 1]);
    assert_eq!(d.name, "plain");

    // A header with "label" first, CRLF line ends, quotes, a gzip without a .gz name.
    let csv = b"\"label\",a,b\r\n1,0.5,-2\r\n0,1e2,3.0\r\n";
    let header = t.write("header.data", &gzip(csv));
    let h = Dataset::from_csv(&header, None).unwrap();
    assert_eq!((h.len(), h.dim, h.classes), (2, 2, 2));
    assert_eq!(h.features, [0.5, -2.0, 100.0, 3.0]);
    assert_eq!(h.labels, [1, 0]);

    // A named label column; "2.0" is an integer label.
    let named = t.write_gz("named.csv.gz", b"x,y,cls\n1,2.0,5\n3,4,6\n");
    let n = Dataset::from_csv(&named, Some("y")).unwrap();
    assert_eq!(
        (n.features, n.labels, n.classes),
        (vec![1.0, 5.0, 3.0, 6.0], vec![2, 4], 5)
    );
    // Without "label" in the header the last column is the label.
    let n = Dataset::from_csv(&named, None).unwrap();
    assert_eq!((n.labels, n.classes), (vec![5, 6], 7));
    expect_data_err(
        Dataset::from_csv(&named, Some("nope")),
        &named,
        "no column named 'nope'",
    );
    expect_data_err(
        Dataset::from_csv(&plain, Some("label")),
        &plain,
        "no header",
    );

    let mut scaled = d.clone();
    assert_eq!(scaled.normalize_max(), 9.0);
    assert_eq!(scaled.features[8], 1.0);

    let (train, test) = load(plain.to_str().unwrap(), 0).unwrap();
    assert_eq!((train.len(), test.len()), (2, 1));
}

#[test]
fn bad_csv_files_are_data_errors_naming_file_and_line() {
    let t = TempDir::new("csv-bad");
    let cases: [(&str, &[u8], &str); 9] = [
        (
            "columns.csv",
            b"1,2,3\n4,5,6\n7,8\n",
            "line 3: expected 3 columns, found 2",
        ),
        (
            "extra.csv",
            b"1,2,3\n4,5,6,7,8\n",
            "line 2: expected 3 columns, found 5",
        ),
        (
            "word.csv",
            b"a,b,label\n1,2,3\nabc,2,1\n",
            "line 3: 'abc' is not a number",
        ),
        (
            "nan.csv",
            b"1,2,3\nNaN,2,1\n",
            "line 2: 'NaN' is not a number",
        ),
        (
            "empty-field.csv",
            b"1,2,3\n1,,1\n",
            "line 2: '' is not a number",
        ),
        (
            "negative.csv",
            b"1,2,0\n1,2,-1\n",
            "line 2: label -1 is not a non-negative integer",
        ),
        (
            "fraction.csv",
            b"1,2,0.5\n",
            "label 0.5 is not a non-negative integer",
        ),
        ("empty.csv", b"", "empty file"),
        ("header-only.csv", b"a,b,label\n", "no data rows"),
    ];
    for (name, bytes, needle) in cases {
        let path = t.write(name, bytes);
        expect_data_err(Dataset::from_csv(&path, None), &path, needle);
    }
    let blank = t.write("blank.csv.gz", &gzip(b"\n \n"));
    expect_data_err(Dataset::from_csv(&blank, None), &blank, "empty file");
    let one = t.write("one-column.csv", b"1\n2\n");
    expect_data_err(
        Dataset::from_csv(&one, None),
        &one,
        "at least one feature column",
    );
    let binary = t.write("binary.csv", &[b'1', b',', 0xff, b'\n']);
    expect_data_err(Dataset::from_csv(&binary, None), &binary, "not UTF-8");
}

#[test]
fn csv_quoted_fields_and_other_delimiters() {
    let t = TempDir::new("csv-delim");
    // Quoted fields: a delimiter inside quotes, an escaped quote in a header name, spaces
    // around quoted and bare fields, and a quoted number.
    let quoted = t.write(
        "quoted.csv",
        b"\"a, first\",\"b \"\"two\"\"\",label\n \"1\" , 2.5,0\n3,\"4\",1\n",
    );
    let q = Dataset::from_csv(&quoted, None).unwrap();
    assert_eq!((q.len(), q.dim, q.classes), (2, 2, 2));
    assert_eq!(q.features, [1.0, 2.5, 3.0, 4.0]);
    assert_eq!(q.labels, [0, 1]);
    let named = Dataset::from_csv(&quoted, Some("a, first")).unwrap();
    assert_eq!(
        (named.labels, named.features),
        (vec![1, 3], vec![2.5, 0.0, 4.0, 1.0]),
        "a quoted header name with a comma"
    );
    // A doubled quote inside a quoted field is one quote: the column is found by that name.
    let escaped = Dataset::from_csv(&quoted, Some("b \"two\""));
    expect_data_err(
        escaped,
        &quoted,
        "line 2: label 2.5 is not a non-negative integer",
    );

    // Semicolons, and commas inside a quoted text header: `;` is the delimiter.
    let semi = t.write("semi.csv", b"x;y;\"label, 0-2\"\n1;2;0\n\n3;4;2\n5;6;1\n");
    let s = Dataset::from_csv(&semi, Some("label, 0-2")).unwrap();
    assert_eq!((s.len(), s.dim, s.classes), (3, 2, 3));
    assert_eq!(s.features, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(s.labels, [0, 2, 1]);
    // Errors keep counting the file's lines (the blank line 3 included).
    let bad = t.write("semi-bad.csv", b"1;2;0\n\n3;x;1\n");
    expect_data_err(
        Dataset::from_csv(&bad, None),
        &bad,
        "line 3: 'x' is not a number (column 2)",
    );
    let short = t.write("semi-short.csv", b"1;2;0\n3;1\n");
    expect_data_err(
        Dataset::from_csv(&short, None),
        &short,
        "line 2: expected 3 columns, found 2",
    );

    // Tabs, without a header.
    let tsv = t.write("tabs.tsv", b"1\t2\t1\n3\t4\t0\n");
    let d = Dataset::from_csv(&tsv, None).unwrap();
    assert_eq!(
        (d.features, d.labels, d.name),
        (vec![1.0, 2.0, 3.0, 4.0], vec![1, 0], String::from("tabs"))
    );

    // A chosen delimiter overrides the detection: the header has one comma and one semicolon,
    // a tie that goes to the semicolon, but the rows are split by commas.
    let mixed = t.write("mixed.csv", b"a;b,label\n1,0\n2,1\n");
    let by_semi = Dataset::from_csv(&mixed, None);
    expect_data_err(by_semi, &mixed, "line 2: expected 2 columns, found 1");
    let by_comma = Dataset::from_csv_delimited(&mixed, None, b',').unwrap();
    assert_eq!(
        (by_comma.features, by_comma.labels),
        (vec![1.0, 2.0], vec![0, 1])
    );
    assert!(matches!(
        Dataset::from_csv_delimited(&mixed, None, b'"'),
        Err(Error::InvalidArgument { .. })
    ));

    // A file with a single column names the delimiter it split at.
    let one = t.write("one.csv", b"1\n2\n");
    expect_data_err(Dataset::from_csv(&one, None), &one, "split at ','");
}

#[test]
fn labels_far_outside_the_others_are_errors_naming_the_line() {
    let t = TempDir::new("csv-labels");
    // A column of ids taken as the label: 5 distinct values, the largest ≥ 1000 x 5.
    let ids = t.write(
        "ids.csv",
        b"f,id\n0.5,1001\n0.1,1002\n0.2,1003\n0.3,1004\n0.4,5000\n",
    );
    expect_data_err(
        Dataset::from_csv(&ids, None),
        &ids,
        "line 6: label 5000 is at least 1000x the number of distinct labels (5)",
    );
    // One stray label: more than 10x the next largest and above 255.
    let stray = t.write("stray.csv", b"1,0\n2,1\n3,2\n4,700\n5,1\n");
    let msg = match Dataset::from_csv(&stray, None) {
        Err(e) => e.to_string(),
        Ok(d) => panic!("loaded with {} classes", d.classes),
    };
    for needle in [
        "stray.csv",
        "line 4: label 700 is more than 10x the next largest label (2)",
        "701 output classes",
        "label column",
    ] {
        assert!(msg.contains(needle), "'{needle}' missing: {msg}");
    }
    // Large labels that are not outliers load: 256 classes, and a gap below 255.
    let mut wide = String::new();
    for l in 0..256 {
        wide += &format!("{l},{l}\n");
    }
    let wide = t.write("wide.csv", wide.as_bytes());
    assert_eq!(Dataset::from_csv(&wide, None).unwrap().classes, 256);
    let gap = t.write("gap.csv", b"1,0\n2,1\n3,200\n");
    assert_eq!(Dataset::from_csv(&gap, None).unwrap().classes, 201);
}

#[test]
fn load_refuses_splits_that_would_score_meaninglessly() {
    let t = TempDir::new("load-bad");
    let mut one_class = String::from("a,b,label\n");
    for i in 0..10 {
        one_class += &format!("{i},{},3\n", i * 2);
    }
    let single = t.write("single.csv", one_class.as_bytes());
    assert_eq!(Dataset::from_csv(&single, None).unwrap().len(), 10);
    let r = load(single.to_str().unwrap(), 0);
    expect_data_err(r, &single, "label 3: with a single class");

    // Two rows: 20% rounds to an empty test split.
    let two = t.write("two.csv", b"1,0\n2,1\n");
    expect_data_err(
        load(two.to_str().unwrap(), 0),
        &two,
        "the test split is empty",
    );

    // IDX training files with a single class are refused just the same.
    t.write("train-images-idx3-ubyte", &idx_images(6, 2, 2));
    t.write("train-labels-idx1-ubyte", &idx_labels(6, 1));
    t.write("t10k-images-idx3-ubyte", &idx_images(2, 2, 2));
    t.write("t10k-labels-idx1-ubyte", &idx_labels(2, 2));
    expect_data_err(load(t.0.to_str().unwrap(), 0), &t.0, "with a single class");

    // Good data still loads, and labels with a gap only warn.
    let mut gap = String::new();
    for i in 0..10 {
        gap += &format!("{i},{}\n", [1, 4][i % 2]);
    }
    let gap = t.write("gap.csv", gap.as_bytes());
    let (train, test) = load(gap.to_str().unwrap(), 0).unwrap();
    assert_eq!((train.len(), test.len(), train.classes), (8, 2, 5));
}
