//! The event trace of a run: one [`TraceEvent`] per control message delivered and per engine note, in the order the
//! driver logged them, with its text line (`kvrelay run --trace`), its JSON line (`--trace-out`), the trace's hash
//! (`trace hash: ...`) and the first place two traces diverge (`--check-determinism`).
//!
//! On the in-memory fabric the same problem (scenario and seed) gives the same trace, event for event: simulated
//! time, fixed per-pair message order, no `HashMap` iteration and no clock. Live runs log wall-clock times instead.

use std::fmt;

use serde::Serialize;
use sha2::{Digest as _, Sha256};

/// The `kind` of an engine's note (messages carry their message kind: registration, link, metadata, status).
pub const NOTE: &str = "note";

/// One event: when, what kind, from which rank (to which, for a message) and what.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct TraceEvent {
    /// Simulated nanoseconds since the start (wall nanoseconds in a live run).
    pub time_ns: u64,
    /// `note`, or the message kind (`registration`, `link`, `metadata`, `status`, `unknown`).
    pub kind: &'static str,
    /// The rank that sent the message or logged the note (`prefill pp0/tp1`).
    pub from: String,
    /// The receiving rank of a message; `None` for a note.
    pub to: Option<String>,
    /// The decoded message or the note.
    pub text: String,
}

impl TraceEvent {
    /// The event as one line of JSON (keys in field order: `time_ns`, `kind`, `from`, `to`, `text`), no newline.
    pub fn json_line(&self) -> String {
        serde_json::to_string(self).expect("a trace event always serialises")
    }
}

impl fmt::Display for TraceEvent {
    /// The `--trace` line: time in microseconds, sender, receiver (messages only), text.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let time = self.time_ns as f64 / 1e3;
        match &self.to {
            Some(to) => write!(f, "{time:>12.3} us  {} -> {to}: {}", self.from, self.text),
            None => write!(f, "{time:>12.3} us  {}: {}", self.from, self.text),
        }
    }
}

/// SHA-256 (lowercase hex) of the trace's JSON lines, each followed by `\n`: exactly the bytes `--trace-out`
/// writes, so `sha256sum` of that file gives the same hash.
pub fn hash(trace: &[TraceEvent]) -> String {
    let mut hasher = Sha256::new();
    for event in trace {
        hasher.update(event.json_line().as_bytes());
        hasher.update(b"\n");
    }
    hasher.finalize().iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Where two traces first differ: the index and each trace's event there (`None`: that trace ended first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence<'a> {
    pub index: usize,
    pub first: Option<&'a TraceEvent>,
    pub second: Option<&'a TraceEvent>,
}

/// The first event at which `first` and `second` differ (`None`: identical).
pub fn first_divergence<'a>(first: &'a [TraceEvent], second: &'a [TraceEvent]) -> Option<Divergence<'a>> {
    let index = first.iter().zip(second).position(|(a, b)| a != b).unwrap_or(first.len().min(second.len()));
    (index < first.len().max(second.len())).then(|| Divergence {
        index,
        first: first.get(index),
        second: second.get(index),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(time_ns: u64, text: &str) -> TraceEvent {
        TraceEvent { time_ns, kind: NOTE, from: "decode pp0/tp0".to_owned(), to: None, text: text.to_owned() }
    }

    #[test]
    fn lines_and_json() {
        let note = event(20_000, "room 0 done");
        assert_eq!(note.to_string(), "      20.000 us  decode pp0/tp0: room 0 done");
        assert_eq!(
            note.json_line(),
            r#"{"time_ns":20000,"kind":"note","from":"decode pp0/tp0","to":null,"text":"room 0 done"}"#
        );
        let message = TraceEvent { kind: "status", to: Some("decode pp0/tp1".to_owned()), ..event(1_500, "status") };
        assert_eq!(message.to_string(), "       1.500 us  decode pp0/tp0 -> decode pp0/tp1: status");
    }

    #[test]
    fn hash_is_of_the_json_lines() {
        assert_eq!(hash(&[]), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        let trace = [event(1, "a"), event(2, "b")];
        assert_eq!(hash(&trace), hash(&trace.clone()));
        assert_ne!(hash(&trace), hash(&[event(1, "a"), event(3, "b")]));
        assert_ne!(hash(&trace), hash(&trace[..1]));
    }

    #[test]
    fn divergence_names_the_first_differing_event() {
        let a = [event(1, "a"), event(2, "b"), event(3, "c")];
        let b = [event(1, "a"), event(2, "x")];
        assert_eq!(first_divergence(&a, &a), None);
        let found = first_divergence(&a, &b).unwrap();
        assert_eq!((found.index, found.first, found.second), (1, Some(&a[1]), Some(&b[1])));
        let found = first_divergence(&a, &a[..2]).unwrap();
        assert_eq!((found.index, found.first, found.second), (2, Some(&a[2]), None));
    }
}
