//! A machine's counters, live or final: every component's, by name for the loss account
//! and the live table, and each component's own stats struct for code that reads them.
//!
//! A component is named the same live and at the end (`vif1.0`, `vif1.0 grant cache`,
//! `vbd1`, `bridge`, `nic`), so a counter seen moving in `pvio up`'s table is the one in
//! the record. Code reads a counter by its type, not its name: `c.sum(|s: &CacheStats|
//! s.hits)` sums every vif's grant cache, and a renamed field is a compile error.

use std::any::Any;
use std::collections::BTreeSet;
use std::sync::Arc;

use hv::counters::CounterSet;

/// What kind of port a component is, for the live table: a component added as a port
/// ([`Counters::add_port`]) gets a row there, whatever its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortKind {
    /// The NIC: receives from the wire, transmits to it.
    Nic,
    /// A netback vif: its receive is guest RX (towards the guest), its transmit the
    /// guest's TX.
    Vif,
    /// An interface of the host pvio reads and writes: a TAP, or a packet socket on a
    /// host interface (`wire cable`).
    HostInterface,
    /// A virtual block device's back end, local or remote: reads as receive, writes as
    /// transmit, in sectors.
    Vbd,
}

/// (component, counter, value) triples, and the sets they came from.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Counters {
    /// (component, counter, value), in the order they were added.
    pub entries: Vec<(String, String, u64)>,
    /// Each set added whole, with its component's name (not in the record: its
    /// entries are).
    #[serde(skip)]
    sets: Vec<(String, Arc<dyn Any + Send + Sync>)>,
    /// Every (component, counter) name added, zero or not: what [`Counters::get`]
    /// knows.
    #[serde(skip)]
    names: BTreeSet<(String, String)>,
    /// The components that are ports, in the order they were added.
    #[serde(skip)]
    ports: Vec<(String, PortKind)>,
}

impl Counters {
    /// Adds one.
    pub fn add(&mut self, comp: &str, name: &str, v: u64) {
        self.names.insert((comp.into(), name.into()));
        self.entries.push((comp.into(), name.into(), v));
    }
    /// A counter's value by name, summed over every entry of that name: for the live
    /// table, the loss account and tests, which walk components by name. Code that
    /// wants one counter reads it by type ([`Counters::sum`]).
    ///
    /// # Panics
    ///
    /// If no counter `name` of component `comp` was ever added, zero or not: a renamed
    /// counter or component fails loudly instead of reading as 0. [`Counters::try_get`]
    /// asks without that promise.
    #[track_caller]
    pub fn get(&self, comp: &str, name: &str) -> u64 {
        self.try_get(comp, name).unwrap_or_else(|| {
            let known: Vec<&str> = self
                .names
                .iter()
                .filter(|(c, _)| c == comp)
                .map(|(_, n)| n.as_str())
                .collect();
            panic!("no counter {name:?} of component {comp:?} (its counters: {known:?})")
        })
    }
    /// A counter's value by name, or `None` if no such counter of that component was
    /// added (a component this machine does not have).
    pub fn try_get(&self, comp: &str, name: &str) -> Option<u64> {
        self.names
            .contains(&(comp.to_string(), name.to_string()))
            .then(|| {
                self.entries
                    .iter()
                    .filter(|(c, n, _)| c == comp && n == name)
                    .map(|e| e.2)
                    .sum()
            })
    }
    /// Adds every counter of a component's set (a per-reason counter gives one entry
    /// per reason, `<field> <Reason>`): the nonzero ones as entries, every name as
    /// known to [`Counters::get`].
    pub fn add_set(&mut self, comp: &str, set: &impl CounterSet) {
        set.visit(&mut |name, v| {
            if v > 0 {
                self.add(comp, name, v);
            } else {
                self.names.insert((comp.into(), name.into()));
            }
        });
        if let Some(s) = set.snapshot() {
            self.sets.push((comp.into(), s));
        }
    }
    /// Adds a port's set ([`Counters::add_set`]) and marks the component a port of
    /// `kind`, which gives it a row in the live table.
    pub fn add_port(&mut self, comp: &str, kind: PortKind, set: &impl CounterSet) {
        self.add_set(comp, set);
        self.mark_port(comp, kind);
    }
    /// Marks component `comp` a port of `kind` (once; the first kind stays).
    pub fn mark_port(&mut self, comp: &str, kind: PortKind) {
        if !self.ports.iter().any(|(c, _)| c == comp) {
            self.ports.push((comp.into(), kind));
        }
    }
    /// The components added as ports, with their kinds, in the order they were added.
    pub fn ports(&self) -> impl Iterator<Item = (&str, PortKind)> {
        self.ports.iter().map(|(c, k)| (c.as_str(), *k))
    }
    /// Takes in another set.
    pub fn extend(&mut self, other: Counters) {
        self.entries.extend(other.entries);
        self.sets.extend(other.sets);
        self.names.extend(other.names);
        for (c, k) in other.ports {
            self.mark_port(&c, k);
        }
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
        // A counter that stayed at zero is known by name, and reads 0.
        assert_eq!(c.get("vif1.0 grant cache", "misses"), 0);
    }

    /// A name no component has is a mistake in the caller (a renamed counter), not a
    /// zero: `get` says so, `try_get` answers `None`.
    #[test]
    #[should_panic(expected = "no counter \"hitz\" of component \"vif1.0 grant cache\"")]
    fn reading_a_counter_that_does_not_exist_fails_loudly() {
        let mut c = Counters::default();
        c.add_set("vif1.0 grant cache", &CacheStats::default());
        assert_eq!(c.try_get("vif1.0 grant cache", "hitz"), None);
        assert_eq!(c.try_get("vif9.0 grant cache", "hits"), None);
        c.get("vif1.0 grant cache", "hitz");
    }

    /// Ports are known by the kind they were added with, not by their names, and keep
    /// it when two machines' counters are put together.
    #[test]
    fn ports_keep_the_kind_they_were_added_with() {
        let mut c = Counters::default();
        c.add_port("nic", PortKind::Nic, &CacheStats::default());
        let mut other = Counters::default();
        other.mark_port("wire cable", PortKind::HostInterface);
        other.mark_port("nic", PortKind::Vif);
        c.extend(other);
        let ports: Vec<_> = c.ports().collect();
        assert_eq!(
            ports,
            [
                ("nic", PortKind::Nic),
                ("wire cable", PortKind::HostInterface)
            ]
        );
    }
}
