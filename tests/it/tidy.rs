//! Repository hygiene that `cargo test` enforces; each failure says how to fix it.

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

/// ARCHITECTURE.md invariant: model, plan, verify, wire and render do no IO, read no clock and draw no randomness.
#[test]
fn pure_modules_do_no_io_time_or_randomness() {
    let forbidden = [
        "std::fs",
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
    let mut pure: Vec<PathBuf> = ["src/model", "src/plan", "src/verify", "src/wire"]
        .iter()
        .flat_map(|dir| files(&root().join(dir), "rs"))
        .collect();
    pure.push(root().join("src/render.rs"));
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
    for path in files(&root().join("src/verify"), "rs") {
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
const UNSAFE_MODULES: [&str; 2] = ["src/fabric/rdma.rs", "src/fabric/plugin.rs"];

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

/// ARCHITECTURE.md: `unsafe` lives in src/fabric/rdma.rs and src/fabric/plugin.rs alone, which alone allow the
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
    for path in files(&root().join("src/engine"), "rs") {
        if path.ends_with("sim.rs") || path.ends_with("tasks.rs") || path.ends_with("live.rs") {
            continue; // the drivers: they fill memory with the oracle's pattern and own the clock
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
    for path in files(&root().join("src/wire"), "rs") {
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
