//! TEMPORARY STUB (replaced by the conformance branch before merge).
use super::Transport;
use crate::fabric::verbs::Caps;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaseError {
    Failed(String),
    Unsupported(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Contract,
    ErrorPath,
}

#[derive(Debug)]
pub struct ConformanceCase {
    pub id: &'static str,
    pub group: Group,
    pub claim: &'static str,
    pub caps: Caps,
    pub run: fn(&mut dyn Transport) -> Result<(), CaseError>,
}

pub fn cases() -> &'static [ConformanceCase] {
    &[]
}
