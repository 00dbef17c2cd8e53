//! Machines from files: the machine `pvio up` runs, written as TOML.
//!
//! ```toml
//! [hypervisor]
//! grant_path = "optimised"      # or "original" (paper 000's)
//! grant_version = 2             # or 1
//!
//! [nic]
//! coalesce_packets = 6          # completions per interrupt
//! coalesce_delay_us = 18        # longest a completion waits
//! adaptive = false              # the driver sets the packets per interrupt from the rate
//! multi_queue = false           # a receive queue per guest, frames placed in its buffers
//!
//! [driver]
//! netfilter = true              # the bridge's netfilter hooks
//!
//! [outside]                     # the far end of the NIC's cable
//! namespace = "pvio-outside"
//! address = "10.77.0.1/24"
//!
//! [[guest]]
//! name = "guest"
//! rx_buffers = "fragments"      # or "linear", "guest-copy"
//! grants = "per-io"             # or "reuse"
//! offloads = true               # checksum offload and GSO (false: the plain path)
//! tap = { namespace = "pvio-guest", address = "10.77.0.2/24" }
//! ```
//!
//! Every key is optional but `[[guest]]`: what a file leaves out is the built-in
//! machine's (`pvio up` with no flags). A key the format does not have, a value of the
//! wrong type or out of range, or a second guest, is refused before anything starts,
//! with the key and its line.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use crate::up::UpConfig;
use crate::RxBuffers;

/// Why a machine file was refused.
#[derive(Debug, thiserror::Error)]
pub enum MachineFileError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not TOML, or not this format; the parser's message names the key and line.
    #[error("{path}: {message}")]
    Format {
        /// The file.
        path: PathBuf,
        /// The parser's message, with its line.
        message: String,
    },
    /// A value the format takes but the machine cannot.
    #[error("{path}:{line}: `{key}`: {why}")]
    Value {
        /// The file.
        path: PathBuf,
        /// The line (from 1).
        line: usize,
        /// The key, dotted.
        key: String,
        /// Why.
        why: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    hypervisor: Hypervisor,
    #[serde(default)]
    nic: Nic,
    #[serde(default)]
    driver: Driver,
    #[serde(default)]
    outside: Endpoint,
    guest: Spanned<Vec<Guest>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Hypervisor {
    grant_path: Option<GrantPath>,
    grant_version: Option<Spanned<u8>>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum GrantPath {
    Original,
    Optimised,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Nic {
    coalesce_packets: Option<Spanned<u32>>,
    coalesce_delay_us: Option<Spanned<u64>>,
    adaptive: Option<bool>,
    multi_queue: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Driver {
    netfilter: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Endpoint {
    namespace: Option<Spanned<String>>,
    address: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Guest {
    #[allow(dead_code)]
    name: Option<String>,
    rx_buffers: Option<Buffers>,
    grants: Option<Grants>,
    offloads: Option<bool>,
    #[serde(default)]
    tap: Endpoint,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Buffers {
    Fragments,
    Linear,
    GuestCopy,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Grants {
    PerIo,
    Reuse,
}

/// Reads the machine in `path`.
pub fn load(path: &Path) -> Result<UpConfig, MachineFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| MachineFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse(path, &text)
}

/// The machine in `text` (read from `path`, named in errors).
pub fn parse(path: &Path, text: &str) -> Result<UpConfig, MachineFileError> {
    let f: File = toml::from_str(text).map_err(|e| MachineFileError::Format {
        path: path.to_path_buf(),
        message: e.to_string().trim_end().to_string(),
    })?;
    let refuse = |span: Range<usize>, key: &str, why: String| MachineFileError::Value {
        path: path.to_path_buf(),
        line: text[..span.start.min(text.len())].matches('\n').count() + 1,
        key: key.to_string(),
        why,
    };
    let mut cfg = UpConfig::default();
    if let Some(p) = f.hypervisor.grant_path {
        cfg.grant_path = match p {
            GrantPath::Original => hv::GrantPath::Original,
            GrantPath::Optimised => hv::GrantPath::Optimised,
        };
    }
    if let Some(v) = f.hypervisor.grant_version {
        cfg.grant_version = match *v.get_ref() {
            1 => hv::GrantVersion::V1,
            2 => hv::GrantVersion::V2,
            n => {
                return Err(refuse(
                    v.span(),
                    "hypervisor.grant_version",
                    format!("{n}: grant tables come in versions 1 and 2"),
                ))
            }
        };
    }
    if let Some(n) = f.nic.coalesce_packets {
        if !(1..=dev::nic::RING_DESCS).contains(n.get_ref()) {
            return Err(refuse(
                n.span(),
                "nic.coalesce_packets",
                format!(
                    "{}: from 1 to {} completions per interrupt",
                    n.get_ref(),
                    dev::nic::RING_DESCS
                ),
            ));
        }
        cfg.coalesce.pkts_per_irq = *n.get_ref();
    }
    if let Some(d) = f.nic.coalesce_delay_us {
        if *d.get_ref() > 1_000_000 {
            return Err(refuse(
                d.span(),
                "nic.coalesce_delay_us",
                format!("{} µs: at most a second", d.get_ref()),
            ));
        }
        cfg.coalesce.max_delay = Duration::from_micros(*d.get_ref());
    }
    if let Some(a) = f.nic.adaptive {
        cfg.coalesce.adaptive = a;
    }
    if let Some(q) = f.nic.multi_queue {
        cfg.multi_queue = q;
    }
    if let Some(n) = f.driver.netfilter {
        cfg.netfilter = n;
    }
    let endpoint = |e: &Endpoint,
                    table: &str,
                    ns: &mut String,
                    addr: &mut String|
     -> Result<(), MachineFileError> {
        if let Some(n) = &e.namespace {
            let name = n.get_ref();
            if name.is_empty() || name.len() > 200 || name.contains(['/', '\0', ' ']) {
                return Err(refuse(
                    n.span(),
                    &format!("{table}.namespace"),
                    format!("{name:?} is not a namespace name"),
                ));
            }
            ns.clone_from(name);
        }
        if let Some(a) = &e.address {
            if !is_cidr(a.get_ref()) {
                return Err(refuse(
                    a.span(),
                    &format!("{table}.address"),
                    format!(
                        "{:?}: an IPv4 address with its prefix, as 10.77.0.1/24",
                        a.get_ref()
                    ),
                ));
            }
            addr.clone_from(a.get_ref());
        }
        Ok(())
    };
    endpoint(
        &f.outside,
        "outside",
        &mut cfg.outside_ns,
        &mut cfg.outside_addr,
    )?;
    let guests = f.guest.get_ref();
    match guests.len() {
        1 => {}
        n => {
            return Err(refuse(
                f.guest.span(),
                "guest",
                format!("{n} guests: `pvio up` runs one guest so far"),
            ))
        }
    }
    let g = &guests[0];
    endpoint(&g.tap, "guest.tap", &mut cfg.guest_ns, &mut cfg.guest_addr)?;
    if let Some(b) = g.rx_buffers {
        cfg.rx_buffers = match b {
            Buffers::Fragments => RxBuffers::Fragments,
            Buffers::Linear => RxBuffers::Linear,
            Buffers::GuestCopy => RxBuffers::GuestCopy,
        };
    }
    if let Some(gr) = g.grants {
        cfg.grant_reuse = matches!(gr, Grants::Reuse);
    }
    if let Some(o) = g.offloads {
        cfg.offloads = o;
    }
    if cfg.outside_ns == cfg.guest_ns {
        let span = g
            .tap
            .namespace
            .as_ref()
            .map_or(f.guest.span(), Spanned::span);
        return Err(refuse(
            span,
            "guest.tap.namespace",
            format!("{:?} is the outside's namespace too", cfg.guest_ns),
        ));
    }
    Ok(cfg)
}

/// `a.b.c.d/n`.
fn is_cidr(s: &str) -> bool {
    s.split_once('/').is_some_and(|(ip, n)| {
        ip.parse::<std::net::Ipv4Addr>().is_ok() && n.parse::<u8>().is_ok_and(|n| n <= 32)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(text: &str) -> Result<UpConfig, MachineFileError> {
        parse(Path::new("m.toml"), text)
    }

    #[test]
    fn a_file_sets_what_it_names_and_leaves_the_rest_to_the_built_in_machine() {
        let cfg = p(r#"
[hypervisor]
grant_path = "optimised"
grant_version = 2

[nic]
coalesce_packets = 32
adaptive = true
multi_queue = true

[driver]
netfilter = false

[[guest]]
rx_buffers = "linear"
grants = "reuse"
offloads = false
tap = { namespace = "g1", address = "10.9.0.2/24" }
"#)
        .expect("a good file");
        let d = UpConfig::default();
        assert_eq!(cfg.grant_path, hv::GrantPath::Optimised);
        assert_eq!(cfg.grant_version, hv::GrantVersion::V2);
        assert_eq!(cfg.coalesce.pkts_per_irq, 32);
        assert!(cfg.coalesce.adaptive);
        assert_eq!(cfg.coalesce.max_delay, d.coalesce.max_delay);
        assert!(cfg.multi_queue && cfg.grant_reuse && !cfg.netfilter);
        assert!(d.offloads && !cfg.offloads);
        assert_eq!(cfg.rx_buffers, RxBuffers::Linear);
        assert_eq!(
            (cfg.guest_ns.as_str(), cfg.guest_addr.as_str()),
            ("g1", "10.9.0.2/24")
        );
        assert_eq!(cfg.outside_ns, d.outside_ns, "the outside left as built in");
    }

    #[test]
    fn a_bad_file_is_refused_with_the_key_and_its_line() {
        for (text, key, line) in [
            ("[[guest]]\nspeed = 3\n", "speed", 2),
            (
                "[nic]\ncoalesce_packets = \"six\"\n[[guest]]\n",
                "coalesce_packets",
                2,
            ),
            (
                "[nic]\n\ncoalesce_packets = 0\n[[guest]]\n",
                "nic.coalesce_packets",
                3,
            ),
            (
                "[hypervisor]\ngrant_version = 3\n[[guest]]\n",
                "hypervisor.grant_version",
                2,
            ),
            (
                "[[guest]]\ntap = { address = \"10.1.0.300/24\" }\n",
                "guest.tap.address",
                2,
            ),
            ("[[guest]]\n[[guest]]\n", "guest", 1),
            ("[driver]\nnetfilter = true\n", "guest", 0),
            ("[[guest]]\ngrants = \"machine-frames\"\n", "grants", 2),
        ] {
            let e = p(text).expect_err(text).to_string();
            assert!(e.contains(key), "{text:?}: {e}");
            if line > 0 {
                assert!(
                    e.contains(&format!("m.toml:{line}:")) || e.contains(&format!("line {line}")),
                    "{text:?}: the line in {e}"
                );
            }
        }
    }

    #[test]
    fn the_example_machines_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../machines");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).expect("machines/") {
            let path = e.expect("entry").path();
            if path.extension().is_some_and(|x| x == "toml") {
                load(&path).unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
        }
        assert!(n > 0, "no example in {}", dir.display());
    }
}
