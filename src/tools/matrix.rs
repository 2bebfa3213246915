//! The compatibility matrix (`kvrelay matrix`): scenarios generated over the axes model family × TP change × prefill
//! PP × decode DCP × peer version, each classified as supported (the bytes moved and every one verified),
//! rejected with kvrelay's reason, impossible (a topology no deployment can start) or failed, and, with another
//! planner in the seat (SGLang's helpers through `tests/planners/sglang/adapter.py`), whether it agrees. Pure: the
//! CLI runs the cells; this module names them, writes their scenarios and renders the tables.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::render::markup_escape as escape;

/// A model family: its name in the table, its state kinds and the scenario's `model` mapping (4 layers, small).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Family {
    pub name: &'static str,
    pub state: &'static str,
    pub model: &'static str,
}

/// The families, one per pool kind kvrelay models.
pub const FAMILIES: [Family; 5] = [
    Family { name: "DeepSeek-V2-Lite", state: "MLA", model: "{preset: deepseek-v2-lite, layers: 4}" },
    Family { name: "Llama-3-8B", state: "GQA", model: "{preset: llama-3-8b, layers: 4}" },
    Family { name: "Qwen3-Next", state: "GQA + GDN", model: "{preset: qwen3-next, layers: 4, kv_layers: [3]}" },
    Family { name: "Kimi-Linear", state: "MLA + KDA", model: "{preset: kimi-linear, layers: 4, kv_layers: [3]}" },
    Family { name: "DeepSeek-V3.2", state: "MLA + DSA", model: "{preset: deepseek-v3.2, layers: 4}" },
];

/// (prefill TP, decode TP).
pub const TP_CHANGES: [(u32, u32); 6] = [(1, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2)];

/// One point of the axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cell {
    pub family: usize,
    pub tp: (u32, u32),
    /// Prefill PP size (decode PP 1).
    pub pp: u32,
    /// Decode DCP size (prefill DCP 1).
    pub dcp: u32,
    /// An older peer: decode registers the legacy frames (no DCP size or rank, no layer ids) and neither side
    /// advertises layer ids.
    pub legacy: bool,
}

/// Every cell, in table order (row: family, TP change; column: peer version, PP, DCP).
pub fn cells() -> Vec<Cell> {
    let mut cells = Vec::new();
    for family in 0..FAMILIES.len() {
        for tp in TP_CHANGES {
            for legacy in [false, true] {
                for pp in [1, 2] {
                    for dcp in [1, 2] {
                        cells.push(Cell { family, tp, pp, dcp, legacy });
                    }
                }
            }
        }
    }
    cells
}

impl Cell {
    /// `deepseek-v2-lite-tp2-pp2-to-tp4-dcp2-legacy`.
    pub fn id(&self) -> String {
        let family = FAMILIES[self.family].name.to_lowercase();
        let pp = if self.pp > 1 { format!("-pp{}", self.pp) } else { String::new() };
        let dcp = if self.dcp > 1 { format!("-dcp{}", self.dcp) } else { String::new() };
        let legacy = if self.legacy { "-legacy" } else { "" };
        format!("{family}-tp{}{pp}-to-tp{}{dcp}{legacy}", self.tp.0, self.tp.1)
    }

    /// The cell's scenario file, expecting `expect` (`ok`, or `{error: kind}`).
    pub fn yaml(&self, expect: &str) -> String {
        let family = FAMILIES[self.family];
        let (prefill_ids, registration) =
            if self.legacy { (", layer_ids: false", ", registration: legacy") } else { ("", "") };
        let dcp = if self.dcp > 1 { format!(", dcp: {}", self.dcp) } else { String::new() };
        format!(
            "# kvrelay matrix cell {id}: {name} ({state}), prefill TP{ptp} PP{pp} -> decode TP{dtp} DCP{dcp_size}{peer}\n\
             name: {id}\n\
             model: {model}\n\
             prefill: {{tp: {ptp}, pp: {pp}, page_size: 16{prefill_ids}}}\n\
             decode: {{tp: {dtp}, page_size: 16{dcp}{registration}}}\n\
             requests:\n  - {{tokens: 100, chunks: [64, 36]}}\n  - {{tokens: 37}}\n\
             expect: {expect}\n",
            id = self.id(),
            name = family.name,
            state = family.state,
            model = family.model,
            ptp = self.tp.0,
            dtp = self.tp.1,
            pp = self.pp,
            dcp_size = self.dcp,
            peer = if self.legacy { ", legacy peer" } else { "" },
        )
    }

    fn column(&self) -> usize {
        usize::from(self.legacy) * 4 + (self.pp as usize - 1) * 2 + (self.dcp as usize - 1)
    }
}

/// What kvrelay does with a cell.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// Planned, moved through the engines and every decode byte verified.
    Supported,
    /// Refused by kvrelay's rules before any write, with the error kind and message.
    Rejected { kind: String, message: String },
    /// The scenario describes no deployment (e.g. a DCP size that does not divide TP).
    Impossible { why: String },
    /// kvrelay planned it but the run failed: a bug in kvrelay.
    Failed { why: String },
}

/// Whether another planner in the seat agrees with kvrelay on a cell.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "upstream", rename_all = "snake_case")]
pub enum Upstream {
    Same,
    Differs { why: String },
}

/// One cell's result.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CellResult {
    pub id: String,
    #[serde(flatten)]
    pub verdict: Verdict,
    #[serde(flatten)]
    pub upstream: Option<Upstream>,
}

const COLUMNS: [&str; 8] =
    ["PP1", "PP1 DCP2", "PP2", "PP2 DCP2", "legacy PP1", "legacy PP1 DCP2", "legacy PP2", "legacy PP2 DCP2"];

/// Footnotes: one per rejection kind, impossibility, failure and upstream difference, numbered in order of first use.
#[derive(Default)]
struct Notes {
    keys: BTreeMap<String, usize>,
    texts: Vec<String>,
}

impl Notes {
    fn note(&mut self, key: String, text: impl FnOnce() -> String) -> usize {
        let next = self.texts.len() + 1;
        *self.keys.entry(key).or_insert_with(|| {
            self.texts.push(text());
            next
        })
    }
}

/// The text of one table cell and its notes.
fn cell_text(cell: &Cell, result: &CellResult, notes: &mut Notes) -> String {
    let mut text = match &result.verdict {
        Verdict::Supported => "✓".to_owned(),
        Verdict::Rejected { kind, message } => {
            let note = notes.note(format!("rejected {kind}"), || {
                format!("rejected, `{kind}`: {} (first: `{}`)", one_line(message), cell.id())
            });
            format!("✗[{note}]")
        }
        Verdict::Impossible { why } => {
            let note = notes.note(format!("impossible {why}"), || format!("no such deployment: {}", one_line(why)));
            format!("–[{note}]")
        }
        Verdict::Failed { why } => {
            let note = notes
                .note(format!("failed {}", cell.id()), || format!("kvrelay FAILED `{}`: {}", cell.id(), one_line(why)));
            format!("FAIL[{note}]")
        }
    };
    if let Some(Upstream::Differs { why }) = &result.upstream {
        let note = notes.note(format!("differs {}", one_line(why)), || {
            format!("the planner in the seat differs (first: `{}`): {}", cell.id(), one_line(why))
        });
        text.push_str(&format!(" ≠[{note}]"));
    }
    text
}

fn one_line(text: &str) -> String {
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.chars().count() > 240 {
        format!("{}...", line.chars().take(240).collect::<String>())
    } else {
        line
    }
}

/// The matrix as a markdown table and its notes (`results` in [`cells`] order, one per cell).
pub fn markdown(results: &[(Cell, CellResult)], planner: Option<&str>) -> String {
    let mut notes = Notes::default();
    let mut out = String::new();
    let _ = writeln!(out, "| model | state | TP | {} |", COLUMNS.join(" | "));
    let _ = writeln!(out, "|---|---|---|{}", "---|".repeat(COLUMNS.len()));
    let mut rows: BTreeMap<(usize, usize), Vec<String>> = BTreeMap::new();
    for (cell, result) in results {
        let tp = TP_CHANGES.iter().position(|tp| *tp == cell.tp).unwrap_or(0);
        let row = rows.entry((cell.family, tp)).or_insert_with(|| vec![String::new(); COLUMNS.len()]);
        row[cell.column()] = cell_text(cell, result, &mut notes);
    }
    for ((family, tp), columns) in rows {
        let (from, to) = TP_CHANGES[tp];
        let family = FAMILIES[family];
        let _ = writeln!(out, "| {} | {} | {from} → {to} | {} |", family.name, family.state, columns.join(" | "));
    }
    let supported = results.iter().filter(|(_, result)| result.verdict == Verdict::Supported).count();
    let rejected = results.iter().filter(|(_, result)| matches!(result.verdict, Verdict::Rejected { .. })).count();
    let _ = writeln!(
        out,
        "\n{} cells: {supported} supported (✓: moved and every byte verified), {rejected} rejected with a reason (✗), {} \
         no deployment (–), {} failed{}.\n",
        results.len(),
        results.iter().filter(|(_, result)| matches!(result.verdict, Verdict::Impossible { .. })).count(),
        results.iter().filter(|(_, result)| matches!(result.verdict, Verdict::Failed { .. })).count(),
        match planner {
            Some(planner) => format!(
                "; {} where `{planner}` in the planner's seat differs (≠)",
                results.iter().filter(|(_, result)| matches!(result.upstream, Some(Upstream::Differs { .. }))).count()
            ),
            None => String::new(),
        }
    );
    for (index, text) in notes.texts.iter().enumerate() {
        let _ = writeln!(out, "{}. {text}", index + 1);
    }
    out
}

/// The matrix as one self-contained HTML page: one line per cell with its whole verdict (and the seat's) in words.
pub fn html(results: &[(Cell, CellResult)], planner: Option<&str>) -> String {
    let mut body = String::from("<h1>kvrelay compatibility matrix</h1><table><tr><th>cell</th><th>kvrelay</th>");
    if planner.is_some() {
        body.push_str("<th>planner in the seat</th>");
    }
    body.push_str("</tr>");
    for (cell, result) in results {
        let (verdict, colour) = match &result.verdict {
            Verdict::Supported => ("supported".to_owned(), crate::report::PASS),
            Verdict::Rejected { kind, message } => (format!("rejected ({kind}): {message}"), "#9a6700"),
            Verdict::Impossible { why } => (format!("no such deployment: {why}"), "#57606a"),
            Verdict::Failed { why } => (format!("FAILED: {why}"), crate::report::FAIL),
        };
        let _ = write!(
            body,
            "<tr><td><code>{}</code></td><td style=\"color:{colour}\">{}</td>",
            escape(&cell.id()),
            escape(&verdict)
        );
        if planner.is_some() {
            let upstream = match &result.upstream {
                Some(Upstream::Same) | None => "same".to_owned(),
                Some(Upstream::Differs { why }) => format!("differs: {why}"),
            };
            let _ = write!(body, "<td>{}</td>", escape(&upstream));
        }
        body.push_str("</tr>");
    }
    body.push_str("</table>");
    crate::report::document("kvrelay matrix", &body, "")
}

/// Where the README holds the generated table.
pub const BEGIN: &str = "<!-- kvrelay matrix: begin (cargo run --release -- matrix --update README.md) -->";
pub const END: &str = "<!-- kvrelay matrix: end -->";

/// The byte range between the end of [`BEGIN`] and the start of [`END`] in `text`.
fn block(text: &str) -> Option<(usize, usize)> {
    let start = text.find(BEGIN)? + BEGIN.len();
    Some((start, start + text[start..].find(END)?))
}

/// `text` with the block between [`BEGIN`] and [`END`] replaced by `table`; `None` when the markers are missing.
pub fn splice(text: &str, table: &str) -> Option<String> {
    let (start, end) = block(text)?;
    Some(format!("{}\n{}{}", &text[..start], table, &text[end..]))
}

/// The block between the markers, as [`splice`] writes it.
pub fn embedded(text: &str) -> Option<&str> {
    let (start, end) = block(text)?;
    Some(text[start..end].strip_prefix('\n').unwrap_or(&text[start..end]))
}
