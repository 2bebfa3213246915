//! The oracle's self-test (`kvrelay selftest`): known layout bugs ([`mutants::Mutant`]) planted in kvrelay's own
//! plans, each run through the engines on the in-memory fabric with the bug in every prefill rank's planner seat,
//! and the independent oracle required to flag every one.
//!
//! A [`MutantPlanner`] takes the seat: it links and plans like kvrelay's own planner (`plan::link`,
//! `Link::chunk_groups`), lets its mutant rewrite each chunk's transfer groups, and records which transfer kinds the
//! rewrite changed. Per scenario a mutant is `n/a` when it cannot change a byte there (from the problem alone),
//! caught when the run fails its expectation (oracle violations, or rooms that end otherwise than expected), and
//! survived otherwise. The selftest lives outside `plan` and `verify`: the oracle never sees the planner.

pub mod mutants;

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;

use crate::engine::seat::{kvrelay_link, LinkQuery, Planner, SeatCopy, SeatError, SeatQuery, SharedPlanner};
use crate::fabric::registry::Fabric;
use crate::harness::{self, Budget, RunError};
use crate::plan::{self, PlanError, TransferGroup, TransferKind};
use crate::scenario::Scenario;
pub use mutants::{Mutant, ALL};

/// A planner in the seat that plans like kvrelay and then plants `mutant` (none: kvrelay's own plans).
pub struct MutantPlanner {
    mutant: Option<Mutant>,
    /// The transfer kinds whose copies the mutant changed, by table name.
    pub changed: BTreeSet<&'static str>,
}

impl MutantPlanner {
    pub fn new(mutant: Option<Mutant>) -> MutantPlanner {
        MutantPlanner { mutant, changed: BTreeSet::new() }
    }

    fn chunk(&mut self, query: &SeatQuery<'_>, site: &mutants::Site<'_>) -> Result<Vec<SeatCopy>, PlanError> {
        let groups = site.link.chunk_groups(query.request, site.chunk)?;
        let Some(mutant) = self.mutant else { return Ok(copies(groups)) };
        let mutated = mutant.mutate(site, groups.clone())?;
        let relayout = site.link.requires_relayout();
        let kinds: BTreeSet<TransferKind> = groups.iter().chain(&mutated).map(|group| group.kind).collect();
        for kind in kinds {
            let of_kind = |groups: &[TransferGroup]| {
                let mut res = copies(groups.iter().filter(|group| group.kind == kind).cloned().collect());
                res.sort_by_key(|copy| {
                    (copy.target_region, copy.target_offset, copy.source_region, copy.source_offset)
                });
                res
            };
            if of_kind(&groups) != of_kind(&mutated) {
                self.changed.insert(mutants::kind_name(kind, query.local.model, relayout));
            }
        }
        Ok(copies(mutated))
    }
}

impl Planner for MutantPlanner {
    fn link(&mut self, query: &LinkQuery<'_>) -> Result<(), SeatError> {
        kvrelay_link(query.local, query.registration).map(|_| ())
    }

    fn plan(&mut self, query: &SeatQuery<'_>) -> Result<Vec<Vec<SeatCopy>>, SeatError> {
        let link = kvrelay_link(query.local, query.registration)?;
        if !link.sends_anything() {
            return Ok(vec![Vec::new(); query.request.chunks.len()]);
        }
        let (peer, _) = plan::peer::from_registration(query.local, query.registration)?;
        let mut res = Vec::new();
        for chunk in 0..query.request.chunks.len() as u32 {
            let site = mutants::Site { query, peer: &peer, link: &link, chunk };
            res.push(self.chunk(query, &site)?);
        }
        Ok(res)
    }
}

fn copies(groups: Vec<TransferGroup>) -> Vec<SeatCopy> {
    crate::engine::seat::group_copies(groups)
}

/// How one mutant fared on one scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The bug cannot change a byte here, and why.
    NotApplicable(&'static str),
    /// The run failed its expectation; the first violation (or room failure) in coordinates. `by_oracle`: the
    /// oracle's byte checks flagged it (not only a room that ended otherwise than expected).
    Caught { example: String, by_oracle: bool },
    /// The run passed with the bug planted; `changed` says whether any copy differed at all.
    Survived { changed: bool },
}

/// One mutant on one scenario.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    pub scenario: String,
    pub verdict: Verdict,
    /// The transfer kinds whose copies the mutant changed on this scenario.
    pub kinds: BTreeSet<&'static str>,
}

/// Runs `scenario` with `mutant` planted (none: kvrelay's own plans) and judges it.
pub fn run_case(scenario: &Scenario, budget: &Budget, mutant: Option<Mutant>) -> Result<Case, RunError> {
    run_case_on(scenario, budget, mutant, &Fabric::Sim)
}

/// [`run_case`] on `fabric` (the live driver on its engines for every fabric but `sim`).
pub fn run_case_on(
    scenario: &Scenario,
    budget: &Budget,
    mutant: Option<Mutant>,
    fabric: &Fabric,
) -> Result<Case, RunError> {
    let name = scenario.file.clone();
    if let Some(Err(reason)) = mutant.map(|mutant| mutant.applies(&scenario.problem)) {
        return Ok(Case { scenario: name, verdict: Verdict::NotApplicable(reason), kinds: BTreeSet::new() });
    }
    let planner = Rc::new(RefCell::new(MutantPlanner::new(mutant)));
    let seat = Some(SharedPlanner(planner.clone()));
    let routed = mutant.and_then(|mutant| mutant.route(&scenario.problem));
    let mut run = harness::Run::new(scenario, budget).on(fabric).planner(seat);
    if let Some(routed) = &routed {
        run = run.routed(routed);
    }
    let outcome = run.execute()?;
    let mut kinds = std::mem::take(&mut planner.borrow_mut().changed);
    if routed.is_some_and(|routed| routed.requests != scenario.problem.requests) {
        kinds.insert("dp-routing");
    }
    let verdict = if outcome.passed() {
        Verdict::Survived { changed: !kinds.is_empty() }
    } else {
        let example = match outcome.violations.first() {
            Some(violation) => format!("{violation}"),
            None => format!("rooms: {}", outcome.failure_text("; ")),
        };
        Verdict::Caught { example, by_oracle: !outcome.violations.is_empty() }
    };
    Ok(Case { scenario: name, verdict, kinds })
}
