//! The `kvrelay` binary end to end: exit codes, stderr errors, the JSON plan and the golden gate.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support::{kvrelay, text};

#[test]
fn run_passes_a_good_scenario() {
    let output = kvrelay(&["run", "scenarios/basic/baseline-tp1-to-tp1.yaml"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    assert!(text(&output.stdout).contains("pass baseline-tp1-to-tp1"));
}

#[test]
fn missing_scenario_is_a_stderr_error_with_nonzero_exit() {
    let output = kvrelay(&["run", "scenarios/nope.yaml"]);
    assert!(!output.status.success());
    assert!(text(&output.stderr).contains("error: scenarios/nope.yaml: cannot read"), "{}", text(&output.stderr));
}

#[test]
fn layout_rank_out_of_range_is_an_error() {
    let output = kvrelay(&["layout", "scenarios/basic/mla-tp2-to-tp4.yaml", "--rank", "9"]);
    assert!(!output.status.success());
    assert!(text(&output.stderr).contains("--rank 9 is out of range: decode has 4 ranks"), "{}", text(&output.stderr));
}

#[test]
fn plan_json_expand_lists_every_copy_with_regions() {
    let output = kvrelay(&["plan", "scenarios/basic/mla-tp2-to-tp4.yaml", "--json", "--expand"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(json["schema"], "kvrelay-plan-1");
    let copies = json["copies"].as_array().unwrap();
    // 4 decode ranks x 4 layers x (70-token request: 5 pages; 16-token request: 1 page), one copy per page pair
    // unless two pages happen to be adjacent on both sides; the plan summary states the exact count.
    let summary = text(&kvrelay(&["plan", "scenarios/basic/mla-tp2-to-tp4.yaml"]).stdout);
    assert!(summary.starts_with(&format!("plan: {} copies", copies.len())), "{summary}");
    let copy = &copies[0];
    for field in [
        "request",
        "chunk",
        "source",
        "source_region",
        "source_offset",
        "target",
        "target_region",
        "target_offset",
        "length",
    ] {
        assert!(!copy[field].is_null(), "copy lacks {field}: {copy}");
    }
    assert_eq!(copy["source_region"]["kind"], "kv");
    let region = &json["regions"][0];
    assert_eq!(region["row_len"], 1152);
    assert_eq!(region["rows_per_item"], 16);
    assert_eq!(region["item_len"], 1152 * 16);
}

/// `plan --json` emits strided descriptors (kvrelay-plan-2): as many bytes as the copies, in no more entries.
#[test]
fn plan_json_emits_descriptors_moving_the_copies_bytes() {
    let scenario = "scenarios/basic/kimi-k3-example-c.yaml";
    let parse = |args: &[&str]| -> serde_json::Value {
        let output = kvrelay(args);
        assert!(output.status.success(), "{}", text(&output.stderr));
        serde_json::from_slice(&output.stdout).unwrap()
    };
    let descriptors = parse(&["plan", scenario, "--json"]);
    let copies = parse(&["plan", scenario, "--json", "--expand"]);
    assert_eq!(descriptors["schema"], "kvrelay-plan-2");
    assert!(descriptors["copies"].is_null());
    assert_eq!(descriptors["regions"], copies["regions"]);
    let (descriptors, copies) = (descriptors["descriptors"].as_array().unwrap(), copies["copies"].as_array().unwrap());
    let field =
        |value: &serde_json::Value, name: &str| value[name].as_u64().unwrap_or_else(|| panic!("{name}: {value}"));
    let bytes: u64 = descriptors.iter().map(|it| field(it, "element_len") * field(it, "count")).sum();
    assert_eq!(bytes, copies.iter().map(|it| field(it, "length")).sum::<u64>());
    let elements: u64 = descriptors.iter().map(|it| field(it, "count")).sum();
    assert_eq!(elements, copies.len() as u64);
    assert!(descriptors.len() < copies.len(), "{} descriptors for {} copies", descriptors.len(), copies.len());
    for name in ["source_offset", "source_stride", "target_offset", "target_stride"] {
        field(&descriptors[0], name);
    }
}

/// `plan --json --paged` (kvrelay-plan-3): read as README.md documents it, logical byte `l` of a table-addressed
/// side at `table[l / item_len] * item_len + l % item_len`, the descriptors move exactly the bytes of the copies,
/// in fewer entries than kvrelay-plan-2 on shuffled pages (KV pages, and paged state).
#[rstest::rstest]
#[case::kv_pages("scenarios/basic/kimi-k3-example-c.yaml")]
#[case::state_pages("scenarios/state/dsa-index-keys-tp2-to-tp4.yaml")]
fn plan_json_paged_descriptors_read_through_the_tables_move_the_copies_bytes(#[case] scenario: &str) {
    let parse = |args: &[&str]| -> serde_json::Value {
        let output = kvrelay(args);
        assert!(output.status.success(), "{}", text(&output.stderr));
        serde_json::from_slice(&output.stdout).unwrap()
    };
    let paged = parse(&["plan", scenario, "--json", "--paged"]);
    let copies = parse(&["plan", scenario, "--json", "--expand"]);
    let strided = parse(&["plan", scenario, "--json"]);
    assert_eq!(paged["schema"], "kvrelay-plan-3");
    let number = |value: &serde_json::Value| value.as_u64().unwrap_or_else(|| panic!("not a number: {value}"));
    let item_len = |side: &str, rank: &serde_json::Value, region: &serde_json::Value| {
        let regions = paged["regions"].as_array().unwrap();
        let found = regions.iter().find(|it| it["side"] == side && it["rank"] == *rank && it["region"] == *region);
        number(&found.unwrap()["item_len"])
    };
    // (source rank, source region, target rank, target region) -> (source byte, target byte, length), coalesced.
    let mut moved: Vec<(String, u64, u64, u64)> = Vec::new();
    for descriptor in paged["descriptors"].as_array().unwrap() {
        let table = |side: &str, name: &str| -> Option<(Vec<u64>, u64)> {
            let name = descriptor[name].as_str().unwrap();
            let tables = paged["tables"].as_array().unwrap();
            let request = tables.iter().find(|it| it["request"] == descriptor["request"]).unwrap();
            let listed = match name.split_once(':') {
                None if name == "physical" => return None,
                None => &request[format!("{side}_{name}")],
                Some((kind, component)) => &request[format!("{side}_{kind}")][component.parse::<usize>().unwrap()],
            };
            let rank = &descriptor[if side == "prefill" { "source" } else { "target" }];
            let region = &descriptor[if side == "prefill" { "source_region" } else { "target_region" }];
            Some((listed.as_array().unwrap().iter().map(number).collect(), item_len(side, rank, region)))
        };
        let (source_table, target_table) = (table("prefill", "source_table"), table("decode", "target_table"));
        let physical = |table: &Option<(Vec<u64>, u64)>, at: u64| match table {
            Some((items, len)) => items[(at / len) as usize] * len + at % len,
            None => at,
        };
        let key = format!(
            "{} {} {} {}",
            descriptor["source"],
            descriptor["source_region"]["index"],
            descriptor["target"],
            descriptor["target_region"]["index"]
        );
        let room =
            |table: &Option<(Vec<u64>, u64)>, at: u64| table.as_ref().map_or(u64::MAX, |(_, len)| len - at % len);
        let element_len = number(&descriptor["element_len"]);
        for k in 0..number(&descriptor["count"]) {
            let source = number(&descriptor["source_offset"]) + k * number(&descriptor["source_stride"]);
            let target = number(&descriptor["target_offset"]) + k * number(&descriptor["target_stride"]);
            // Cut where an item ends on either side: each part lies in one page on both.
            let mut done = 0;
            while done < element_len {
                let (from, to) = (source + done, target + done);
                let length = (element_len - done).min(room(&source_table, from)).min(room(&target_table, to));
                moved.push((key.clone(), physical(&source_table, from), physical(&target_table, to), length));
                done += length;
            }
        }
    }
    let expected = copies["copies"].as_array().unwrap().iter().map(|copy| {
        let key = format!(
            "{} {} {} {}",
            copy["source"], copy["source_region"]["index"], copy["target"], copy["target_region"]["index"]
        );
        (key, number(&copy["source_offset"]), number(&copy["target_offset"]), number(&copy["length"]))
    });
    let (moved, expected) = (coalesced(moved), coalesced(expected.collect()));
    assert!(moved == expected, "the paged descriptors move {} runs, the copies {}", moved.len(), expected.len());
    let (paged_count, strided_count) =
        (paged["descriptors"].as_array().unwrap().len(), strided["descriptors"].as_array().unwrap().len());
    assert!(paged_count < strided_count, "{paged_count} paged descriptors, {strided_count} strided");
}

/// Byte moves sorted, with runs that continue on both sides (same key) joined.
fn coalesced(mut moves: Vec<(String, u64, u64, u64)>) -> Vec<(String, u64, u64, u64)> {
    moves.sort();
    let mut out: Vec<(String, u64, u64, u64)> = Vec::new();
    for (key, source, target, length) in moves {
        match out.last_mut() {
            Some(last) if last.0 == key && last.1 + last.3 == source && last.2 + last.3 == target => last.3 += length,
            _ => out.push((key, source, target, length)),
        }
    }
    out
}

#[test]
fn plan_of_a_rejected_scenario_fails_with_the_domain_message() {
    let output = kvrelay(&["plan", "scenarios/rejections/dcp-2-to-8.yaml", "--json"]);
    assert!(!output.status.success());
    assert!(text(&output.stderr).contains("plan rejected: Unsupported PD DCP topology: 2 -> 8"));
}

/// Copies the small scenarios of `from` (the check below runs each of them twice).
fn copy_small(from: &Path, to: &Path, names: &[&str]) {
    std::fs::create_dir_all(to).unwrap();
    for name in names {
        std::fs::copy(from.join(name), to.join(name)).unwrap();
    }
}

/// `check` is the CI gate: a tampered golden file fails it, naming the scenario and giving a reproduce line.
#[test]
fn check_fails_on_a_golden_difference() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let temp = std::env::temp_dir().join(format!("kvrelay-check-{}", std::process::id()));
    let (scenarios, golden) = (temp.join("scenarios"), temp.join("golden"));
    let names = ["baseline-tp1-to-tp1.yaml", "mla-tp2-to-tp4.yaml", "mla-tp4-to-tp2.yaml"];
    copy_small(&root.join("scenarios/basic"), &scenarios, &names);
    // The golden names are relative to the scenarios dir, so basic__x becomes x for this flat copy.
    std::fs::create_dir_all(&golden).unwrap();
    for name in names {
        std::fs::copy(
            root.join(format!("golden/golden@basic__{name}.snap")),
            golden.join(format!("golden@{name}.snap")),
        )
        .unwrap();
    }
    let ok = kvrelay(&["check", scenarios.to_str().unwrap(), "--golden", golden.to_str().unwrap()]);
    assert!(ok.status.success(), "{}", text(&ok.stderr));
    assert!(text(&ok.stdout).contains("pass mla-tp4-to-tp2.yaml"));
    let target = golden.join("golden@mla-tp4-to-tp2.yaml.snap");
    // Any layout line will do (which rows hold what follows the seeded allocator): claim a row too many.
    let golden_text = std::fs::read_to_string(&target).unwrap();
    let line = golden_text.lines().find(|line| line.trim_start().starts_with("rows ")).unwrap();
    let tampered = golden_text.replacen(line, &line.replacen("rows ", "rows 0..0, ", 1), 1);
    assert_ne!(tampered, golden_text);
    std::fs::write(&target, tampered).unwrap();
    let bad = kvrelay(&["check", scenarios.to_str().unwrap(), "--golden", golden.to_str().unwrap()]);
    let stderr = text(&bad.stderr);
    std::fs::remove_dir_all(&temp).unwrap();
    assert!(!bad.status.success());
    assert!(stderr.contains("FAIL mla-tp4-to-tp2.yaml: layout differs"), "{stderr}");
    assert!(stderr.contains("reproduce: cargo run --release -- run"), "{stderr}");
}

/// `check` on one scenario file or one subdirectory of the corpus finds the golden files `check scenarios` uses
/// (they are named from the path under `scenarios/`), so a developer can re-check the one case they touched.
#[test]
fn check_on_one_file_or_subdirectory_finds_its_golden() {
    let file = kvrelay(&["check", "scenarios/basic/baseline-tp1-to-tp1.yaml"]);
    assert!(file.status.success(), "{}", text(&file.stderr));
    assert!(text(&file.stdout).contains("pass scenarios/basic/baseline-tp1-to-tp1.yaml"), "{}", text(&file.stdout));
    let dir = kvrelay(&["check", "scenarios/rejections"]);
    assert!(dir.status.success(), "{}", text(&dir.stderr));
    assert!(text(&dir.stdout).contains(" 0 failed"), "{}", text(&dir.stdout));
}

/// Same scenario and seed, byte-identical output; another seed moves the pages and still passes the oracle.
#[test]
fn run_output_is_deterministic_per_seed() {
    let first = kvrelay(&["run", "scenarios/basic/deepseek-v2-lite-dcp1-to-dcp2.yaml", "--seed", "11"]);
    let second = kvrelay(&["run", "scenarios/basic/deepseek-v2-lite-dcp1-to-dcp2.yaml", "--seed", "11"]);
    let other = kvrelay(&["run", "scenarios/basic/deepseek-v2-lite-dcp1-to-dcp2.yaml", "--seed", "12"]);
    assert!(first.status.success() && other.status.success(), "{}", text(&other.stderr));
    assert_eq!(first.stdout, second.stdout);
    assert_ne!(first.stdout, other.stdout, "a different seed must hand out different pages");
    assert!(text(&first.stdout).starts_with("seed: 11\n"));
}

/// `check` reads `.yml` as well as `.yaml`, never follows a symbolic link (two links to `.` used to walk about
/// 2^40 paths), and says what it skipped and why.
#[cfg(unix)]
#[test]
fn check_skips_links_and_reads_yml() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let temp = std::env::temp_dir().join(format!("kvrelay-links-{}", std::process::id()));
    let (scenarios, golden) = (temp.join("scenarios"), temp.join("golden"));
    copy_small(&root.join("scenarios/basic"), &scenarios, &["baseline-tp1-to-tp1.yaml"]);
    std::fs::rename(scenarios.join("baseline-tp1-to-tp1.yaml"), scenarios.join("baseline.yml")).unwrap();
    std::fs::create_dir_all(&golden).unwrap();
    let snapshot = std::fs::read_to_string(root.join("golden/golden@basic__baseline-tp1-to-tp1.yaml.snap")).unwrap();
    let snapshot = snapshot.replace("scenario: baseline-tp1-to-tp1", "scenario: baseline");
    std::fs::write(golden.join("golden@baseline.yml.snap"), snapshot).unwrap();
    std::os::unix::fs::symlink(".", scenarios.join("loop-a")).unwrap();
    std::os::unix::fs::symlink(".", scenarios.join("loop-b")).unwrap();
    std::fs::write(scenarios.join("notes.txt"), "not a scenario").unwrap();
    let output = kvrelay(&["check", scenarios.to_str().unwrap(), "--golden", golden.to_str().unwrap()]);
    std::fs::remove_dir_all(&temp).unwrap();
    let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
    assert!(output.status.success(), "{stderr}");
    assert!(stdout.contains("pass baseline.yml") && stdout.contains("1 scenarios, 1 passed"), "{stdout}");
    for skipped in
        ["loop-a: a symbolic link (not followed)", "loop-b: a symbolic link", "notes.txt: not a .yaml or .yml"]
    {
        assert!(stderr.contains(skipped), "{stderr}");
    }
}

/// Writes `yaml` to a fresh temporary scenario file.
fn temp_scenario(name: &str, yaml: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("kvrelay-{name}-{}.yaml", std::process::id()));
    std::fs::write(&path, yaml).unwrap();
    path
}

/// The default simulated-memory budget is the machine's (half of its available memory), not a fixed 16 GiB: a
/// Kimi-K3 scenario needing terabytes fails before allocating, with the budget message, instead of aborting.
#[test]
fn default_budget_is_the_machines_and_refuses_before_allocating() {
    let path = temp_scenario(
        "huge",
        "# Kimi-K3 with 500 M tokens: about 14 TB of pools.\nmodel: {preset: kimi-k3}\nprefill: {page_size: 64}\ndecode: {page_size: 64}\nrequests: [{tokens: 500000000}]\nexpect: ok\n",
    );
    let output = Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(["run", path.to_str().unwrap()])
        .env_remove("KVRELAY_MAX_FABRIC_BYTES")
        .output()
        .unwrap();
    let stderr = text(&output.stderr);
    assert!(!output.status.success());
    assert!(stderr.contains("of simulated memory, more than the budget of"), "{stderr}");
    assert!(
        stderr.contains("bytes this machine has available") || stderr.contains("available memory unknown"),
        "{stderr}"
    );
    let bad = Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(["run", path.to_str().unwrap()])
        .env("KVRELAY_MAX_FABRIC_BYTES", "lots")
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(
        text(&bad.stderr).contains("KVRELAY_MAX_FABRIC_BYTES=\"lots\" is not a byte count"),
        "{}",
        text(&bad.stderr)
    );
}

#[test]
fn diff_reports_identical_images_on_the_live_driver() {
    let output = kvrelay(&["diff", "--fabric", "live-sim", "scenarios/basic/mla-tp2-to-tp4.yaml"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(stdout.contains("sim vs live-sim") && stdout.contains("  identical"), "{stdout}");
    assert!(stdout.contains("1 of 1 scenarios identical on both fabrics"), "{stdout}");
}

#[test]
fn run_on_the_live_driver_passes_and_names_the_fabric() {
    let output = kvrelay(&["run", "--fabric", "live-sim", "scenarios/basic/baseline-tp1-to-tp1.yaml"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(stdout.starts_with("fabric: live-sim") && stdout.contains("pass baseline-tp1-to-tp1"), "{stdout}");
}

#[test]
fn an_unknown_fabric_is_an_error_naming_the_choices() {
    let output = kvrelay(&["run", "--fabric", "tcp", "scenarios/basic/baseline-tp1-to-tp1.yaml"]);
    assert!(!output.status.success());
    assert!(
        text(&output.stderr).contains(
            "unknown fabric `tcp` (fix: sim, live-sim, rdma, nixl, cuda, plugin:PATH, child:COMMAND or mooncake)"
        ),
        "{}",
        text(&output.stderr)
    );
}

#[test]
fn ranks_as_processes_refuse_the_in_memory_fabric_with_the_reason() {
    let output = kvrelay(&[
        "launch",
        "--fabric",
        "live-sim",
        "--connect-timeout",
        "1",
        "scenarios/basic/baseline-tp1-to-tp1.yaml",
    ]);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    // Every child refuses before connecting; the launcher reports each decode rank without a verdict.
    assert!(stderr.contains("the in-memory fabric lives inside one process"), "{stderr}");
    assert!(text(&output.stdout).contains("decode 0: no verdict"), "{}", text(&output.stdout));
}

#[cfg(not(feature = "rdma"))]
#[test]
fn rdma_without_the_feature_says_how_to_build_it() {
    let output = kvrelay(&["run", "--fabric", "rdma", "scenarios/basic/baseline-tp1-to-tp1.yaml"]);
    assert!(!output.status.success());
    assert!(text(&output.stderr).contains("cargo build --release --features rdma"), "{}", text(&output.stderr));
}

#[test]
fn serve_refuses_a_rank_the_scenario_does_not_have() {
    let output = kvrelay(&[
        "serve",
        "--role",
        "decode",
        "--rank",
        "9",
        "--bootstrap",
        "127.0.0.1:1",
        "scenarios/basic/baseline-tp1-to-tp1.yaml",
    ]);
    assert!(!output.status.success());
    assert!(
        text(&output.stderr).contains("--rank 9: the scenario has 1 Decode ranks (fix: 0..1)"),
        "{}",
        text(&output.stderr)
    );
}

/// `kvrelay bench --scaling` prints a markdown table whose K3 token sweep plans more with more tokens (counts, not
/// timings): shuffled pages need more descriptors, contiguous pages never fewer, both more per-row copies; paged
/// descriptors stay as few on both, whatever the token count.
#[test]
fn bench_scaling_table_grows_with_tokens() {
    let output = kvrelay(&["bench", "--scaling", "--max-tokens", "16384", "--iterations", "1"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(
        stdout.starts_with(
            "| tokens | shape | plan ms | plan ms / 1K tokens | descr+lower ms | descriptors | paged ms | paged descriptors | per-row copies |"
        ),
        "{stdout}"
    );
    assert!(!stdout.contains("not planned"), "{stdout}");
    let rows: Vec<Vec<String>> = stdout
        .lines()
        .skip(2)
        .filter(|line| line.starts_with('|'))
        .map(|line| line.trim_matches('|').split('|').map(|cell| cell.trim().to_owned()).collect())
        .collect();
    for pages in ["contiguous", "shuffled"] {
        let sweep: Vec<(u64, u64, u64, u64)> = rows
            .iter()
            .filter(|row| row[1] == format!("K3 PP8/TP1->TP8/DCP8 {pages}"))
            .map(|row| {
                (row[0].parse().unwrap(), row[5].parse().unwrap(), row[8].parse().unwrap(), row[7].parse().unwrap())
            })
            .collect();
        // The DCP sweep repeats the shuffled TP8/DCP8 shape at the largest token count; keep one row per count.
        let mut sweep = sweep;
        sweep.dedup_by_key(|row| row.0);
        assert_eq!(sweep.iter().map(|row| row.0).collect::<Vec<_>>(), [4096, 16384], "{stdout}");
        let (small, large) = (sweep[0], sweep[1]);
        assert!(large.2 > small.2, "per-row copies must grow with tokens ({pages}): {stdout}");
        // One paged descriptor per decode rank and layer (8 x 24), page order and token count notwithstanding.
        assert_eq!((small.3, large.3), (192, 192), "paged descriptors ({pages}): {stdout}");
        if pages == "shuffled" {
            assert!(large.1 > small.1, "descriptors must grow with tokens on shuffled pages: {stdout}");
        } else {
            assert!(large.1 >= small.1, "descriptors must not shrink with tokens: {stdout}");
        }
    }
    // The DCP and TP sweeps are there, up to 64 decode ranks.
    assert!(stdout.contains("| K3 PP8/TP1->TP64/DCP64 shuffled |"), "{stdout}");
    assert!(stdout.contains("| Llama-3-70B TP8->TP64 shuffled |"), "{stdout}");
}

/// `kvrelay replay` runs a tiny load through the engines, verifies every byte and prints its report (lines, not
/// timings).
#[test]
fn replay_reports_a_verified_load() {
    let output = kvrelay(&["replay", "--requests", "2", "--tokens", "1024", "--concurrency", "2"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    for line in [
        "requests: 2\n",
        "input tokens: 2048\n",
        "seconds: ",
        "input tokens/s: ",
        "bytes moved: ",
        "bytes/s: ",
        "peak rss bytes: ",
        "latency ms (simulated completion of each request's rooms in its wave): p50 ",
        "failed requests: 0\n",
        "violations: 0\n",
    ] {
        assert!(stdout.contains(line), "no `{line}` in {stdout}");
    }
    // Its progress bar is for a terminal: a pipe gets the report alone.
    assert!(!text(&output.stderr).contains('\r'), "{}", text(&output.stderr));
}

/// Completions and the man page come from the clap definitions: every command is in both.
#[test]
fn completions_and_the_man_page_are_generated_from_the_commands() {
    for shell in ["bash", "zsh", "fish"] {
        let output = kvrelay(&["completions", shell]);
        assert!(output.status.success(), "{}", text(&output.stderr));
        let script = text(&output.stdout);
        for command in ["check", "serve", "merge", "selftest", "completions"] {
            assert!(script.contains(command), "{shell} completions lack {command}");
        }
    }
    let man = kvrelay(&["man"]);
    assert!(man.status.success(), "{}", text(&man.stderr));
    let page = text(&man.stdout);
    assert!(page.contains(".TH kvrelay 1"), "not a roff man page: {}", &page[..page.len().min(200)]);
    assert!(page.contains("kvrelay\\-merge") || page.contains("merge"), "the man page lacks merge");
    assert!(!kvrelay(&["completions", "tcsh"]).status.success(), "an unknown shell is refused");
}

/// A long command's progress bar is drawn only on a terminal: a pipe (a CI log) gets its report alone.
#[test]
fn progress_bars_stay_out_of_a_pipe() {
    let output = kvrelay(&["sim", "scenarios/engines", "--seeds", "2"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stderr = text(&output.stderr);
    assert!(!stderr.contains('\r') && !stderr.contains("[="), "a progress bar reached a pipe: {stderr:?}");
    assert!(text(&output.stdout).contains("harness failures: 0"));
}
