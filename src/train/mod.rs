//! Training: datasets and the training loop.

pub mod data;
