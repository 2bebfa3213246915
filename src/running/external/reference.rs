//! kvrelay's own planner behind the plan protocol (`kvrelay planner`): the protocol's reference implementation,
//! and the proof that a planner outside the process sees enough. It rebuilds each query from the case's scenario
//! file (its own layout and request, as the prefill rank holds them) and from the wire frames the query carries
//! (the peer's registration and the request's metadata), then answers with [`seat::kvrelay_copies`].

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;

use serde_json::{json, Value};

use super::protocol::{self, Answer};
use crate::engine::seat::{self, SeatQuery};
use crate::model::RankId;
use crate::plan::Local;
use crate::scenario::{self, Scenario};
use crate::wire::{Registration, RequestMeta};

/// Why the reference planner cannot read a query (answered as a rejection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    #[error("reference planner: the query names no case")]
    NoCase,
    #[error("reference planner: {0}")]
    Scenario(#[from] crate::scenario::ScenarioError),
    #[error("reference planner: no such rank")]
    NoRank,
    #[error("reference planner: `{key}` is not hex frames")]
    NotHex { key: &'static str },
    #[error(transparent)]
    Wire(#[from] crate::wire::WireError),
    #[error("reference planner: no such request")]
    NoRequest,
}

error_kinds! {
    /// The kind of a [`ReferenceError`].
    pub enum ReferenceErrorKind {
        /// The query's case is missing or its scenario does not load.
        Case = "case",
        /// The query names a rank or request the scenario does not have.
        Unknown = "unknown",
        /// The query's frames are not hex or not valid wire messages.
        Frames = "frames",
    }
}

impl ReferenceError {
    /// The failure's kind (stable across rewording).
    pub fn kind(&self) -> ReferenceErrorKind {
        match self {
            ReferenceError::NoCase | ReferenceError::Scenario(_) => ReferenceErrorKind::Case,
            ReferenceError::NoRank | ReferenceError::NoRequest => ReferenceErrorKind::Unknown,
            ReferenceError::NotHex { .. } | ReferenceError::Wire(_) => ReferenceErrorKind::Frames,
        }
    }
}

/// Answers every query line of `input` on `output` until `input` ends.
pub fn serve(input: impl BufRead, mut output: impl Write) -> std::io::Result<()> {
    let mut scenarios: BTreeMap<String, Scenario> = BTreeMap::new();
    for line in input.lines() {
        let line = line?;
        let reply = match serde_json::from_str::<Value>(&line) {
            Ok(value) if value["type"] == "hello" => json!({
                "type": "hello",
                "protocol": protocol::NAME,
                "version": protocol::VERSION,
                "planner": format!("kvrelay reference planner {}", env!("CARGO_PKG_VERSION")),
            })
            .to_string(),
            Ok(value) if value["type"] == "plan" || value["type"] == "link" => {
                let id = value["id"].as_u64().unwrap_or(0);
                let kind = value["type"].as_str().unwrap_or("plan");
                let answer = answer(&value, &mut scenarios).unwrap_or_else(|error| Answer::Rejected(error.to_string()));
                protocol::answer_line(kind, id, &answer)
            }
            _ => json!({ "type": "error", "error": "not a plan-protocol message" }).to_string(),
        };
        writeln!(output, "{reply}")?;
        output.flush()?;
    }
    Ok(())
}

/// kvrelay's answer to one query, or why the query cannot be read (as a rejection).
fn answer(query: &Value, scenarios: &mut BTreeMap<String, Scenario>) -> Result<Answer, ReferenceError> {
    let case = query["case"].as_str().ok_or(ReferenceError::NoCase)?;
    if !scenarios.contains_key(case) {
        let scenario = scenario::load(Path::new(case))?;
        scenarios.insert(case.to_owned(), scenario);
    }
    let problem = &scenarios[case].problem;
    let rank = RankId {
        dp: query["rank"]["dp"].as_u64().unwrap_or(0) as u32,
        cp: query["rank"]["cp"].as_u64().unwrap_or(0) as u32,
        pp: query["rank"]["pp"].as_u64().unwrap_or(u64::MAX) as u32,
        tp: query["rank"]["tp"].as_u64().unwrap_or(u64::MAX) as u32,
    };
    let layout = problem.prefill.ranks.iter().find(|layout| layout.rank == rank).ok_or(ReferenceError::NoRank)?;
    let frames = |key: &'static str| protocol::unhex_frames(&query[key]).ok_or(ReferenceError::NotHex { key });
    let registration = Registration::decode(&frames("registration_frames")?)?;
    let local = Local { model: &problem.model, topology: &problem.prefill.topology, layout };
    if query["type"] == "link" {
        return Ok(match seat::kvrelay_link(local, &registration) {
            Ok(_) => Answer::Linked,
            Err(error) => Answer::Rejected(error.to_string()),
        });
    }
    let meta = RequestMeta::decode(&frames("meta_frames")?)?;
    let request =
        problem.requests.iter().find(|request| u64::from(request.id) == meta.room).ok_or(ReferenceError::NoRequest)?;
    let view = seat::view(request, &meta, &problem.model);
    let query = SeatQuery { rank, local, registration: &registration, meta: &meta, request: &view };
    Ok(match seat::kvrelay_copies(&query) {
        Ok(copies) => Answer::Copies(copies),
        Err(error) => Answer::Rejected(error.to_string()),
    })
}
