//! Stable text renderings: golden layouts, plan statistics, violations. Pure; no wall time, no addresses.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::harness::Outcome;
use crate::model::{Problem, RankId, Region, RegionKind, Side, TensorShape};
use crate::plan::paged::PagedDescriptor;
use crate::plan::{Plan, TransferKind};
use crate::scenario::{Expectation, Scenario};
use crate::verify::{item_noun, tensor_name, Described, Observation, Origin, RegionKey, Run, Sources, Violation};
use crate::wire::KvPoll;

/// Violations shown in a rendering; the rest are counted.
const VIOLATIONS_SHOWN: usize = 40;

/// The golden text of a scenario run: [`golden_header`] then the decode layout.
pub fn golden(scenario: &Scenario, outcome: &Outcome) -> String {
    let mut out = golden_header(scenario, outcome);
    if scenario.events {
        out.push_str(&events(outcome));
    }
    out.push_str(&layout(&scenario.problem, &outcome.observation, None));
    out
}

/// What a scenario expects: `ok`, `error: <kind>`, or the rooms a partial rejection fails.
pub fn expectation(expect: &Expectation) -> String {
    match expect {
        Expectation::Ok => "ok".to_owned(),
        Expectation::Error(expected) => format!("error: {expected}"),
        Expectation::Partial { error, ranks, requests } => {
            let list = |ids: &Option<Vec<u32>>| ids.as_ref().map_or("all".to_owned(), |ids| format!("{ids:?}"));
            format!("error on decode ranks {}, requests {}: {error}", list(ranks), list(requests))
        }
    }
}

/// Verdict, plan statistics, decisions and violations of a run.
pub fn golden_header(scenario: &Scenario, outcome: &Outcome) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "scenario: {}", scenario.name);
    let _ = writeln!(out, "expect: {}", expectation(&scenario.expect));
    if outcome.passed() {
        out.push_str("verdict: pass\n");
    } else {
        let _ = writeln!(out, "verdict: FAIL: {}", outcome.failure_text("; "));
    }
    match &outcome.plan {
        Ok(plan) => out.push_str(&plan_summary(plan)),
        Err(error) if matches!(scenario.expect, Expectation::Partial { .. }) => {
            let _ = writeln!(out, "plan: rejected in part, the engines serve the rest: {error}");
        }
        Err(error) => {
            let _ = writeln!(out, "plan: rejected before any write: {error}");
        }
    }
    out.push_str(&violations(&outcome.violations));
    out
}

/// The engines' story of a run: control messages by kind, and how each request ended on each decode rank, with
/// its simulated time (deterministic).
pub fn events(outcome: &Outcome) -> String {
    let Some(run) = &outcome.engine else { return "events: none, the simulated fabric failed\n".to_owned() };
    let counts: Vec<String> = run.messages.iter().map(|(kind, count)| format!("{count} {kind}")).collect();
    let mut out = format!("events: {} control messages ({})\n", run.messages.values().sum::<u64>(), counts.join(", "));
    if !run.faults.is_empty() {
        let faults: Vec<String> = run.faults.iter().map(|(kind, count)| format!("{count} {kind}")).collect();
        let _ = writeln!(out, "faults injected: {}", faults.join(", "));
    }
    for (rank, rooms) in &run.rooms {
        for (id, room) in rooms {
            let ended = match (&room.reason, room.poll) {
                (Some(reason), _) => format!("Failed: {reason}"),
                (None, poll) => format!("{poll:?}"),
            };
            let at = room.ended_ns.map_or(String::new(), |ns| format!(" at {:.3} us", ns as f64 / 1e3));
            let _ = writeln!(out, "  decode {rank}: request {id} {ended}{at}");
        }
    }
    for (rank, rooms) in &run.prefill_rooms {
        for (id, (poll, reason)) in rooms.iter().filter(|(_, (poll, _))| *poll != Some(KvPoll::Success)) {
            let ended = match (reason, poll) {
                (Some(reason), _) => format!("Failed: {reason}"),
                (None, Some(poll)) => format!("{poll:?}"),
                (None, None) => "never ready".to_owned(),
            };
            let _ = writeln!(out, "  prefill {rank}: request {id} {ended}");
        }
    }
    let premature = crate::harness::premature_successes(run);
    if !premature.is_empty() {
        let rooms: Vec<String> = premature.iter().map(|(rank, id)| format!("decode {rank} request {id}")).collect();
        let _ = writeln!(out, "Success before its bytes landed: {}", rooms.join(", "));
    }
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

/// Which form `kvrelay plan --json` emits (README.md "JSON plan schema").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanForm {
    /// `kvrelay-plan-2`: strided descriptors.
    Descriptors,
    /// `kvrelay-plan-1`: every copy (`--expand`).
    Copies,
    /// `kvrelay-plan-3`: descriptors through the requests' page tables (`--paged`).
    Paged,
}

/// Streams the plan as one JSON document (schema in README.md): regions, then every descriptor or every copy, in
/// canonical order.
pub fn plan_json(problem: &Problem, plan: &Plan, form: PlanForm, out: &mut impl std::io::Write) -> std::io::Result<()> {
    let rank = |side: Side, rank: RankId| serde_json::json!({"dp": rank.dp, "pp": rank.pp, "tp": rank.tp, "dcp": problem.side(side).topology.dcp_rank(rank.tp)});
    let region = |side: Side, owner: RankId, index: u32| {
        let region = &problem.side(side).rank(owner).regions[index as usize];
        serde_json::json!({"index": index, "kind": region.kind.to_string(), "tensor": tensor_name(problem, region), "layer": region.layer})
    };
    let schema = match form {
        PlanForm::Descriptors => "kvrelay-plan-2",
        PlanForm::Copies => "kvrelay-plan-1",
        PlanForm::Paged => "kvrelay-plan-3",
    };
    writeln!(out, "{{\"schema\": \"{schema}\",")?;
    writeln!(out, "\"scenario\": {},", serde_json::Value::from(problem.name.clone()))?;
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
                    "row_len": item.row_len(),
                    "rows_per_item": item.rows_per_item,
                    "item_count": item.item_count,
                    "len": item.len_bytes(),
                });
                write!(out, "{}{value}", if first { "  " } else { ",\n  " })?;
                first = false;
            }
        }
    }
    writeln!(out, "\n],")?;
    match form {
        PlanForm::Paged => {
            tables_json(problem, out)?;
            let paged = crate::plan::paged::compact(problem, &plan.descriptors());
            return descriptors_json(paged.into_iter(), true, &rank, &region, out);
        }
        PlanForm::Descriptors => {
            let descriptors = plan.descriptors();
            let physical = descriptors.iter().map(crate::plan::paged::physical);
            return descriptors_json(physical, false, &rank, &region, out);
        }
        PlanForm::Copies => {}
    }
    writeln!(out, "\"copies\": [")?;
    let mut first = true;
    for copy in plan.copies() {
        let value = serde_json::json!({
            "request": copy.request,
            "chunk": copy.chunk,
            "transfer": transfer_kind(copy.kind),
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

/// The `tables` of schema `kvrelay-plan-3`: each request's page lists (README.md "JSON plan schema").
fn tables_json(problem: &Problem, out: &mut impl std::io::Write) -> std::io::Result<()> {
    writeln!(out, "\"tables\": [")?;
    for (index, request) in problem.requests.iter().enumerate() {
        let value = serde_json::json!({
            "request": request.id,
            "prefill_kv_pages": request.prefill_pages,
            "decode_kv_pages": request.decode_kv_pages(),
            "prefill_state_pages": request.prefill_state.pages,
            "decode_state_pages": request.decode_state.pages,
        });
        write!(out, "{}{value}", if index == 0 { "  " } else { ",\n  " })?;
    }
    writeln!(out, "\n],")
}

/// The `descriptors` array and the document's end: plan-2's (all sides physical, no table keys) or, with
/// `tables`, plan-3's.
fn descriptors_json(
    descriptors: impl Iterator<Item = PagedDescriptor>,
    tables: bool,
    rank: &dyn Fn(Side, RankId) -> serde_json::Value,
    region: &dyn Fn(Side, RankId, u32) -> serde_json::Value,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    writeln!(out, "\"descriptors\": [")?;
    for (index, descriptor) in descriptors.enumerate() {
        let mut value = serde_json::json!({
            "request": descriptor.request,
            "chunk": descriptor.chunk,
            "transfer": transfer_kind(descriptor.kind),
            "source": rank(Side::Prefill, descriptor.source),
            "source_region": region(Side::Prefill, descriptor.source, descriptor.source_region),
            "source_offset": descriptor.source_offset,
            "source_stride": descriptor.source_stride,
            "target": rank(Side::Decode, descriptor.target),
            "target_region": region(Side::Decode, descriptor.target, descriptor.target_region),
            "target_offset": descriptor.target_offset,
            "target_stride": descriptor.target_stride,
            "element_len": descriptor.element_len,
            "count": descriptor.count,
        });
        if tables {
            value["source_table"] = descriptor.source_table.to_string().into();
            value["target_table"] = descriptor.target_table.to_string().into();
        }
        write!(out, "{}{value}", if index == 0 { "  " } else { ",\n  " })?;
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

/// What landed where on each decode rank (or only `only`), run-length encoded and decoded from the bytes.
///
/// Consecutive regions whose maps are identical (typically the layers of one stage) share one block.
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
        let mut blocks: Vec<(String, Vec<u32>, Vec<String>)> = Vec::new();
        for (index, region) in rank_layout.regions.iter().enumerate() {
            let key = RegionKey { side: Side::Decode, rank, region: index as u32 };
            let Some(bytes) = observation.images.get(&key) else {
                continue;
            };
            // The run-length encoded lines, independent of the region's own layer id (so layers can share a block).
            let (tensor, reordered) = viewed(problem, region, bytes);
            let bytes = reordered.as_deref().unwrap_or(bytes);
            let name = tensor_name(problem, region);
            let spans =
                region_spans(&sources, region.layer, &name, region.row_len(), item_noun(problem, region), bytes);
            let lines: Vec<String> = spans.into_iter().map(|span| span.line).collect();
            if lines.is_empty() {
                untouched += 1;
                continue;
            }
            match blocks.last_mut() {
                Some((last_tensor, layers, last_lines)) if *last_tensor == tensor && *last_lines == lines => {
                    layers.push(region.layer)
                }
                _ => blocks.push((tensor, vec![region.layer], lines)),
            }
        }
        for (tensor, layers, lines) in blocks {
            let names: Vec<String> = layers.iter().map(ToString::to_string).collect();
            let noun = if layers.len() == 1 { "layer" } else { "layers" };
            let _ = writeln!(out, "  {noun} {} {tensor}:", names.join(", "));
            for line in lines {
                let _ = writeln!(out, "    {line}");
            }
        }
        if untouched > 0 {
            let _ = writeln!(out, "  {untouched} of {} regions untouched", rank_layout.regions.len());
        }
    }
    out
}

/// A decode region's name in a layout and the bytes to decode: a state tensor the decode holds in another element
/// order than the prefill's (`state_layouts`) is permuted into the prefill's order first, item by item, so that its
/// source words (8 bytes, `verify/pattern.rs`) come back whole instead of as 2-byte elements of many words; its name
/// says so.
pub fn viewed(problem: &Problem, region: &Region, bytes: &[u8]) -> (String, Option<Vec<u8>>) {
    let name = tensor_name(problem, region);
    let RegionKind::State { component, tensor } = region.kind else { return (name, None) };
    let model = &problem.model;
    let (Some((prefill_outer, _)), Some((decode_outer, _))) = (
        problem.prefill.sliced_layout(model, component, tensor),
        problem.decode.sliced_layout(model, component, tensor),
    ) else {
        return (name, None);
    };
    let shape = &model.state[component as usize].tensors[tensor as usize].shape;
    let TensorShape::Sliced { full_dim, unit_bytes, outer_count, .. } = shape else { return (name, None) };
    let (channel, dim) = (u64::from(*outer_count) * unit_bytes, u64::from(full_dim / problem.decode.topology.tp));
    let rows = u64::from(prefill_outer.max(decode_outer));
    if prefill_outer == decode_outer || dim * channel != region.item_len || channel % rows != 0 || region.item_len == 0
    {
        return (name, None);
    }
    let element = (channel / rows) as usize;
    let at = |outer: u32, channel: u64, row: u64| -> usize {
        (if u64::from(outer) == rows { row * dim + channel } else { channel * rows + row }) as usize * element
    };
    let mut out = bytes.to_vec();
    for start in (0..bytes.len()).step_by(region.item_len as usize) {
        for channel in 0..dim {
            for row in 0..rows {
                let (from, to) = (start + at(decode_outer, channel, row), start + at(prefill_outer, channel, row));
                if let (Some(piece), Some(place)) = (bytes.get(from..from + element), out.get_mut(to..to + element)) {
                    place.copy_from_slice(piece);
                }
            }
        }
    }
    (
        format!("{name}, held transposed (outer {decode_outer}): shown in the prefill's order (outer {prefill_outer})"),
        Some(out),
    )
}

/// One row-aligned piece of a decode region and where its bytes came from.
#[derive(Debug, Clone, Copy)]
struct Cell {
    row: u64,
    column: u64,
    length: u64,
    number: u32,
    source_offset: u64,
}

/// One run-length encoded piece of a decode region: `rows` consecutive rows from `first_row`, bytes
/// `column..column + length` of each, where they came from (`None`: bytes of no known origin) and its golden line.
#[derive(Debug, Clone)]
pub struct Span {
    pub first_row: u64,
    pub rows: u64,
    pub column: u64,
    pub length: u64,
    /// Where the first row's bytes came from.
    pub from: Option<Described>,
    pub line: String,
}

/// The pieces of one region's bytes, in reading order (first row, then column): what [`layout`] prints a line for.
pub fn region_spans(
    sources: &Sources<'_>,
    layer: u32,
    tensor: &str,
    row_len: u64,
    noun: &str,
    bytes: &[u8],
) -> Vec<Span> {
    let mut cells: Vec<Cell> = Vec::new();
    let mut spans: Vec<Span> = Vec::new();
    for run in sources.runs(0, bytes) {
        match run {
            Run::Sentinel { .. } => {}
            Run::Unknown { offset, length } => {
                let first_row = offset / row_len;
                spans.push(Span {
                    first_row,
                    rows: (offset + length).div_ceil(row_len) - first_row,
                    column: offset % row_len,
                    length: length.min(row_len),
                    from: None,
                    line: format!("bytes {offset}..{} <- GARBLED", offset + length),
                });
            }
            Run::Source { offset, length, number, source_offset } => {
                // Split at row boundaries so relaid-out and head-sliced rows line up in columns.
                let mut at = offset;
                while at < offset + length {
                    let end = ((at / row_len + 1) * row_len).min(offset + length);
                    cells.push(Cell {
                        row: at / row_len,
                        column: at % row_len,
                        length: end - at,
                        number,
                        source_offset: source_offset + (at - offset),
                    });
                    at = end;
                }
            }
        }
    }
    // Columns first (head slices, state blocks), then rows, so each column run-length encodes on its own.
    let mut columns: BTreeMap<(u64, u64), Vec<Cell>> = BTreeMap::new();
    for cell in cells {
        columns.entry((cell.column, cell.length)).or_default().push(cell);
    }
    for ((column, length), cells) in columns {
        // Segments advance by a constant step in the source's own coordinate: token position, slot row or byte.
        let coordinates: Vec<(Described, (u8, u32, u32), i64)> = cells
            .iter()
            .map(|cell| {
                let described = sources.describe(cell.number, cell.source_offset, cell.length);
                let (class, value) = match described.origin {
                    Origin::Token { request, position, .. } => ((0, request, cell.number), i64::from(position)),
                    Origin::Slot { row, .. } => ((1, 0, cell.number), row as i64),
                    Origin::State { request, .. } | Origin::Aux { request, .. } => {
                        ((2, request.unwrap_or(u32::MAX), cell.number), cell.source_offset as i64)
                    }
                };
                (described, class, value)
            })
            .collect();
        let mut start = 0;
        while start < cells.len() {
            let mut end = start + 1;
            let step = coordinates.get(start + 1).map(|next| next.2 - coordinates[start].2);
            while end < cells.len() {
                // State items and aux rows only merge when the source items are contiguous too.
                let contiguous = coordinates[start].1 .0 != 2 || step == Some(cells[start].length as i64);
                let fits = cells[end].row == cells[end - 1].row + 1
                    && coordinates[end].1 == coordinates[start].1
                    && Some(coordinates[end].2 - coordinates[end - 1].2) == step
                    && contiguous;
                if !fits {
                    break;
                }
                end += 1;
            }
            let (first, last) = (&cells[start], &cells[end - 1]);
            let rows = if end - start == 1 {
                format!("{noun} {}", first.row)
            } else {
                format!("{noun}s {}..{}", first.row, last.row)
            };
            let columns = if column == 0 && length == row_len {
                String::new()
            } else {
                format!(" bytes {column}..{}", column + length)
            };
            let span = describe_span(&coordinates[start].0, &coordinates[end - 1].0, end - start, layer, tensor);
            spans.push(Span {
                first_row: first.row,
                rows: last.row - first.row + 1,
                column,
                length,
                from: Some(coordinates[start].0.clone()),
                line: format!("{rows}{columns} <- {span}"),
            });
            start = end;
        }
    }
    spans.sort_by_key(|span| (span.first_row, span.column));
    spans
}

/// `request 2 positions 5..509 step 8 from prefill pp0/tp0`, naming the source layer only when it differs.
fn describe_span(first: &Described, last: &Described, count: usize, layer: u32, tensor: &str) -> String {
    let mut text = match (&first.origin, &last.origin) {
        (
            Origin::Token { request, position, heads },
            Origin::Token { request: last_request, position: last_position, .. },
        ) if request == last_request && count > 1 => {
            let step = (last_position - position) / (count as u32 - 1);
            let step = if step == 1 { String::new() } else { format!(" step {step}") };
            let heads = heads.map_or(String::new(), |(head, count)| heads_text(head, count));
            format!("request {request} positions {position}..{last_position}{step}{heads}")
        }
        (Origin::Token { request, position, heads }, _) if count == 1 => {
            let heads = heads.map_or(String::new(), |(head, count)| heads_text(head, count));
            format!("request {request} position {position}{heads}")
        }
        (Origin::Slot { row, heads }, Origin::Slot { row: last_row, .. }) => {
            let heads = heads.map_or(String::new(), |(head, count)| heads_text(head, count));
            if count == 1 {
                format!("unused slot row {row}{heads}")
            } else {
                format!("unused slot rows {row}..{last_row}{heads}")
            }
        }
        _ if count == 1 => origin_text(&first.origin),
        _ => format!("{} .. {}", origin_text(&first.origin), origin_text(&last.origin)),
    };
    text.push_str(&format!(" from prefill {}", first.source));
    if first.layer != layer || first.tensor != tensor {
        text.push_str(&format!(" layer {} {}", first.layer, first.tensor));
    }
    text
}

fn heads_text(head: u32, count: u32) -> String {
    if count == 1 {
        format!(" head {head}")
    } else {
        format!(" heads {head}..{}", head + count - 1)
    }
}

fn origin_text(origin: &Origin) -> String {
    match origin {
        Origin::Token { request, position, heads } => {
            format!(
                "request {request} position {position}{}",
                heads.map_or(String::new(), |(head, count)| heads_text(head, count))
            )
        }
        Origin::Slot { row, heads } => {
            format!("unused slot row {row}{}", heads.map_or(String::new(), |(head, count)| heads_text(head, count)))
        }
        Origin::State { request: Some(request), noun, item, within } => {
            format!("request {request} {noun} {item} {within}").trim_end().to_owned()
        }
        Origin::State { request: None, noun, item, within } => {
            format!("unowned {noun} {item} {within}").trim_end().to_owned()
        }
        Origin::Aux { request: Some(request), row } => format!("request {request} aux row {row}"),
        Origin::Aux { request: None, row } => format!("unowned aux row {row}"),
    }
}

fn transfer_kind(kind: TransferKind) -> String {
    match kind {
        TransferKind::Kv => "kv".to_owned(),
        TransferKind::Draft => "draft".to_owned(),
        TransferKind::State { component } => format!("state{component}"),
        TransferKind::Aux => "aux".to_owned(),
        TransferKind::Staging { slot } => format!("staging{slot}"),
    }
}

/// Text made safe for XML and HTML attribute and element content (control characters other than tab and newline become
/// U+FFFD: XML 1.0 cannot carry them).
pub fn markup_escape(text: &str) -> String {
    let mut res = String::with_capacity(text.len());
    for char in text.chars() {
        match char {
            '&' => res.push_str("&amp;"),
            '<' => res.push_str("&lt;"),
            '>' => res.push_str("&gt;"),
            '"' => res.push_str("&quot;"),
            '\'' => res.push_str("&apos;"),
            '\t' | '\n' => res.push(char),
            char if char.is_control() => res.push('\u{FFFD}'),
            char => res.push(char),
        }
    }
    res
}
