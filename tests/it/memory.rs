//! The arena: reuse, the budget and typed out-of-memory errors, reserve / empty_cache /
//! reset_peak, merging of freed neighbours, and the report. Each test opens devices of its own
//! (one per backend) so that no other test's tensors show in the statistics.

use crate::common;

use common::*;
use fitgrad::{DType, Device, DeviceOptions, Error, MemoryStats, Tensor};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// A fresh device (own arena) per backend that `devices()` found, with `opts`.
fn fresh_devices(opts: DeviceOptions) -> Vec<Device> {
    let mut backends: Vec<String> = devices()
        .iter()
        .map(|d| d.info().adapter.backend.clone())
        .collect();
    backends.sort();
    backends.dedup();
    let mut out = Vec::new();
    for b in backends {
        if let Some(d) = fresh_device(opts.clone().backend(b)) {
            out.push(d);
        }
    }
    out
}

/// What must hold at any moment.
fn check_invariants(s: &MemoryStats, when: &str) {
    assert!(
        s.peak_bytes_in_use >= s.bytes_in_use,
        "{when}: peak in use {} < in use {}",
        s.peak_bytes_in_use,
        s.bytes_in_use
    );
    assert!(
        s.peak_bytes_reserved >= s.bytes_reserved,
        "{when}: peak reserved < reserved: {s:?}"
    );
    assert!(
        s.bytes_reserved >= s.bytes_in_use,
        "{when}: reserved < in use: {s:?}"
    );
    assert!(
        s.allocations >= s.frees,
        "{when}: more frees than allocations: {s:?}"
    );
    assert!(s.reuse_hits <= s.allocations, "{when}: {s:?}");
    assert!(s.buffers_released <= s.buffers_created, "{when}: {s:?}");
    assert_eq!(
        s.segments as u64,
        s.buffers_created - s.buffers_released,
        "{when}: live segments: {s:?}"
    );
    assert_eq!(s.bytes_cached(), s.bytes_reserved - s.bytes_in_use);
    if let Some(b) = s.budget {
        assert!(
            s.bytes_reserved <= b,
            "{when}: reserved above the budget: {s:?}"
        );
    }
}

/// A small op whose result is checked: the device still works.
fn still_works(dev: &Device) {
    let a: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let b: Vec<f32> = (0..1000).map(|i| 0.5 * i as f32).collect();
    let ta = Tensor::from_slice(dev, &a, &[1000]).unwrap();
    let tb = Tensor::from_slice(dev, &b, &[1000]).unwrap();
    let got = ta.add(&tb).unwrap().to_vec::<f32>().unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(got, want, "add after an error on {}", label(dev));
}

#[test]
fn same_size_alloc_and_drop_reuses_one_buffer() {
    for dev in fresh_devices(DeviceOptions::default()) {
        let what = label(&dev);
        for _ in 0..1000 {
            let t = Tensor::zeros(&dev, &[1000], DType::F32).unwrap();
            drop(t);
        }
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert_eq!(s.buffers_created, 1, "{what}: {s:?}");
        assert!(s.reuse_hits >= 999, "{what}: {s:?}");
        assert_eq!(s.allocations, 1000, "{what}");
        assert_eq!(s.frees, 1000, "{what}");
        assert_eq!(s.bytes_in_use, 0, "{what}");
        assert_eq!(
            s.peak_bytes_in_use, 4096,
            "{what}: 4000 bytes take one 4 KiB block"
        );

        // Larger than a shared segment: one dedicated buffer, then reuse.
        for _ in 0..50 {
            let t = Tensor::zeros(&dev, &[1 << 20], DType::F32).unwrap();
            drop(t);
        }
        let s2 = dev.memory_stats();
        check_invariants(&s2, &what);
        assert_eq!(s2.buffers_created, 2, "{what}: {s2:?}");
        assert!(s2.reuse_hits >= s.reuse_hits + 49, "{what}: {s2:?}");

        // A steady loop of ops creates no buffers after its first step.
        let x = Tensor::ones(&dev, &[300, 7], DType::F32).unwrap();
        let step = || {
            x.add(&x)
                .unwrap()
                .relu()
                .unwrap()
                .sum_axis(1, true)
                .unwrap()
        };
        drop(step());
        let before = dev.memory_stats().buffers_created;
        for _ in 0..100 {
            drop(step());
        }
        let out = step();
        assert_eq!(out.to_vec::<f32>().unwrap(), vec![14.0; 300], "{what}");
        assert_eq!(dev.memory_stats().buffers_created, before, "{what}");
        dev.sync().unwrap();
    }
}

#[test]
fn budget_gives_typed_out_of_memory_and_the_device_keeps_working() {
    for dev in fresh_devices(DeviceOptions::default().memory_budget(MIB)) {
        let what = label(&dev);
        let r = Tensor::zeros(&dev, &[512 * 1024], DType::F32);
        let err = match r {
            Err(e) => e,
            Ok(t) => panic!("{what}: a 2 MiB tensor under a 1 MiB budget was created: {t:?}"),
        };
        match &err {
            Error::OutOfMemory {
                requested,
                in_use,
                reserved,
                budget,
            } => {
                assert_eq!(*requested, 2 * MIB, "{what}");
                assert_eq!(*in_use, 0, "{what}");
                assert_eq!(*reserved, 0, "{what}");
                assert_eq!(*budget, Some(MIB), "{what}");
            }
            other => panic!("{what}: expected Error::OutOfMemory, got {other:?}"),
        }
        let msg = err.to_string();
        for part in ["2.00 MiB", "1.00 MiB", "batch size", "empty_cache"] {
            assert!(msg.contains(part), "{what}: message lacks {part:?}: {msg}");
        }
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert_eq!(s.oom_errors, 1, "{what}");
        assert_eq!(s.budget, Some(MIB), "{what}");
        assert_eq!(
            s.bytes_reserved, 0,
            "{what}: nothing was reserved for the refused tensor"
        );
        still_works(&dev);
        check_invariants(&dev.memory_stats(), &what);
    }
}

#[test]
fn budget_counts_what_is_in_use_and_frees_cached_segments() {
    for dev in fresh_devices(DeviceOptions::default().memory_budget(MIB)) {
        let what = label(&dev);
        let n600k = 150 * 1024; // 600 KiB of f32
        let a = Tensor::zeros(&dev, &[n600k], DType::F32).unwrap();
        match Tensor::zeros(&dev, &[n600k], DType::F32) {
            Err(Error::OutOfMemory {
                requested,
                in_use,
                reserved,
                budget,
            }) => {
                assert_eq!(requested, 600 * KIB, "{what}");
                assert_eq!(in_use, 600 * KIB, "{what}");
                assert!(
                    (600 * KIB..=MIB).contains(&reserved),
                    "{what}: reserved {reserved}"
                );
                assert_eq!(budget, Some(MIB));
            }
            other => panic!("{what}: expected OutOfMemory, got {other:?}"),
        }
        check_invariants(&dev.memory_stats(), &what);
        drop(a);
        // The freed block serves the same request again.
        let b = Tensor::zeros(&dev, &[n600k], DType::F32).unwrap();
        drop(b);
        // A larger one does not fit the cached segment: the arena gives that back first.
        let c = Tensor::zeros(&dev, &[200 * 1024], DType::F32).unwrap();
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert!(s.buffers_released >= 1, "{what}: {s:?}");
        assert_eq!(s.bytes_in_use, 800 * KIB, "{what}");
        assert_eq!(c.to_vec::<f32>().unwrap().len(), 200 * 1024);
        drop(c);
        still_works(&dev);

        // Lowering the budget below what is cached: the next allocation that needs room frees it.
        dev.set_memory_budget(None).unwrap();
        let big = Tensor::zeros(&dev, &[1 << 20], DType::F32).unwrap(); // 4 MiB
        drop(big);
        assert!(dev.memory_stats().bytes_reserved >= 4 * MIB);
        dev.set_memory_budget(Some(MIB)).unwrap();
        assert!(matches!(
            Tensor::zeros(&dev, &[(5 * MIB / 4) as usize], DType::F32),
            Err(Error::OutOfMemory {
                budget: Some(MIB),
                ..
            })
        ));
        let s = dev.memory_stats();
        assert!(
            s.bytes_reserved <= MIB,
            "{what}: cached segments kept: {s:?}"
        );
        check_invariants(&s, &what);
        still_works(&dev);
        // reserve() respects the budget too.
        assert!(matches!(
            dev.reserve(2 * MIB),
            Err(Error::OutOfMemory { .. })
        ));
        dev.set_memory_budget(None).unwrap();
        assert_eq!(dev.memory_stats().budget, None);
        drop(Tensor::zeros(&dev, &[1 << 20], DType::F32).unwrap());
        still_works(&dev);
    }
}

#[test]
fn reserve_empty_cache_and_peaks() {
    for dev in fresh_devices(DeviceOptions::default()) {
        let what = label(&dev);
        dev.reserve(4 * MIB).unwrap();
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert!(s.bytes_reserved >= 4 * MIB, "{what}: {s:?}");
        assert_eq!(s.bytes_in_use, 0);
        let created = s.buffers_created;
        assert!(created >= 1);

        // Tensors totalling less than the reservation: no new buffer.
        let sizes = [256 * 1024, 256 * 1024, 100_000, 1000, 3, 0, 77_777];
        let mut tensors = Vec::new();
        let mut total = 0;
        for (i, &n) in sizes.iter().enumerate() {
            let dtype = if i % 2 == 0 { DType::F32 } else { DType::F16 };
            let t = Tensor::zeros(&dev, &[n], dtype).unwrap();
            assert!(t.allocated_bytes() >= (n * dtype.size()) as u64);
            assert_eq!(t.allocated_bytes() % 256, 0);
            total += t.allocated_bytes();
            tensors.push(t);
            let s = dev.memory_stats();
            check_invariants(&s, &what);
            assert_eq!(s.bytes_in_use, total, "{what}");
        }
        assert!(total < 4 * MIB);
        let s = dev.memory_stats();
        assert_eq!(s.buffers_created, created, "{what}: {s:?}");
        assert_eq!(s.reuse_hits, sizes.len() as u64, "{what}: {s:?}");
        let peak = s.peak_bytes_in_use;
        assert_eq!(peak, total);

        drop(tensors);
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert_eq!(s.bytes_in_use, 0);
        assert_eq!(s.peak_bytes_in_use, peak, "the peak survives the frees");

        dev.reset_peak();
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert_eq!(s.peak_bytes_in_use, s.bytes_in_use, "{what}");
        assert_eq!(s.peak_bytes_reserved, s.bytes_reserved, "{what}");

        let report = dev.memory_report();
        assert!(
            report.contains("in use") && report.contains("reserved"),
            "report:\n{report}"
        );
        assert!(
            report.contains(&dev.info().adapter.name),
            "report:\n{report}"
        );

        dev.empty_cache();
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert_eq!(s.bytes_reserved, 0, "{what}: {s:?}");
        assert_eq!(s.segments, 0);
        assert_eq!(s.buffers_released, created);
        assert_eq!(s.largest_free_block, 0);

        // empty_cache keeps the segments tensors still use.
        let keep = Tensor::ones(&dev, &[1000], DType::F32).unwrap();
        let tmp = Tensor::ones(&dev, &[1 << 20], DType::F32).unwrap();
        drop(tmp);
        let before = dev.memory_stats().bytes_reserved;
        dev.empty_cache();
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert!(s.bytes_reserved < before, "{what}: {s:?}");
        assert!(s.bytes_reserved >= keep.allocated_bytes());
        assert_eq!(keep.to_vec::<f32>().unwrap(), vec![1.0; 1000]);
        // Peaks follow new highs after a reset.
        dev.reset_peak();
        let t = Tensor::zeros(&dev, &[10_000], DType::F32).unwrap();
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert_eq!(
            s.peak_bytes_in_use,
            keep.allocated_bytes() + t.allocated_bytes()
        );
        still_works(&dev);
    }
}

#[test]
fn freed_neighbours_merge() {
    for dev in fresh_devices(DeviceOptions::default()) {
        let what = label(&dev);
        // Four 512 KiB tensors fill one reserved 2 MiB segment, in order.
        dev.reserve(2 * MIB).unwrap();
        let q = 128 * 1024; // f32 elements in 512 KiB
        let a = Tensor::zeros(&dev, &[q], DType::F32).unwrap();
        let b = Tensor::zeros(&dev, &[q], DType::F32).unwrap();
        let c = Tensor::zeros(&dev, &[q], DType::F32).unwrap();
        let d = Tensor::full(&dev, &[q], 3.0, DType::F32).unwrap();
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert_eq!(s.buffers_created, 1, "{what}: {s:?}");
        assert_eq!(s.largest_free_block, 0, "{what}: {s:?}");
        // Free the middle one first, then its neighbours on both sides.
        drop(b);
        assert_eq!(dev.memory_stats().largest_free_block, 512 * KIB);
        drop(a);
        assert_eq!(
            dev.memory_stats().largest_free_block,
            MIB,
            "{what}: a + b merged"
        );
        drop(c);
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert_eq!(
            s.largest_free_block,
            3 * 512 * KIB,
            "{what}: a + b + c merged"
        );
        // One tensor of the combined size takes the merged range: no new buffer.
        let e = Tensor::full(&dev, &[3 * q], 2.0, DType::F32).unwrap();
        let s = dev.memory_stats();
        check_invariants(&s, &what);
        assert_eq!(s.buffers_created, 1, "{what}: {s:?}");
        assert_eq!(s.largest_free_block, 0);
        // Both are intact.
        let ev = e.to_vec::<f32>().unwrap();
        assert!(ev.iter().all(|&v| v == 2.0), "{what}");
        let dv = d.to_vec::<f32>().unwrap();
        assert!(dv.iter().all(|&v| v == 3.0), "{what}");
        drop(d);
        drop(e);
        assert_eq!(dev.memory_stats().largest_free_block, 2 * MIB, "{what}");
    }
}

/// Every op returns its temporaries: after the results are dropped nothing is in use.
#[test]
fn ops_leak_nothing() {
    for dev in fresh_devices(DeviceOptions::default()) {
        let what = label(&dev);
        for dtype in [DType::F32, DType::F16] {
            {
                let x = Tensor::randn(&dev, &[3, 70, 5], 0.0, 1.0, 1, dtype).unwrap();
                let y = Tensor::ones(&dev, &[5], dtype).unwrap();
                let results = vec![
                    x.add(&y).unwrap(),
                    x.div(&y).unwrap(),
                    x.relu().unwrap(),
                    x.rdiv_scalar(2.0).unwrap(),
                    x.sum().unwrap(),
                    x.mean().unwrap(),
                    x.sum_axis(1, true).unwrap(),
                    x.mean_axis(0, false).unwrap(),
                    x.transpose().unwrap(),
                    x.to_dtype(DType::F32).unwrap(),
                    x.to_dtype(DType::F16).unwrap(),
                    x.reshape(&[210, 5]).unwrap(),
                    Tensor::zeros(&dev, &[0, 3], dtype).unwrap().mean().unwrap(),
                ];
                for r in &results {
                    r.to_vec_f32().unwrap();
                }
                let s = dev.memory_stats();
                check_invariants(&s, &what);
                assert!(s.bytes_in_use > 0);
            }
            let s = dev.memory_stats();
            check_invariants(&s, &what);
            assert_eq!(s.bytes_in_use, 0, "{what} {dtype}: leaked {s:?}");
            assert_eq!(s.allocations, s.frees, "{what} {dtype}: {s:?}");
        }
        dev.sync().unwrap();
    }
}
