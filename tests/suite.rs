//! Every integration test in one binary. One binary links once (each separate test binary
//! linked wgpu, naga and the crate again), and its tests share one device per backend
//! (`common::devices`), so each kernel is compiled once per backend for the whole suite
//! rather than once per file: software adapters compile every pipeline from scratch in each
//! process. Each file below is a module named after it: `cargo test --test suite matmul::`
//! runs one file's tests, `cargo test --test suite ::gl` one backend's.
//!
//! tests/mpi.rs stays a binary of its own (it needs the `mpi` feature and mpirun).

mod common;

mod attention;
mod autograd;
mod budget_limits;
mod checkpoint;
mod clip;
mod compress_models;
mod creation;
mod custom_model;
mod data;
mod data_parallel;
mod device;
mod distill;
mod divergence;
mod dropout;
mod elementwise;
mod embedding;
mod errors;
mod fit;
mod fit_auto;
mod generic;
mod gpt;
mod large;
mod layer_norm;
mod layout;
mod matmul;
mod max_argmax;
mod memory;
mod nonfinite;
mod optim;
mod param_groups;
mod prune;
mod quantize;
mod reduce;
mod report;
mod report_browser;
mod resume_checks;
mod select;
mod shard;
mod softmax;
mod softmax_masked;
mod text;
mod timeline;
mod train;
mod train_gpt_cli;
mod transpose_cast;
mod unary_more;
