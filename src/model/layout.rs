//! Derivation of each rank's registered regions from topology and model geometry.

use std::ops::Range;

use super::{LayerId, ModelGeometry, RankLayout, Region, RegionKind, Side, SideLayout, Topology};

/// Layers held by pipeline stage `stage` of `pp` (domain.md §4.1): the last `L mod pp` stages get one extra.
pub fn stage_layers(layer_count: u32, pp: u32, stage: u32) -> Range<u32> {
    let base = layer_count / pp;
    let rem = layer_count % pp;
    if stage < pp - rem {
        stage * base..(stage + 1) * base
    } else {
        let start = stage * (base + 1) - (pp - rem);
        start..start + base + 1
    }
}

/// Registration choices of one side that scenarios may vary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SideOptions {
    /// Whether ranks advertise `kv_layer_ids` (domain.md §4.2).
    pub advertise_layer_ids: bool,
    /// Layers whose entry this side fails to register (models a broken peer).
    pub missing_layers: Vec<LayerId>,
    /// Pool capacity in pages, including padding page 0.
    pub page_count: u32,
}

/// Builds the regions of every rank of one side: one KV entry per MLA layer of the rank's stage.
pub fn build_side_layout(side: Side, topology: Topology, model: &ModelGeometry, options: &SideOptions) -> SideLayout {
    let item_len = u64::from(topology.page_size) * model.token_len();
    let ranks = topology
        .ranks()
        .map(|rank| {
            let layers = stage_layers(model.layer_count, topology.pp, rank.pp);
            let regions: Vec<Region> = model
                .mla_layers
                .iter()
                .copied()
                .filter(|layer| layers.contains(layer) && !options.missing_layers.contains(layer))
                .map(|layer| Region {
                    kind: RegionKind::Kv,
                    layer,
                    item_len,
                    page_count: options.page_count,
                    page_size: topology.page_size,
                })
                .collect();
            let advertised_layer_ids =
                options.advertise_layer_ids.then(|| regions.iter().map(|region| region.layer).collect());
            RankLayout { rank, regions, advertised_layer_ids }
        })
        .collect();
    SideLayout { side, topology, ranks }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// domain.md §4.1: K3's 93 layers over PP8.
    #[test]
    fn stage_partition_gives_last_stages_the_extra_layers() {
        let stages: Vec<_> = (0..8).map(|s| stage_layers(93, 8, s)).collect();
        assert_eq!(stages, vec![0..11, 11..22, 22..33, 33..45, 45..57, 57..69, 69..81, 81..93]);
    }
}
