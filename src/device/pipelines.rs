//! The pipeline cache: each kernel is compiled once per device under its key, with shader
//! compile errors caught in an error scope.

use super::{lock, Device};
use crate::{Error, Result};
use std::sync::Arc;

/// A compiled kernel and the layout of its bind group (binding 0 = parameters, then tensors).
/// While planning, kernels that were never compiled are stand-ins with only a name.
pub(crate) struct Kernel {
    pub name: String,
    pub compiled: Option<(wgpu::ComputePipeline, wgpu::BindGroupLayout)>,
    /// Storage bindings the shader declares (a split tensor's windows each count).
    pub tensor_bindings: usize,
}

/// Storage bindings declared by `source` (binding 0, the parameters, is not one).
fn tensor_bindings(source: &str) -> usize {
    source.matches("var<storage").count()
}

impl Device {
    /// The compiled kernel cached under `key`, compiling `source()` on first use with the
    /// given values for its `override` constants (which must be part of `key`). Shader compile
    /// errors come back as [`Error::Gpu`] rather than a panic. `bounds_proven` drops wgpu's
    /// runtime bounds checks: only for kernels that keep every access in range themselves.
    pub(crate) fn kernel(
        &self,
        key: &str,
        constants: &[(&str, f64)],
        bounds_proven: bool,
        source: impl FnOnce() -> String,
    ) -> Result<Arc<Kernel>> {
        if let Some(k) = lock(&self.inner.kernels).get(key) {
            return Ok(k.clone());
        }
        if self.is_planning() {
            // A stand-in, not cached: the real run compiles it. Its bindings are counted so a
            // plan refuses what the real dispatch would.
            return Ok(Arc::new(Kernel {
                name: key.to_string(),
                compiled: None,
                tensor_bindings: tensor_bindings(&source()),
            }));
        }
        let dev = &self.inner.device;
        let scope = dev.push_error_scope(wgpu::ErrorFilter::Validation);
        let source = source();
        let bindings = tensor_bindings(&source);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(key),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        };
        let module = if bounds_proven {
            // SAFETY: the caller's kernel clamps or guards every index it reads and writes
            // against the shapes it is dispatched with, and its tests cover the edges; wgpu's
            // per-access bounds checks cost about a quarter of matmul time on lavapipe.
            unsafe {
                dev.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        } else {
            dev.create_shader_module(desc)
        };
        let pipeline = dev.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(key),
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                // Every kernel writes workgroup memory before reading it.
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(Error::Gpu(format!("kernel {key}: {e}")));
        }
        let layout = pipeline.get_bind_group_layout(0);
        let k = Arc::new(Kernel {
            name: key.to_string(),
            compiled: Some((pipeline, layout)),
            tensor_bindings: bindings,
        });
        lock(&self.inner.kernels).insert(key.to_string(), k.clone());
        Ok(k)
    }
}
