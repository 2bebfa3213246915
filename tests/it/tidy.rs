//! Repository hygiene that `cargo test` enforces; each failure says how to fix it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Scenario files: what `kvrelay check` reads.
fn scenario_files() -> Vec<PathBuf> {
    let dir = root().join("scenarios");
    let mut res = files(&dir, "yaml");
    res.extend(files(&dir, "yml"));
    res.sort();
    res
}

fn files(dir: &Path, extension: &str) -> Vec<PathBuf> {
    let mut res = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|ext| ext == extension) {
                res.push(path);
            }
        }
    }
    res.sort();
    res
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap()
}

#[test]
fn every_source_file_starts_with_module_docs() {
    for path in files(&root().join("src"), "rs") {
        assert!(
            read(&path).starts_with("//!"),
            "{} must start with a `//!` doc comment saying what the module is",
            path.display()
        );
    }
}

/// ARCHITECTURE.md invariant: model, plan, verify, wire, limits, faults and render do no IO, start no thread, read
/// no clock and draw no randomness.
#[test]
fn pure_modules_do_no_io_time_or_randomness() {
    let forbidden = [
        "std::fs",
        "std::thread",
        "std::time",
        "Instant",
        "SystemTime",
        "tokio",
        "thread_rng",
        "rand::",
        "HashMap",
        "HashSet",
        "std::net",
        "std::env",
        "println!",
        "eprintln!",
        "SimRng",
        "crate::seed",
        "chacha20",
    ];
    let mut pure: Vec<PathBuf> =
        ["src/pure/model", "src/pure/plan", "src/pure/verify", "src/pure/wire", "src/tools/report"]
            .iter()
            .flat_map(|dir| files(&root().join(dir), "rs"))
            .collect();
    pure.extend(
        ["src/tools/render.rs", "src/tools/matrix.rs", "src/pure/limits.rs", "src/pure/faults.rs"]
            .map(|path| root().join(path)),
    );
    for path in pure {
        let text = read(&path);
        for word in forbidden {
            assert!(
                !text.contains(word),
                "{} uses `{word}`: pure modules must not do IO, time or randomness (move it to cli/exec/fabric)",
                path.display()
            );
        }
    }
}

/// The oracle is written independently of the planner: verify/ never names plan code.
#[test]
fn oracle_never_calls_the_planner() {
    for path in files(&root().join("src/pure/verify"), "rs") {
        let text = read(&path);
        assert!(
            !text.contains("crate::plan") && !text.contains("plan::"),
            "{} refers to the planner; derive expectations from domain.md instead",
            path.display()
        );
    }
}

/// The fabric seam moves bytes between addresses it was given keys for: it never names plans, models or the oracle,
/// and the simulated world is deterministic.
#[test]
fn fabric_seam_knows_no_plan() {
    // `Duration` (a wait's bound) is vocabulary; reading a clock is not.
    let forbidden =
        ["crate::verify", "crate::plan", "crate::model", "HashMap", "HashSet", "Instant", "SystemTime", "SimRng"];
    for path in ["src/fabric/mod.rs", "src/fabric/verbs.rs", "src/fabric/world.rs"] {
        let text = read(&root().join(path));
        for word in forbidden {
            assert!(
                !text.contains(word),
                "{path} uses `{word}`: the seam takes only std, thiserror and fabric items (domain types go in exec)"
            );
        }
    }
}

/// The RDMA and plug-in fabrics may name the clock and the file system (waiting, sysfs GID types, loading a shared
/// object) but nothing above the seam (the plug-in fabric implements the certification kit's `Transport`, its one
/// import from above).
#[test]
fn unsafe_fabrics_know_no_plan() {
    for path in UNSAFE_MODULES {
        let text = read(&root().join(path));
        for word in
            ["crate::verify", "crate::plan", "crate::model", "crate::engine", "crate::exec", "HashMap", "SimRng"]
        {
            assert!(!text.contains(word), "{path} uses `{word}`: a fabric takes only the seam's types");
        }
    }
}

/// The modules allowed `unsafe` code (ARCHITECTURE.md, "Unsafe code"): the RDMA verbs fabric and the C ABI plug-in
/// loader.
const UNSAFE_MODULES: [&str; 7] = [
    "src/fabric/rdma.rs",
    "src/fabric/plugin.rs",
    "src/fabric/nixl.rs",
    "src/fabric/cuda/mod.rs",
    "src/fabric/cuda/engine.rs",
    "src/fabric/cuda/compare.rs",
    "src/fabric/cuda/ceilings.rs",
];

/// How many times the keyword `unsafe` occurs in the code of one line (comments and words like `unsafe_code`
/// excluded).
fn unsafe_keywords(line: &str) -> usize {
    let code = line.split("//").next().unwrap_or_default();
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices("unsafe")
        .filter(|&(index, word)| {
            !code[..index].chars().next_back().is_some_and(is_word)
                && !code[index + word.len()..].chars().next().is_some_and(is_word)
        })
        .count()
}

/// ARCHITECTURE.md: `unsafe` lives in the fabrics of [`UNSAFE_MODULES`] alone, which alone allow the
/// `unsafe_code` lint that Cargo.toml denies (and deny undocumented unsafe blocks).
#[test]
fn unsafe_code_lives_only_in_the_rdma_and_plugin_fabrics() {
    let manifest = read(&root().join("Cargo.toml"));
    assert!(manifest.contains("unsafe_code = \"deny\""), "Cargo.toml must deny unsafe_code for the whole crate");
    for path in files(&root().join("src"), "rs") {
        let relative = path.strip_prefix(root()).unwrap().to_string_lossy().replace('\\', "/");
        let text = read(&path);
        if UNSAFE_MODULES.contains(&relative.as_str()) {
            assert!(text.contains("#![allow(unsafe_code)]"), "{relative} must allow unsafe_code at its top");
            assert!(
                text.contains("#![deny(clippy::undocumented_unsafe_blocks)]"),
                "{relative} must deny clippy::undocumented_unsafe_blocks at its top"
            );
            continue;
        }
        assert!(
            !text.contains("allow(unsafe_code)"),
            "{relative} allows unsafe_code: only {UNSAFE_MODULES:?} may (move the foreign call there)"
        );
        for (number, line) in text.lines().enumerate() {
            assert_eq!(
                unsafe_keywords(line),
                0,
                "{relative}:{} uses `unsafe`: only {UNSAFE_MODULES:?} may (move the code there, with a SAFETY comment)",
                number + 1
            );
        }
    }
}

/// Every `unsafe` in the RDMA and plug-in fabrics sits right under a comment block holding `// SAFETY:` that says
/// why it is sound.
#[test]
fn every_unsafe_in_the_unsafe_fabrics_says_why_it_is_sound() {
    for path in UNSAFE_MODULES {
        let text = read(&root().join(path));
        let lines: Vec<&str> = text.lines().collect();
        let mut count = 0;
        for (index, line) in lines.iter().enumerate() {
            if unsafe_keywords(line) == 0 {
                continue;
            }
            count += 1;
            let comments = lines[..index].iter().rev().take_while(|above| above.trim_start().starts_with("//"));
            let documented = comments.into_iter().any(|above| above.trim_start().starts_with("// SAFETY:"));
            assert!(
                documented,
                "{path}:{} has `unsafe` without a `// SAFETY:` comment right above it: say why it is sound",
                index + 1
            );
        }
        assert!(count > 0, "{path} has no `unsafe`: drop its `#![allow(unsafe_code)]` and this test's exception");
    }
}

#[test]
fn unsafe_keywords_are_found_in_code_only() {
    assert_eq!(unsafe_keywords("let x = unsafe { f() };"), 1);
    assert_eq!(unsafe_keywords("unsafe impl Send for X {}"), 1);
    assert_eq!(unsafe_keywords("// take it out without unsafe"), 0);
    assert_eq!(unsafe_keywords("#![allow(unsafe_code)]"), 0);
    assert_eq!(unsafe_keywords("f(); // unsafe { g() }"), 0);
}

/// Engines see the decode side only through the wire and the planner, and never judge themselves: no oracle.
#[test]
fn engines_never_call_the_oracle() {
    for path in files(&root().join("src/running/engine"), "rs") {
        let drivers = ["sim.rs", "tasks.rs", "live.rs", "direct.rs"];
        if drivers.iter().any(|driver| path.ends_with(driver)) {
            continue; // the drivers: they fill memory with the oracle's pattern and own the clock
        }
        if path.ends_with("resident.rs") {
            continue; // the drivers' half: what `sim::finish_nodes` hands the oracle of memory kept on a device
        }
        let text = read(&path);
        for word in ["crate::verify", "verify::", "fabric::world", "std::time", "tokio"] {
            assert!(!text.contains(word), "{} uses `{word}`: engines are sans-IO and never judge", path.display());
        }
    }
}

/// The wire codec is the bottom of the control plane: it may not depend on the planner or the oracle.
#[test]
fn wire_imports_nothing_from_plan_or_verify() {
    for path in files(&root().join("src/pure/wire"), "rs") {
        let text = read(&path);
        for word in ["crate::plan", "crate::verify", "plan::", "verify::"] {
            assert!(
                !text.contains(word),
                "{} uses `{word}`: wire/ may import only limits and std (move the logic to plan/ or verify/)",
                path.display()
            );
        }
    }
}

#[test]
fn no_should_panic_or_ignored_tests() {
    let banned = [concat!("#[should", "_panic"), concat!("#[", "ignore")];
    for path in files(&root().join("tests"), "rs").into_iter().chain(files(&root().join("src"), "rs")) {
        let text = read(&path);
        for word in banned {
            assert!(
                !text.contains(word),
                "{} contains `{word}`: assert the current behaviour with a FIXME instead",
                path.display()
            );
        }
    }
}

#[test]
fn every_scenario_starts_with_a_comment() {
    for path in scenario_files() {
        assert!(
            read(&path).starts_with('#'),
            "{} must start with a `#` comment saying what it exercises and why",
            path.display()
        );
    }
}

/// Every scenario has a golden layout and every golden layout has a scenario (insta's `--unreferenced=reject`).
#[test]
fn golden_files_and_scenarios_match_one_to_one() {
    let scenarios_dir = root().join("scenarios");
    let expected: Vec<String> = scenario_files()
        .iter()
        .map(|path| kvrelay::render::golden_file_name(path.strip_prefix(&scenarios_dir).unwrap()))
        .collect();
    let mut actual: Vec<String> = files(&root().join("golden"), "snap")
        .iter()
        .map(|path| path.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    actual.sort();
    let mut expected_sorted = expected.clone();
    expected_sorted.sort();
    let missing: Vec<&String> = expected_sorted.iter().filter(|name| !actual.contains(name)).collect();
    let orphaned: Vec<&String> = actual.iter().filter(|name| !expected_sorted.contains(name)).collect();
    assert!(
        missing.is_empty(),
        "scenarios without golden layout {missing:?}: run `cargo test`, review golden/*.snap.new and accept them"
    );
    assert!(orphaned.is_empty(), "golden files without scenario {orphaned:?}: delete them");
}

/// The pure core (ARCHITECTURE.md, "Layers"): scenario input, the planner, the oracle, the wire and their
/// vocabulary, below every module that runs, drives or presents anything.
const PURE_CORE: [&str; 8] = ["model", "limits", "seed", "faults", "scenario", "plan", "verify", "wire"];

/// The modules above the pure core, which it never imports.
const ABOVE_THE_CORE: [&str; 18] = [
    "fabric",
    "engine",
    "harness",
    "parallel",
    "swarm",
    "certify",
    "selftest",
    "shrink",
    "cli",
    "process",
    "control",
    "external",
    "exec",
    "explain",
    "shard",
    "from_config",
    "report",
    "matrix",
];

/// The one import cycle left, being untied in issue 19 with the transport seam's rewrite: the plug-in fabric
/// implements certification's `Transport`, and certification runs the engines over the harness, which run on the
/// fabric. Every other cycle is an error, and this one may only shrink.
/// The layers of lib.rs and ARCHITECTURE.md, bottom up, each a folder of `src/` (the CLI is its own): a module may
/// import only from its own layer or one below.
const LAYERS: [(&str, &[&str]); 5] = [
    ("pure", &["kinds", "model", "limits", "seed", "faults", "scenario", "plan", "verify", "wire"]),
    ("fabric", &["fabric"]),
    ("running", &["engine", "control", "external", "exec", "harness", "parallel", "process"]),
    (
        "tools",
        &["certify", "selftest", "explain", "from_config", "swarm", "shard", "shrink", "render", "report", "matrix"],
    ),
    ("cli", &["cli"]),
];

/// The layer number of top-level module `module` (0 = the pure core).
fn layer_of(module: &str) -> usize {
    LAYERS
        .iter()
        .position(|(_, modules)| modules.contains(&module))
        .unwrap_or_else(|| panic!("module `{module}` is in no layer of LAYERS: add it where lib.rs puts it"))
}

/// `text` without its `//` comments (doc comments included: a doc link is no import).
fn code(text: &str) -> String {
    text.lines().map(|line| line.split("//").next().unwrap_or_default()).collect::<Vec<_>>().join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The top-level modules `code` names through `crate::` paths: `crate::a::b`, `$crate::a`, `crate::{a, b::c}`.
fn crate_refs(code: &str) -> BTreeSet<String> {
    let leading_ident = |text: &str| text.trim_start().chars().take_while(|&c| is_ident(c)).collect::<String>();
    let mut refs = BTreeSet::new();
    for (index, word) in code.match_indices("crate::") {
        if code[..index].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let rest = &code[index + word.len()..];
        let Some(group) = rest.strip_prefix('{') else {
            refs.insert(leading_ident(rest));
            continue;
        };
        // Split the group at its own commas (nested groups belong to their item).
        let (mut depth, mut start) = (0usize, 0);
        for (at, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    refs.insert(leading_ident(&group[start..at]));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    refs.insert(leading_ident(&group[start..at]));
                    start = at + 1;
                }
                _ => {}
            }
        }
    }
    refs.remove("");
    refs
}

#[test]
fn crate_refs_are_found_in_paths_and_groups() {
    let found = crate_refs("use crate::plan::{self, Plan};\nuse crate::{wire::Registration, model::{A, B}, limits};");
    assert_eq!(found, ["limits", "model", "plan", "wire"].map(String::from).into());
    assert_eq!(crate_refs("x = $crate::seed::Seed(1); my_crate::fabric::X; crate :: y"), ["seed".into()].into());
    assert!(crate_refs(&code("/// [`crate::fabric::faults`]\nlet a = 1; // crate::engine")).is_empty());
}

/// The top-level module of a source file (`src/pure/plan/rows.rs` is `plan`, `src/running/harness.rs` is `harness`,
/// `src/fabric/seam.rs` is `fabric`); `None` for the crate root, the binary and a layer folder's own `mod.rs`.
fn top_module(path: &Path) -> Option<String> {
    let relative = path.strip_prefix(root().join("src")).unwrap();
    let mut components = relative.components().map(|part| part.as_os_str().to_string_lossy().into_owned());
    let mut first = components.next()?;
    if ["pure", "running", "tools"].contains(&first.as_str()) {
        first = components.next()?;
        if first == "mod.rs" {
            return None;
        }
    }
    match first.strip_suffix(".rs") {
        Some("lib" | "main") => None,
        Some(name) => Some(name.to_owned()),
        None => Some(first),
    }
}

/// The imports between top-level modules through `crate::` paths: module → (module it names → a file naming it).
fn import_graph() -> BTreeMap<String, BTreeMap<String, String>> {
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for path in files(&root().join("src"), "rs") {
        let Some(module) = top_module(&path) else { continue };
        let relative = path.strip_prefix(root()).unwrap().to_string_lossy().replace('\\', "/");
        let edges = graph.entry(module.clone()).or_default();
        for target in crate_refs(&code(&read(&path))).into_iter().filter(|target| *target != module) {
            edges.entry(target).or_insert_with(|| relative.clone());
        }
    }
    graph
}

/// The shortest import cycle from `start` back to itself, as `a → b (file) → ...`, if there is one.
fn cycle_through(graph: &BTreeMap<String, BTreeMap<String, String>>, start: &str) -> Option<Vec<String>> {
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(module) = queue.pop_front() {
        for target in graph.get(module).into_iter().flat_map(BTreeMap::keys) {
            if target == start {
                let mut path = vec![module];
                while let Some(&before) = came_from.get(path.last().unwrap()) {
                    path.push(before);
                }
                path.reverse();
                path.push(start);
                let steps =
                    path.windows(2).map(|pair| format!("{} → {} ({})", pair[0], pair[1], graph[pair[0]][pair[1]]));
                return Some(steps.collect());
            }
            if target != start && !came_from.contains_key(target.as_str()) {
                came_from.insert(target, module);
                queue.push_back(target);
            }
        }
    }
    None
}

/// ARCHITECTURE.md, "Layers": no top-level module of the pure core lies on an import cycle, with another core module
/// or with any module above it.
#[test]
fn no_import_cycle_through_the_pure_core() {
    let graph = import_graph();
    for module in PURE_CORE {
        assert!(graph.contains_key(module), "src/pure/{module} is gone: update PURE_CORE");
        if let Some(cycle) = cycle_through(&graph, module) {
            panic!(
                "{module} is on an import cycle: {cycle:?}; move the shared piece down so only one direction remains"
            );
        }
    }
}

/// No import cycle between top-level modules at all: tools built on running (swarm, shrink, selftest, certify)
/// import the harness, never the reverse, and a fabric never imports what runs on it.
#[test]
fn no_import_cycles() {
    let graph = import_graph();
    for module in graph.keys() {
        if let Some(cycle) = cycle_through(&graph, module) {
            panic!(
                "{module} is on an import cycle: {cycle:?}; move the shared piece down so only one direction remains"
            );
        }
    }
}

/// ARCHITECTURE.md, "Layers": every import points down the layers of [`LAYERS`] or stays in its layer (every file of
/// `fabric/` included: no backend imports certification, the engines or the harness), and each layer's modules
/// live in its folder.
#[test]
fn no_arrow_points_up_the_layers() {
    let graph = import_graph();
    for (module, targets) in &graph {
        for (target, file) in targets {
            assert!(
                layer_of(target) <= layer_of(module),
                "{file}: {module} (layer {}) imports {target} (layer {}), which is above it: move the shared piece down",
                LAYERS[layer_of(module)].0,
                LAYERS[layer_of(target)].0
            );
        }
    }
    for (layer, modules) in LAYERS.iter().filter(|(layer, _)| ["pure", "running", "tools"].contains(layer)) {
        for module in *modules {
            let (dir, file) = (root().join("src").join(layer).join(module), format!("src/{layer}/{module}.rs"));
            assert!(dir.is_dir() || root().join(&file).is_file(), "{module} is not in src/{layer}/: move it there");
        }
    }
}

/// ARCHITECTURE.md, "Layers": the pure core names nothing above it, not even in its tests.
#[test]
fn pure_core_imports_nothing_above_it() {
    for module in PURE_CORE {
        let dir = root().join("src/pure").join(module);
        let paths = if dir.is_dir() { files(&dir, "rs") } else { vec![root().join(format!("src/pure/{module}.rs"))] };
        for path in paths {
            let refs = crate_refs(&code(&read(&path)));
            let above: Vec<&String> = refs.iter().filter(|target| ABOVE_THE_CORE.contains(&target.as_str())).collect();
            assert!(
                above.is_empty(),
                "{} (pure core) imports {above:?}: move the type it needs down into the core (or the call up to the caller)",
                path.display()
            );
        }
    }
}
