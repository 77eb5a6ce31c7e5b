//! Dispatches of more than 65,535 workgroups, which the device splits into a 2-D grid that the
//! kernels turn back into a linear index. The only tests with large tensors (tens of millions of
//! elements, built on the GPU from small inputs so little crosses the bus).

mod common;

use common::*;
use fitgrad::{DType, Device};

device_tests!(
    elementwise_past_65535_workgroups,
    reduction_past_65535_workgroups
);

/// out[r, c] = a[r] + b[c] over 8193 x 4097 f16 elements: more than 2 * 256 * 65,535, so the
/// elementwise kernel runs on a 2-D grid. Every value is a small integer, exact in f16, and
/// different neighbours differ, so a wrong index shows.
fn elementwise_past_65535_workgroups(dev: &Device) {
    let (rows, cols) = (8193usize, 4097usize);
    assert!(rows * cols > 2 * 256 * 65_535);
    let a: Vec<f32> = (0..rows).map(|r| (r % 64) as f32).collect();
    let b: Vec<f32> = (0..cols).map(|c| ((c % 31) * 64) as f32).collect();
    let ta = upload(dev, &a, &[rows, 1], DType::F16);
    let tb = upload(dev, &b, &[1, cols], DType::F16);
    let out = ta.add(&tb).unwrap();
    assert_eq!(out.dims(), &[rows, cols]);
    let got = out.to_vec_f32().unwrap();
    let mut bad = 0usize;
    let mut first = None;
    for r in 0..rows {
        for c in 0..cols {
            let want = a[r] + b[c];
            if got[r * cols + c] != want {
                bad += 1;
                first.get_or_insert((r, c, got[r * cols + c], want));
            }
        }
    }
    assert_eq!(
        bad,
        0,
        "on {}: first wrong (row, col, got, want) {first:?}",
        label(dev)
    );
}

/// A row reduction with more than 65,535 rows of 64 or more elements runs one workgroup per
/// row on a 2-D grid; contiguous rows (axis 1) and strided ones (axis 0) both.
fn reduction_past_65535_workgroups(dev: &Device) {
    let (rows, cols) = (65_537usize, 64usize);
    let a: Vec<f32> = (0..rows).map(|r| (r % 100) as f32).collect();
    let b: Vec<f32> = (0..cols).map(|c| (c % 7) as f32).collect();
    let b_sum: f32 = b.iter().sum();
    let ta = upload(dev, &a, &[rows, 1], DType::F32);
    let tb = upload(dev, &b, &[1, cols], DType::F32);
    let x = ta.add(&tb).unwrap(); // (rows, 64)
    let s = x.sum_axis(1, false).unwrap().to_vec::<f32>().unwrap();
    let want: Vec<f32> = a.iter().map(|&v| 64.0 * v + b_sum).collect();
    assert_close(
        &format!("sum over 64-long rows of {rows} on {}", label(dev)),
        &s,
        &want,
        Tol::EXACT,
    );
    let xt = x.transpose().unwrap(); // (64, rows): reduce axis 0, inner = rows
    let s = xt.sum_axis(0, true).unwrap();
    assert_eq!(s.dims(), &[1, rows]);
    assert_close(
        &format!("strided sum over axis 0 of (64, {rows}) on {}", label(dev)),
        &s.to_vec::<f32>().unwrap(),
        &want,
        Tol::EXACT,
    );
}
