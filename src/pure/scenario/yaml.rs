//! Bounded YAML parsing: the alias expansion limit, and parser errors restated in the scenario's own terms.
//!
//! Parsing is two passes over the text (a few KiB): the first counts every value the document expands to, aliases
//! included, and stops at [`MAX_YAML_VALUES`]; the second deserialises the DTOs of `raw.rs`. No message carries
//! parser internals or echoes an unbounded user string.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use super::{Diagnostic, ScenarioErrorKind};
use crate::limits::{MAX_ECHO_CHARS, MAX_NESTING, MAX_YAML_VALUES};

/// Marker of the counting pass's own error.
const EXPANSION: &str = "kvrelay: value limit";

/// Parses `text` into the scenario DTOs, or the one diagnostic that stops it.
pub(super) fn parse<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, Diagnostic> {
    let counter = Cell::new(0);
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    if let Err(error) = (Count { seen: &counter }).deserialize(deserializer) {
        return Err(diagnostic(text, String::new(), &error));
    }
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(deserializer).map_err(|failure| {
        let path = failure.path().to_string();
        let path = if path == "." || path == "?" { String::new() } else { path };
        diagnostic(text, path, failure.inner())
    })
}

/// Counts every value of the document, following aliases, and fails past [`MAX_YAML_VALUES`].
#[derive(Clone, Copy)]
struct Count<'a> {
    seen: &'a Cell<u64>,
}

impl Count<'_> {
    fn tick<E: de::Error>(self) -> Result<(), E> {
        self.seen.set(self.seen.get() + 1);
        if self.seen.get() > MAX_YAML_VALUES {
            return Err(E::custom(EXPANSION));
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

macro_rules! count_scalars {
    ($($method:ident: $type:ty),*) => {
        $(fn $method<E: de::Error>(self, _: $type) -> Result<(), E> {
            self.tick()
        })*
    };
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("any YAML value")
    }

    count_scalars!(visit_bool: bool, visit_i64: i64, visit_u64: u64, visit_i128: i128, visit_u128: u128,
        visit_f64: f64, visit_str: &str, visit_bytes: &[u8]);

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.tick()
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.tick()
    }

    fn visit_some<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.tick()?;
        deserializer.deserialize_any(self)
    }

    fn visit_newtype_struct<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        self.tick()?;
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.tick()?;
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.tick()?;
        while map.next_key_seed(self)?.is_some() {
            map.next_value_seed(self)?;
        }
        Ok(())
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        self.tick()?;
        let ((), variant) = data.variant_seed(self)?;
        de::VariantAccess::newtype_variant_seed(variant, self)
    }
}

/// A parser error as a located diagnostic in the scenario's terms.
fn diagnostic(text: &str, path: String, error: &serde_yaml_ng::Error) -> Diagnostic {
    let raw = error.to_string();
    let location = error.location();
    let (mut line, mut column) = (location.as_ref().map(|it| it.line()), location.as_ref().map(|it| it.column()));
    let mut kind = ScenarioErrorKind::TooLarge;
    let message = if raw.contains(EXPANSION) || raw.contains("repetition limit exceeded") {
        (line, column) = (None, None);
        format!(
            "the document expands to more than {MAX_YAML_VALUES} values (YAML aliases repeat their anchored node each time; fix: fewer aliases or shorter lists)"
        )
    } else if raw.contains("recursion limit exceeded") {
        format!(
            "values nest deeper than {MAX_NESTING} levels, counting what aliases repeat (fix: flatten the scenario)"
        )
    } else if let Some(key) = duplicate_key(&raw) {
        kind = ScenarioErrorKind::Syntax;
        if let Some(found) = line.and_then(|from| second_occurrence(text, from, &key)) {
            (line, column) = (Some(found), None);
        }
        format!("`{}` is given twice (fix: keep one)", clip(&key))
    } else if error.location().is_some()
        && path.is_empty()
        && !raw.contains("invalid type")
        && !raw.contains("missing field")
    {
        kind = ScenarioErrorKind::Syntax;
        format!(
            "YAML syntax: {} (fix: check indentation, and quote values containing `: `, `#`, `[` or `{{`)",
            syntax(&raw)
        )
    } else {
        kind = ScenarioErrorKind::Schema;
        in_scenario_terms(&strip_locations(&raw), &path)
    };
    Diagnostic { line, column, path: clip_path(&path), message, kind }
}

/// Removes the ` at line L column C` (and ` at position N`) that libyaml and serde_yaml_ng append.
fn strip_locations(message: &str) -> String {
    let mut out = String::new();
    let mut rest = message;
    while let Some(at) = rest.find(" at ") {
        out.push_str(&rest[..at]);
        let tail = &rest[at + 4..];
        let location = ["line ", "position "].iter().find_map(|prefix| tail.strip_prefix(prefix));
        match location {
            Some(after) => {
                let skip = after
                    .char_indices()
                    .find(|(_, c)| !(c.is_ascii_digit() || *c == ' ' || "column".contains(*c)))
                    .map_or(after.len(), |(index, _)| index);
                rest = after[skip..].trim_start_matches(' ');
                if !rest.is_empty() && !rest.starts_with(',') {
                    out.push(' ');
                }
            }
            None => {
                out.push_str(" at ");
                rest = tail;
            }
        }
    }
    out.push_str(rest);
    out
}

/// A libyaml problem and context, without locations.
fn syntax(raw: &str) -> String {
    clip(&strip_locations(raw).replace(", while", " while"))
}

/// serde's wording for a scenario author: no Rust type names, no unbounded echoes.
fn in_scenario_terms(message: &str, path: &str) -> String {
    let mut message = message.to_owned();
    // serde_yaml_ng prefixes the path again inside some messages.
    if let Some((head, rest)) = message.split_once(": ") {
        if !head.contains(' ') && !path.is_empty() && path.starts_with(head) {
            message = rest.to_owned();
        }
    }
    let words = [
        ("expected u32", "expected a whole number from 0 to 4294967295"),
        ("expected u64", "expected a whole number from 0 to 18446744073709551615"),
        ("expected usize", "expected a whole number from 0 to 18446744073709551615"),
        ("expected a boolean", "expected true or false"),
        ("invalid type: sequence", "found a list"),
        ("invalid type: map", "found a mapping"),
        ("invalid type: string", "found the text"),
        ("invalid type: integer", "found the number"),
        ("invalid type: floating point", "found the number"),
        ("invalid type: boolean", "found"),
        ("invalid type: unit value", "found an empty value"),
        ("invalid value: integer", "the number"),
    ];
    for (from, to) in words {
        message = message.replace(from, to);
    }
    clip(&message)
}

/// The key of a `duplicate field` error.
fn duplicate_key(raw: &str) -> Option<String> {
    let rest = raw.split("duplicate field `").nth(1)?;
    Some(rest.split('`').next()?.to_owned())
}

/// The 1-based line of the second `key:` at or after line `from` (serde reports the mapping's start).
fn second_occurrence(text: &str, from: usize, key: &str) -> Option<usize> {
    let pattern = format!("{key}:");
    let mut seen = 0;
    for (index, line) in text.lines().enumerate().skip(from.saturating_sub(1)) {
        let mut rest = line;
        while let Some(at) = rest.find(&pattern) {
            let before = rest[..at].chars().next_back();
            if before.is_none_or(|c| matches!(c, ' ' | '{' | ',' | '-' | '\t')) {
                seen += 1;
                if seen == 2 {
                    return Some(index + 1);
                }
            }
            rest = &rest[at + pattern.len()..];
        }
    }
    None
}

/// Cuts every backticked string, and the whole message, to [`MAX_ECHO_CHARS`] characters (plus the unchanged
/// list of expected keys), so a megabyte key is not echoed.
pub(super) fn clip(message: &str) -> String {
    let mut out = String::new();
    for (index, part) in message.split('`').enumerate() {
        if index > 0 {
            out.push('`');
        }
        out.push_str(&cut(part, if index % 2 == 1 { MAX_ECHO_CHARS } else { 4 * MAX_ECHO_CHARS }));
    }
    out
}

/// A field path with each segment cut to [`MAX_ECHO_CHARS`].
fn clip_path(path: &str) -> String {
    path.split('.').map(|segment| cut(segment, MAX_ECHO_CHARS)).collect::<Vec<_>>().join(".")
}

fn cut(text: &str, most: usize) -> String {
    match text.char_indices().nth(most) {
        Some((at, _)) => format!("{}... ({} characters)", &text[..at], text.chars().count()),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_are_stripped_once() {
        assert_eq!(
            strip_locations(
                "did not find expected key at line 5 column 3, while parsing a block mapping at line 1 column 1"
            ),
            "did not find expected key, while parsing a block mapping"
        );
        assert_eq!(strip_locations("control characters at position 340"), "control characters");
    }

    #[test]
    fn long_echoes_are_cut() {
        let key = "k".repeat(1000);
        let clipped = clip(&format!("unknown field `{key}`, expected one of `tp`"));
        assert!(clipped.len() < 200, "{clipped}");
        assert!(clipped.contains("(1000 characters)"), "{clipped}");
        assert!(clipped.ends_with("expected one of `tp`"), "{clipped}");
    }

    #[test]
    fn duplicate_is_found_after_the_mapping_start() {
        let text = "model: {}\nprefill: {tp: 1}\ndecode: {}\nprefill: {tp: 2}\n";
        assert_eq!(second_occurrence(text, 1, "prefill"), Some(4));
        assert_eq!(second_occurrence("a: {tp: 1, tp: 2}\n", 1, "tp"), Some(1));
    }
}
