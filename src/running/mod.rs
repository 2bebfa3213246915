//! Running a scenario (layer 3): the per-rank engines and their drivers (`engine`), the control plane and ranks as
//! processes (`control`, `process`), other planners in the seat (`external`), the direct execution baseline
//! (`exec`), the one run pipeline with its judgement (`harness`) and work spread over threads (`parallel`). Imports the pure core and the fabrics only.

pub mod control;
pub mod engine;
pub mod exec;
pub mod external;
pub mod harness;
pub mod parallel;
pub mod process;
