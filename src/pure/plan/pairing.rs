//! Entry pairing by global layer id, `build_transfer_entry_pairs` (domain.md §4.3).

use std::collections::{BTreeMap, VecDeque};

use super::PlanError;
use crate::model::LayerId;

/// Pairs source entry `i` with target entry `j`; returns `j` for each `i`.
///
/// With ids on both sides, each source entry takes the first unused target entry of the same id.
/// Positional pairing is allowed only when `allow_positional` (prefill PP = 1, domain.md §4.3).
pub(crate) fn pair_entries(
    source_ids: Option<&[LayerId]>,
    target_ids: Option<&[LayerId]>,
    source_entries: usize,
    target_entries: usize,
    allow_positional: bool,
) -> Result<Vec<usize>, PlanError> {
    if source_entries == 0 {
        return Ok(Vec::new());
    }
    match (source_ids, target_ids) {
        (Some(source), Some(target)) => {
            if source.len() != source_entries || target.len() != target_entries {
                return Err(PlanError::LayerMetadataLength {
                    source_ids: source.len(),
                    source_entries,
                    target_ids: target.len(),
                    target_entries,
                });
            }
            let mut queues: BTreeMap<LayerId, VecDeque<usize>> = BTreeMap::new();
            for (position, layer) in target.iter().enumerate() {
                queues.entry(*layer).or_default().push_back(position);
            }
            source
                .iter()
                .map(|layer| {
                    queues.get_mut(layer).and_then(VecDeque::pop_front).ok_or(PlanError::MissingLayer { layer: *layer })
                })
                .collect()
        }
        (Some(_), None) | (None, Some(_)) if !allow_positional => Err(PlanError::OneSidedLayerMetadata),
        _ => {
            if target_entries < source_entries || (source_entries != target_entries && !allow_positional) {
                return Err(PlanError::PositionalPairing { prefill: source_entries, decode: target_entries });
            }
            Ok((0..source_entries).collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// domain.md §4.5: src ids [17,23] against dst ids [11,17,23] pair with dst entries 1 and 2.
    #[test]
    fn pairs_by_global_layer_id_not_position() {
        let res = pair_entries(Some(&[17, 23]), Some(&[11, 17, 23]), 2, 3, false);
        assert_eq!(res, Ok(vec![1, 2]));
    }

    #[test]
    fn repeated_ids_pair_in_order() {
        let res = pair_entries(Some(&[5, 5]), Some(&[5, 9, 5]), 2, 3, false);
        assert_eq!(res, Ok(vec![0, 2]));
    }

    #[test]
    fn missing_target_layer_is_named() {
        let res = pair_entries(Some(&[83, 92]), Some(&[83]), 2, 1, false);
        assert_eq!(res, Err(PlanError::MissingLayer { layer: 92 }));
    }

    #[test]
    fn one_sided_metadata_rejected_under_pp() {
        let res = pair_entries(Some(&[3, 7]), None, 2, 24, false);
        assert_eq!(res, Err(PlanError::OneSidedLayerMetadata));
    }

    #[test]
    fn one_sided_metadata_falls_back_to_position_without_pp() {
        let res = pair_entries(None, Some(&[3, 7]), 2, 2, true);
        assert_eq!(res, Ok(vec![0, 1]));
    }

    #[test]
    fn positional_pairing_needs_equal_counts_under_pp() {
        let res = pair_entries(None, None, 3, 24, false);
        assert_eq!(res, Err(PlanError::PositionalPairing { prefill: 3, decode: 24 }));
    }

    /// Without PP, positional pairing takes the first decode entries when decode has more (the trailing ones are
    /// draft entries, domain.md §4.3), and can never pair more prefill entries than decode has.
    #[test]
    fn positional_pairing_without_pp_takes_a_prefix_and_needs_enough_targets() {
        assert_eq!(pair_entries(None, None, 2, 3, true), Ok(vec![0, 1]));
        let res = pair_entries(None, None, 3, 2, true);
        assert_eq!(res, Err(PlanError::PositionalPairing { prefill: 3, decode: 2 }));
    }

    /// Id lists must have one id per entry on each side (found by cargo-mutants: a mismatch on one side alone was
    /// not tested).
    #[test]
    fn layer_id_lists_must_match_their_entry_counts_on_each_side() {
        let expected = |source_ids, target_ids| PlanError::LayerMetadataLength {
            source_ids,
            source_entries: 2,
            target_ids,
            target_entries: 3,
        };
        assert_eq!(pair_entries(Some(&[1, 2]), Some(&[1, 2]), 2, 3, false), Err(expected(2, 2)));
        assert_eq!(pair_entries(Some(&[1]), Some(&[1, 2, 3]), 2, 3, false), Err(expected(1, 3)));
    }
}
