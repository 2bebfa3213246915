//! Checks on a scenario's raw bytes before any YAML parsing: size, encoding, control characters, nesting depth.
//!
//! The YAML parser's cost grows with the square of the nesting depth and its error for a bad byte gives no line,
//! so these are checked here first, each located at a line and column. The depth is a conservative estimate from
//! indentation, `- ` markers and flow brackets (quoted scalars, comments and block scalars are skipped); scenarios
//! nest about 6 deep, far below [`MAX_NESTING`].

use super::{Diagnostic, ScenarioErrorKind};
use crate::limits::{MAX_NESTING, MAX_SCENARIO_BYTES};

/// Where a problem is, 1-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Position {
    pub(super) line: usize,
    pub(super) column: usize,
}

fn at(position: Position, message: String, kind: ScenarioErrorKind) -> Diagnostic {
    Diagnostic { line: Some(position.line), column: Some(position.column), path: String::new(), message, kind }
}

/// Line and column of byte `offset` of `bytes` (columns count characters, not bytes).
fn position(bytes: &[u8], offset: usize) -> Position {
    let before = &bytes[..offset];
    let line = before.iter().filter(|byte| **byte == b'\n').count() + 1;
    let line_start = before.iter().rposition(|byte| *byte == b'\n').map_or(0, |at| at + 1);
    let column = String::from_utf8_lossy(&before[line_start..]).chars().count() + 1;
    Position { line, column }
}

/// The text of a scenario file, or the one diagnostic that stops it from being parsed.
pub(super) fn checked_text(bytes: &[u8]) -> Result<&str, Diagnostic> {
    if bytes.len() as u64 > MAX_SCENARIO_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    let text = std::str::from_utf8(bytes).map_err(|error| {
        let place = position(bytes, error.valid_up_to());
        at(place, "the file is not UTF-8 text (fix: save it as UTF-8)".to_owned(), ScenarioErrorKind::NotText)
    })?;
    if let Some((offset, character)) = text.char_indices().find(|(_, character)| forbidden(*character)) {
        let place = position(bytes, offset);
        return Err(at(
            place,
            format!(
                "control character U+{:04X} is not allowed in YAML (fix: remove it; only tab, CR and LF are allowed)",
                u32::from(character)
            ),
            ScenarioErrorKind::NotText,
        ));
    }
    if let Some(place) = too_deep(text) {
        return Err(at(
            place,
            format!(
                "collections nest deeper than {MAX_NESTING} levels here (fix: a scenario needs about 6; flatten it)"
            ),
            ScenarioErrorKind::TooLarge,
        ));
    }
    Ok(text)
}

/// The refusal of a file of `len` bytes.
pub(super) fn too_large(len: u64) -> Diagnostic {
    Diagnostic {
        line: None,
        column: None,
        path: String::new(),
        message: format!(
            "the file has {len} bytes, more than the limit of {MAX_SCENARIO_BYTES} (fix: a scenario is a few KiB; let the allocator hand out pages instead of listing them)"
        ),
        kind: ScenarioErrorKind::TooLarge,
    }
}

/// Characters YAML 1.2 does not allow in a stream (c-printable), except the byte-order mark.
fn forbidden(character: char) -> bool {
    let allowed_control = matches!(character, '\t' | '\n' | '\r' | '\u{85}');
    (character.is_control() && !allowed_control) || matches!(character, '\u{FFFE}' | '\u{FFFF}')
}

/// Scanner state carried across lines.
#[derive(Default)]
struct Scan {
    /// Indentation of the open block collections.
    indents: Vec<usize>,
    /// Open `[` / `{`.
    flow: usize,
    /// Inside a quoted scalar that may span lines: its quote character.
    quote: Option<char>,
    /// Inside a block scalar (`|`, `>`): the indentation of the line that opened it.
    block_scalar: Option<usize>,
}

/// The first position where the nesting estimate exceeds [`MAX_NESTING`], if any.
fn too_deep(text: &str) -> Option<Position> {
    let mut scan = Scan::default();
    for (index, line) in text.lines().enumerate() {
        if let Some(column) = scan.line(line) {
            return Some(Position { line: index + 1, column });
        }
    }
    None
}

impl Scan {
    /// Scans one line; returns the 1-based column where the depth went past the limit.
    fn line(&mut self, line: &str) -> Option<usize> {
        let content = line.trim_start_matches(' ');
        let indent = line.len() - content.len();
        if let Some(opener) = self.block_scalar {
            if content.is_empty() || indent > opener {
                return None;
            }
            self.block_scalar = None;
        }
        let blank = content.is_empty() || content.starts_with('#');
        let mut block = self.indents.len();
        if self.flow == 0 && self.quote.is_none() && !blank {
            while self.indents.last().is_some_and(|top| *top > indent) {
                self.indents.pop();
            }
            if self.indents.last().is_none_or(|top| *top < indent) {
                self.indents.push(indent);
            }
            block = self.indents.len();
        }
        let mut previous = ' ';
        let mut last_token = ' ';
        for (column, (offset, character)) in line.char_indices().enumerate() {
            match self.quote {
                Some('\'') if character == '\'' => self.quote = None,
                Some('"') if character == '"' && previous != '\\' => self.quote = None,
                Some(_) => {}
                None => match character {
                    '#' if previous == ' ' || previous == '\t' || column == 0 => break,
                    '\'' | '"' if opens_token(previous) => self.quote = Some(character),
                    '[' | '{' => self.flow += 1,
                    ']' | '}' => self.flow = self.flow.saturating_sub(1),
                    // `- ` and `? ` open a nested block collection on the same line.
                    '-' | '?' if self.flow == 0 && opens_token(previous) && compact(&line[offset + 1..]) => block += 1,
                    _ => {}
                },
            }
            if block + self.flow > MAX_NESTING {
                return Some(column + 1);
            }
            if !character.is_whitespace() {
                last_token = character;
            }
            previous = character;
        }
        if self.quote.is_none() && self.flow == 0 && matches!(last_token, '|' | '>') {
            self.block_scalar = Some(indent);
        }
        None
    }
}

/// Whether what follows a `-` or `?` makes it an indicator (`- x`, a lone `-`), not part of a scalar (`-1`).
fn compact(rest: &str) -> bool {
    rest.chars().next().is_none_or(|next| next == ' ')
}

/// Whether a quote or indicator after `previous` starts a token (not `don't` inside a plain scalar).
fn opens_token(previous: char) -> bool {
    matches!(previous, ' ' | '\t' | '[' | '{' | ',' | ':' | '-' | '?')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_flow_nesting_is_refused_at_its_column() {
        let text = "a: ".to_owned() + &"[".repeat(40);
        let error = checked_text(text.as_bytes()).unwrap_err();
        assert_eq!((error.line, error.column), (Some(1), Some(4 + MAX_NESTING - 1)), "{error:?}");
    }

    #[test]
    fn compact_sequences_on_one_line_count_as_nesting() {
        let text = "- ".repeat(40) + "x";
        assert!(checked_text(text.as_bytes()).is_err());
        assert!(checked_text("- - - x\n".as_bytes()).is_ok());
    }

    #[test]
    fn brackets_in_quotes_comments_and_block_scalars_do_not_count() {
        let brackets = "[".repeat(40);
        let text = format!("a: '{brackets}'\nb: \"{brackets}\" # {brackets}\nc: |\n  {brackets}\nd: 1\n");
        assert!(checked_text(text.as_bytes()).is_ok(), "{:?}", checked_text(text.as_bytes()));
    }

    #[test]
    fn invalid_utf8_and_control_characters_are_located() {
        let error = checked_text(b"a: 1\nbb: \xff\n").unwrap_err();
        assert_eq!((error.line, error.column), (Some(2), Some(5)));
        let error = checked_text("a: 1\nb: x\u{1}y\n".as_bytes()).unwrap_err();
        assert_eq!((error.line, error.column), (Some(2), Some(5)));
        assert!(error.message.contains("U+0001"), "{}", error.message);
    }
}
