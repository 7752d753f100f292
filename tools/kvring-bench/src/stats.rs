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
