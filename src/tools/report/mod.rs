//! `kvrelay report`: one self-contained HTML page per run (inline CSS, SVG and a few lines of script; nothing
//! fetched) and an index page over many. Pure: the CLI runs the scenarios and writes the files.
//!
//! A page shows the verdict and the one-line reproduce command, the oracle's violations in coordinates, a picture per
//! decode rank of which request, source rank and source layer landed in every row (violations drawn over it in
//! [`picture::VIOLATION`], a colour used for nothing else), the planner's decisions, the SGLang code paths the
//! transfers take, and the event timeline.

pub mod picture;
pub mod timeline;

use std::fmt::Write as _;

use crate::harness::Outcome;
use crate::render::{self, markup_escape as escape};
use crate::scenario::Scenario;
use crate::verify::Violation;

/// Violations listed in a page's table (all of them are drawn, up to the picture's own cap).
const TABLE_ROWS: usize = 500;
/// Of them, shown before the pictures; the rest fold away.
const TABLE_SHOWN: usize = 8;
/// Trace events listed in a page's table.
const EVENT_ROWS: usize = 1_000;

/// Fills of the verdict banner.
pub const PASS: &str = "#1a7f37";
pub const FAIL: &str = "#cf222e";

/// What a page is about besides the run: how to reproduce it and what was planted.
pub struct PageContext<'a> {
    /// The one-line command that gives the same run (and page).
    pub reproduce: &'a str,
    /// The selftest mutant planted in kvrelay's plans, if any.
    pub mutant: Option<&'a str>,
    /// The fabric the run used (`sim`, `cuda`, ...).
    pub fabric: &'a str,
}

const STYLE: &str = r#"
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 24px 40px; color: #1f2328; background: #fff; }
h1 { font-size: 20px; margin: 18px 0 6px; } h2 { font-size: 17px; margin: 26px 0 8px; } h3 { font-size: 15px; margin: 16px 0 6px; }
.banner { color: #fff; padding: 10px 14px; font-weight: 600; border-radius: 4px; }
code, pre { font: 12.5px ui-monospace, monospace; } pre { background: #f6f8fa; padding: 8px; overflow-x: auto; }
table { border-collapse: collapse; } td, th { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; vertical-align: top; }
.swatch { display: inline-block; width: 12px; height: 12px; margin: 0 4px -1px 10px; border: 1px solid #999; }
text.band, text.lane { font: 11px ui-monospace, monospace; text-anchor: end; } text.axis { font: 11px system-ui; }
.note { color: #57606a; }
"#;

/// Recolours every picture's rectangles by request (`q`), source rank (`s`) or source layer (`l`).
const SCRIPT: &str = r#"
const palette = PALETTE_JSON;
function paint(by) {
  for (const rect of document.querySelectorAll('svg.rank rect[data-q]')) {
    const value = rect.dataset[by];
    if (value === '') { continue; }
    rect.setAttribute('fill', palette[Number(value) % palette.length]);
  }
}
for (const input of document.querySelectorAll('input[name=colour]')) { input.addEventListener('change', () => paint(input.value)); }
document.body.dataset.rendered = String(document.querySelectorAll('svg.rank rect.violation').length);
"#;

/// The HTML page of one run of `scenario`.
pub fn page(scenario: &Scenario, outcome: &Outcome, context: &PageContext<'_>) -> String {
    let problem = &scenario.problem;
    let passed = outcome.passed();
    let mut body = String::new();
    let _ = write!(body, "<h1>{}</h1>", escape(&scenario.name));
    let verdict = if passed { "pass".to_owned() } else { format!("FAIL: {}", outcome.failure_text("; ")) };
    let _ = write!(
        body,
        r#"<div class="banner" id="verdict" style="background:{}">{}</div>"#,
        if passed { PASS } else { FAIL },
        escape(&verdict)
    );
    let expectation = render::expectation(&scenario.expect);
    let _ = write!(
        body,
        "<p>file <code>{}</code> · seed {} · fabric <code>{}</code> · expects {}{}</p><p>reproduce: <code>{}</code></p>",
        escape(&scenario.file),
        scenario.seed,
        escape(context.fabric),
        escape(&expectation),
        context.mutant.map_or(String::new(), |mutant| format!(
            " · <b>planted mutant <code>{}</code></b> (kvrelay's plans deliberately broken)",
            escape(mutant)
        )),
        escape(context.reproduce)
    );
    body.push_str(&pictures(scenario, outcome));
    body.push_str(&violation_table(&outcome.violations));
    body.push_str("<h2>Planner decisions</h2>");
    match &outcome.plan {
        Ok(plan) => {
            let _ = write!(body, "<pre>{}</pre>", escape(&render::plan_summary(plan)));
        }
        Err(error) => {
            let _ = write!(body, "<p>rejected ({}): {}</p>", escape(error.kind().name()), escape(&error.to_string()));
        }
    }
    let paths = crate::explain::render(&scenario.name, &crate::explain::explain(problem));
    let _ = write!(body, "<h2>SGLang code paths</h2><pre>{}</pre>", escape(&paths));
    body.push_str(&events(outcome));
    let script = SCRIPT.replace("PALETTE_JSON", &format!("{:?}", picture::PALETTE));
    let title = format!("{} · {}", scenario.name, if passed { "pass" } else { "FAIL" });
    document(&title, &body, &script)
}

/// A whole self-contained page: `body`, the house style and `script` (may be empty).
pub fn document(title: &str, body: &str, script: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style>\
         </head><body>{body}<script>{script}</script></body></html>\n",
        escape(title)
    )
}

fn violation_table(violations: &[Violation]) -> String {
    if violations.is_empty() {
        return "<h2>Violations</h2><p>none: every byte the oracle enumerates from domain.md is where it belongs.</p>"
            .to_owned();
    }
    let header = "<table><tr><th>decode rank</th><th>region</th><th>place</th><th>what</th></tr>";
    let mut out = format!("<h2>Violations: {}</h2>{header}", violations.len());
    for (index, violation) in violations.iter().take(TABLE_ROWS).enumerate() {
        if index == TABLE_SHOWN {
            let _ = write!(
                out,
                "</table><details><summary>{} more</summary>{header}",
                violations.len().min(TABLE_ROWS) - TABLE_SHOWN
            );
        }
        let _ = write!(
            out,
            "<tr><td>{}</td><td><a href=\"#r{}-g{}\">{}</a></td><td>{}</td><td>{}</td></tr>",
            violation.rank,
            picture::rank_slug(violation.rank),
            violation.at.region,
            escape(&violation.region),
            escape(&violation.place),
            escape(&violation.kind.to_string())
        );
    }
    out.push_str("</table>");
    if violations.len() > TABLE_SHOWN {
        out.push_str("</details>");
    }
    if violations.len() > TABLE_ROWS {
        let _ = write!(out, "<p class=\"note\">... and {} more</p>", violations.len() - TABLE_ROWS);
    }
    out
}

fn pictures(scenario: &Scenario, outcome: &Outcome) -> String {
    let problem = &scenario.problem;
    let mut out = String::from(
        "<h2>Where the bytes went</h2><p>One band per decode region, one column per row (or item); a row split \
         across heads or state blocks is split top to bottom. Grey: untouched; light grey: a row of no request; \
         black: bytes of no known origin; a red bar under a run: a violation there (what landed stays visible above it). Hover for the decoded origin. Colour by \
         <label><input type=\"radio\" name=\"colour\" value=\"q\" checked> request</label> \
         <label><input type=\"radio\" name=\"colour\" value=\"s\"> source rank</label> \
         <label><input type=\"radio\" name=\"colour\" value=\"l\"> source layer</label></p>",
    );
    if outcome.engine.is_none() {
        out.push_str("<p class=\"note\">The run ended before any byte moved: nothing to draw.</p>");
        return out;
    }
    for layout in &problem.decode.ranks {
        let rank = layout.rank;
        let mine: Vec<&Violation> = outcome.violations.iter().filter(|violation| violation.rank == rank).collect();
        let picture = picture::rank_picture(problem, &outcome.observation, &mine, rank);
        let _ = write!(
            out,
            "<h3 id=\"decode-{}\">decode {rank} (dcp rank {}){}</h3>",
            picture::rank_slug(rank),
            problem.decode.topology.dcp_rank(rank.tp),
            if mine.is_empty() { String::new() } else { format!(": {} violations", mine.len()) }
        );
        let mut legend = String::new();
        for (request, colour) in &picture.requests {
            let _ = write!(
                legend,
                "<span class=\"swatch\" style=\"background:{}\"></span>request {request}",
                picture::PALETTE[colour % picture::PALETTE.len()]
            );
        }
        let sources: Vec<String> = picture.sources.iter().map(|rank| format!("prefill {rank}")).collect();
        let _ = write!(out, "<p>{legend}<span class=\"note\"> · from {}</span></p>", escape(&sources.join(", ")));
        out.push_str(&picture.svg);
        for note in &picture.notes {
            let _ = write!(out, "<p class=\"note\">{}</p>", escape(note));
        }
    }
    out
}

fn events(outcome: &Outcome) -> String {
    let mut out = String::from("<h2>Events</h2>");
    let Some(run) = &outcome.engine else {
        out.push_str("<p>none: the engines did not run.</p>");
        return out;
    };
    let _ = write!(out, "<pre>{}</pre>", escape(&render::events(outcome)));
    if !run.trace.is_empty() {
        out.push_str(
            "<p>Time runs left to right on a logarithmic scale; a line joins a message's sender and receiver.",
        );
        for kind in timeline::KINDS {
            let _ = write!(
                out,
                "<span class=\"swatch\" style=\"background:{}\"></span>{kind}",
                timeline::kind_colour(kind)
            );
        }
        let _ = write!(
            out,
            "<span class=\"swatch\" style=\"background:{}\"></span>room succeeded",
            timeline::ROOM_SUCCEEDED
        );
        let _ =
            write!(out, "<span class=\"swatch\" style=\"background:{}\"></span>room failed</p>", timeline::ROOM_FAILED);
    }
    out.push_str(&timeline::timeline(run));
    if !run.trace.is_empty() {
        let _ = write!(out, "<details><summary>{} events</summary><pre>", run.trace.len());
        for event in run.trace.iter().take(EVENT_ROWS) {
            let _ = writeln!(out, "{}", escape(&event.to_string()));
        }
        if run.trace.len() > EVENT_ROWS {
            let _ = writeln!(out, "... and {} more", run.trace.len() - EVENT_ROWS);
        }
        out.push_str("</pre></details>");
    }
    out
}

/// `text` as a file name: ASCII letters, digits, `-`, `_` and `.` kept, anything else `_`.
pub fn file_stem(text: &str) -> String {
    text.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect()
}

/// One line of the index page.
pub struct IndexEntry {
    pub scenario: String,
    /// The page, relative to the index.
    pub href: String,
    pub passed: bool,
    /// The oracle's violations, where the run's outcome was kept (certify keeps only the verdict).
    pub violations: Option<usize>,
    pub failure: String,
}

/// The index page over many runs (a whole `check`).
pub fn index(title: &str, entries: &[IndexEntry]) -> String {
    let failed = entries.iter().filter(|entry| !entry.passed).count();
    let mut body = format!(
        "<h1>{}</h1><div class=\"banner\" id=\"verdict\" style=\"background:{}\">{} scenarios, {} failed</div>",
        escape(title),
        if failed == 0 { PASS } else { FAIL },
        entries.len(),
        failed
    );
    body.push_str("<table><tr><th>scenario</th><th>verdict</th><th>violations</th><th>why</th></tr>");
    for entry in entries {
        let _ = write!(
            body,
            "<tr><td><a href=\"{}\">{}</a></td><td style=\"color:{}\">{}</td><td>{}</td><td>{}</td></tr>",
            escape(&entry.href),
            escape(&entry.scenario),
            if entry.passed { PASS } else { FAIL },
            if entry.passed { "pass" } else { "FAIL" },
            entry.violations.map_or("–".to_owned(), |count| count.to_string()),
            escape(&entry.failure)
        );
    }
    body.push_str("</table>");
    document(title, &body, "")
}
