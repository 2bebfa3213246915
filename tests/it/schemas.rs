//! The JSON Schemas of src/schemas/: each file is what `kvrelay schema` prints, and every scenario and every kind of
//! document kvrelay emits (plan-1/2/3 for every scenario, certification reports clean and failing, `check --json`,
//! `sim --json`, a `from-config` scenario) validates against its schema (the `jsonschema` crate, draft 2020-12),
//! while a scenario or plan with a wrong field does not.

use std::path::{Path, PathBuf};

use kvrelay::certify::SimTransport;
use kvrelay::cli::schema::{schema, schema_text, SchemaName};
use kvrelay::render::{plan_json, PlanForm};

use crate::conformance::{Broken, Sabotage};
use crate::support::{kvrelay, text};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn validator(name: SchemaName) -> jsonschema::Validator {
    jsonschema::draft202012::new(&schema(name)).unwrap_or_else(|error| panic!("{} schema: {error}", name.stem()))
}

#[track_caller]
fn valid(validator: &jsonschema::Validator, document: &serde_json::Value, what: &str) {
    let errors: Vec<String> = validator
        .iter_errors(document)
        .take(5)
        .map(|error| format!("{} at {}", error, error.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{what} breaks its schema:\n{}", errors.join("\n"));
}

fn scenario_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut dirs = vec![root().join("scenarios")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|ext| ext == "yaml") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn yaml(text: &str) -> serde_json::Value {
    serde_yaml_ng::from_str(text).unwrap()
}

#[test]
fn the_schema_files_are_what_kvrelay_schema_prints() {
    for name in SchemaName::ALL {
        let file = root().join(format!("src/schemas/{}.schema.json", name.stem()));
        let held = std::fs::read_to_string(&file).unwrap();
        assert!(
            held == schema_text(name),
            "{} is stale: regenerate it with `cargo run -- schema {} > {}`",
            file.display(),
            name.stem(),
            file.display()
        );
        // Each compiles as draft 2020-12.
        validator(name);
    }
}

#[test]
fn every_scenario_validates_and_a_misspelt_or_mistyped_field_does_not() {
    let scenarios = validator(SchemaName::Scenario);
    let files = scenario_files();
    assert!(files.len() > 50, "{} scenarios", files.len());
    for file in &files {
        valid(&scenarios, &yaml(&std::fs::read_to_string(file).unwrap()), &file.display().to_string());
    }
    let good = "model: {preset: kimi-k3}\nprefill: {tp: 1, page_size: 64}\ndecode: {tp: 2, page_size: 64}\nrequests: [{tokens: 100}]\nexpect: ok\n";
    valid(&scenarios, &yaml(good), "a minimal scenario");
    for (bad, why) in [
        (good.replace("page_size: 64}\ndecode", "page_sise: 64}\ndecode"), "a misspelt field"),
        (good.replace("tp: 2", "tp: two"), "a word for a number"),
        (good.replace("kimi-k3", "kimi-k9"), "an unknown preset"),
        (good.replace("expect: ok", "expect: fine"), "an unknown verdict"),
        (good.replace("expect: ok", "expect: {error: no_such_kind}"), "an unknown error kind"),
        (good.replace("requests: [{tokens: 100}]\n", ""), "no requests"),
    ] {
        assert!(!scenarios.is_valid(&yaml(&bad)), "{why} passed the schema:\n{bad}");
    }
}

#[test]
fn every_plan_form_of_every_scenario_validates() {
    let plans = validator(SchemaName::Plan);
    let mut checked = 0;
    for file in scenario_files() {
        let scenario = kvrelay::scenario::load(&file).unwrap();
        let Ok(plan) = kvrelay::plan::plan(&scenario.problem) else { continue };
        let mut forms = vec![PlanForm::Descriptors, PlanForm::Paged];
        if plan.copy_count() < 50_000 {
            forms.push(PlanForm::Copies);
        }
        for form in forms {
            let mut bytes = Vec::new();
            plan_json(&scenario.problem, &plan, form, &mut bytes).unwrap();
            let document: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            valid(&plans, &document, &format!("{} as {form:?}", file.display()));
            checked += 1;
        }
    }
    assert!(checked > 100, "{checked} plans");
    let mut bytes = Vec::new();
    let scenario = kvrelay::scenario::load(&root().join("scenarios/basic/mla-tp2-to-tp4.yaml")).unwrap();
    plan_json(&scenario.problem, &kvrelay::plan::plan(&scenario.problem).unwrap(), PlanForm::Paged, &mut bytes)
        .unwrap();
    let mut document: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    document["descriptors"][0]["source_table"] = "pages".into();
    assert!(!plans.is_valid(&document), "an unknown table name passed");
    document["schema"] = "kvrelay-plan-2".into();
    assert!(!plans.is_valid(&document), "plan-2 with tables passed");
}

#[test]
fn certification_reports_clean_and_failing_validate() {
    let reports = validator(SchemaName::CertifyReport);
    let clean = crate::certify::run(&mut SimTransport::eager(), &crate::certify::options());
    let broken = crate::certify::run(
        &mut Broken { inner: SimTransport::eager(), sabotage: Sabotage::ShiftWrites },
        &crate::certify::options(),
    );
    assert!(clean.certified() && !broken.certified());
    for (report, what) in [(clean, "a certified report"), (broken, "a failing report")] {
        let document: serde_json::Value = serde_json::from_str(&report.json()).unwrap();
        valid(&reports, &document, what);
    }
}

#[test]
fn check_and_sim_results_and_an_imported_scenario_validate() {
    let temp = Path::new(env!("CARGO_TARGET_TMPDIR")).join("schemas");
    std::fs::create_dir_all(&temp).unwrap();
    let file = |name: &str| temp.join(name).display().to_string();
    for args in [
        vec!["check", "scenarios/engines", "--json", &file("check.json")],
        vec!["sim", "scenarios/engines", "--seeds", "2", "--json", &file("sim.json")],
        vec![
            "scenario",
            "from-config",
            "tests/configs/deepseek-v3.json",
            "--prefill",
            "--tp 1 --pp-size 2 --page-size 64",
            "--decode",
            "--tp 2 --dcp-size 2 --page-size 64",
            "--out",
            &file("imported.yaml"),
        ],
    ] {
        let output = kvrelay(&args);
        assert!(output.status.success(), "{args:?}: {}{}", text(&output.stdout), text(&output.stderr));
    }
    let read = |name: &str| std::fs::read_to_string(file(name)).unwrap();
    valid(&validator(SchemaName::Check), &serde_json::from_str(&read("check.json")).unwrap(), "check --json");
    valid(&validator(SchemaName::Sim), &serde_json::from_str(&read("sim.json")).unwrap(), "sim --json");
    valid(&validator(SchemaName::Scenario), &yaml(&read("imported.yaml")), "a from-config scenario");
}
