//! Seeded faults as data: the fault kinds, a rule (a kind and how often it fires) and a plan (the rules of a run and
//! the seed their draws derive from), as a scenario's `faults:` list or a swarm names them.
//!
//! Pure vocabulary, below [`crate::scenario`] which parses it: what each kind does, and the injection that draws the
//! rules, belong to the fabric that injects them ([`crate::fabric::faults`], which re-exports these types).

/// The completion status a `wr_error` fault completes its work request with (verbs' `IBV_WC_REM_ACCESS_ERR` or
/// `IBV_WC_RETRY_EXC_ERR`; the fabric turns it into its own status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WrErrorStatus {
    /// The remote range is not inside the peer's region of the rkey.
    RemoteAccess,
    /// The peer did not answer.
    RetryExceeded,
}

/// What goes wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FaultKind {
    WrError(WrErrorStatus),
    TornWrite,
    Corrupt,
    DropCompletion,
    DuplicateCompletion,
    DropMessage,
    DuplicateMessage,
    CrashPrefill,
    NotifyBeforeData,
    DelayMessage,
    ReorderMessage,
    DelayCompletion,
    ReorderCompletion,
    Timeout,
    ReadAfterRelease,
    CrashRestartPrefill,
}

impl FaultKind {
    /// Every kind, in the order of the names below (swarm runs draw subsets of it).
    pub const ALL: [FaultKind; 17] = [
        FaultKind::WrError(WrErrorStatus::RemoteAccess),
        FaultKind::WrError(WrErrorStatus::RetryExceeded),
        FaultKind::TornWrite,
        FaultKind::Corrupt,
        FaultKind::DropCompletion,
        FaultKind::DuplicateCompletion,
        FaultKind::DropMessage,
        FaultKind::DuplicateMessage,
        FaultKind::CrashPrefill,
        FaultKind::NotifyBeforeData,
        FaultKind::DelayMessage,
        FaultKind::ReorderMessage,
        FaultKind::DelayCompletion,
        FaultKind::ReorderCompletion,
        FaultKind::Timeout,
        FaultKind::ReadAfterRelease,
        FaultKind::CrashRestartPrefill,
    ];

    /// The name in a `faults:` list.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::WrError(WrErrorStatus::RemoteAccess) => "wr_error_remote_access",
            FaultKind::WrError(WrErrorStatus::RetryExceeded) => "wr_error_retry_exceeded",
            FaultKind::TornWrite => "torn_write",
            FaultKind::Corrupt => "corrupt",
            FaultKind::DropCompletion => "drop_completion",
            FaultKind::DuplicateCompletion => "duplicate_completion",
            FaultKind::DropMessage => "drop_message",
            FaultKind::DuplicateMessage => "duplicate_message",
            FaultKind::CrashPrefill => "crash_prefill",
            FaultKind::NotifyBeforeData => "notify_before_data",
            FaultKind::DelayMessage => "delay_message",
            FaultKind::ReorderMessage => "reorder_message",
            FaultKind::DelayCompletion => "delay_completion",
            FaultKind::ReorderCompletion => "reorder_completion",
            FaultKind::Timeout => "timeout",
            FaultKind::ReadAfterRelease => "read_after_release",
            FaultKind::CrashRestartPrefill => "crash_restart_prefill",
        }
    }

    /// The kind named `name`, if any.
    pub fn parse(name: &str) -> Option<FaultKind> {
        FaultKind::ALL.into_iter().find(|kind| kind.name() == name)
    }

    /// Whether it happens to a work request (otherwise to a control message).
    pub fn on_work_request(self) -> bool {
        !matches!(
            self,
            FaultKind::DropMessage | FaultKind::DuplicateMessage | FaultKind::DelayMessage | FaultKind::ReorderMessage
        )
    }

    /// Whether the bytes it leaves are wrong while every status says Success (only the oracle can see it).
    pub fn silent(self) -> bool {
        matches!(self, FaultKind::Corrupt | FaultKind::NotifyBeforeData | FaultKind::ReadAfterRelease)
    }
}

/// One rule: `kind` happens with `probability` (0 to 1) to each work request or message it applies to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultRule {
    pub kind: FaultKind,
    pub probability: f64,
}

/// The rules of a run and the seed their streams derive from.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultPlan {
    pub seed: u64,
    pub rules: Vec<FaultRule>,
}

impl FaultPlan {
    /// Whether any rule can fire.
    pub fn is_empty(&self) -> bool {
        self.rules.iter().all(|rule| rule.probability <= 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_their_names() {
        for kind in FaultKind::ALL {
            assert_eq!(FaultKind::parse(kind.name()), Some(kind));
        }
        assert_eq!(FaultKind::parse("teleport"), None);
    }
}
