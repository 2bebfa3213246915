//! The one run pipeline: a [`Run`] is built from a scenario, a budget, a [`Fabric`] (or a transport under
//! certification), the planner in the prefill ranks' seat, faults and the simulation's options; [`Run::engines`]
//! checks the budget and drives every rank's engine on the fabric, and [`Run::execute`] also judges every decode
//! rank (the composed plan's verdict, the oracle, the rooms, or the fault guarantee under faults). `check`, `run`,
//! `diff`, `certify`, `sim`, `selftest`, `shrink`, `bench` and `replay` all go through it.

use crate::engine::live::{self, LiveOptions};
use crate::engine::seat::SharedPlanner;
use crate::engine::sim::{SimOptions, SimRun};
use crate::engine::tasks;
use crate::fabric::faults::FaultPlan;
use crate::fabric::registry::{Fabric, RDMA_CAPS};
use crate::fabric::transport::Transport;
use crate::model::Problem;
use crate::scenario::Scenario;

use super::{check_budget, judge, Budget, Failure, FailureKind, Judge, Outcome, RunError};

/// One run of a scenario through the engines (module docs).
pub struct Run<'a> {
    scenario: &'a Scenario,
    /// What the engines run when it differs from the scenario's problem (a routing bug under self-test).
    routed: Option<&'a Problem>,
    budget: Budget,
    fabric: Fabric,
    transport: Option<&'a mut dyn Transport>,
    planner: Option<SharedPlanner>,
    faults: Option<FaultPlan>,
    sim: SimOptions,
    live: LiveOptions,
    mark: Option<&'a mut dyn FnMut(&'static str)>,
}

impl<'a> Run<'a> {
    /// `scenario` on the in-memory fabric in simulated time, with its own faults, within `budget`.
    pub fn new(scenario: &'a Scenario, budget: &Budget) -> Run<'a> {
        Run {
            scenario,
            routed: None,
            budget: budget.clone(),
            fabric: Fabric::Sim,
            transport: None,
            planner: None,
            faults: None,
            sim: SimOptions::default(),
            live: LiveOptions::default(),
            mark: None,
        }
    }

    /// On `fabric` (`sim`: the simulation driver; every other: the live driver on its transport's engines).
    pub fn on(mut self, fabric: &Fabric) -> Run<'a> {
        self.fabric = fabric.clone();
        self
    }

    /// On the engines of `transport` (a transport under certification), with the live driver.
    pub fn on_transport(mut self, transport: &'a mut dyn Transport) -> Run<'a> {
        self.transport = Some(transport);
        self
    }

    /// The engines run `routed` (the scenario's problem with its requests dispatched otherwise: a routing bug the
    /// self-test plants); the oracle still judges against the scenario's own problem.
    pub fn routed(mut self, routed: &'a Problem) -> Run<'a> {
        self.routed = Some(routed);
        self
    }

    /// With `planner` in every prefill rank's seat (judged by the rooms and the oracle only).
    pub fn planner(mut self, planner: Option<SharedPlanner>) -> Run<'a> {
        self.planner = planner;
        self
    }

    /// With `faults` instead of the scenario's own (judged by the fault guarantee when any).
    pub fn faults(mut self, faults: FaultPlan) -> Run<'a> {
        self.faults = Some(faults);
        self
    }

    /// With these simulation options (trace, images, chunk pool, caps, time limit; its planner and faults are
    /// replaced by the run's own when set).
    pub fn sim_options(mut self, options: &SimOptions) -> Run<'a> {
        self.sim = options.clone();
        self
    }

    /// With these live-driver options (real-clock fabrics).
    pub fn live_options(mut self, options: &LiveOptions) -> Run<'a> {
        self.live = options.clone();
        self
    }

    /// With the event trace on.
    pub fn trace(mut self, trace: bool) -> Run<'a> {
        self.sim.trace = trace;
        self.live.trace = trace;
        self
    }

    /// Calls `mark` after each phase of a simulated run (stage, execute, observe: the benchmark's timings).
    pub fn marked(mut self, mark: &'a mut dyn FnMut(&'static str)) -> Run<'a> {
        self.mark = Some(mark);
        self
    }

    /// The faults the run injects: its own, else the simulation options', else the scenario's own when kvrelay's
    /// planner runs on the in-memory fabric in simulated time (the one place faults are injected; a planner in the
    /// seat and a transport under certification run a fault scenario without its faults, as before the pipeline).
    fn fault_plan(&self) -> FaultPlan {
        match &self.faults {
            Some(faults) => faults.clone(),
            None if !self.sim.faults.is_empty() => self.sim.faults.clone(),
            None if self.planner.is_none() && self.transport.is_none() => self.scenario.faults.clone(),
            None => FaultPlan::default(),
        }
    }

    /// Whose plan the run is judged against.
    fn judge(&self) -> Judge {
        if self.planner.is_some() {
            Judge::SeatOnly
        } else if !self.fault_plan().is_empty() && self.fabric.simulated() && self.transport.is_none() {
            Judge::Guarantee
        } else {
            Judge::OwnPlan
        }
    }

    /// Checks the budget, then drives the engines: the run, or the fabric's failure in words.
    pub fn engines(&mut self) -> Result<Result<SimRun, Failure>, RunError> {
        check_budget(&self.scenario.problem, &self.budget)?;
        Ok(self.drive().map_err(|text| Failure::new(FailureKind::Fabric, text)))
    }

    fn drive(&mut self) -> Result<SimRun, String> {
        let problem = self.routed.unwrap_or(&self.scenario.problem);
        let faults = self.fault_plan();
        let live = LiveOptions { planner: self.planner.clone().or(self.live.planner.clone()), ..self.live.clone() };
        if let Some(transport) = self.transport.as_deref_mut() {
            return live::run_local(problem, &live, |node| transport.engine(node, RDMA_CAPS))
                .map_err(|error| error.to_string());
        }
        if !self.fabric.simulated() {
            if !faults.is_empty() {
                let name = self.fabric.name();
                return Err(format!("the scenario's faults are injected by the in-memory fabric only, not on {name}"));
            }
            let mut transport = self.fabric.transport().map_err(|error| error.to_string())?;
            let name = self.fabric.name();
            return live::run_local(problem, &live, |node| transport.engine(node, RDMA_CAPS))
                .map_err(|error| format!("the {name} fabric failed: {error}"));
        }
        let options =
            SimOptions { faults, planner: self.planner.clone().or(self.sim.planner.clone()), ..self.sim.clone() };
        let run = match self.mark.as_deref_mut() {
            Some(mark) => tasks::run_marked(problem, &options, mark),
            None => tasks::run(problem, &options),
        };
        run.map_err(|error| format!("the simulated fabric failed: {error}"))
    }

    /// [`Run::engines`], then every decode rank judged ([`Outcome`]).
    pub fn execute(mut self) -> Result<Outcome, RunError> {
        let engine = self.engines()?;
        Ok(judge(self.scenario, engine, self.judge()))
    }
}
