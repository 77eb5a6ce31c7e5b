//! Datasets (being written).
