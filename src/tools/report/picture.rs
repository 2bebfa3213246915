//! The picture of one decode rank: an SVG with one band per region (layer and tensor), one rectangle per run of rows
//! that came from the same request and source, and the oracle's violations drawn over them in their coordinates.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use crate::model::{Problem, RankId, Side};
use crate::render::{markup_escape as escape, region_spans, Span};
use crate::verify::{item_noun, tensor_name, Observation, Origin, RegionKey, Sources, Violation};

/// Width of the band labels, of the plot, and one band's height, in CSS pixels.
const LABEL_WIDTH: f64 = 190.0;
const PLOT_WIDTH: f64 = 960.0;
const BAND: f64 = 14.0;
const BAND_GAP: f64 = 4.0;
/// Rectangles drawn per rank before the picture says it stopped (a page must stay openable).
const MAX_SPANS: usize = 40_000;
/// Violations drawn per rank; the table lists them all (up to its own cap).
const MAX_MARKS: usize = 2_000;

/// Fills: requests and source ranks cycle through `PALETTE`; `SLOT` is a row of no request, `GARBLED` bytes of no
/// known origin, `UNTOUCHED` the band's background (sentinel bytes). `VIOLATION` is used for nothing else, so a
/// screenshot's pixels of that colour are violations.
pub const PALETTE: [&str; 12] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f", "#bab0ac", "#2f4b7c", "#a0cbe8",
    "#8cd17d", "#ffbe7d",
];
pub const SLOT: &str = "#c9c9c9";
pub const GARBLED: &str = "#000000";
pub const UNTOUCHED: &str = "#f2f2f2";
pub const VIOLATION: &str = "#e8003d";

/// How one decode rank's picture came out: the SVG and what it could not draw.
pub struct Picture {
    pub svg: String,
    /// Requests that appear, with their palette index, and the source ranks that appear (the legend).
    pub requests: BTreeMap<u32, usize>,
    pub sources: BTreeSet<RankId>,
    pub notes: Vec<String>,
}

/// The picture of decode rank `rank`: every region whose image the run left on the host, in region order.
pub fn rank_picture(problem: &Problem, observation: &Observation, violations: &[&Violation], rank: RankId) -> Picture {
    let sources = Sources::new(problem);
    let source_index: BTreeMap<RankId, usize> =
        problem.prefill.ranks.iter().enumerate().map(|(index, layout)| (layout.rank, index)).collect();
    let mut picture =
        Picture { svg: String::new(), requests: BTreeMap::new(), sources: BTreeSet::new(), notes: vec![] };
    let layout = problem.decode.rank(rank);
    let mut bands = String::new();
    let mut marks = String::new();
    let (mut y, mut drawn, mut marked) = (0.0, 0usize, 0usize);
    for (index, region) in layout.regions.iter().enumerate() {
        let key = RegionKey { side: Side::Decode, rank, region: index as u32 };
        let Some(bytes) = observation.images.get(&key) else {
            if observation.sparse.contains_key(&key) || observation.resident.contains_key(&key) {
                picture.notes.push(format!(
                    "layer {} {}: not read back to the host, not drawn",
                    region.layer,
                    tensor_name(problem, region)
                ));
            }
            continue;
        };
        let (tensor, reordered) = crate::render::viewed(problem, region, bytes);
        let bytes = reordered.as_deref().unwrap_or(bytes);
        let row_len = region.row_len().max(1);
        let rows = (bytes.len() as u64 / row_len).max(1);
        let scale = PLOT_WIDTH / rows as f64;
        let noun = item_noun(problem, region);
        let label = format!("layer {} {tensor}", region.layer);
        let _ = write!(
            bands,
            r#"<g id="r{rank_id}-g{index}"><text x="{lx}" y="{ty:.1}" class="band">{label}</text><rect x="{LABEL_WIDTH}" y="{y:.1}" width="{PLOT_WIDTH}" height="{BAND}" fill="{UNTOUCHED}"><title>{label}: {rows} {noun}s of {row_len} B, untouched where grey</title></rect>"#,
            rank_id = rank_slug(rank),
            lx = LABEL_WIDTH - 6.0,
            ty = y + BAND - 3.0,
            label = escape(&label),
        );
        for span in region_spans(&sources, region.layer, &tensor_name(problem, region), row_len, noun, bytes) {
            if drawn == MAX_SPANS {
                picture.notes.push(format!("stopped drawing after {MAX_SPANS} runs of rows; the golden text has all"));
            }
            drawn += 1;
            if drawn > MAX_SPANS {
                continue;
            }
            bands.push_str(&span_rect(&span, y, scale, row_len, &source_index, &mut picture));
        }
        bands.push_str("</g>");
        for violation in violations.iter().filter(|violation| violation.at.region == index as u32) {
            marked += 1;
            if marked > MAX_MARKS {
                continue;
            }
            let first = violation.at.offset / row_len;
            let last = (violation.at.offset + violation.at.length.max(1) - 1) / row_len;
            let width = ((last - first + 1) as f64 * scale).max(4.0);
            let x = (LABEL_WIDTH + first as f64 * scale).min(LABEL_WIDTH + PLOT_WIDTH - width);
            let _ = write!(
                marks,
                r#"<rect class="violation" x="{x:.2}" y="{top:.1}" width="{width:.2}" height="{height:.1}" fill="{VIOLATION}"><title>{text}</title></rect>"#,
                top = y + BAND * 0.45,
                height = BAND * 0.55 + 1.0,
                text = escape(&violation.to_string()),
            );
        }
        y += BAND + BAND_GAP;
    }
    if marked > MAX_MARKS {
        picture.notes.push(format!("{marked} violations, the first {MAX_MARKS} drawn"));
    }
    let (width, height) = (LABEL_WIDTH + PLOT_WIDTH + 8.0, y.max(BAND));
    picture.svg = format!(
        r#"<svg class="rank" width="{width}" height="{height}" viewBox="0 0 {width} {height}">{bands}{marks}</svg>"#
    );
    picture
}

/// The rectangle of one run of rows: placed by row and by column within the row, filled by request, with the
/// request, source rank and source layer as data for the colouring switch and its golden line as tooltip.
fn span_rect(
    span: &Span,
    y: f64,
    scale: f64,
    row_len: u64,
    source_index: &BTreeMap<RankId, usize>,
    picture: &mut Picture,
) -> String {
    let x = LABEL_WIDTH + span.first_row as f64 * scale;
    let width = (span.rows as f64 * scale).max(0.5);
    let top = y + span.column as f64 / row_len as f64 * BAND;
    let height = (span.length as f64 / row_len as f64 * BAND).max(1.0);
    let (fill, request, source, layer) = match &span.from {
        None => (GARBLED.to_owned(), String::new(), String::new(), String::new()),
        Some(described) => {
            let request = match &described.origin {
                Origin::Token { request, .. } => Some(*request),
                Origin::State { request, .. } | Origin::Aux { request, .. } => *request,
                Origin::Slot { .. } => None,
            };
            // Requests take palette colours in order of first appearance on the page.
            let next = picture.requests.len();
            let colour = request.map(|request| *picture.requests.entry(request).or_insert(next));
            let fill = colour.map_or(SLOT, |colour| PALETTE[colour % PALETTE.len()]).to_owned();
            let source = source_index.get(&described.source).copied().unwrap_or(0);
            picture.sources.insert(described.source);
            (
                fill,
                colour.map_or(String::new(), |colour| colour.to_string()),
                source.to_string(),
                described.layer.to_string(),
            )
        }
    };
    format!(
        r#"<rect x="{x:.2}" y="{top:.2}" width="{width:.2}" height="{height:.2}" fill="{fill}" data-q="{request}" data-s="{source}" data-l="{layer}"><title>{}</title></rect>"#,
        escape(&span.line)
    )
}

/// `decode tp3` as an id fragment: `tp3`.
pub fn rank_slug(rank: RankId) -> String {
    rank.to_string().chars().filter(char::is_ascii_alphanumeric).collect()
}
