//! `SimFabric`: byte-accurate memory per rank and region; writes execute at post time, bounds-checked.

use std::collections::BTreeMap;

use super::transport::{Completion, CompletionStatus, Transport, TransportError, WriteRequest};
use crate::verify::RegionKey;

/// In-memory fabric. A write outside a registered region completes in error and never touches memory.
#[derive(Debug, Default)]
pub struct SimFabric {
    regions: BTreeMap<RegionKey, Vec<u8>>,
    completions: Vec<Completion>,
}

impl SimFabric {
    pub fn new() -> SimFabric {
        SimFabric::default()
    }

    fn execute(&mut self, write: &WriteRequest) -> CompletionStatus {
        let in_bounds = |bytes: &Vec<u8>, offset: u64| {
            offset.checked_add(write.length).is_some_and(|end| end <= bytes.len() as u64)
        };
        match self.regions.get(&write.source) {
            Some(bytes) if in_bounds(bytes, write.source_offset) => {}
            _ => return CompletionStatus::LocalProtection,
        }
        match self.regions.get(&write.target) {
            Some(bytes) if in_bounds(bytes, write.target_offset) => {}
            _ => return CompletionStatus::RemoteAccess,
        }
        let source = write.source_offset as usize..(write.source_offset + write.length) as usize;
        let target = write.target_offset as usize;
        if write.source == write.target {
            self.regions.get_mut(&write.target).expect("checked above").copy_within(source, target);
        } else {
            // Two distinct map entries: take the source out to borrow both without unsafe.
            let bytes = self.regions.remove(&write.source).expect("checked above");
            let target_bytes = self.regions.get_mut(&write.target).expect("checked above");
            target_bytes[target..target + source.len()].copy_from_slice(&bytes[source]);
            self.regions.insert(write.source, bytes);
        }
        CompletionStatus::Success
    }
}

impl Transport for SimFabric {
    fn register(&mut self, key: RegionKey, bytes: Vec<u8>) -> Result<(), TransportError> {
        if self.regions.contains_key(&key) {
            return Err(TransportError::AlreadyRegistered(key));
        }
        self.regions.insert(key, bytes);
        Ok(())
    }

    fn post_writes(&mut self, writes: &[WriteRequest]) -> Result<(), TransportError> {
        for write in writes {
            let status = self.execute(write);
            self.completions.push(Completion { id: write.id, status });
        }
        Ok(())
    }

    fn poll(&mut self, completions: &mut Vec<Completion>) {
        completions.append(&mut self.completions);
    }

    fn read(&self, key: RegionKey) -> Result<Vec<u8>, TransportError> {
        self.regions.get(&key).cloned().ok_or(TransportError::NotRegistered(key))
    }

    fn release(&mut self, key: RegionKey) -> Result<Vec<u8>, TransportError> {
        self.regions.remove(&key).ok_or(TransportError::NotRegistered(key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{RankId, Side};

    fn key(side: Side, region: u32) -> RegionKey {
        RegionKey { side, rank: RankId::new(0, 0), region }
    }

    #[test]
    fn out_of_bounds_write_completes_in_error_and_writes_nothing() {
        let mut fabric = SimFabric::new();
        fabric.register(key(Side::Prefill, 0), vec![1; 16]).unwrap();
        fabric.register(key(Side::Decode, 0), vec![0; 16]).unwrap();
        let write = |id, target_offset| WriteRequest {
            id,
            source: key(Side::Prefill, 0),
            source_offset: 8,
            target: key(Side::Decode, 0),
            target_offset,
            length: 8,
        };
        fabric.post_writes(&[write(1, 12), write(2, 8)]).unwrap();
        let mut completions = Vec::new();
        fabric.poll(&mut completions);
        assert_eq!(
            completions,
            vec![
                Completion { id: 1, status: CompletionStatus::RemoteAccess },
                Completion { id: 2, status: CompletionStatus::Success }
            ]
        );
        // Only the in-bounds write landed: bytes 8..16 are ones, 0..8 untouched (the failed write aimed at 12..20).
        assert_eq!(fabric.read(key(Side::Decode, 0)).unwrap(), [[0; 8], [1; 8]].concat());
    }
}
