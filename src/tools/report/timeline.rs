//! The event timeline of a run: one lane per rank, every control message as a line from its sender's lane to its
//! receiver's at its (simulated) time, every engine note as a dot, and each decode room's end as a diamond.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::engine::sim::SimRun;
use crate::engine::trace::TraceEvent;
use crate::render::markup_escape as escape;

const LABEL_WIDTH: f64 = 150.0;
const PLOT_WIDTH: f64 = 1000.0;
const LANE: f64 = 22.0;
/// Events drawn; the table below the picture lists the first of them too.
pub const MAX_EVENTS: usize = 4_000;

/// Stroke of a message kind (registration, link, metadata, status) and of notes.
pub fn kind_colour(kind: &str) -> &'static str {
    match kind {
        "registration" => "#4e79a7",
        "link" => "#76b7b2",
        "metadata" => "#f28e2b",
        "status" => "#59a14f",
        "note" => "#7f7f7f",
        _ => "#b07aa1",
    }
}

/// The lanes of a trace: prefill ranks first, then decode ranks, each in name order.
fn lanes(trace: &[TraceEvent]) -> BTreeMap<String, usize> {
    let mut names: Vec<&str> =
        trace.iter().flat_map(|event| [Some(event.from.as_str()), event.to.as_deref()]).flatten().collect();
    names.sort_by_key(|name| (!name.starts_with("prefill"), *name));
    names.dedup();
    names.into_iter().enumerate().map(|(index, name)| (name.to_owned(), index)).collect()
}

/// Fills of a room's end (distinct from the verdict banner's, so a screenshot's banner pixels are the banner).
pub const ROOM_SUCCEEDED: &str = "#2da44e";
pub const ROOM_FAILED: &str = "#a40e26";

/// The kinds in the legend, in the order drawn there.
pub const KINDS: [&str; 5] = ["registration", "link", "metadata", "status", "note"];

/// The timeline SVG of `run` (empty when the run logged no trace).
pub fn timeline(run: &SimRun) -> String {
    let trace = &run.trace;
    if trace.is_empty() {
        return String::new();
    }
    let lanes = lanes(trace);
    let end = trace.iter().map(|event| event.time_ns).max().unwrap_or(0).max(run.run_ns).max(1);
    // Logarithmic in microseconds: set-up messages take microseconds, deadlines seconds, and both must read.
    let span = (end as f64 / 1e3).ln_1p();
    let x = |ns: u64| LABEL_WIDTH + (ns as f64 / 1e3).ln_1p() / span * PLOT_WIDTH;
    let lane_y = |name: &str| lanes.get(name).map_or(0.0, |lane| 20.0 + *lane as f64 * LANE);
    let mut svg = String::new();
    for name in lanes.keys() {
        let y = lane_y(name);
        let _ = write!(
            svg,
            r##"<text x="{lx}" y="{ty:.1}" class="lane">{name}</text><line x1="{LABEL_WIDTH}" x2="{right}" y1="{y:.1}" y2="{y:.1}" stroke="#dddddd"/>"##,
            lx = LABEL_WIDTH - 6.0,
            ty = y + 4.0,
            right = LABEL_WIDTH + PLOT_WIDTH,
            name = escape(name),
        );
    }
    for event in trace.iter().take(MAX_EVENTS) {
        let (at, from) = (x(event.time_ns), lane_y(&event.from));
        let colour = kind_colour(event.kind);
        let title = escape(&event.to_string());
        match &event.to {
            Some(to) => {
                let _ = write!(
                    svg,
                    r#"<line x1="{at:.2}" x2="{at:.2}" y1="{from:.1}" y2="{to:.1}" stroke="{colour}" stroke-width="1.5"><title>{title}</title></line><circle cx="{at:.2}" cy="{to:.1}" r="2.5" fill="{colour}"><title>{title}</title></circle>"#,
                    to = lane_y(to),
                );
            }
            None => {
                let _ = write!(
                    svg,
                    r#"<circle cx="{at:.2}" cy="{from:.1}" r="2" fill="{colour}"><title>{title}</title></circle>"#
                );
            }
        }
    }
    for (rank, rooms) in &run.rooms {
        let y = lane_y(&format!("decode {rank}"));
        for (id, room) in rooms {
            let Some(ended) = room.ended_ns else { continue };
            let (colour, what) = match &room.reason {
                Some(reason) => (ROOM_FAILED, format!("Failed: {reason}")),
                None => (ROOM_SUCCEEDED, format!("{:?}", room.poll)),
            };
            let (cx, title) =
                (x(ended), escape(&format!("decode {rank}: request {id} {what} at {:.3} us", ended as f64 / 1e3)));
            let _ = write!(
                svg,
                r#"<path d="M{cx:.2} {top:.1} l5 6 l-5 6 l-5 -6 z" fill="{colour}"><title>{title}</title></path>"#,
                top = y - 6.0,
            );
        }
    }
    let height = 30.0 + lanes.len() as f64 * LANE;
    let width = LABEL_WIDTH + PLOT_WIDTH + 10.0;
    let mut grid = String::new();
    let mut tick = 1u64;
    while tick <= end {
        let label = if tick < 1_000 {
            "0".to_owned()
        } else if tick < 1_000_000 {
            format!("{} us", tick / 1_000)
        } else if tick < 1_000_000_000 {
            format!("{} ms", tick / 1_000_000)
        } else {
            format!("{} s", tick / 1_000_000_000)
        };
        let _ = write!(
            grid,
            r##"<line x1="{at:.1}" x2="{at:.1}" y1="8" y2="{bottom:.1}" stroke="#eeeeee"/><text x="{at:.1}" y="{ty:.1}" class="axis" text-anchor="middle">{label}</text>"##,
            at = x(if tick == 1 { 0 } else { tick }),
            bottom = height - 14.0,
            ty = height - 2.0,
        );
        let Some(next) = (if tick == 1 { Some(1_000) } else { tick.checked_mul(10) }) else { break };
        tick = next;
    }
    format!(
        r#"<svg class="timeline" width="{width}" height="{height}" viewBox="0 0 {width} {height}">{grid}{svg}</svg>"#
    )
}
