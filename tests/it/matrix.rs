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
