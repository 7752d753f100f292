//! Layer groups: a RETRIEVE may land its layers in `G` groups, one after
//! another, so that an engine's forward reads layer `i` as soon as the group
//! holding it landed while the later groups are still copied.
//!
//! The split is fixed (engine and server compute it alike): group `k` of
//! `G` over `L` layers is `k * L / G .. (k + 1) * L / G` (integer division),
//! so every group holds `L / G` or `L / G + 1` consecutive layers.

use std::ops::Range;

/// `layers` split into `groups` consecutive ranges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerGroups {
    layers: u32,
    groups: u32,
}

impl LayerGroups {
    /// `None` unless `1 <= groups <= layers`.
    pub fn new(layers: u32, groups: u32) -> Option<LayerGroups> {
        (groups >= 1 && groups <= layers).then_some(LayerGroups { layers, groups })
    }

    /// How many groups.
    pub fn len(&self) -> u32 {
        self.groups
    }

    /// Never empty (at least one group).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The layers of group `k` (below [`LayerGroups::len`]).
    pub fn range(&self, k: u32) -> Range<u32> {
        assert!(k < self.groups, "layer group {k} of {}", self.groups);
        self.start(k)..self.start(k + 1)
    }

    /// The group holding `layer` (below the layer count).
    pub fn of_layer(&self, layer: u32) -> u32 {
        assert!(layer < self.layers, "layer {layer} of {}", self.layers);
        // The last k with start(k) <= layer: start(k) <= layer iff
        // k * L / G <= layer iff k * L < (layer + 1) * G.
        let k = ((u64::from(layer) + 1) * u64::from(self.groups) - 1) / u64::from(self.layers);
        k as u32
    }

    /// Every group's layers, in order.
    pub fn iter(&self) -> impl Iterator<Item = Range<u32>> + '_ {
        (0..self.groups).map(|k| self.range(k))
    }

    fn start(&self, k: u32) -> u32 {
        (u64::from(k) * u64::from(self.layers) / u64::from(self.groups)) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_cover_every_layer_once_in_order() {
        for layers in 1..=80 {
            for groups in 1..=layers {
                let g = LayerGroups::new(layers, groups).unwrap();
                let mut next = 0;
                for (k, r) in g.iter().enumerate() {
                    assert_eq!(r.start, next, "{layers}/{groups}");
                    assert!(r.len() as u32 >= layers / groups && r.len() as u32 <= layers / groups + 1);
                    for l in r.clone() {
                        assert_eq!(g.of_layer(l), k as u32, "layer {l} of {layers}/{groups}");
                    }
                    next = r.end;
                }
                assert_eq!(next, layers);
            }
        }
        assert!(LayerGroups::new(4, 0).is_none() && LayerGroups::new(4, 5).is_none());
    }
}
