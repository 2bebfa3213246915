//! Hostile and absurd scenario files: never a panic, a hang or an abort, always an error that names the file.
//!
//! Three layers: every file kept in `tests/hostile/` (the fuzzer's past crashes and one example per class of
//! issue 6) has its message pinned by insta; a proptest puts edge values into every numeric field of every corpus
//! scenario and runs the whole pipeline; another splices arbitrary bytes into corpus files. Accepted inputs run
//! under a small memory budget so every case is cheap; a hang would stall this test, never pass it.

use std::path::{Path, PathBuf};

use kvrelay::harness::{self, Budget};
use kvrelay::scenario;
use proptest::prelude::*;
use serde_yaml_ng::Value;

/// Simulated memory an accepted mutant may register: enough for small scenarios, refusing the large ones fast.
const BUDGET: u64 = 32 << 20;

/// Values at and around every boundary the loader and planner meet (issue 6's classes among them).
const EDGES: &[i128] = &[
    -1,
    0,
    1,
    2,
    3,
    7,
    8,
    9,
    16,
    63,
    64,
    100,
    4096,
    65535,
    65536,
    1 << 24,
    (1 << 24) + 1,
    i32::MAX as i128,
    1 << 31,
    u32::MAX as i128,
    1 << 32,
    1 << 63,
    u64::MAX as i128 - 7,
    u64::MAX as i128,
];

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "yaml") {
            out.push(path);
        }
    }
}

fn sorted_files(dir: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    files_under(&Path::new(env!("CARGO_MANIFEST_DIR")).join(dir), &mut files);
    files.sort();
    files
}

/// Every corpus scenario as a YAML value.
fn corpus() -> &'static [Value] {
    static CORPUS: std::sync::OnceLock<Vec<Value>> = std::sync::OnceLock::new();
    CORPUS.get_or_init(|| {
        sorted_files("scenarios")
            .iter()
            .map(|path| serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap())
            .collect()
    })
}

/// Loads and runs `bytes` as a scenario file end to end; a panic anywhere fails the calling test.
/// Returns the loader's or runner's error text, or the verdict.
fn exercise(bytes: &[u8]) -> String {
    match scenario::parse_bytes(bytes, "mutant.yaml", "mutant", None) {
        Err(error) => {
            let text = error.to_string();
            assert!(text.starts_with("mutant.yaml"), "the error does not name the file: {text}");
            assert!(!text.contains("RawScenario") && !text.contains("untagged"), "parser internals leak: {text}");
            text
        }
        Ok(scenario) => match harness::run_with(&scenario, &Budget::bytes(BUDGET), &Default::default()) {
            Err(error) => error.to_string(),
            Ok(outcome) => {
                let _ = kvrelay::render::golden(&scenario, &outcome);
                format!("ran: {}", outcome.failure_text("; "))
            }
        },
    }
}

/// Paths to every leaf (`Vec` of mapping keys and sequence indices) of `value`.
fn leaves(value: &Value, path: &mut Vec<Value>, out: &mut Vec<Vec<Value>>) {
    match value {
        Value::Mapping(map) => {
            for (key, child) in map {
                path.push(key.clone());
                leaves(child, path, out);
                path.pop();
            }
        }
        Value::Sequence(items) => {
            for (index, child) in items.iter().enumerate() {
                path.push(Value::from(index as u64));
                leaves(child, path, out);
                path.pop();
            }
        }
        _ => out.push(path.clone()),
    }
}

fn at_path<'a>(value: &'a mut Value, path: &[Value]) -> &'a mut Value {
    path.iter().fold(value, |node, key| match node {
        Value::Sequence(items) => &mut items[key.as_u64().unwrap() as usize],
        other => other.get_mut(key).unwrap(),
    })
}

fn edge(index: usize) -> Value {
    let value = EDGES[index % EDGES.len()];
    match u64::try_from(value) {
        Ok(value) => Value::from(value),
        Err(_) => Value::from(value as i64),
    }
}

/// One structure-aware mutation of a corpus scenario.
#[derive(Debug, Clone)]
enum Mutation {
    /// Put an edge value at the `leaf`-th leaf.
    Edge { leaf: usize, value: usize },
    /// Drop the `leaf`-th leaf's innermost key or item.
    Remove { leaf: usize },
    /// Add field `name` with an edge value to the mapping holding the `leaf`-th leaf.
    Inject { leaf: usize, name: usize, value: usize },
    /// Replace the `leaf`-th leaf by a whole subtree of another scenario.
    Graft { leaf: usize, donor: usize, donor_leaf: usize },
}

/// Field names of the schema (raw.rs), so injections hit real fields as well as unknown ones.
const FIELDS: &[&str] = &[
    "tp",
    "pp",
    "dcp",
    "page_size",
    "pool_pages",
    "slots",
    "kv_token_len",
    "metadata_components",
    "layers",
    "kv_layers",
    "kv_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "dtype_bytes",
    "aux",
    "tokens",
    "decode_prefix",
    "chunks",
    "decode_page_count",
    "window_pages",
    "dim",
    "unit_bytes",
    "outer",
    "item_len",
    "entries",
    "token_len",
    "component",
    "entry",
    "tensor",
    "groups",
    "no_such_field",
];

fn apply(base: &Value, mutation: &Mutation) -> Value {
    let mut value = base.clone();
    let mut paths = Vec::new();
    leaves(&value, &mut Vec::new(), &mut paths);
    let pick = |leaf: usize| &paths[leaf % paths.len()];
    match mutation {
        Mutation::Edge { leaf, value: edge_index } => *at_path(&mut value, pick(*leaf)) = edge(*edge_index),
        Mutation::Remove { leaf } => {
            let path = pick(*leaf);
            let (last, parent) = path.split_last().unwrap();
            match at_path(&mut value, parent) {
                Value::Sequence(items) => drop(items.remove(last.as_u64().unwrap() as usize)),
                Value::Mapping(map) => drop(map.remove(last)),
                _ => {}
            }
        }
        Mutation::Inject { leaf, name, value: edge_index } => {
            let path = pick(*leaf);
            if let Value::Mapping(map) = at_path(&mut value, &path[..path.len() - 1]) {
                map.insert(Value::from(FIELDS[name % FIELDS.len()]), edge(*edge_index));
            }
        }
        Mutation::Graft { leaf, donor, donor_leaf } => {
            let donor = &corpus()[donor % corpus().len()];
            let mut donor_paths = Vec::new();
            leaves(donor, &mut Vec::new(), &mut donor_paths);
            let donor_path = &donor_paths[donor_leaf % donor_paths.len()];
            let mut donor = donor.clone();
            let subtree = at_path(&mut donor, &donor_path[..donor_path.len().saturating_sub(1)]).clone();
            *at_path(&mut value, pick(*leaf)) = subtree;
        }
    }
    value
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), any::<usize>()).prop_map(|(leaf, value)| Mutation::Edge { leaf, value }),
        1 => any::<usize>().prop_map(|leaf| Mutation::Remove { leaf }),
        1 => (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(leaf, name, value)| Mutation::Inject { leaf, name, value }),
        1 => (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(leaf, donor, donor_leaf)| Mutation::Graft { leaf, donor, donor_leaf }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Edge values in any numeric field (and removed, injected or grafted fields) of any corpus scenario never
    /// panic, hang or abort: the loader, planner, fabric and oracle answer with an error or a verdict.
    #[test]
    fn edge_values_in_every_field_never_panic(scenario in any::<usize>(), mutations in prop::collection::vec(mutation(), 1..4)) {
        let mut value = corpus()[scenario % corpus().len()].clone();
        for mutation in &mutations {
            value = apply(&value, mutation);
        }
        let text = serde_yaml_ng::to_string(&value).unwrap();
        exercise(text.as_bytes());
    }

    /// Arbitrary bytes spliced into a corpus file never panic and always get an error naming the file (or load).
    #[test]
    fn arbitrary_bytes_never_panic(scenario in any::<usize>(), at in any::<usize>(), bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let files = sorted_files("scenarios");
        let mut text = std::fs::read(&files[scenario % files.len()]).unwrap();
        let at = at % (text.len() + 1);
        text.splice(at..at, bytes);
        exercise(&text);
    }
}

/// Every numeric field of every corpus scenario, set to every edge value in turn, answers without a panic; each
/// refusal by the loader names the field it was given.
#[test]
fn every_numeric_field_at_every_edge_value() {
    let mut runs = 0;
    for base in corpus() {
        let mut paths = Vec::new();
        leaves(base, &mut Vec::new(), &mut paths);
        for path in paths.iter().filter(|path| matches!(at_path(&mut base.clone(), path), Value::Number(_))) {
            for index in 0..EDGES.len() {
                let mut value = base.clone();
                *at_path(&mut value, path) = edge(index);
                exercise(serde_yaml_ng::to_string(&value).unwrap().as_bytes());
                runs += 1;
            }
        }
    }
    assert!(runs > 1000, "only {runs} runs: the corpus lost its numeric fields");
}

/// Every file in tests/hostile/ (one per class of issue 6, and every crash the fuzzer found) gets the error pinned
/// in its snapshot; none panics.
#[test]
fn hostile_files_get_clear_errors() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hostile");
    let mut report = String::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|entry| entry.unwrap().path()).collect();
    files.sort();
    for path in files.iter().filter(|path| path.extension().is_some_and(|ext| ext == "yaml")) {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(path).unwrap();
        let result = exercise(&bytes).replace("mutant.yaml", &name);
        report.push_str(&format!("## {name}\n{}\n\n", result.trim_end()));
    }
    insta::assert_snapshot!("hostile", report);
}
