//! A machine's counters, live or final: every component's, by name for the loss account
//! and the live table, and each component's own stats struct for code that reads them.
//!
//! A component is named the same live and at the end (`vif1.0`, `vif1.0 grant cache`,
//! `vbd1`, `bridge`, `nic`), so a counter seen moving in `pvio up`'s table is the one in
//! the record. Code reads a counter by its type, not its name: `c.sum(|s: &CacheStats|
//! s.hits)` sums every vif's grant cache, and a renamed field is a compile error.

use std::any::Any;
use std::sync::Arc;

use hv::counters::CounterSet;

/// (component, counter, value) triples, and the sets they came from.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Counters {
    /// (component, counter, value), in the order they were added.
    pub entries: Vec<(String, String, u64)>,
    /// Each set added whole, with its component's name (not in the record: its
    /// entries are).
    #[serde(skip)]
    sets: Vec<(String, Arc<dyn Any + Send + Sync>)>,
}

impl Counters {
    /// Adds one.
    pub fn add(&mut self, comp: &str, name: &str, v: u64) {
        self.entries.push((comp.into(), name.into(), v));
    }
    /// A counter's value by name, summed over every entry of that name (0 if absent):
    /// for the live table and the loss account, which walk components by name. Code
    /// that wants one counter reads it by type ([`Counters::sum`]).
    pub fn get(&self, comp: &str, name: &str) -> u64 {
        self.entries
            .iter()
            .filter(|(c, n, _)| c == comp && n == name)
            .map(|e| e.2)
            .sum()
    }
    /// Adds every nonzero counter of a component's set (a per-reason counter gives one
    /// entry per reason, `<field> <Reason>`).
    pub fn add_set(&mut self, comp: &str, set: &impl CounterSet) {
        set.visit(&mut |name, v| {
            if v > 0 {
                self.add(comp, name, v);
            }
        });
        if let Some(s) = set.snapshot() {
            self.sets.push((comp.into(), s));
        }
    }
    /// Takes in another set.
    pub fn extend(&mut self, other: Counters) {
        self.entries.extend(other.entries);
        self.sets.extend(other.sets);
    }
    /// Every set of type `S` added, with the component each was added under.
    pub fn sets<S: 'static>(&self) -> impl Iterator<Item = (&str, &S)> {
        self.sets
            .iter()
            .filter_map(|(c, s)| Some((c.as_str(), s.downcast_ref::<S>()?)))
    }
    /// One counter of every set of type `S`, summed (every vif's grant cache hits, say);
    /// 0 if there is none.
    pub fn sum<S: 'static>(&self, f: impl Fn(&S) -> u64) -> u64 {
        self.sets::<S>().map(|(_, s)| f(s)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use net::netback::CacheStats;

    /// Two vifs' grant caches, each under its vif's name: a report reads one counter
    /// over both by type, the live table each by name, and the two agree.
    #[test]
    fn a_counter_is_read_by_type_over_every_component_and_by_name_per_component() {
        let mut c = Counters::default();
        let a = CacheStats {
            hits: 3,
            ..CacheStats::default()
        };
        let b = CacheStats {
            hits: 4,
            misses: 1,
            ..CacheStats::default()
        };
        c.add_set("vif1.0 grant cache", &a);
        let mut other = Counters::default();
        other.add_set("vif2.0 grant cache", &b);
        c.extend(other);
        assert_eq!(c.sum(|s: &CacheStats| s.hits), 7);
        assert_eq!(c.sum(|s: &CacheStats| s.misses), 1);
        assert_eq!(c.get("vif2.0 grant cache", "hits"), 4);
        let names: Vec<&str> = c.sets::<CacheStats>().map(|(n, _)| n).collect();
        assert_eq!(names, ["vif1.0 grant cache", "vif2.0 grant cache"]);
        // A type never added sums to nothing.
        assert_eq!(c.sum(|s: &net::bridge::BridgeStats| s.forwarded), 0);
    }
}
