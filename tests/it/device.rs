//! The device itself: adapter listing and choice, info, equality, sync, and running on a wgpu
//! device the application already owns (`Device::from_wgpu`).

use crate::common;

use common::*;
use fitgrad::{DType, Device, DeviceOptions, Tensor};
use half::f16;

device_tests!(sync_and_flush_after_work);

fn backend_of(name: &str) -> wgpu::Backends {
    match name {
        "vulkan" => wgpu::Backends::VULKAN,
        "gl" => wgpu::Backends::GL,
        "metal" => wgpu::Backends::METAL,
        "dx12" => wgpu::Backends::DX12,
        other => panic!("unexpected backend name {other}"),
    }
}

#[test]
fn adapters_and_info() {
    let devs = devices();
    if devs.is_empty() {
        return;
    }
    let list = Device::adapters();
    assert!(
        !list.is_empty(),
        "devices() found adapters, Device::adapters() none"
    );
    for dev in &devs {
        let info = dev.info();
        assert!(
            list.iter()
                .any(|a| a.name == info.adapter.name && a.backend == info.adapter.backend),
            "{} is not in Device::adapters(): {list:?}",
            label(dev)
        );
        let text = info.to_string();
        assert!(text.contains("adapter:") && text.contains("f16:"), "{text}");
        assert!(info.limits.max_storage_buffer_binding_size >= 128 << 20);
        assert!(info.limits.max_compute_invocations_per_workgroup >= 256);
        assert!(format!("{dev:?}").contains(&info.adapter.name));
        // Clones share everything; separately opened devices are different devices.
        assert_eq!(dev, &dev.clone());
    }
    for (i, a) in devs.iter().enumerate() {
        for b in &devs[i + 1..] {
            assert_ne!(a, b);
        }
    }
}

/// An adapter chosen by a substring of its name (any case).
#[test]
fn adapter_by_name() {
    if std::env::var("FITGRAD_ADAPTER").is_ok_and(|v| !v.is_empty()) {
        return;
    }
    let devs = devices();
    let Some(first) = devs.first() else {
        return;
    };
    let name = first.info().adapter.name.to_uppercase();
    let want: String = name.chars().take(5).collect();
    let dev = fresh_device(
        DeviceOptions::default()
            .adapter(want.clone())
            .backend(first.info().adapter.backend.clone()),
    )
    .expect("the adapter devices() opened");
    assert!(dev.info().adapter.name.to_uppercase().contains(&want));
    let t = Tensor::full(&dev, &[3], 2.0, DType::F32).unwrap();
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![2.0; 3]);
}

fn sync_and_flush_after_work(dev: &Device) {
    let x = Tensor::ones(dev, &[1000], DType::F32).unwrap();
    let mut y = x.clone();
    for _ in 0..10 {
        y = y.add(&x).unwrap();
    }
    dev.flush().unwrap();
    dev.sync().unwrap();
    dev.sync().unwrap(); // nothing pending
    assert_eq!(
        y.to_vec::<f32>().unwrap(),
        vec![11.0; 1000],
        "{}",
        label(dev)
    );
}

/// fitgrad on a wgpu device and queue the application created, with and without SHADER_F16.
#[test]
fn runs_on_an_application_wgpu_device() {
    let devs = devices();
    let mut backends: Vec<String> = devs
        .iter()
        .map(|d| d.info().adapter.backend.clone())
        .collect();
    backends.sort();
    backends.dedup();
    for backend in backends {
        let backends = backend_of(&backend);
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        desc.backends = backends;
        let instance = wgpu::Instance::new(desc);
        let adapters = pollster::block_on(instance.enumerate_adapters(backends));
        let adapter = adapters.first().expect("devices() found this backend");
        let has_f16 = adapter.features().contains(wgpu::Features::SHADER_F16);
        for want_f16 in [false, true] {
            if want_f16 && !has_f16 {
                continue;
            }
            let features = if want_f16 {
                wgpu::Features::SHADER_F16
            } else {
                wgpu::Features::empty()
            };
            let (device, queue) =
                pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
                    label: Some("application device"),
                    required_features: features,
                    required_limits:
                        wgpu::Limits::downlevel_defaults().using_resolution(adapter.limits()),
                    experimental_features: wgpu::ExperimentalFeatures::disabled(),
                    memory_hints: wgpu::MemoryHints::Performance,
                    trace: wgpu::Trace::Off,
                }))
                .unwrap();
            // The application's handler stays in place (fitgrad installs none on a device it
            // does not own).
            let app_errors = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let counter = app_errors.clone();
            device.on_uncaptured_error(std::sync::Arc::new(move |_e: wgpu::Error| {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }));
            let dev = Device::from_wgpu(device, queue, DeviceOptions::default()).unwrap();
            let what = format!("from_wgpu on {backend}, SHADER_F16 {want_f16}");
            assert_eq!(dev.info().f16_native, want_f16, "{what}");
            let a = Tensor::from_slice(&dev, &[1.0f32, 2.0, 3.0], &[3, 1]).unwrap();
            let b = Tensor::from_slice(&dev, &[10.0f32, 20.0], &[2]).unwrap();
            let c = a.mul(&b).unwrap().sum_axis(0, false).unwrap();
            assert_eq!(c.to_vec::<f32>().unwrap(), vec![60.0, 120.0], "{what}");
            let h = c.to_dtype(DType::F16).unwrap().relu().unwrap();
            assert_eq!(
                h.to_vec::<f16>().unwrap(),
                vec![f16::from_f32(60.0), f16::from_f32(120.0)],
                "{what}"
            );
            // The application's own handles keep working alongside.
            let buf = dev.wgpu_device().create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: 256,
                usage: wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            dev.wgpu_queue().write_buffer(&buf, 0, &[0u8; 16]);
            dev.sync().unwrap();
            assert_eq!(
                app_errors.load(std::sync::atomic::Ordering::SeqCst),
                0,
                "{what}"
            );
            // MAP_READ with MAP_WRITE is invalid: the application's handler hears of it.
            let _bad = dev.wgpu_device().create_buffer(&wgpu::BufferDescriptor {
                label: None,
                size: 16,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::MAP_WRITE,
                mapped_at_creation: false,
            });
            let _ = dev.wgpu_device().poll(wgpu::PollType::wait_indefinitely());
            assert_eq!(
                app_errors.load(std::sync::atomic::Ordering::SeqCst),
                1,
                "{what}: the application's error handler was replaced"
            );
        }
    }
}
