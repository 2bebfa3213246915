//! The pure core (layer 1): no IO, no clock, no randomness, no threads (`tests/it/tidy.rs`). In dependency order:
//! the error-kind macro, `model`, `limits`, `seed`, `faults`, `scenario`, `plan`, `verify`, `wire`.

#[macro_use]
mod kinds;

pub mod faults;
pub mod limits;
pub mod model;
pub mod plan;
pub mod scenario;
pub mod seed;
pub mod verify;
pub mod wire;
