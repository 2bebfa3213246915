//! The planner's seat: who decides a prefill rank's writes. kvrelay's own planner sits there by default
//! (`plan::link` at registration, `Link::chunk_groups` per chunk); another planner can take the seat through
//! [`Planner`] (an external process speaking the plan protocol: `crate::external`). It is asked once per room and
//! peer, with exactly what the prefill rank knows then: its own layout, the peer's decoded registration, the
//! request's decoded metadata and its chunks, and it answers with byte copies per chunk or a rejection text.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;

use crate::model::{ModelGeometry, RankId, Request, StateIndices, StateKind};
use crate::plan::{Descriptor, Link, Local, Plan, TransferGroup};
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

/// What a prefill rank knows when a decode peer registers (domain.md §6.3).
#[derive(Debug)]
pub struct LinkQuery<'a> {
    pub rank: RankId,
    pub local: Local<'a>,
    /// The peer's registration as decoded from the wire.
    pub registration: &'a Registration,
}

error_kinds! {
    /// The kind of a [`SeatError`].
    pub enum SeatErrorKind {
        /// The planner refused the peer or the room, in its own words (a rejection: the peer or room fails with it).
        Rejected = "rejected",
        /// The planner broke its contract (exited, answered malformed or the wrong shape, or too few chunks).
        Broken = "broken",
    }
}

/// Why the planner in the seat gave no copies.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SeatError {
    /// The planner's rejection text (what the failed rooms carry on the wire).
    #[error("{0}")]
    Rejected(String),
    /// What went wrong with the planner.
    #[error("{0}")]
    Broken(String),
}

impl SeatError {
    pub fn kind(&self) -> SeatErrorKind {
        match self {
            SeatError::Rejected(_) => SeatErrorKind::Rejected,
            SeatError::Broken(_) => SeatErrorKind::Broken,
        }
    }
}

impl From<crate::plan::PlanError> for SeatError {
    fn from(error: crate::plan::PlanError) -> SeatError {
        SeatError::Rejected(error.to_string())
    }
}

/// A planner in the seat.
pub trait Planner {
    /// Whether this prefill rank can serve the peer at all (registration time): `Err` refuses it with the
    /// planner's reason; the decode rank then fails its requests and withdraws them (domain.md §6.4).
    fn link(&mut self, query: &LinkQuery<'_>) -> Result<(), SeatError>;

    /// The copies of every chunk of `query.request` (one list per chunk, in chunk order), or the planner's
    /// rejection of the room in its own words (the room then fails on this prefill rank, for every peer).
    fn plan(&mut self, query: &SeatQuery<'_>) -> Result<Vec<Vec<SeatCopy>>, SeatError>;
}

/// One planner shared by every prefill engine of a run (one external process serves them all).
#[derive(Clone)]
pub struct SharedPlanner(pub Rc<RefCell<dyn Planner>>);

impl fmt::Debug for SharedPlanner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SharedPlanner")
    }
}

/// kvrelay's own planner: the link's groups for every chunk of `view`, as copies per chunk.
pub fn own_copies(link: &Link, view: &Request) -> Result<Vec<Vec<SeatCopy>>, SeatError> {
    let mut planned = Vec::new();
    for index in 0..view.chunks.len() {
        let groups = link.chunk_groups(view, index as u32)?;
        planned.push(group_copies(groups));
    }
    Ok(planned)
}

/// kvrelay's own planner as strided descriptors per chunk (`plan::descriptor`): for an engine that takes strided
/// entries, the same bytes as [`own_copies`] in a form that does not grow with the rows.
pub fn own_descriptors(link: &Link, view: &Request) -> Result<Vec<Vec<Descriptor>>, SeatError> {
    let mut planned = Vec::new();
    for index in 0..view.chunks.len() {
        let groups = link.chunk_groups(view, index as u32)?;
        planned.push(Plan { groups, explain: Vec::new() }.descriptors());
    }
    Ok(planned)
}

/// One chunk's transfer groups as the seat's byte copies, in plan order.
pub fn group_copies(groups: Vec<TransferGroup>) -> Vec<SeatCopy> {
    let plan = Plan { groups, explain: Vec::new() };
    let copies = plan.copies().map(|copy| SeatCopy {
        source_region: copy.source_region,
        source_offset: copy.source_offset,
        target_region: copy.target_region,
        target_offset: copy.target_offset,
        length: copy.length,
    });
    copies.collect()
}

/// The request as this prefill rank plans it for one peer: its own pages and chunks, the peer's pages, indices and
/// prefix from the metadata (domain.md §6.1 step 4).
pub fn view(local: &Request, meta: &RequestMeta, model: &ModelGeometry) -> Request {
    let mut view = local.clone();
    view.decode_prefix = meta.decode_prefix_len;
    view.staging_offsets = meta.staging_offsets.clone();
    // A HiSparse decode sends host pages for its KV and, with a draft, the logical pages for the draft.
    if meta.device_kv_indices.is_empty() {
        view.decode_pages = meta.kv_indices.clone();
        view.decode_host_pages = Vec::new();
    } else {
        view.decode_pages = meta.device_kv_indices.clone();
        view.decode_host_pages = meta.kv_indices.clone();
    }
    let slot = model
        .state
        .iter()
        .zip(&meta.state_indices)
        .find(|(component, _)| component.kind == StateKind::Mamba)
        .and_then(|(_, indices)| indices.first().copied())
        .unwrap_or(0);
    let pages = model
        .state
        .iter()
        .enumerate()
        .map(|(index, component)| match component.kind {
            StateKind::Mamba => Vec::new(),
            _ => meta.state_indices.get(index).cloned().unwrap_or_default(),
        })
        .collect();
    view.decode_state = StateIndices { slot, aux: meta.aux_index.unwrap_or(0), pages };
    view
}

/// kvrelay's own link of a registered peer (the reference planner's answer to a link query).
pub fn kvrelay_link(local: Local<'_>, registration: &Registration) -> Result<Link, SeatError> {
    let (peer, _) = crate::plan::peer::from_registration(local, registration)?;
    Ok(crate::plan::link(local, &peer)?)
}

/// What kvrelay's own planner answers to `query` (the reference planner of the plan protocol): the link from the
/// peer's registration, then the link's copies for every chunk; a rejection in the planner's words.
pub fn kvrelay_copies(query: &SeatQuery<'_>) -> Result<Vec<Vec<SeatCopy>>, SeatError> {
    let link = kvrelay_link(query.local, query.registration)?;
    if !link.sends_anything() {
        return Ok(vec![Vec::new(); query.request.chunks.len()]);
    }
    own_copies(&link, query.request)
}
