//! Stable text renderings: golden layouts, plan statistics, violations. Pure; no wall time, no addresses.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::harness::Outcome;
use crate::model::{Problem, RankId, Side};
use crate::plan::Plan;
use crate::scenario::{Expectation, Scenario};
use crate::verify::{Content, Observation, RegionKey, Sources, Violation};

/// Violations shown in a rendering; the rest are counted.
const VIOLATIONS_SHOWN: usize = 40;

/// The golden text of a scenario run: [`golden_header`] then the decode layout.
pub fn golden(scenario: &Scenario, outcome: &Outcome) -> String {
    let mut out = golden_header(scenario, outcome);
    out.push_str(&layout(&scenario.problem, &outcome.observation, None));
    out
}

/// Verdict, plan statistics, decisions and violations of a run.
pub fn golden_header(scenario: &Scenario, outcome: &Outcome) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "scenario: {}", scenario.name);
    match &scenario.expect {
        Expectation::Ok => out.push_str("expect: ok\n"),
        Expectation::Error(message) => {
            let _ = writeln!(out, "expect: error: {message}");
        }
    }
    if outcome.passed() {
        out.push_str("verdict: pass\n");
    } else {
        let _ = writeln!(out, "verdict: FAIL: {}", outcome.failures.join("; "));
    }
    match &outcome.plan {
        Ok(plan) => out.push_str(&plan_summary(plan)),
        Err(error) => {
            let _ = writeln!(out, "plan: rejected before any write: {error}");
        }
    }
    out.push_str(&violations(&outcome.violations));
    out
}

/// Golden file of the scenario at `relative` (path under scenarios/), as insta's `glob!` names it.
pub fn golden_file_name(relative: &Path) -> String {
    let relative = relative.to_string_lossy().replace(['/', '\\'], "__");
    format!("golden@{relative}.snap")
}

/// The body of an insta snapshot file (everything after the `---` metadata header).
pub fn snapshot_body(text: &str) -> String {
    let mut parts = text.splitn(3, "---\n");
    match (parts.next(), parts.next(), parts.next()) {
        (Some(""), Some(_header), Some(body)) => body.to_owned(),
        _ => text.to_owned(),
    }
}

/// A short line diff: the first differing lines of `expected` and `actual`, with line numbers.
pub fn diff(expected: &str, actual: &str) -> String {
    let mut out = String::new();
    let mut shown = 0;
    let expected: Vec<&str> = expected.lines().collect();
    let actual: Vec<&str> = actual.lines().collect();
    for index in 0..expected.len().max(actual.len()) {
        let (want, got) = (expected.get(index), actual.get(index));
        if want == got {
            continue;
        }
        let _ = writeln!(
            out,
            "  line {}:\n    golden: {}\n    actual: {}",
            index + 1,
            want.unwrap_or(&"<none>"),
            got.unwrap_or(&"<none>")
        );
        shown += 1;
        if shown == 10 {
            out.push_str("  ...\n");
            break;
        }
    }
    out
}

/// Streams the plan as one JSON document (schema in README.md): regions, then every copy in canonical order.
pub fn plan_json(problem: &Problem, plan: &Plan, out: &mut impl std::io::Write) -> std::io::Result<()> {
    let rank = |side: Side, rank: RankId| {
        let topology = match side {
            Side::Prefill => &problem.prefill.topology,
            Side::Decode => &problem.decode.topology,
        };
        serde_json::json!({"pp": rank.pp, "tp": rank.tp, "dcp": topology.dcp_rank(rank.tp)})
    };
    let region = |side: Side, owner: RankId, index: u32| {
        let layout = match side {
            Side::Prefill => problem.prefill.rank(owner),
            Side::Decode => problem.decode.rank(owner),
        };
        let region = &layout.regions[index as usize];
        serde_json::json!({"index": index, "kind": region.kind.to_string(), "layer": region.layer})
    };
    writeln!(out, "{{\"scenario\": {},", serde_json::Value::from(problem.name.clone()))?;
    writeln!(out, "\"regions\": [")?;
    let mut first = true;
    for side_layout in [&problem.prefill, &problem.decode] {
        for layout in &side_layout.ranks {
            for (index, item) in layout.regions.iter().enumerate() {
                let value = serde_json::json!({
                    "side": side_layout.side.to_string(),
                    "rank": rank(side_layout.side, layout.rank),
                    "region": region(side_layout.side, layout.rank, index as u32),
                    "item_len": item.item_len,
                    "token_len": item.token_len(),
                    "page_count": item.page_count,
                    "len": item.len_bytes(),
                });
                write!(out, "{}{value}", if first { "  " } else { ",\n  " })?;
                first = false;
            }
        }
    }
    writeln!(out, "\n],")?;
    writeln!(out, "\"copies\": [")?;
    let mut first = true;
    for copy in plan.copies() {
        let value = serde_json::json!({
            "request": copy.request,
            "chunk": copy.chunk,
            "source": rank(Side::Prefill, copy.source),
            "source_region": region(Side::Prefill, copy.source, copy.source_region),
            "source_offset": copy.source_offset,
            "target": rank(Side::Decode, copy.target),
            "target_region": region(Side::Decode, copy.target, copy.target_region),
            "target_offset": copy.target_offset,
            "length": copy.length,
        });
        write!(out, "{}{value}", if first { "  " } else { ",\n  " })?;
        first = false;
    }
    writeln!(out, "\n]}}")
}

/// Copy and byte totals, per (prefill rank, decode rank) pair, and the planner's decisions.
pub fn plan_summary(plan: &Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "plan: {} copies, {} bytes, {} transfer groups",
        plan.copy_count(),
        plan.bytes_total(),
        plan.groups.len()
    );
    out.push_str("explain:\n");
    for decision in &plan.explain {
        let _ = writeln!(out, "  - {decision}");
    }
    let mut pairs: BTreeMap<(RankId, RankId), (u64, u64)> = BTreeMap::new();
    for copy in plan.copies() {
        let entry = pairs.entry((copy.source, copy.target)).or_default();
        entry.0 += 1;
        entry.1 += copy.length;
    }
    out.push_str("per rank pair:\n");
    for ((source, target), (copies, bytes)) in pairs {
        let _ = writeln!(out, "  prefill {source} -> decode {target}: {copies} copies, {bytes} bytes");
    }
    out
}

/// The first violations, one per line, and how many more there are.
pub fn violations(violations: &[Violation]) -> String {
    let mut out = String::new();
    if violations.is_empty() {
        return out;
    }
    let _ = writeln!(out, "violations: {}", violations.len());
    for violation in violations.iter().take(VIOLATIONS_SHOWN) {
        let _ = writeln!(out, "  {violation}");
    }
    if violations.len() > VIOLATIONS_SHOWN {
        let _ = writeln!(out, "  ... and {} more", violations.len() - VIOLATIONS_SHOWN);
    }
    out
}

/// What landed where on each decode rank (or only `only`), run-length encoded, decoded from the bytes.
pub fn layout(problem: &Problem, observation: &Observation, only: Option<RankId>) -> String {
    let sources = Sources::new(problem);
    let mut out = String::from("layout:\n");
    for rank_layout in &problem.decode.ranks {
        let rank = rank_layout.rank;
        if only.is_some_and(|only| only != rank) {
            continue;
        }
        let _ = writeln!(out, "decode {rank} (dcp rank {}):", problem.decode.topology.dcp_rank(rank.tp));
        let mut untouched = 0;
        for (index, region) in rank_layout.regions.iter().enumerate() {
            let key = RegionKey { side: Side::Decode, rank, region: index as u32 };
            let Some(bytes) = observation.images.get(&key) else {
                continue;
            };
            let row_len = region.token_len();
            let segments = segments((0..region.row_count()).map(|row| {
                let offset = row * row_len;
                sources.classify(offset, &bytes[offset as usize..(offset + row_len) as usize])
            }));
            if segments.is_empty() {
                untouched += 1;
                continue;
            }
            let _ = writeln!(out, "  layer {}:", region.layer);
            for segment in segments {
                let _ = writeln!(out, "    {}", segment.render(region.layer));
            }
        }
        if untouched > 0 {
            let _ = writeln!(out, "  {untouched} of {} regions untouched", rank_layout.regions.len());
        }
    }
    out
}

/// A run of consecutive decode rows whose contents advance by a constant step.
struct Segment {
    first_row: u64,
    rows: u64,
    first: Content,
    step: i64,
}

/// The coordinate of a content that advances along a segment, and the key that must stay equal.
fn progression(content: &Content) -> Option<(i64, (u8, u32, RankId, u32))> {
    match *content {
        Content::Token { request, position, source, layer } => Some((i64::from(position), (0, request, source, layer))),
        Content::Slot { source, layer, row } => Some((row as i64, (1, 0, source, layer))),
        Content::Garbled { .. } => Some((0, (2, 0, RankId { pp: 0, tp: 0 }, 0))),
        Content::Sentinel => None,
    }
}

fn segments(rows: impl Iterator<Item = Content>) -> Vec<Segment> {
    let mut res: Vec<Segment> = Vec::new();
    let mut last: Option<(u64, i64)> = None;
    for (row, content) in rows.enumerate() {
        let row = row as u64;
        let Some((value, key)) = progression(&content) else {
            last = None;
            continue;
        };
        if let (Some(segment), Some((last_row, last_value))) = (res.last_mut(), last) {
            let same_key = progression(&segment.first).map(|it| it.1) == Some(key);
            let step = value - last_value;
            let fits = segment.rows == 1 || step == segment.step;
            if last_row + 1 == row && same_key && fits {
                if segment.rows == 1 {
                    segment.step = step;
                }
                segment.rows += 1;
                last = Some((row, value));
                continue;
            }
        }
        res.push(Segment { first_row: row, rows: 1, first: content, step: 0 });
        last = Some((row, value));
    }
    res
}

impl Segment {
    fn render(&self, target_layer: u32) -> String {
        let rows = if self.rows == 1 {
            format!("row {}", self.first_row)
        } else {
            format!("rows {}..{}", self.first_row, self.first_row + self.rows - 1)
        };
        let span = |first: i64, noun: &str| {
            if self.rows == 1 {
                format!("{noun} {first}")
            } else {
                let last = first + self.step * (self.rows as i64 - 1);
                let step = if self.step == 1 { String::new() } else { format!(" step {}", self.step) };
                format!("{noun}s {first}..{last}{step}")
            }
        };
        let from = |source: RankId, layer: u32| {
            if layer == target_layer {
                format!("from prefill {source}")
            } else {
                format!("from prefill {source} layer {layer}")
            }
        };
        match self.first {
            Content::Token { request, position, source, layer } => {
                format!("{rows} <- request {request} {} {}", span(i64::from(position), "position"), from(source, layer))
            }
            Content::Slot { source, layer, row } => {
                format!("{rows} <- unused {} {}", span(row as i64, "slot row"), from(source, layer))
            }
            Content::Garbled { .. } => format!("{rows} <- GARBLED bytes"),
            Content::Sentinel => unreachable!("sentinel rows are never in a segment"),
        }
    }
}
