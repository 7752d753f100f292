//! Whether a layout's strided boxes of rows can share a byte: a proof that
//! they cannot, or a refusal. Each (layer, part) of a layout is a box:
//! `offset + b * block_stride + h * head_stride + t * token_stride + [0,
//! width)` over every block, head and token. Exact for boxes whose strides
//! nest (each stride at least the extent of the smaller ones, as every
//! dense tensor's do) and for translates of one box shape, which covers
//! every layout an engine makes; anything else is refused as unprovable.

/// One (layer, part)'s box of rows in one allocation.
#[derive(Clone, Debug)]
pub(super) struct RowBox {
    pub alloc: u32,
    pub offset: u64,
    pub width: u64,
    /// (count, stride) of the dimensions with more than one index, by
    /// ascending stride.
    pub dims: Vec<(u64, u64)>,
}

impl RowBox {
    pub fn new(alloc: u32, offset: u64, width: u64, dims: [(u64, u64); 3]) -> RowBox {
        let mut d: Vec<(u64, u64)> = dims.into_iter().filter(|&(n, _)| n > 1).collect();
        d.sort_by_key(|&(_, s)| s);
        RowBox {
            alloc,
            offset,
            width,
            dims: d,
        }
    }

    /// One past the last byte, if it fits in a u64.
    pub fn end(&self) -> Option<u64> {
        let mut end = self.offset.checked_add(self.width)?;
        for &(n, s) in &self.dims {
            end = end.checked_add((n - 1).checked_mul(s)?)?;
        }
        Some(end)
    }

    /// Whether two rows of this box may share a byte: true unless the
    /// strides nest (then rows are distinct by construction).
    pub fn self_overlaps(&self) -> bool {
        let mut span = u128::from(self.width);
        for &(n, s) in &self.dims {
            if u128::from(s) < span {
                return true;
            }
            span += u128::from(n - 1) * u128::from(s);
        }
        false
    }

    /// Whether `self` and `other` (each free of self-overlap) may share a
    /// byte. Exact when both have the same dimensions; otherwise true as
    /// soon as their byte ranges meet.
    pub fn overlaps(&self, other: &RowBox) -> bool {
        if self.alloc != other.alloc {
            return false;
        }
        let (Some(ea), Some(eb)) = (self.end(), other.end()) else {
            return true;
        };
        if ea <= other.offset || eb <= self.offset {
            return false;
        }
        if self.dims != other.dims {
            return true;
        }
        // A byte of `self` is offset_a + g + e (g a lattice point, e <
        // width_a), one of `other` offset_b + g' + e'. They meet iff some
        // difference of lattice points d makes offset_a - offset_b + d lie
        // in [-(width_a - 1), width_b - 1].
        let delta = i128::from(self.offset) - i128::from(other.offset);
        let lo = -(i128::from(self.width) - 1);
        let hi = i128::from(other.width) - 1;
        reach(delta, &self.dims, lo, hi)
    }
}

/// Whether `delta + sum(j_k * s_k)`, |j_k| < n_k, can land in [lo, hi].
fn reach(delta: i128, dims: &[(u64, u64)], lo: i128, hi: i128) -> bool {
    let Some((&(n, s), inner)) = dims.split_last() else {
        return lo <= delta && delta <= hi;
    };
    let (n, s) = (i128::from(n), i128::from(s));
    // What the inner dimensions can still add, either way.
    let r: i128 = inner
        .iter()
        .map(|&(n, s)| i128::from(n - 1) * i128::from(s))
        .sum();
    // j such that delta + j*s lies within [lo - r, hi + r].
    let first = div_ceil(lo - r - delta, s).max(-(n - 1));
    let last = div_floor(hi + r - delta, s).min(n - 1);
    if last - first > 8 {
        // Not nested: cannot tell cheaply, so say they may meet.
        return first <= last;
    }
    (first..=last).any(|j| reach(delta + j * s, inner, lo, hi))
}

fn div_floor(a: i128, b: i128) -> i128 {
    a.div_euclid(b)
}

fn div_ceil(a: i128, b: i128) -> i128 {
    -(-a).div_euclid(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force: every byte of every row.
    fn bytes(b: &RowBox) -> std::collections::HashSet<u64> {
        let mut out = std::collections::HashSet::new();
        let mut starts = vec![b.offset];
        for &(n, s) in &b.dims {
            starts = starts
                .iter()
                .flat_map(|&o| (0..n).map(move |i| o + i * s))
                .collect();
        }
        for o in starts {
            out.extend(o..o + b.width);
        }
        out
    }

    #[test]
    fn agrees_with_brute_force_on_small_boxes() {
        let mut seed = 7u64;
        let mut next = |m: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % m
        };
        let mut checked = 0;
        for _ in 0..20_000 {
            let shape = [(next(3) + 1, next(40)), (next(3) + 1, next(40)), (next(2) + 1, next(40))];
            let a = RowBox::new(0, next(30), next(6) + 1, shape);
            let same = next(2) == 0;
            let shape_b = if same {
                shape
            } else {
                [(next(3) + 1, next(40)), (next(3) + 1, next(40)), (1, 0)]
            };
            let b = RowBox::new(0, next(60), next(6) + 1, shape_b);
            let (ba, bb) = (bytes(&a), bytes(&b));
            let rows_a: u64 = a.dims.iter().map(|d| d.0).product();
            let truly_self = (ba.len() as u64) < rows_a * a.width;
            if !a.self_overlaps() {
                assert!(!truly_self, "{a:?}");
            }
            if a.self_overlaps() || b.self_overlaps() {
                continue;
            }
            let meet = !ba.is_disjoint(&bb);
            let said = a.overlaps(&b);
            if meet {
                assert!(said, "{a:?} {b:?} meet");
            }
            if a.dims == b.dims {
                assert_eq!(said, meet, "{a:?} {b:?}");
                checked += 1;
            }
        }
        assert!(checked > 1000);
    }
}
