//! A machine's final counters: every component's, by name, for the loss account.

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
    /// Takes in another set.
    pub fn extend(&mut self, other: Counters) {
        self.entries.extend(other.entries);
    }
}

/// The stack's counters.
pub fn stack(c: &mut Counters, s: &net::stack::Stack) {
    let st = s.stats();
    c.add("stack", "frames", st.frames);
    c.add("stack", "datagrams", st.datagrams);
    for r in net::stack::RxDrop::ALL {
        let n = st.drop_count(r);
        if n > 0 {
            c.add("stack", &format!("drop {r:?}"), n);
        }
    }
    c.add("stack", "soft_csums", st.soft_csums);
}

/// The NIC driver's counters.
pub fn driver(c: &mut Counters, d: &dev::driver::NicDriver) {
    let s = d.stats();
    c.add("driver", "rx_packets", s.rx_packets);
    c.add("driver", "rx_no_buffer", s.rx_no_buffer);
    c.add("driver", "rx_errors", s.rx_errors);
    c.add("driver", "irqs", s.irqs);
}

/// netfront's counters.
pub fn netfront(c: &mut Counters, f: &net::netfront::Netfront) {
    let s = f.stats();
    c.add("netfront", "rx_packets", s.rx_packets);
    c.add("netfront", "rx_errors", s.rx_errors.iter().sum());
    c.add("netfront", "rx_no_buffer", s.rx_no_buffer);
}
