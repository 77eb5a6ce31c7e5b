//! The cost of fitgrad's own f16 conversions (shaders/include/f16_bits.wgsl: integer code, the
//! same bits on every adapter) against WGSL's `pack2x16float` / `unpack2x16float` (whose result
//! the spec leaves open for inf, NaN and values past f16's range), each in a kernel that only
//! converts: 4M f32 to 2M packed words, and back. Prints the ratio of each pair, measured in the
//! same run on the same adapter, after criterion's figures.
//! `cargo bench --bench f16_convert`; set FITGRAD_BACKEND / FITGRAD_ADAPTER to pick another.

mod common;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::time::{Duration, Instant};
use wgpu::util::DeviceExt;

/// Elements converted per dispatch.
const N: u32 = 1 << 22;

/// A kernel over `inp` and `out` (both storage arrays) whose `main` converts one word's pair.
fn kernel(packing: bool, builtin: bool) -> String {
    let body = match (packing, builtin) {
        (true, true) => "out[w] = pack2x16float(vec2<f32>(inp[2u * w], inp[2u * w + 1u]));",
        (true, false) => "out[w] = fg16_pack2(vec2<f32>(inp[2u * w], inp[2u * w + 1u]));",
        (false, true) => {
            "let v = unpack2x16float(inp[w]); out[2u * w] = v.x; out[2u * w + 1u] = v.y;"
        }
        (false, false) => {
            "let v = fg16_unpack2(inp[w]); out[2u * w] = v.x; out[2u * w + 1u] = v.y;"
        }
    };
    let (ti, to) = if packing {
        ("f32", "u32")
    } else {
        ("u32", "f32")
    };
    format!(
        "{}\n@group(0) @binding(0) var<storage, read_write> inp: array<{ti}>;\n\
         @group(0) @binding(1) var<storage, read_write> out: array<{to}>;\n\
         @compute @workgroup_size(256)\n\
         fn main(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{\n\
           let w = g.y * nwg.x * 256u + g.x;\n  if (w >= {}u) {{ return; }}\n  {body}\n}}\n",
        include_str!("../shaders/include/f16_bits.wgsl"),
        N / 2
    )
}

struct Run {
    device: wgpu::Device,
    queue: wgpu::Queue,
    pipeline: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
}

impl Run {
    fn new(dev: &fitgrad::Device, packing: bool, builtin: bool, input: &[u8]) -> Run {
        let device = dev.wgpu_device().clone();
        let queue = dev.wgpu_queue().clone();
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("f16_convert"),
            source: wgpu::ShaderSource::Wgsl(kernel(packing, builtin).into()),
        });
        let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("f16_convert"),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        let inp = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: input,
            usage: wgpu::BufferUsages::STORAGE,
        });
        let out_bytes = if packing { N as u64 * 2 } else { N as u64 * 4 };
        let out = device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: out_bytes,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let bind = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &[
                wgpu::BindGroupEntry {
                    binding: 0,
                    resource: inp.as_entire_binding(),
                },
                wgpu::BindGroupEntry {
                    binding: 1,
                    resource: out.as_entire_binding(),
                },
            ],
        });
        Run {
            device,
            queue,
            pipeline,
            bind,
        }
    }

    /// One dispatch over every word, waited for.
    fn once(&self) {
        let mut enc = self.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&self.pipeline);
            pass.set_bind_group(0, &self.bind, &[]);
            let groups = (N / 2).div_ceil(256);
            // Past 65,535 workgroups in x the grid goes 2-D (the kernel folds y back in).
            let x = groups.min(65_535);
            pass.dispatch_workgroups(x, groups.div_ceil(x), 1);
        }
        self.queue.submit([enc.finish()]);
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .expect("poll");
    }

    /// The median of `reps` timed dispatches, after one warm-up.
    fn median(&self, reps: usize) -> Duration {
        self.once();
        let mut t: Vec<Duration> = (0..reps)
            .map(|_| {
                let s = Instant::now();
                self.once();
                s.elapsed()
            })
            .collect();
        t.sort();
        t[reps / 2]
    }
}

fn bench(c: &mut Criterion) {
    let Some(dev) = common::device() else {
        return;
    };
    // Typical values (normal, a few tenths to a few units) with no special values: the common
    // case, where the builtins' answers are defined.
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let floats: Vec<f32> = (0..N)
        .map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0)
        .collect();
    let halves: Vec<u16> = floats
        .iter()
        .map(|&v| half::f16::from_f32(v).to_bits())
        .collect();
    let f32_bytes: &[u8] = bytemuck::cast_slice(&floats);
    let f16_bytes: &[u8] = bytemuck::cast_slice(&halves);
    let mut ratios = Vec::new();
    for (packing, what, bytes) in [
        (true, "pack (f32 -> f16)", f32_bytes),
        (false, "unpack (f16 -> f32)", f16_bytes),
    ] {
        let builtin = Run::new(&dev, packing, true, bytes);
        let ours = Run::new(&dev, packing, false, bytes);
        let mut g = c.benchmark_group(if packing { "f16_pack" } else { "f16_unpack" });
        g.sample_size(10);
        g.throughput(Throughput::Elements(N as u64));
        g.bench_function("builtin_4M", |b| b.iter(|| builtin.once()));
        g.bench_function("fitgrad_4M", |b| b.iter(|| ours.once()));
        g.finish();
        let (tb, to) = (builtin.median(15), ours.median(15));
        ratios.push(format!(
            "{what}: fitgrad {:.3} ms, builtin {:.3} ms, ratio {:.2}",
            to.as_secs_f64() * 1e3,
            tb.as_secs_f64() * 1e3,
            to.as_secs_f64() / tb.as_secs_f64()
        ));
    }
    eprintln!("\nf16 conversion on {}:", dev.info().adapter.name);
    for r in ratios {
        eprintln!("  {r}");
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
