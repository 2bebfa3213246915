//! The JSON Schema (draft 2020-12) of scenario files, derived from the serde types of `raw.rs` (schemars), with
//! each field's description taken from raw.rs's own field table and the closed word lists (presets, state kinds,
//! fault kinds, error kinds) as enums. `kvrelay schema scenario` prints it; `src/schemas/scenario.schema.json` is
//! the copy editors point at (`# yaml-language-server: $schema=...`), kept current by a test.

use std::collections::BTreeMap;

use serde_json::Value;

use super::lower::{PRESET_NAMES, STATE_KINDS};
use super::raw::RawScenario;
use crate::faults::FaultKind;
use crate::plan::PlanErrorKind;

/// The `$id` of the scenario schema.
pub const ID: &str = "https://kvrelay.dev/schemas/scenario.schema.json";

/// raw.rs's field table: dotted path (`model.preset`, `*.pool_pages`, `requests[].tokens`) to its meaning.
fn field_table() -> BTreeMap<String, String> {
    let mut table = BTreeMap::new();
    for line in include_str!("raw.rs").lines() {
        let Some(row) = line.strip_prefix("//! | `") else { continue };
        let cells: Vec<&str> = row.splitn(4, " | ").collect();
        let [fields, _, default, meaning] = cells[..] else { continue };
        let meaning = meaning.trim_end_matches(" |").trim();
        let text = if default == "none" || default == "required" {
            meaning.to_owned()
        } else {
            format!("{meaning} (default: {})", default.trim())
        };
        let fields = format!("`{fields}");
        for path in fields.split('`').skip(1).step_by(2) {
            table.insert(path.to_owned(), text.clone());
        }
    }
    table
}

/// The description of the property at `path` (`prefill.tp`, `requests[].tokens`): its own row, or the row of
/// either side (`*.`, `prefill.` or `decode.`).
fn describe<'a>(table: &'a BTreeMap<String, String>, path: &str) -> Option<&'a String> {
    // A list's row may name it with `[]` (`model.state[]`).
    let listed = format!("{path}[]");
    if let Some(text) = table.get(path).or_else(|| table.get(&listed)) {
        return Some(text);
    }
    let side = ["prefill.", "decode."].iter().find_map(|side| path.strip_prefix(side));
    table.get(path).or_else(|| {
        let field = side?;
        ["*.", "prefill.", "decode."].iter().find_map(|prefix| {
            table.get(&format!("{prefix}{field}")).or_else(|| table.get(&format!("{prefix}{field}[]")))
        })
    })
}

/// Walks `schema` (the property at `path`), describing every property from the table and resolving `$ref`s into
/// `$defs` once (a definition shared by both sides is described from the first side's path).
fn annotate(
    schema: &mut Value,
    defs: &mut serde_json::Map<String, Value>,
    table: &BTreeMap<String, String>,
    path: &str,
    done: &mut Vec<String>,
) {
    if let Some(reference) = schema.get("$ref").and_then(Value::as_str).map(str::to_owned) {
        let name = reference.trim_start_matches("#/$defs/").to_owned();
        if done.contains(&name) {
            return;
        }
        done.push(name.clone());
        if let Some(mut def) = defs.remove(&name) {
            annotate(&mut def, defs, table, path, done);
            defs.insert(name, def);
        }
        return;
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(branches)) = schema.get_mut(key) {
            for branch in branches {
                annotate(branch, defs, table, path, done);
            }
        }
    }
    if let Some(items) = schema.get_mut("items") {
        annotate(items, defs, table, &format!("{path}[]"), done);
    }
    if let Some(Value::Object(properties)) = schema.get_mut("properties") {
        for (name, property) in properties.iter_mut() {
            let child = if path.is_empty() { name.clone() } else { format!("{path}.{name}") };
            if let (Some(text), Value::Object(object)) = (describe(table, &child), &mut *property) {
                object.insert("description".to_owned(), Value::String(text.clone()));
            }
            annotate(property, defs, table, &child, done);
        }
    }
}

/// Sets `enum` on the string property `property` of definition `def`.
fn words(defs: &mut serde_json::Map<String, Value>, def: &str, property: &str, names: Vec<String>) {
    let Some(slot) = defs.get_mut(def).and_then(|def| def.pointer_mut(&format!("/properties/{property}"))) else {
        return;
    };
    let words: Vec<Value> = names.into_iter().map(Value::String).collect();
    // Optional fields are `type: [string, null]`; keep null allowed where it was.
    let nullable = slot.get("type").is_some_and(|kind| kind.as_array().is_some_and(|kinds| kinds.len() > 1));
    let mut words = words;
    if nullable {
        words.push(Value::Null);
    }
    if let Value::Object(object) = slot {
        object.insert("enum".to_owned(), Value::Array(words));
    }
}

/// The scenario schema.
pub fn scenario_schema() -> Value {
    let mut schema = schemars::schema_for!(RawScenario).to_value();
    let table = field_table();
    let mut defs = match schema.get_mut("$defs").map(Value::take) {
        Some(Value::Object(defs)) => defs,
        _ => serde_json::Map::new(),
    };
    let mut done = Vec::new();
    annotate(&mut schema, &mut defs, &table, "", &mut done);
    words(&mut defs, "RawModel", "preset", PRESET_NAMES.map(str::to_owned).to_vec());
    words(&mut defs, "RawComponent", "kind", STATE_KINDS.map(|(name, _)| name.to_owned()).to_vec());
    words(&mut defs, "RawFault", "kind", FaultKind::ALL.iter().map(|kind| kind.name().to_owned()).collect());
    words(&mut defs, "RawError", "error", PlanErrorKind::ALL.iter().map(|kind| kind.name().to_owned()).collect());
    words(&mut defs, "RawRegistrationFields", "item_lens", vec!["per_entry".to_owned(), "entry0".to_owned()]);
    if let Value::Object(object) = &mut schema {
        object.insert("$defs".to_owned(), Value::Object(defs));
        object.insert("$id".to_owned(), Value::String(ID.to_owned()));
        object.insert("title".to_owned(), Value::String("kvrelay scenario".to_owned()));
        object.insert(
            "description".to_owned(),
            Value::String(
                "A kvrelay scenario: a model, the prefill and decode sides' layouts, requests and the expected verdict \
                 (README.md \"Scenarios\"; field table in src/pure/scenario/raw.rs)."
                    .to_owned(),
            ),
        );
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_of_the_table_describes_a_property_and_every_preset_is_a_shape() {
        let schema = scenario_schema().to_string();
        for (path, text) in field_table() {
            assert!(schema.contains(&serde_json::to_string(&text).unwrap()), "no property got `{path}`'s description");
        }
        for name in PRESET_NAMES {
            assert!(super::super::lower::preset(name).is_some(), "preset `{name}` is not a shape");
        }
    }
}
