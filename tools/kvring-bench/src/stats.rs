//! Percentiles over many samples.

use serde_json::json;

pub struct Summary {
    pub n: usize,
    pub p50: u64,
    pub p99: u64,
    pub min: u64,
    pub max: u64,
}

impl Summary {
    pub fn of(mut v: Vec<u64>) -> Summary {
        assert!(!v.is_empty(), "no samples");
        v.sort_unstable();
        let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
        Summary {
            n: v.len(),
            p50: at(0.50),
            p99: at(0.99),
            min: v[0],
            max: v[v.len() - 1],
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        json!({ "p50": self.p50, "p99": self.p99, "min": self.min, "max": self.max, "samples": self.n })
    }
}

/// The smallest, middle and largest of a few figures (one per round).
pub struct Spread {
    pub n: usize,
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Spread {
    /// None when there is nothing to summarise.
    pub fn of(v: &[f64]) -> Option<Spread> {
        if v.is_empty() {
            return None;
        }
        let mut v = v.to_vec();
        v.sort_unstable_by(f64::total_cmp);
        let mid = v.len() / 2;
        let median = if v.len() % 2 == 1 {
            v[mid]
        } else {
            (v[mid - 1] + v[mid]) / 2.0
        };
        Some(Spread {
            n: v.len(),
            min: v[0],
            median,
            max: v[v.len() - 1],
        })
    }

    pub fn to_json(&self) -> serde_json::Value {
        json!({ "min": self.min, "median": self.median, "max": self.max, "rounds": self.n })
    }
}
