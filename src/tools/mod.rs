//! What is built on running (layer 4): transport certification (`certify`), the oracle's mutation self-test
//! (`selftest`), which SGLang code paths a scenario exercises (`explain`), a scenario from a model's config.json (`from_config`), fault swarms (`swarm`), commands split across machines (`shard`), minimal failing scenarios (`shrink`) and stable text for golden files and the
//! CLI (`render`). `bench` and `replay` are commands of the CLI over the same pipeline.

pub mod certify;
pub mod explain;
pub mod from_config;
pub mod matrix;
pub mod render;
pub mod report;
pub mod selftest;
pub mod shard;
pub mod shrink;
pub mod swarm;
