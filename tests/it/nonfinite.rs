//! Device::nonfinite: the fused "any NaN or inf" check over several tensors, on every device and
//! in f32 and f16, with the bad value anywhere (first, last, the odd tail of a packed f16 tensor).

use crate::common;

use common::*;
use fitgrad::{DType, Device, Error, Tensor};

device_tests!(finds_nan_and_inf_anywhere);

fn finds_nan_and_inf_anywhere(dev: &Device) {
    {
        for dtype in [DType::F32, DType::F16] {
            let what = |s: &str| format!("{s}, {dtype} on {}", label(dev));
            for n in [1usize, 3, 4, 7, 255, 1000, 4097] {
                let clean = host_data(n as u64, n, -6e4, 6e4);
                let t = upload(dev, &clean, &[n], dtype);
                assert!(
                    !dev.nonfinite(&[&t]).unwrap(),
                    "{}",
                    what(&format!("clean {n}"))
                );
                for pos in [0, n / 2, n - 1] {
                    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                        let mut h = clean.clone();
                        h[pos] = bad;
                        let b = upload(dev, &h, &[n], dtype);
                        assert!(
                            dev.nonfinite(&[&t, &b, &t]).unwrap(),
                            "{}",
                            what(&format!("{bad} at {pos} of {n}"))
                        );
                    }
                }
            }
            // f16 overflow from a finite f32 computation is caught too.
            let big = upload(dev, &[6e4], &[1], dtype).mul_scalar(4.0).unwrap();
            assert_eq!(
                dev.nonfinite(&[&big]).unwrap(),
                dtype == DType::F16,
                "{}",
                what("overflow")
            );
            let empty = Tensor::zeros(dev, &[0, 3], dtype).unwrap();
            assert!(!dev.nonfinite(&[]).unwrap());
            assert!(!dev.nonfinite(&[&empty]).unwrap());
        }
    }
}

#[test]
fn tensors_of_another_device_are_an_error() {
    let devs = devices();
    if devs.len() < 2 {
        return;
    }
    let t = Tensor::zeros(&devs[1], &[4], DType::F32).unwrap();
    assert!(matches!(
        devs[0].nonfinite(&[&t]),
        Err(Error::DeviceMismatch { .. })
    ));
}
