//! `kvrelay serve` with no per-rank arguments, placed by the launchers clusters run: a `torchrun`-style
//! environment (every machine) and Open MPI's real `mpirun` (where it is installed: `.ci/run` installs Debian's
//! `openmpi-bin`; elsewhere the test says `skipped:`). The ranks cross processes through the reference child
//! transport, so no RDMA device or engine wheel is needed.

use std::process::{Command, Output, Stdio};

use crate::support::text;

const SCENARIO: &str = "scenarios/engines/dcp-relayout-two-stages.yaml";
/// 2 prefill and 2 decode ranks.
const RANKS: u32 = 4;

fn fabric() -> String {
    format!("child:python3 {}/tests/transports/memcpy_engine.py", env!("CARGO_MANIFEST_DIR"))
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn serve(env: &[(&str, String)], extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_kvrelay"));
    command
        .args(["serve", SCENARIO, "--fabric", &fabric(), "--timeout", "30"])
        .args(extra)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("KVRELAY_SEED")
        .envs(env.iter().map(|(key, value)| (*key, value.as_str())))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn all(outputs: &[Output]) -> String {
    outputs.iter().map(|output| format!("{}{}", text(&output.stdout), text(&output.stderr))).collect()
}

#[test]
fn torchrun_style_ranks_find_their_place_and_rank_0_runs_the_hub() {
    let port = free_port().to_string();
    let children: Vec<_> = (0..RANKS)
        .map(|rank| {
            let env = [
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", RANKS.to_string()),
                ("MASTER_ADDR", "127.0.0.1".to_owned()),
                ("MASTER_PORT", port.clone()),
            ];
            serve(&env, &[]).spawn().unwrap()
        })
        .collect();
    let outputs: Vec<Output> = children.into_iter().map(|child| child.wait_with_output().unwrap()).collect();
    let out = all(&outputs);
    assert!(outputs.iter().all(|output| output.status.success()), "{out}");
    for (global, place) in [(0, "prefill 0"), (1, "prefill 1"), (2, "decode 0"), (3, "decode 1")] {
        assert!(out.contains(&format!("torchrun rank {global}: {place} (hub 127.0.0.1:{port})")), "{out}");
    }
    // Rank 0 ran the hub, every rank connected to it, and both decode ranks judged every request byte-exact.
    assert!(text(&outputs[0].stdout).contains("hub: 24 messages routed, 0 dropped"), "{out}");
    assert_eq!(out.matches(" connected").count(), RANKS as usize, "{out}");
    for decode in ["pp0/tp0", "pp0/tp1"] {
        assert!(out.contains(&format!("verdict decode {decode}: 2 requests, 2 succeeded, 0 violations")), "{out}");
    }
}

#[test]
fn a_launcher_world_that_does_not_match_the_scenario_is_refused_by_name() {
    let env = [("RANK", "0".to_owned()), ("WORLD_SIZE", "3".to_owned()), ("KVRELAY_HUB", "127.0.0.1:1".to_owned())];
    let output = serve(&env, &[]).output().unwrap();
    let out = all(std::slice::from_ref(&output));
    assert!(!output.status.success(), "{out}");
    assert!(out.contains("WORLD_SIZE=3 (torchrun), but the scenario has 2 prefill and 2 decode ranks"), "{out}");
    assert!(out.contains("fix: start 4 processes"), "{out}");
}

#[test]
fn mpirun_starts_a_scenario_with_no_per_rank_arguments() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "CI runs this test with mpirun: .ci/run installs openmpi-bin");
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"skipped: no mpirun here (Debian's openmpi-bin; .ci/run installs it)\n",
        );
        return;
    }
    let hub = format!("127.0.0.1:{}", free_port());
    let output = Command::new("mpirun")
        // Root in containers and CI, and more ranks than cores on a small machine.
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &RANKS.to_string(), "-x", "KVRELAY_HUB"])
        .arg(env!("CARGO_BIN_EXE_kvrelay"))
        .args(["serve", SCENARIO, "--fabric", &fabric(), "--timeout", "30"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("KVRELAY_HUB", &hub)
        .env_remove("KVRELAY_SEED")
        .output()
        .unwrap();
    let out = all(std::slice::from_ref(&output));
    assert!(output.status.success(), "{out}");
    for (global, place) in [(0, "prefill 0"), (3, "decode 1")] {
        assert!(out.contains(&format!("Open MPI rank {global}: {place} (hub {hub})")), "{out}");
    }
    for decode in ["pp0/tp0", "pp0/tp1"] {
        assert!(out.contains(&format!("verdict decode {decode}: 2 requests, 2 succeeded, 0 violations")), "{out}");
    }
}

/// `kvrelay sim --shard K/N --json` on every shard, `kvrelay merge`d: the unsharded swarm's totals exactly, and a
/// missing shard refused by name.
#[test]
fn a_sharded_swarm_merges_back_to_the_unsharded_one() {
    use crate::support::kvrelay;

    let temp = std::env::temp_dir().join(format!("kvrelay-shards-{}", std::process::id()));
    std::fs::create_dir_all(&temp).unwrap();
    let file = |name: &str| temp.join(name).display().to_string();
    let sim = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["sim", "scenarios/engines", "--seeds", "5"];
        args.extend_from_slice(extra);
        let output = crate::support::kvrelay_with_env(&args, env);
        assert!(output.status.success(), "{}{}", text(&output.stdout), text(&output.stderr));
    };
    sim(&["--json", &file("all.json")], &[]);
    for index in 1..=2 {
        sim(&["--shard", &format!("{index}/3"), "--json", &file(&format!("{index}.json"))], &[]);
    }
    // The third as the last task of a Slurm array 0-2 (`sbatch --array=0-2`).
    let slurm = [("SLURM_ARRAY_TASK_ID", "2"), ("SLURM_ARRAY_TASK_MIN", "0"), ("SLURM_ARRAY_TASK_MAX", "2")];
    sim(&["--shard", "slurm", "--json", &file("3.json")], &slurm);
    let merged = kvrelay(&["merge", &file("3.json"), &file("1.json"), &file("2.json"), "--json", &file("merged.json")]);
    assert!(merged.status.success(), "{}{}", text(&merged.stdout), text(&merged.stderr));
    let tally = |name: &str| {
        let value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file(name)).unwrap()).unwrap();
        value["tally"].clone()
    };
    assert!(tally("all.json")["runs"].as_u64().unwrap() > 0);
    assert_eq!(tally("merged.json"), tally("all.json"));
    // The shards split the runs: none is run twice, none left out.
    let runs: u64 = (1..=3).map(|index| tally(&format!("{index}.json"))["runs"].as_u64().unwrap()).sum();
    assert_eq!(Some(runs), tally("all.json")["runs"].as_u64());
    let missing = kvrelay(&["merge", &file("1.json"), &file("3.json")]);
    assert!(!missing.status.success());
    assert!(text(&missing.stderr).contains("shard(s) 2/3 missing"), "{}", text(&missing.stderr));
    let _ = std::fs::remove_dir_all(&temp);
}

/// `kvrelay check --shard K/N --json` over a directory, merged: every scenario's result, in the unsharded order.
#[test]
fn a_sharded_check_merges_back_to_the_unsharded_one() {
    use crate::support::kvrelay;

    let temp = std::env::temp_dir().join(format!("kvrelay-check-shards-{}", std::process::id()));
    std::fs::create_dir_all(&temp).unwrap();
    let file = |name: &str| temp.join(name).display().to_string();
    let check = |extra: &[&str]| {
        let mut args = vec!["check", "scenarios/basic"];
        args.extend_from_slice(extra);
        let output = kvrelay(&args);
        assert!(output.status.success(), "{}{}", text(&output.stdout), text(&output.stderr));
    };
    check(&["--json", &file("all.json")]);
    check(&["--shard", "1/2", "--json", &file("1.json")]);
    check(&["--shard", "2/2", "--json", &file("2.json")]);
    let merged = kvrelay(&["merge", &file("2.json"), &file("1.json"), "--json", &file("merged.json")]);
    assert!(merged.status.success(), "{}{}", text(&merged.stdout), text(&merged.stderr));
    let cases = |name: &str| {
        let value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(file(name)).unwrap()).unwrap();
        value["cases"].clone()
    };
    assert!(cases("all.json").as_array().is_some_and(|all| all.len() > 2));
    assert_eq!(cases("merged.json"), cases("all.json"));
    let _ = std::fs::remove_dir_all(&temp);
}

/// `kvrelay selftest --shard K/N --json`, merged: the unsharded run's table, matrix and verdict line for line.
#[test]
fn a_sharded_selftest_merges_back_to_the_unsharded_one() {
    use crate::support::kvrelay;

    let temp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("selftest-shards");
    std::fs::create_dir_all(&temp).unwrap();
    let file = |name: &str| temp.join(name).display().to_string();
    let selftest = |extra: &[&str]| {
        let mut args =
            vec!["selftest", "scenarios/state", "--mutant", "state-block-wrong-rank", "--mutant", "flat-conv-split"];
        args.extend_from_slice(extra);
        let output = kvrelay(&args);
        assert!(output.status.success(), "{}{}", text(&output.stdout), text(&output.stderr));
        text(&output.stdout)
    };
    let all = selftest(&["--json", &file("all.json")]);
    selftest(&["--shard", "1/2", "--json", &file("1.json")]);
    selftest(&["--shard", "2/2", "--json", &file("2.json")]);
    let merged = kvrelay(&["merge", &file("2.json"), &file("1.json"), "--json", &file("merged.json")]);
    assert!(merged.status.success(), "{}{}", text(&merged.stdout), text(&merged.stderr));
    // The unsharded run's first line names the directory; everything after it is the table, matrix and verdict.
    let body = all.split_once('\n').unwrap().1;
    assert_eq!(text(&merged.stdout), body);
    assert!(body.contains("selftest passed"), "{body}");
    let json = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(file(name)).unwrap()).unwrap()
    };
    assert_eq!(json("merged.json"), json("all.json"));
}
