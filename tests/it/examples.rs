//! The examples' own code, compiled once into the test binary for the tests that call their
//! `run` (each example's `main` goes unused here).

#[allow(dead_code)]
#[path = "../../examples/custom_model/main.rs"]
pub mod custom_model;
#[allow(dead_code)]
#[path = "../../examples/finetune/main.rs"]
pub mod finetune;
#[allow(dead_code)]
#[path = "../../examples/train_cnn/main.rs"]
pub mod train_cnn;
#[allow(dead_code)]
#[path = "../../examples/train_gpt/main.rs"]
pub mod train_gpt;
#[allow(dead_code)]
#[path = "../../examples/train_mlp/main.rs"]
pub mod train_mlp;
