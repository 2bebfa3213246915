//! The planner's seat: who decides a prefill rank's writes. kvrelay's own planner sits there by default
//! (`plan::link` at registration, `Link::chunk_groups` per chunk); another planner can take the seat through
//! [`Planner`] (an external process speaking the plan protocol: `crate::external`). It is asked once per room and
//! peer, with exactly what the prefill rank knows then: its own layout, the peer's decoded registration, the
//! request's decoded metadata and its chunks, and it answers with byte copies per chunk or a rejection text.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;

use crate::model::{RankId, Request};
use crate::plan::Local;
use crate::wire::{Registration, RequestMeta};

/// What a prefill rank knows when it plans one room for one peer (domain.md §6.1 step 5).
#[derive(Debug)]
pub struct SeatQuery<'a> {
    pub rank: RankId,
    pub local: Local<'a>,
    /// The peer's registration as decoded from the wire.
    pub registration: &'a Registration,
    /// The request's metadata from that peer, as decoded from the wire.
    pub meta: &'a RequestMeta,
    /// This rank's view of the request: its own pages, state indices and chunks, with the peer's pages, indices
    /// and prefix from the metadata (what kvrelay's own planner plans from).
    pub request: &'a Request,
}

/// One planned copy: `length` bytes at `source_offset` of local region `source_region` to `target_offset` of the
/// peer's region `target_region` (regions in registration order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeatCopy {
    pub source_region: u32,
    pub source_offset: u64,
    pub target_region: u32,
    pub target_offset: u64,
    pub length: u64,
}

/// A planner in the seat.
pub trait Planner {
    /// The copies of every chunk of `query.request` (one list per chunk, in chunk order), or the planner's
    /// rejection of the room in its own words.
    fn plan(&mut self, query: &SeatQuery<'_>) -> Result<Vec<Vec<SeatCopy>>, String>;
}

/// One planner shared by every prefill engine of a run (one external process serves them all).
#[derive(Clone)]
pub struct SharedPlanner(pub Rc<RefCell<dyn Planner>>);

impl fmt::Debug for SharedPlanner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedPlanner")
    }
}
