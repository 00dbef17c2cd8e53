//! Live counters of a running machine: per port (the NIC, each vif, each TAP),
//! packets and bits per second each way, drops by reason, and ring occupancy, from
//! two samples of the components' own counters ([`Running::live_counters`]).
//!
//! A port's directions are its component's: the NIC receives from the wire and
//! transmits to it; a vif's receive is netback's guest-RX (towards the guest) and its
//! transmit the guest's TX; a TAP's receive is what pvio read from the interface.
//!
//! [`Running::live_counters`]: crate::udp::Running::live_counters

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Instant;

use dev::nic::NicRegs;
use dev::tap::TapCounters;
use kernel::counters::PortKind;
use kernel::Counters;
use net::netback::VifStats;

/// The components' counters at one instant.
#[derive(Debug, Clone)]
pub struct Sample {
    /// When they were read.
    pub at: Instant,
    /// What they were.
    pub counters: Counters,
}

/// Which counters of a component make a port's row.
#[derive(Debug, Clone, Copy)]
struct Kind {
    rx_packets: &'static str,
    rx_bytes: &'static str,
    tx_packets: &'static str,
    tx_bytes: &'static str,
    drops: &'static [&'static str],
    /// Bytes per unit of the byte counters (a sector's 512 for a block device).
    unit: f64,
}

const NIC: Kind = Kind {
    rx_packets: "rx_frames",
    rx_bytes: "rx_bytes",
    tx_packets: "tx_frames",
    tx_bytes: "tx_bytes",
    drops: NicRegs::DROPS,
    unit: 1.0,
};
const VIF: Kind = Kind {
    rx_packets: "rx_packets",
    rx_bytes: "rx_bytes",
    tx_packets: "tx_packets",
    tx_bytes: "tx_bytes",
    drops: VifStats::DROPS,
    unit: 1.0,
};
const TAP: Kind = Kind {
    rx_packets: "frames_in",
    rx_bytes: "bytes_in",
    tx_packets: "frames_out",
    tx_bytes: "bytes_out",
    drops: TapCounters::DROPS,
    unit: 1.0,
};
/// A virtual block device's back end (`vbd<guest>`, `rvbd<guest>` for a remote disk):
/// its reads as "rx" (the guest's data in), its writes as "tx", in sectors.
const VBD: Kind = Kind {
    rx_packets: "reads",
    rx_bytes: "sectors_read",
    tx_packets: "writes",
    tx_bytes: "sectors_written",
    drops: &["io_errors", "bad_grants", "id_in_flight"],
    unit: 512.0,
};

/// The counters that make a row for a port of `kind`.
fn kind(kind: PortKind) -> Kind {
    match kind {
        PortKind::Nic => NIC,
        PortKind::Vif => VIF,
        PortKind::HostInterface => TAP,
        PortKind::Vbd => VBD,
    }
}

/// Every packet the ports of `c` dropped so far, every reason of each port's kind
/// together (the sum of the live table's drops column over the machine's life).
pub fn drops(c: &Counters) -> u64 {
    c.ports()
        .flat_map(|(port, pk)| {
            kind(pk)
                .drops
                .iter()
                .map(move |d| c.try_get(port, d).unwrap_or(0))
        })
        .sum()
}

/// How full a vif's rings were at the second sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Rings {
    /// TX slots in use.
    pub tx: u64,
    /// RX slots in use (buffers posted, not yet filled).
    pub rx: u64,
    /// Slots in each ring.
    pub size: u64,
}

/// One port over one interval.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PortRates {
    /// The component (`nic`, `vif1.0`, `guest tap`).
    pub port: String,
    /// Packets received per second.
    pub rx_pps: f64,
    /// Bits received per second.
    pub rx_bps: f64,
    /// Packets sent per second.
    pub tx_pps: f64,
    /// Bits sent per second.
    pub tx_bps: f64,
    /// Packets dropped during the interval, by the counter that counted them (only
    /// those that moved).
    pub drops: BTreeMap<String, u64>,
    /// Ring occupancy, for a vif.
    pub rings: Option<Rings>,
}

/// Every port's rates between two samples, in the order the ports first appear.
pub fn rates(before: &Sample, after: &Sample) -> Vec<PortRates> {
    let secs = after
        .at
        .saturating_duration_since(before.at)
        .as_secs_f64()
        .max(1e-9);
    // A counter a port's set does not have reads as 0 (a vif's ring counters on a TAP),
    // and so does one of a port that came up between the two samples.
    let at = |s: &Sample, port: &str, name: &str| s.counters.try_get(port, name).unwrap_or(0);
    after
        .counters
        .ports()
        .map(|(port, pk)| {
            let k = kind(pk);
            let delta = |name: &str| at(after, port, name).saturating_sub(at(before, port, name));
            let per_s = |name: &str| delta(name) as f64 / secs;
            let drops = k
                .drops
                .iter()
                .map(|&d| (d.to_string(), delta(d)))
                .filter(|(_, n)| *n > 0)
                .collect();
            let rings = (at(after, port, "ring_size") > 0).then(|| Rings {
                tx: at(after, port, "tx_ring_used"),
                rx: at(after, port, "rx_ring_used"),
                size: at(after, port, "ring_size"),
            });
            PortRates {
                port: port.to_string(),
                rx_pps: per_s(k.rx_packets),
                rx_bps: per_s(k.rx_bytes) * 8.0 * k.unit,
                tx_pps: per_s(k.tx_packets),
                tx_bps: per_s(k.tx_bytes) * 8.0 * k.unit,
                drops,
                rings,
            }
        })
        .collect()
}

/// A rate with an SI prefix: `812`, `14.2 k`, `1.93 M`, `9.41 G`.
fn si(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2} G", x / 1e9),
        x if x >= 1e6 => format!("{:.2} M", x / 1e6),
        x if x >= 1e3 => format!("{:.1} k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// The compact table: a line per port.
pub fn table(rows: &[PortRates]) -> String {
    let mut out = format!(
        "{:<12} {:>9} {:>11} {:>9} {:>11}  {:<13} {}\n",
        "port", "rx pkt/s", "rx bit/s", "tx pkt/s", "tx bit/s", "ring tx/rx", "drops"
    );
    for r in rows {
        let ring = r.rings.map_or(String::new(), |g| {
            format!("{}/{} of {}", g.tx, g.rx, g.size)
        });
        let drops = if r.drops.is_empty() {
            "-".to_string()
        } else {
            r.drops
                .iter()
                .map(|(n, d)| format!("{n} {d}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            out,
            "{:<12} {:>9} {:>11} {:>9} {:>11}  {:<13} {}",
            r.port,
            si(r.rx_pps),
            si(r.rx_bps),
            si(r.tx_pps),
            si(r.tx_bps),
            ring,
            drops
        );
    }
    out
}

/// The same as one JSON line: the seconds since `start` and the ports.
pub fn json_line(since_start_s: f64, rows: &[PortRates]) -> String {
    serde_json::json!({ "t_s": since_start_s, "ports": rows }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A sample of `entries`, each component whose name `port` knows marked a port.
    fn sample(at: Instant, entries: &[(&str, &str, u64)]) -> Sample {
        let mut counters = Counters::default();
        for &(c, n, v) in entries {
            counters.add(c, n, v);
            if let Some(k) = port(c) {
                counters.mark_port(c, k);
            }
        }
        Sample { at, counters }
    }

    fn port(c: &str) -> Option<PortKind> {
        match c {
            "nic" => Some(PortKind::Nic),
            "vif1.0" | "vif2.0" => Some(PortKind::Vif),
            "guest tap" | "wire cable" => Some(PortKind::HostInterface),
            _ => None,
        }
    }

    #[test]
    fn rates_are_deltas_over_the_interval_per_port_with_drops_by_reason_and_rings() {
        let t0 = Instant::now();
        let before = sample(
            t0,
            &[
                ("nic", "rx_frames", 1000),
                ("nic", "rx_bytes", 1_500_000),
                ("vif1.0", "rx_packets", 900),
                ("vif1.0", "rx_queue_full", 5),
                ("bridge", "forwarded", 7),
            ],
        );
        let after = sample(
            t0 + Duration::from_millis(500),
            &[
                ("nic", "rx_frames", 2000),
                ("nic", "rx_bytes", 3_000_000),
                ("nic", "rx_missed", 4),
                ("vif1.0", "rx_packets", 1800),
                ("vif1.0", "rx_bytes", 1_350_000),
                ("vif1.0", "tx_packets", 50),
                ("vif1.0", "rx_queue_full", 5),
                ("vif1.0", "tx_ring_used", 3),
                ("vif1.0", "rx_ring_used", 250),
                ("vif1.0", "ring_size", 256),
                ("vif1.0 grant cache", "hits", 99),
                ("guest tap", "frames_out", 10),
                ("bridge", "forwarded", 9),
                ("wire cable", "frames_in", 30),
            ],
        );
        // Every port's drops so far, each by its kind's reasons: the NIC's missed
        // frames and the vif's full queue, not the bridge's forwarding or a cache's hits.
        assert_eq!(drops(&before.counters), 5);
        assert_eq!(drops(&after.counters), 9);
        let r = rates(&before, &after);
        let ports: Vec<&str> = r.iter().map(|p| p.port.as_str()).collect();
        // A host interface gets its row whatever its name (`pvio up --cable`'s is
        // `wire cable`, no ` tap` in it).
        assert_eq!(ports, ["nic", "vif1.0", "guest tap", "wire cable"]);
        let nic = &r[0];
        assert!((nic.rx_pps - 2000.0).abs() < 1e-6, "{nic:?}");
        assert!((nic.rx_bps - 24_000_000.0).abs() < 1e-3, "{nic:?}");
        assert_eq!(nic.drops, BTreeMap::from([("rx_missed".to_string(), 4)]));
        assert_eq!(nic.rings, None);
        let vif = &r[1];
        assert!((vif.rx_pps - 1800.0).abs() < 1e-6);
        assert!((vif.tx_pps - 100.0).abs() < 1e-6);
        assert!(
            vif.drops.is_empty(),
            "a drop counter that did not move: {vif:?}"
        );
        assert_eq!(
            vif.rings,
            Some(Rings {
                tx: 3,
                rx: 250,
                size: 256
            })
        );
        assert!((r[2].tx_pps - 20.0).abs() < 1e-6);
        assert!((r[3].rx_pps - 60.0).abs() < 1e-6);
        let t = table(&r);
        assert_eq!(t.lines().count(), 5, "{t}");
        assert!(t.contains("vif1.0") && t.contains("3/250 of 256") && t.contains("rx_missed 4"));
        assert!(t.contains("24.00 M"), "{t}");
    }

    #[test]
    fn the_json_line_carries_the_same_rows() {
        let t0 = Instant::now();
        let a = sample(t0, &[("vif2.0", "tx_bytes", 0)]);
        let b = sample(t0 + Duration::from_secs(1), &[("vif2.0", "tx_bytes", 1000)]);
        let line = json_line(3.0, &rates(&a, &b));
        assert!(!line.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&line).expect("valid JSON");
        assert_eq!(v["t_s"], 3.0);
        assert_eq!(v["ports"][0]["port"], "vif2.0");
        assert_eq!(v["ports"][0]["tx_bps"], 8000.0);
        assert!(v["ports"][0]["drops"]
            .as_object()
            .is_some_and(|d| d.is_empty()));
    }
}
