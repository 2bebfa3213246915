//! `kvrelay schema NAME`: the JSON Schemas of what kvrelay reads and writes. Scenario files, certification reports
//! and `check`/`sim` results are derived from their serde types (schemars); the plan JSON, written by hand in
//! `tools::render`, has its schema written by hand too (src/schemas/plan.schema.json). src/schemas/ holds a copy of
//! each, kept current by tests/it/schemas.rs, which also validates every scenario and emitted document against them.

use serde_json::Value;

use super::{merge, sim};

/// The documents with a schema, by the name `kvrelay schema` takes (also the file stem in src/schemas/).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SchemaName {
    /// Scenario files (YAML; editors validate them with it).
    Scenario,
    /// `kvrelay plan --json`: kvrelay-plan-1, -2 and -3.
    Plan,
    /// `kvrelay certify`'s report.json.
    CertifyReport,
    /// `kvrelay check --json`.
    Check,
    /// `kvrelay sim --json`.
    Sim,
}

impl SchemaName {
    pub const ALL: [SchemaName; 5] =
        [SchemaName::Scenario, SchemaName::Plan, SchemaName::CertifyReport, SchemaName::Check, SchemaName::Sim];

    /// The file stem in src/schemas/.
    pub fn stem(self) -> &'static str {
        match self {
            SchemaName::Scenario => "scenario",
            SchemaName::Plan => "plan",
            SchemaName::CertifyReport => "certify-report",
            SchemaName::Check => "check",
            SchemaName::Sim => "sim",
        }
    }
}

/// The schema `name`, as `kvrelay schema` prints it and src/schemas/ holds it.
pub fn schema(name: SchemaName) -> Value {
    let (mut schema, format, title) = match name {
        SchemaName::Scenario => return crate::scenario::schema::scenario_schema(),
        SchemaName::Plan => {
            return serde_json::from_str(include_str!("../schemas/plan.schema.json"))
                .expect("src/schemas/plan.schema.json is JSON (tests/it/schemas.rs)")
        }
        SchemaName::CertifyReport => (
            crate::certify::report_schema(),
            crate::certify::REPORT_FORMAT,
            "kvrelay certification report (report.json)",
        ),
        SchemaName::Check => (
            schemars::schema_for!(merge::CheckResult).to_value(),
            merge::CHECK_FORMAT,
            "kvrelay check --json (kvrelay-check-1)",
        ),
        SchemaName::Sim => {
            (schemars::schema_for!(sim::SimResult).to_value(), sim::FORMAT, "kvrelay sim --json (kvrelay-sim-1)")
        }
    };
    // The serde types hold `format` as a string; the schema pins the one value each document carries.
    if let Some(slot) = schema.pointer_mut("/properties/format") {
        *slot = serde_json::json!({ "const": format });
    }
    if let Value::Object(object) = &mut schema {
        let id = format!("https://kvrelay.dev/schemas/{}.schema.json", name.stem());
        object.insert("$id".to_owned(), Value::String(id));
        object.insert("title".to_owned(), Value::String(title.to_owned()));
    }
    schema
}

/// The schema as its file holds it: pretty JSON and a final newline.
pub fn schema_text(name: SchemaName) -> String {
    let mut text = serde_json::to_string_pretty(&schema(name)).expect("a JSON value serialises");
    text.push('\n');
    text
}
