//! `kvrelay matrix`: the README's table is what the command prints today, and the table holds every kind of verdict.

use crate::support::{kvrelay, text};

#[test]
fn the_readme_matrix_is_current() {
    let output = kvrelay(&["matrix"]);
    assert!(output.status.success(), "{}{}", text(&output.stdout), text(&output.stderr));
    let table = text(&output.stdout);
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let embedded = kvrelay::matrix::embedded(&readme).expect("README.md has the matrix markers");
    assert!(
        embedded == table,
        "README.md's matrix is stale: run `cargo run --release -- matrix --update README.md`\n--- now ---\n{table}"
    );
    for mark in ["✓", "✗[", "–["] {
        assert!(table.contains(mark), "no `{mark}` cell in the matrix");
    }
    assert!(table.contains(" 0 failed"), "{table}");
}

#[test]
fn every_cell_has_its_own_name_and_a_scenario_that_loads_or_says_why_not() {
    let cells = kvrelay::matrix::cells();
    let mut ids: Vec<String> = cells.iter().map(|cell| cell.id()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), cells.len(), "two cells share a name");
    let loaded =
        cells.iter().filter(|cell| kvrelay::scenario::parse(&cell.yaml("ok"), "<matrix>", &cell.id()).is_ok()).count();
    // Only the DCP2 columns of a TP1 decode are no deployment: 2 TP changes x 2 PP x 2 peers x 5 families.
    assert_eq!(cells.len() - loaded, 40);
}

/// `kvrelay matrix --shard K/N --json` on every shard, merged: the unsharded table and JSON exactly.
#[test]
fn a_sharded_matrix_merges_back_to_the_unsharded_one() {
    let temp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("matrix-shards");
    std::fs::create_dir_all(&temp).unwrap();
    let file = |name: &str| temp.join(name).display().to_string();
    let all = kvrelay(&["matrix", "--json", &file("all.json")]);
    assert!(all.status.success(), "{}", text(&all.stderr));
    for index in 1..=2 {
        let shard = kvrelay(&["matrix", "--shard", &format!("{index}/2"), "--json", &file(&format!("{index}.json"))]);
        assert!(shard.status.success(), "{}", text(&shard.stderr));
    }
    let merged = kvrelay(&["merge", &file("2.json"), &file("1.json"), "--json", &file("merged.json")]);
    assert!(merged.status.success(), "{}", text(&merged.stderr));
    assert_eq!(text(&merged.stdout), text(&all.stdout), "the merged table is the unsharded one");
    let json = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(file(name)).unwrap()).unwrap()
    };
    assert_eq!(json("merged.json"), json("all.json"));
    let missing = kvrelay(&["merge", &file("1.json")]);
    assert!(!missing.status.success() && text(&missing.stderr).contains("2/2 missing"), "{}", text(&missing.stderr));
}
