//! A machine's final counters: every component's, by name, for the loss account.

use net::counters::CounterSet;

/// (component, counter, value) triples.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Counters {
    /// (component, counter, value), in the order they were added.
    pub entries: Vec<(String, String, u64)>,
}

impl Counters {
    /// Adds one.
    pub fn add(&mut self, comp: &str, name: &str, v: u64) {
        self.entries.push((comp.into(), name.into(), v));
    }
    /// A counter's value, summed over every entry of that name (0 if absent).
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
    }
    /// Takes in another set.
    pub fn extend(&mut self, other: Counters) {
        self.entries.extend(other.entries);
    }
}
