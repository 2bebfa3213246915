//! The connector seat: a transport child (`crate::fabric::child`) that also sits in every prefill rank's planner
//! seat and moves the bytes itself (ops `seat_link` and `seat_send`, `src/fabric/child/README.md`, "Connector
//! seat"). That is how a connector's own send path runs on kvrelay's corpus (SGLang's `MooncakeKVManager` on
//! Mooncake's engine: `tests/connectors/sglang/`): the connector computes every address from the registration
//! kvrelay's decode ranks advertised (the child's own mappings and engine addresses) and writes through its engine;
//! kvrelay's engines carry only the control messages, and the oracle judges the decode bytes read back from the
//! shared files.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Map, Value};

use super::protocol;
use crate::engine::seat::{LinkQuery, Planner, SeatCopy, SeatError, SeatQuery};
use crate::fabric::child::{ChildTransport, OpError};
use crate::model::{Problem, RankId};

/// How long one `seat_send` may take by default (the connector moves a whole request to one peer in it).
pub const SEND_TIMEOUT: Duration = Duration::from_secs(600);

/// The child in every prefill rank's seat: each query goes to the child as `seat_link`/`seat_send` for the node of
/// the asking rank, with the plan protocol's query as its `query`; the child's verdict is the seat's.
pub struct ChildSeat {
    child: ChildTransport,
    /// Prefill rank → its node number (the `node` of the `engine` op that opened its engine).
    nodes: BTreeMap<RankId, u32>,
    case: String,
    send_timeout: Duration,
    next_id: u64,
}

impl ChildSeat {
    /// The seat of `problem`'s prefill ranks in case `case`, served by `child` (a handle on the transport the run's
    /// engines use; nodes numbered as the engines number them: prefill ranks first, in the problem's order).
    pub fn new(child: ChildTransport, problem: &Problem, case: &str, send_timeout: Duration) -> ChildSeat {
        let nodes = problem.prefill.ranks.iter().enumerate().map(|(index, layout)| (layout.rank, index as u32));
        ChildSeat { child, nodes: nodes.collect(), case: case.to_owned(), send_timeout, next_id: 1 }
    }

    /// Asks the child `op` about `query` for `rank`'s node: `Ok` when it accepted (or sent), its verdict as
    /// [`SeatError::Rejected`], and a refusal or a broken child as [`SeatError::Broken`].
    fn ask(&mut self, op: &'static str, rank: RankId, query: Value, timeout: Duration) -> Result<(), SeatError> {
        let Some(node) = self.nodes.get(&rank).copied() else {
            return Err(SeatError::Broken(format!("prefill rank {rank} is not a rank of this scenario")));
        };
        match self.child.call(op, json!({"node": node, "query": query}), timeout) {
            Ok(answer) => {
                verdict(&answer).unwrap_or_else(|problem| Err(SeatError::Broken(self.child.break_with(op, &problem))))
            }
            Err(OpError::Refused(message)) => {
                Err(SeatError::Broken(format!("the connector refused op `{op}` for prefill {rank}: {message}")))
            }
            Err(OpError::Broken(text)) => Err(SeatError::Broken(text)),
        }
    }

    fn id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }
}

/// The child's answer to a seat op: `Ok(Ok)` accepted, `Ok(Err)` its rejection, `Err` a malformed answer.
fn verdict(answer: &Map<String, Value>) -> Result<Result<(), SeatError>, String> {
    match answer.get("rejected") {
        None | Some(Value::Null) => Ok(Ok(())),
        Some(Value::String(text)) => Ok(Err(SeatError::Rejected(text.clone()))),
        Some(other) => Err(format!("field `rejected`: expected a text, got {other}")),
    }
}

impl Planner for ChildSeat {
    fn link(&mut self, query: &LinkQuery<'_>) -> Result<(), SeatError> {
        let line = protocol::link_query(self.id(), &self.case, query);
        let timeout = self.child.call_timeout();
        self.ask("seat_link", query.rank, line, timeout)
    }

    /// The child sends every chunk itself; kvrelay's engines post nothing (an empty list per chunk).
    fn plan(&mut self, query: &SeatQuery<'_>) -> Result<Vec<Vec<SeatCopy>>, SeatError> {
        let line = protocol::query(self.id(), &self.case, query);
        self.ask("seat_send", query.rank, line, self.send_timeout)?;
        Ok(vec![Vec::new(); query.request.chunks.len()])
    }
}
