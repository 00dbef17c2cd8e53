//! The driver domain's software bridge: a learning L2 switch between the physical NIC's
//! port and each guest's vif, with the bridge-netfilter hooks of paper 000 §3.4.4.
//!
//! Every frame entering the bridge has its source address learned on its port, and its
//! destination looked up in the forwarding database: a known unicast address goes to
//! its port, anything else floods to every other port. With filtering on, each IPv4
//! frame then passes the three bridge-netfilter hooks (pre-routing, forward,
//! post-routing) as Linux's `br_netfilter` passes it: the pre-routing hook validates
//! the IP header as `ip_rcv` does, and each hook walks the rule chains of the tables
//! registered on it (raw, mangle, nat, filter) down to their policy. With no rules that
//! is all it does — which is the cost the paper measured with netfilter compiled in and
//! no rule configured. Switched off, frames skip the hooks entirely.

use hv::counters::PerReason;
use hv::profile::{enter, Class};
use smoltcp::wire::{EthernetFrame, EthernetProtocol, IpProtocol, Ipv4Address, Ipv4Packet};

use crate::skb::{SkbId, SkbPool};
use crate::wire::{ETH_HEADER, IPV4_HEADER};

/// Ports a bridge has at most.
pub const MAX_PORTS: usize = 64;
/// Forwarding-database entries (a power of two).
pub const FDB_SIZE: usize = 256;

/// Where a frame goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forward {
    /// To this port.
    Port(u16),
    /// To every port but the one it came in on.
    Flood,
    /// Nowhere (counted).
    Drop(BridgeDrop),
}

/// Why the bridge dropped a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BridgeDrop {
    /// Shorter than an Ethernet header.
    Runt,
    /// A source address that is multicast (never valid).
    BadSource,
    /// Addressed to the port it came from.
    SamePort,
    /// The IP header failed the pre-routing hook's checks.
    BadIp,
    /// A rule said drop.
    Filtered,
    /// A source address the port may not use: a vif sending from any address but the
    /// one the toolstack configured for it, or any port sending from an address that
    /// belongs to a vif elsewhere (Xen's vif scripts add the same ebtables rule).
    Spoofed,
}

impl BridgeDrop {
    /// Every reason, in counter order.
    pub const ALL: [BridgeDrop; 6] = [
        BridgeDrop::Runt,
        BridgeDrop::BadSource,
        BridgeDrop::SamePort,
        BridgeDrop::BadIp,
        BridgeDrop::Filtered,
        BridgeDrop::Spoofed,
    ];
}

hv::reason!(BridgeDrop);

/// A hook point of bridge netfilter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hook {
    /// `NF_BR_PRE_ROUTING` (→ `NF_INET_PRE_ROUTING`).
    PreRouting = 0,
    /// `NF_BR_FORWARD` (→ `NF_INET_FORWARD`).
    Forward = 1,
    /// `NF_BR_POST_ROUTING` (→ `NF_INET_POST_ROUTING`).
    PostRouting = 2,
}

/// What a rule does with a match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Let it through (stop evaluating).
    Accept,
    /// Drop it.
    Drop,
    /// Go on to the next rule.
    Continue,
}

/// A rule: what it matches (every set field must match) and its verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// Source network and prefix length.
    pub src: Option<(Ipv4Address, u8)>,
    /// Destination network and prefix length.
    pub dst: Option<(Ipv4Address, u8)>,
    /// Protocol.
    pub proto: Option<IpProtocol>,
    /// Destination port range (UDP/TCP).
    pub dport: Option<(u16, u16)>,
    /// Verdict on a match.
    pub verdict: Verdict,
}

#[derive(Debug, Clone)]
struct Chain {
    rules: Vec<Rule>,
    policy: Verdict,
    /// Packets that reached this chain.
    packets: u64,
}

#[derive(Debug, Clone)]
struct Table {
    name: &'static str,
    /// One chain per hook the table is registered on.
    chains: [Option<Chain>; 3],
}

/// The parsed headers a hook matches on.
#[derive(Debug, Clone, Copy)]
struct Headers {
    src: Ipv4Address,
    dst: Ipv4Address,
    proto: IpProtocol,
    dport: Option<u16>,
}

fn prefix_match(a: Ipv4Address, (net, len): (Ipv4Address, u8)) -> bool {
    let mask = if len == 0 {
        0
    } else {
        u32::MAX << (32 - len.min(32) as u32)
    };
    u32::from(a) & mask == u32::from(net) & mask
}

impl Rule {
    fn matches(&self, h: &Headers) -> bool {
        self.src.is_none_or(|n| prefix_match(h.src, n))
            && self.dst.is_none_or(|n| prefix_match(h.dst, n))
            && self.proto.is_none_or(|p| p == h.proto)
            && self
                .dport
                .is_none_or(|(lo, hi)| h.dport.is_some_and(|d| (lo..=hi).contains(&d)))
    }
}

/// Bridge netfilter: the tables and their chains.
#[derive(Debug, Clone)]
pub struct Netfilter {
    tables: Vec<Table>,
}

impl Default for Netfilter {
    /// The tables a kernel with iptables loaded has, all empty with an ACCEPT policy.
    fn default() -> Self {
        let empty = || {
            Some(Chain {
                rules: Vec::new(),
                policy: Verdict::Accept,
                packets: 0,
            })
        };
        Self {
            tables: vec![
                Table {
                    name: "raw",
                    chains: [empty(), None, None],
                },
                Table {
                    name: "mangle",
                    chains: [empty(), empty(), empty()],
                },
                Table {
                    name: "nat",
                    chains: [empty(), None, empty()],
                },
                Table {
                    name: "filter",
                    chains: [None, empty(), None],
                },
            ],
        }
    }
}

impl Netfilter {
    /// Appends a rule to `table`'s chain at `hook`. False if the table has no such chain.
    pub fn append(&mut self, table: &str, hook: Hook, rule: Rule) -> bool {
        match self
            .tables
            .iter_mut()
            .find(|t| t.name == table)
            .and_then(|t| t.chains[hook as usize].as_mut())
        {
            Some(c) => {
                c.rules.push(rule);
                true
            }
            None => false,
        }
    }

    /// Packets that reached `table`'s chain at `hook`.
    pub fn chain_packets(&self, table: &str, hook: Hook) -> Option<u64> {
        self.tables
            .iter()
            .find(|t| t.name == table)
            .and_then(|t| t.chains[hook as usize].as_ref())
            .map(|c| c.packets)
    }

    /// `nf_hook_slow`: every table on the hook, in priority order, until one drops.
    fn run(&mut self, hook: Hook, h: &Headers) -> Verdict {
        for t in &mut self.tables {
            let Some(c) = t.chains[hook as usize].as_mut() else {
                continue;
            };
            c.packets += 1;
            let mut v = c.policy;
            for r in &c.rules {
                if r.matches(h) && r.verdict != Verdict::Continue {
                    v = r.verdict;
                    break;
                }
            }
            if v == Verdict::Drop {
                return Verdict::Drop;
            }
        }
        Verdict::Accept
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct FdbEntry {
    mac: [u8; 6],
    port: u16,
    valid: bool,
    /// Set by the toolstack for a vif's address: never relearned from traffic.
    fixed: bool,
}

/// Counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BridgeStats {
    /// Frames forwarded to one port.
    pub forwarded: u64,
    /// Frames flooded.
    pub flooded: u64,
    /// IPv4 frames that passed the netfilter hooks (none with filtering off).
    pub hooked: u64,
    /// Drops per [`BridgeDrop`].
    pub drops: PerReason<BridgeDrop>,
}

hv::counter_set!(BridgeStats {
    forwarded,
    flooded,
    hooked,
    drops
});

/// The bridge.
#[derive(Debug)]
pub struct Bridge {
    fdb: Box<[FdbEntry]>,
    ports: u16,
    /// The address each vif port was configured with; `None` for a port that may send
    /// from any address not fixed elsewhere (the NIC's).
    port_mac: [Option<[u8; 6]>; MAX_PORTS],
    /// The hooks, when filtering is on.
    pub netfilter: Option<Netfilter>,
    stats: BridgeStats,
}

fn fdb_hash(mac: &[u8; 6]) -> usize {
    let v = mac
        .iter()
        .fold(0u32, |h, &b| h.wrapping_mul(31).wrapping_add(b as u32));
    (v ^ (v >> 8)) as usize & (FDB_SIZE - 1)
}

impl Bridge {
    /// A bridge with `ports` ports, filtering on or off.
    pub fn new(ports: u16, filter: bool) -> Self {
        Self {
            fdb: vec![FdbEntry::default(); FDB_SIZE].into_boxed_slice(),
            ports: ports.min(MAX_PORTS as u16),
            port_mac: [None; MAX_PORTS],
            netfilter: filter.then(Netfilter::default),
            stats: BridgeStats::default(),
        }
    }

    /// Ports.
    pub fn ports(&self) -> u16 {
        self.ports
    }
    /// Counters.
    pub fn stats(&self) -> &BridgeStats {
        &self.stats
    }

    /// Records that `mac` lives behind `port`, as the bridge learns from traffic. An
    /// address fixed for a vif ([`Self::attach_vif`]) is not moved.
    pub fn learn(&mut self, mac: [u8; 6], port: u16) {
        self.insert(FdbEntry {
            mac,
            port,
            valid: true,
            fixed: false,
        });
    }

    /// The toolstack attaches a vif: `port` carries the guest whose address is `mac`.
    /// The address is fixed there (frames to it go to `port` before the guest sends
    /// anything, and no frame from elsewhere moves it), and the port may send from no
    /// other address.
    pub fn attach_vif(&mut self, port: u16, mac: [u8; 6]) {
        if let Some(m) = self.port_mac.get_mut(port as usize) {
            *m = Some(mac);
        }
        self.insert(FdbEntry {
            mac,
            port,
            valid: true,
            fixed: true,
        });
    }

    fn insert(&mut self, new: FdbEntry) {
        let mut i = fdb_hash(&new.mac);
        // Open addressing: the entry for the address, or the first free one; a full
        // probe overwrites the home slot unless it is fixed.
        for _ in 0..FDB_SIZE {
            let e = &mut self.fdb[i];
            if e.valid && e.mac == new.mac && e.fixed && !new.fixed {
                return;
            }
            if !e.valid || e.mac == new.mac {
                *e = new;
                return;
            }
            i = (i + 1) & (FDB_SIZE - 1);
        }
        let home = &mut self.fdb[fdb_hash(&new.mac)];
        if !home.fixed || new.fixed {
            *home = new;
        }
    }

    fn entry(&self, mac: &[u8; 6]) -> Option<&FdbEntry> {
        let mut i = fdb_hash(mac);
        for _ in 0..FDB_SIZE {
            let e = &self.fdb[i];
            if !e.valid {
                return None;
            }
            if e.mac == *mac {
                return Some(e);
            }
            i = (i + 1) & (FDB_SIZE - 1);
        }
        None
    }

    fn lookup(&self, mac: &[u8; 6]) -> Option<u16> {
        self.entry(mac).map(|e| e.port)
    }

    /// Forgets every address behind `port`, fixed ones too (its vif went away).
    pub fn forget_port(&mut self, port: u16) {
        let keep: Vec<FdbEntry> = self
            .fdb
            .iter()
            .filter(|e| e.valid && e.port != port)
            .copied()
            .collect();
        self.fdb.iter_mut().for_each(|e| e.valid = false);
        for e in keep {
            self.insert(e);
        }
        if let Some(m) = self.port_mac.get_mut(port as usize) {
            *m = None;
        }
    }

    fn count_drop(&mut self, why: BridgeDrop) -> Forward {
        self.stats.drops.add(why);
        Forward::Drop(why)
    }

    /// Decides where a frame (data at its Ethernet header) that came in on `in_port`
    /// goes, learning its source and running the hooks. The caller transmits it (or
    /// frees it on a drop).
    pub fn input(&mut self, pool: &SkbPool, skb: SkbId, in_port: u16) -> Forward {
        let _c = enter(Class::Bridge);
        let mut hdr = [0u8; ETH_HEADER + 60];
        let n = pool.len(skb).min(hdr.len());
        if n < ETH_HEADER || pool.read(skb, 0, &mut hdr[..n]).is_err() {
            return self.count_drop(BridgeDrop::Runt);
        }
        let eth = EthernetFrame::new_unchecked(&hdr[..n]);
        let (src, dst) = (eth.src_addr().0, eth.dst_addr().0);
        if src[0] & 1 != 0 {
            return self.count_drop(BridgeDrop::BadSource);
        }
        // Anti-spoofing before learning: a vif sends only from its own address, and
        // nobody sends from an address fixed on another port. Learning from such a
        // frame would redirect the owner's unicast traffic to the sender.
        let own = self.port_mac.get(in_port as usize).copied().flatten();
        match (own, self.entry(&src)) {
            (Some(mac), _) if mac != src => return self.count_drop(BridgeDrop::Spoofed),
            (_, Some(e)) if e.fixed && e.port != in_port => {
                return self.count_drop(BridgeDrop::Spoofed)
            }
            (_, Some(e)) if e.port == in_port => {}
            _ => self.learn(src, in_port),
        }
        let out = if dst[0] & 1 != 0 {
            None
        } else {
            self.lookup(&dst)
        };
        if out == Some(in_port) {
            return self.count_drop(BridgeDrop::SamePort);
        }
        if self.netfilter.is_some() && eth.ethertype() == EthernetProtocol::Ipv4 {
            let _f = enter(Class::Netfilter);
            let Some(h) = pre_routing_checks(&hdr[ETH_HEADER..n], pool.len(skb) - ETH_HEADER)
            else {
                return self.count_drop(BridgeDrop::BadIp);
            };
            let nf = self.netfilter.as_mut().expect("checked above");
            for hook in [Hook::PreRouting, Hook::Forward, Hook::PostRouting] {
                if nf.run(hook, &h) == Verdict::Drop {
                    return self.count_drop(BridgeDrop::Filtered);
                }
            }
            self.stats.hooked += 1;
        }
        match out {
            Some(p) => {
                self.stats.forwarded += 1;
                Forward::Port(p)
            }
            None => {
                self.stats.flooded += 1;
                Forward::Flood
            }
        }
    }
}

/// `br_nf_pre_routing`'s IP checks (those of `ip_rcv`): version, header length, total
/// length against the frame, header checksum. Returns the fields rules match on.
fn pre_routing_checks(ip: &[u8], frame_ip_len: usize) -> Option<Headers> {
    if ip.len() < IPV4_HEADER {
        return None;
    }
    let p = Ipv4Packet::new_unchecked(ip);
    let hl = p.header_len() as usize;
    if p.version() != 4 || hl < IPV4_HEADER || hl > ip.len() {
        return None;
    }
    let tl = p.total_len() as usize;
    if tl < hl || tl > frame_ip_len {
        return None;
    }
    if !Ipv4Packet::new_unchecked(&ip[..hl]).verify_checksum() {
        return None;
    }
    let proto = p.next_header();
    let dport = (matches!(proto, IpProtocol::Udp | IpProtocol::Tcp)
        && p.frag_offset() == 0
        && ip.len() >= hl + 4)
        .then(|| u16::from_be_bytes([ip[hl + 2], ip[hl + 3]]));
    Some(Headers {
        src: p.src_addr(),
        dst: p.dst_addr(),
        proto,
        dport,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::skb::NET_SKB_PAD;
    use crate::wire::tests::{flow, frames_of};
    use hv::{DomainConfig, GrantPath, GrantVersion, HvConfig, Hypervisor};
    use std::sync::Arc;

    fn pool() -> (Arc<Hypervisor>, SkbPool) {
        let hv = Hypervisor::new(HvConfig {
            frames: 1024,
            grant_path: GrantPath::Optimised,
            ..HvConfig::default()
        })
        .expect("hv");
        let d = hv
            .create_domain(&DomainConfig {
                name: "d".into(),
                pages: 256,
                grant_frames: 1,
                grant_version: GrantVersion::V2,
                vcpus: 1,
                map_slots: 4,
                driver_domain: true,
            })
            .expect("dom");
        (hv, SkbPool::new(d, 16, 0).expect("pool"))
    }

    fn skb(pool: &mut SkbPool, f: &[u8]) -> SkbId {
        let id = pool.alloc(NET_SKB_PAD).expect("skb");
        pool.put(id, f).expect("put");
        id
    }

    #[test]
    fn unknown_destinations_flood_then_learned_ones_forward() {
        let (_hv, mut p) = pool();
        let mut br = Bridge::new(3, true);
        let f = frames_of(100, 1).remove(0);
        let id = skb(&mut p, &f);
        assert_eq!(
            br.input(&p, id, 0),
            Forward::Flood,
            "receiver not known yet"
        );
        br.learn(flow().dst_mac, 2);
        assert_eq!(br.input(&p, id, 0), Forward::Port(2));
        // The sender was learned on port 0: a reply goes there.
        let mut back = f.clone();
        back[0..6].copy_from_slice(&flow().src_mac);
        back[6..12].copy_from_slice(&flow().dst_mac);
        let id2 = skb(&mut p, &back);
        assert_eq!(br.input(&p, id2, 2), Forward::Port(0));
        // Addressed back to its own port.
        assert_eq!(
            br.input(&p, id, 2),
            Forward::Drop(BridgeDrop::SamePort),
            "moved: the sender is now on 2"
        );
    }

    #[test]
    fn hooks_check_ip_headers_and_rules_drop_with_filtering_on_only() {
        let (_hv, mut p) = pool();
        let mut f = frames_of(100, 1).remove(0);
        for filter in [true, false] {
            let mut br = Bridge::new(2, filter);
            br.learn(flow().dst_mac, 1);
            let id = skb(&mut p, &f);
            assert_eq!(br.input(&p, id, 0), Forward::Port(1));
            assert_eq!(br.stats().hooked, u64::from(filter), "hooks passed");
            if let Some(nf) = br.netfilter.as_mut() {
                assert_eq!(nf.chain_packets("filter", Hook::Forward), Some(1));
                nf.append(
                    "filter",
                    Hook::Forward,
                    Rule {
                        src: None,
                        dst: Some((flow().dst_ip, 32)),
                        proto: Some(IpProtocol::Udp),
                        dport: Some((flow().dst_port, flow().dst_port)),
                        verdict: Verdict::Drop,
                    },
                );
            }
            let want = if filter {
                Forward::Drop(BridgeDrop::Filtered)
            } else {
                Forward::Port(1)
            };
            assert_eq!(br.input(&p, id, 0), want);
            assert_eq!(
                br.stats().hooked,
                u64::from(filter),
                "a dropped frame is not counted"
            );
        }
        // A corrupted IP header is caught by the pre-routing checks (only with hooks).
        f[ETH_HEADER + 10] ^= 0x40;
        let id = skb(&mut p, &f);
        let mut br = Bridge::new(2, true);
        br.learn(flow().dst_mac, 1);
        assert_eq!(br.input(&p, id, 0), Forward::Drop(BridgeDrop::BadIp));
        let mut br = Bridge::new(2, false);
        br.learn(flow().dst_mac, 1);
        assert_eq!(br.input(&p, id, 0), Forward::Port(1));
    }

    #[test]
    fn runts_and_multicast_sources_are_dropped() {
        let (_hv, mut p) = pool();
        let mut br = Bridge::new(2, true);
        let id = skb(&mut p, &[0u8; 10]);
        assert_eq!(br.input(&p, id, 0), Forward::Drop(BridgeDrop::Runt));
        let mut f = frames_of(10, 1).remove(0);
        f[6] |= 1;
        let id = skb(&mut p, &f);
        assert_eq!(br.input(&p, id, 0), Forward::Drop(BridgeDrop::BadSource));
        assert_eq!(
            (
                br.stats().drops.get(BridgeDrop::Runt),
                br.stats().drops.get(BridgeDrop::BadSource)
            ),
            (1, 1)
        );
    }

    #[test]
    fn a_vif_cannot_send_from_another_guests_address_or_redirect_its_traffic() {
        // Finding 10 of issue 15: one spoofed frame used to relearn the victim's
        // address on the attacker's port.
        let (_hv, mut p) = pool();
        let (victim, attacker) = ([2, 0, 0, 0, 0, 0xb], [2, 0, 0, 0, 0, 0xa]);
        let mut br = Bridge::new(3, false);
        br.attach_vif(1, attacker);
        br.attach_vif(2, victim);
        let frame = |src: [u8; 6], dst: [u8; 6]| {
            let mut f = frames_of(100, 1).remove(0);
            f[0..6].copy_from_slice(&dst);
            f[6..12].copy_from_slice(&src);
            f
        };
        let outside = flow().src_mac;
        // The attacker sends from the victim's address, and from a made-up one.
        for src in [victim, [2, 0, 0, 0, 0, 0xc]] {
            let id = skb(&mut p, &frame(src, outside));
            assert_eq!(br.input(&p, id, 1), Forward::Drop(BridgeDrop::Spoofed));
        }
        // The wire claims the victim's address too.
        let id = skb(&mut p, &frame(victim, attacker));
        assert_eq!(br.input(&p, id, 0), Forward::Drop(BridgeDrop::Spoofed));
        assert_eq!(br.stats().drops.get(BridgeDrop::Spoofed), 3);
        // The victim's traffic still goes to the victim.
        let id = skb(&mut p, &frame(outside, victim));
        assert_eq!(br.input(&p, id, 0), Forward::Port(2));
        // Honest frames from each vif are forwarded.
        let id = skb(&mut p, &frame(attacker, victim));
        assert_eq!(br.input(&p, id, 1), Forward::Port(2));
        let id = skb(&mut p, &frame(victim, outside));
        assert_eq!(br.input(&p, id, 2), Forward::Port(0));
        // Detached, the port's address is free to move again.
        br.forget_port(2);
        let id = skb(&mut p, &frame(victim, attacker));
        assert_eq!(br.input(&p, id, 0), Forward::Port(1));
        let id = skb(&mut p, &frame(attacker, victim));
        assert_eq!(br.input(&p, id, 1), Forward::Port(0));
    }
}
