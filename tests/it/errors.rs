//! Every misuse returns a typed error (never a panic) that names the op and what was wrong, and
//! the device keeps working afterwards.

use crate::common;

use common::*;
use fitgrad::{DType, Device, DeviceOptions, Error, Tensor};
use half::f16;

device_tests!(
    shape_mismatch_names_op_and_both_shapes,
    dtype_mismatch,
    from_slice_with_wrong_length,
    reshape_to_another_element_count,
    axis_out_of_range,
    rank_five_shape,
    transpose_of_rank_below_two,
    to_vec_of_the_wrong_element_type,
    item_of_more_than_one_element,
    bad_random_arguments,
    too_many_elements,
    unknown_backend_and_adapter
);

/// A small op after an error still gives the right values.
fn still_works(dev: &Device) {
    let a = Tensor::from_slice(dev, &[1.0f32, 2.0, 3.0], &[3]).unwrap();
    let b = Tensor::from_slice(dev, &[10.0f32, 20.0, 30.0], &[3]).unwrap();
    let c = a.add(&b).unwrap().mul_scalar(2.0).unwrap();
    assert_eq!(
        c.to_vec::<f32>().unwrap(),
        vec![22.0, 44.0, 66.0],
        "device {} stopped working after an error",
        label(dev)
    );
}

fn f32_tensor(dev: &Device, dims: &[usize]) -> Tensor {
    upload(dev, &host_data(1, numel(dims), -1.0, 1.0), dims, DType::F32)
}

fn shape_mismatch_names_op_and_both_shapes(dev: &Device) {
    let a = f32_tensor(dev, &[2, 3]);
    let b = f32_tensor(dev, &[4, 3]);
    for (name, r) in [
        ("add", a.add(&b)),
        ("sub", a.sub(&b)),
        ("mul", a.mul(&b)),
        ("div", a.div(&b)),
    ] {
        match r {
            Err(Error::Shape { op, lhs, rhs, .. }) => {
                assert_eq!(op, name);
                assert_eq!(lhs, vec![2, 3]);
                assert_eq!(rhs, vec![4, 3]);
            }
            other => {
                panic!("{name} of [2, 3] and [4, 3]: expected Error::Shape, got {other:?}")
            }
        }
    }
    let e = a.add(&b).unwrap_err().to_string();
    assert!(
        e.contains("add") && e.contains("[2, 3]") && e.contains("[4, 3]"),
        "message: {e}"
    );
    // Both sides would need to stretch a dim that is not 1.
    let c = f32_tensor(dev, &[3, 2, 5]);
    let d = f32_tensor(dev, &[4, 1]);
    assert!(matches!(c.add(&d), Err(Error::Shape { op: "add", .. })));
    still_works(dev);
}

fn dtype_mismatch(dev: &Device) {
    let a = f32_tensor(dev, &[4]);
    let b = Tensor::zeros(dev, &[4], DType::F16).unwrap();
    match a.mul(&b) {
        Err(Error::DType { op, expected, got }) => {
            assert_eq!(op, "mul");
            assert_eq!(expected, DType::F32);
            assert_eq!(got, DType::F16);
        }
        other => panic!("expected Error::DType, got {other:?}"),
    }
    let msg = b.sub(&a).unwrap_err().to_string();
    assert!(
        msg.contains("sub") && msg.contains("f16") && msg.contains("f32"),
        "message: {msg}"
    );
    still_works(dev);
}

fn from_slice_with_wrong_length(dev: &Device) {
    for (len, dims) in [(5usize, &[2usize, 3][..]), (7, &[2, 3]), (0, &[]), (2, &[])] {
        let data = vec![1.0f32; len];
        match Tensor::from_slice(dev, &data, dims) {
            Err(Error::Shape { op, lhs, rhs, .. }) => {
                assert_eq!(op, "from_slice");
                assert_eq!(lhs, vec![len]);
                assert_eq!(rhs, dims.to_vec());
            }
            other => panic!("{len} values for {dims:?}: expected Error::Shape, got {other:?}"),
        }
    }
    let h = vec![f16::ONE; 3];
    assert!(matches!(
        Tensor::from_slice(dev, &h, &[4]),
        Err(Error::Shape {
            op: "from_slice",
            ..
        })
    ));
    still_works(dev);
}

fn reshape_to_another_element_count(dev: &Device) {
    let a = f32_tensor(dev, &[2, 3]);
    match a.reshape(&[7]) {
        Err(Error::Shape { op, lhs, rhs, .. }) => {
            assert_eq!(op, "reshape");
            assert_eq!(lhs, vec![2, 3]);
            assert_eq!(rhs, vec![7]);
        }
        other => panic!("expected Error::Shape, got {other:?}"),
    }
    assert!(a.reshape(&[]).is_err());
    assert!(a.reshape(&[0, 6]).is_err());
    assert!(matches!(
        a.reshape(&[1, 1, 1, 1, 6]),
        Err(Error::InvalidArgument { .. })
    ));
    // The tensor itself is unharmed.
    assert_eq!(a.dims(), &[2, 3]);
    assert_eq!(a.to_vec::<f32>().unwrap(), host_data(1, 6, -1.0, 1.0));
    still_works(dev);
}

fn axis_out_of_range(dev: &Device) {
    let a = f32_tensor(dev, &[2, 3]);
    for (name, r) in [
        ("sum_axis", a.sum_axis(2, false)),
        ("mean_axis", a.mean_axis(5, true)),
    ] {
        match r {
            Err(Error::InvalidArgument { op, reason }) => {
                assert_eq!(op, name);
                assert!(reason.contains("axis"), "reason: {reason}");
            }
            other => panic!("{name}: expected Error::InvalidArgument, got {other:?}"),
        }
    }
    // A rank-0 tensor has no axis at all.
    let s = Tensor::scalar(dev, 1.0f32).unwrap();
    assert!(matches!(
        s.sum_axis(0, false),
        Err(Error::InvalidArgument { .. })
    ));
    still_works(dev);
}

fn rank_five_shape(dev: &Device) {
    let dims = [1usize, 2, 1, 2, 1];
    let checks: Vec<(&str, fitgrad::Result<Tensor>)> = vec![
        ("zeros", Tensor::zeros(dev, &dims, DType::F32)),
        ("ones", Tensor::ones(dev, &dims, DType::F16)),
        ("full", Tensor::full(dev, &dims, 2.0, DType::F32)),
        ("from_slice", Tensor::from_slice(dev, &[0.0f32; 4], &dims)),
        (
            "rand_uniform",
            Tensor::rand_uniform(dev, &dims, 0.0, 1.0, 1, DType::F32),
        ),
        ("randn", Tensor::randn(dev, &dims, 0.0, 1.0, 1, DType::F32)),
    ];
    for (name, r) in checks {
        match r {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(reason.contains("rank 5"), "{name}: reason {reason}");
            }
            other => panic!("{name} of rank 5: expected InvalidArgument, got {other:?}"),
        }
    }
    still_works(dev);
}

fn transpose_of_rank_below_two(dev: &Device) {
    for dims in [&[5usize][..], &[]] {
        let a = f32_tensor(dev, dims);
        match a.transpose() {
            Err(Error::Shape { op, lhs, .. }) => {
                assert_eq!(op, "transpose");
                assert_eq!(lhs, dims.to_vec());
            }
            other => panic!("transpose of {dims:?}: expected Error::Shape, got {other:?}"),
        }
    }
    still_works(dev);
}

fn to_vec_of_the_wrong_element_type(dev: &Device) {
    let a = f32_tensor(dev, &[3]);
    match a.to_vec::<f16>() {
        Err(Error::DType { op, expected, got }) => {
            assert_eq!(op, "to_vec");
            assert_eq!(expected, DType::F32);
            assert_eq!(got, DType::F16);
        }
        other => panic!("expected Error::DType, got {other:?}"),
    }
    let h = Tensor::zeros(dev, &[3], DType::F16).unwrap();
    assert!(matches!(h.to_vec::<f32>(), Err(Error::DType { .. })));
    // to_vec_f32 works whatever the dtype.
    assert_eq!(h.to_vec_f32().unwrap(), vec![0.0; 3]);
    still_works(dev);
}

fn item_of_more_than_one_element(dev: &Device) {
    let a = f32_tensor(dev, &[2]);
    assert!(matches!(a.item(), Err(Error::Shape { op: "item", .. })));
    let e = Tensor::zeros(dev, &[0], DType::F32).unwrap();
    assert!(matches!(e.item(), Err(Error::Shape { op: "item", .. })));
    still_works(dev);
}

fn bad_random_arguments(dev: &Device) {
    let r = Tensor::rand_uniform(dev, &[3], 2.0, 1.0, 0, DType::F32);
    assert!(
        matches!(
            r,
            Err(Error::InvalidArgument {
                op: "rand_uniform",
                ..
            })
        ),
        "{r:?}"
    );
    let r = Tensor::rand_uniform(dev, &[3], f32::NAN, 1.0, 0, DType::F32);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let r = Tensor::randn(dev, &[3], 0.0, -1.0, 0, DType::F32);
    assert!(
        matches!(r, Err(Error::InvalidArgument { op: "randn", .. })),
        "{r:?}"
    );
    let r = Tensor::randn(dev, &[3], f32::INFINITY, 1.0, 0, DType::F16);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    still_works(dev);
}

fn too_many_elements(dev: &Device) {
    let r = Tensor::zeros(dev, &[1 << 20, 1 << 20], DType::F32);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    let r = Tensor::zeros(dev, &[usize::MAX, 2], DType::F32);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    // Past the largest buffer (a tensor past one storage binding is bound as windows):
    // refused before any memory is asked for.
    let max = dev.info().limits.max_buffer_size;
    let n = (max / 4 + 1) as usize;
    let r = Tensor::zeros(dev, &[n], DType::F32);
    match r {
        Err(Error::Limit {
            op, value, limit, ..
        }) => {
            assert_eq!(op, "alloc");
            assert!(value > limit && limit <= max, "{value} vs {limit}");
        }
        other => panic!("{n} f32 elements: expected Error::Limit, got {other:?}"),
    }
    still_works(dev);
}

#[test]
fn tensors_of_two_devices() {
    let devs = devices();
    let Some(dev) = devs.first() else {
        return;
    };
    let Some(other) =
        fresh_device(DeviceOptions::default().backend(dev.info().adapter.backend.clone()))
    else {
        return;
    };
    let a = f32_tensor(dev, &[3]);
    let b = f32_tensor(&other, &[3]);
    assert!(matches!(
        a.add(&b),
        Err(Error::DeviceMismatch { op: "add" })
    ));
    assert!(matches!(
        b.div(&a),
        Err(Error::DeviceMismatch { op: "div" })
    ));
    still_works(dev);
    still_works(&other);
}

/// Opening a device for an unknown backend or adapter is an error, and the devices already open
/// keep working after it.
fn unknown_backend_and_adapter(dev: &Device) {
    // The environment overrides the options; these checks need it unset.
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.is_empty());
    if !set("FITGRAD_BACKEND") {
        let r = Device::with_options(DeviceOptions::default().backend("cuda"));
        assert!(
            matches!(r, Err(Error::InvalidArgument { .. })),
            "{:?}",
            r.err()
        );
    }
    if !set("FITGRAD_ADAPTER") {
        let r = Device::with_options(DeviceOptions::default().adapter("no such adapter, surely"));
        match r {
            Err(e @ Error::NoAdapter { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("no such adapter, surely"), "message: {msg}");
            }
            other => panic!("expected Error::NoAdapter, got {:?}", other.err()),
        }
    }
    still_works(dev);
}
