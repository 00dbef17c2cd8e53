//! Linux TAP devices: an Ethernet interface whose frames a process reads and writes.
//!
//! `pvio up` puts the NIC model's cable and a guest's network stack on real interfaces
//! with these. The only unsafe part is the `TUNSETIFF` ioctl; frames then move with
//! plain `read`/`write` on the returned file, one frame per call.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;

const IFNAMSIZ: usize = 16;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
/// `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags (the rest of the
/// 40-byte union unused).
#[repr(C)]
struct IfReq {
    name: [u8; IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// `IFF_VNET_HDR`: each frame is preceded by a `struct virtio_net_hdr`.
const IFF_VNET_HDR: libc::c_short = 0x4000;
/// `_IOW('T', 208, unsigned int)`.
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
/// `TUN_F_CSUM`: the reader takes frames with a partial checksum.
const TUN_F_CSUM: libc::c_ulong = 0x01;
/// `TUN_F_TSO4`: the reader takes TCP/IPv4 frames larger than the MTU (GSO).
const TUN_F_TSO4: libc::c_ulong = 0x02;
/// `TUN_F_TSO6`: and TCP/IPv6 ones.
const TUN_F_TSO6: libc::c_ulong = 0x04;
/// `TUN_F_TSO_ECN`: those may carry ECN (CWR is then the segmenter's business).
const TUN_F_TSO_ECN: libc::c_ulong = 0x08;

/// What a TAP's reader (pvio) can take from the kernel's stack, and so what that stack
/// may leave undone: nothing, checksums, or checksums and TCP/IPv4 segmentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TapOffload {
    /// Plain frames, no header: every checksum complete, nothing above the MTU.
    None,
    /// Each frame behind a virtio-net header; partial checksums allowed.
    Csum,
    /// As `Csum`, and TCP segments (over IPv4 or IPv6) of up to 64 KiB with their
    /// segment size.
    CsumTso,
}

/// Creates (or attaches to) the TAP interface `name` in the calling thread's network
/// namespace, without packet-information headers: each `read` returns one Ethernet
/// frame, each `write` sends one. Returns the file and the name the kernel chose.
pub fn open_tap(name: &str) -> io::Result<(File, String)> {
    open_tap_offload(name, TapOffload::None)
}

/// As [`open_tap`], with the offloads `off` enabled: unless `None`, every frame read
/// or written is preceded by a 10-byte virtio-net header (`IFF_VNET_HDR`, the
/// kernel's default header size), and `TUNSETOFFLOAD` tells the kernel what pvio
/// takes.
pub fn open_tap_offload(name: &str, off: TapOffload) -> io::Result<(File, String)> {
    if name.len() >= IFNAMSIZ || name.bytes().any(|b| b == 0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name too long",
        ));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
    let mut req = IfReq {
        name: [0; IFNAMSIZ],
        flags: IFF_TAP
            | IFF_NO_PI
            | if off == TapOffload::None {
                0
            } else {
                IFF_VNET_HDR
            },
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `req` is (40 bytes,
    // the name first, the flags at offset 16); `file` is an open /dev/net/tun.
    if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = match off {
        TapOffload::None => 0,
        TapOffload::Csum => TUN_F_CSUM,
        TapOffload::CsumTso => TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN,
    };
    // SAFETY: TUNSETOFFLOAD takes its argument by value (an unsigned int of TUN_F_*
    // flags); `file` is the TAP just attached.
    if flags != 0 && unsafe { libc::ioctl(file.as_raw_fd(), TUNSETOFFLOAD, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let len = req.name.iter().position(|&b| b == 0).unwrap_or(IFNAMSIZ);
    let chosen = String::from_utf8_lossy(&req.name[..len]).into_owned();
    Ok((file, chosen))
}

const _: () = assert!(std::mem::size_of::<IfReq>() == 40);

/// `_IOW('T', 203, int)`.
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;

/// Makes the TAP that `file` is attached to outlive every file attached to it (`on`):
/// the interface, its addresses and its bridge port stay when the process exits, and
/// the next process to open the same name attaches to it (frames that arrive meanwhile
/// are dropped by the kernel, as on an unplugged cable). With `!on`, the interface goes
/// with the last file, as a TAP made without this does.
pub fn set_persist(file: &impl AsRawFd, on: bool) -> io::Result<()> {
    // SAFETY: TUNSETPERSIST takes its argument by value (0 or 1); `file` is a TAP
    // attached with TUNSETIFF (the kernel refuses any other descriptor).
    if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETPERSIST, libc::c_ulong::from(on)) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `SIOCBRADDIF` (linux/sockios.h; the libc crate names it for Android only): adds the
/// interface whose index the request carries to the bridge it names.
const SIOCBRADDIF: libc::c_ulong = 0x89a2;

/// `struct ifreq` whose union holds an `int` (an interface index) or a `short` (its
/// flags), each at the union's start, kept as the bytes the kernel reads and writes.
#[repr(C)]
struct IfReqInt {
    name: [u8; IFNAMSIZ],
    data: [u8; 24],
}

const _: () = assert!(std::mem::size_of::<IfReqInt>() == 40);

impl IfReqInt {
    fn named(name: &str) -> io::Result<Self> {
        if name.is_empty() || name.len() >= IFNAMSIZ || name.bytes().any(|b| b == 0 || b == b'/') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not an interface name"),
            ));
        }
        let mut r = IfReqInt {
            name: [0; IFNAMSIZ],
            data: [0; 24],
        };
        r.name[..name.len()].copy_from_slice(name.as_bytes());
        Ok(r)
    }
    fn int(&self) -> libc::c_int {
        libc::c_int::from_ne_bytes([self.data[0], self.data[1], self.data[2], self.data[3]])
    }
    fn set_int(&mut self, v: libc::c_int) {
        self.data[..4].copy_from_slice(&v.to_ne_bytes());
    }
    fn short(&self) -> libc::c_short {
        libc::c_short::from_ne_bytes([self.data[0], self.data[1]])
    }
    fn set_short(&mut self, v: libc::c_short) {
        self.data[..2].copy_from_slice(&v.to_ne_bytes());
    }
}

/// One interface request on a socket made for it (any socket takes them).
fn if_ioctl(request: libc::c_ulong, req: &mut IfReqInt) -> io::Result<()> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and nothing else owns it.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: every request passed here (SIOCGIFINDEX, SIOCBRADDIF, SIOCGIFFLAGS,
    // SIOCSIFFLAGS) reads and writes one `struct ifreq` of 40 bytes, which `req` is: the
    // name first, the int or short at offset 16.
    if unsafe { libc::ioctl(sock.as_raw_fd(), request, req as *mut IfReqInt) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The bridge `ifname` is a port of, if it is one (its `master` in sysfs).
pub fn bridge_of(ifname: &str) -> Option<String> {
    let link = std::fs::read_link(format!("/sys/class/net/{ifname}/master")).ok()?;
    link.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// Puts the interface `ifname` on the bridge `bridge` and brings it up, as Xen's
/// `vif-bridge` hotplug script does for the interface a back end made (`ip link set
/// master`, `ip link set up`). Already on that bridge is not an error; on another
/// bridge is (`EBUSY`), and the interface stays where it was.
pub fn join_bridge(ifname: &str, bridge: &str) -> io::Result<()> {
    if bridge_of(ifname).as_deref() != Some(bridge) {
        let mut r = IfReqInt::named(ifname)?;
        if_ioctl(libc::SIOCGIFINDEX, &mut r)?;
        let mut b = IfReqInt::named(bridge)?;
        b.set_int(r.int());
        if_ioctl(SIOCBRADDIF, &mut b)?;
    }
    set_up(ifname)
}

/// Sets `IFF_UP` on the interface `ifname` (`ip link set up`).
pub fn set_up(ifname: &str) -> io::Result<()> {
    let mut r = IfReqInt::named(ifname)?;
    if_ioctl(libc::SIOCGIFFLAGS, &mut r)?;
    // Written back as read, with IFF_UP added.
    r.set_short(r.short() | libc::IFF_UP as libc::c_short);
    if_ioctl(libc::SIOCSIFFLAGS, &mut r)
}

/// Waits up to `timeout` for `file` to have something to read; true if it has.
pub fn wait_readable(file: &File, timeout: std::time::Duration) -> io::Result<bool> {
    let mut p = libc::pollfd {
        fd: file.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd for an open descriptor, and its count.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    match r {
        0 => Ok(false),
        n if n > 0 => Ok(p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exists(name: &str) -> bool {
        std::path::Path::new("/sys/class/net").join(name).exists()
    }

    #[test]
    #[ignore = "needs root: TAPs (.ci/run runs it as root)"]
    fn a_persistent_tap_outlives_its_file_and_the_next_open_attaches_to_it() {
        let name = format!("pvpst{}", std::process::id() % 10_000);
        let (f, got) = open_tap_offload(&name, TapOffload::CsumTso).expect("tap");
        assert_eq!(got, name);
        set_persist(&f, true).expect("persist");
        drop(f);
        assert!(exists(&name), "the interface stays without a file");
        let (f, again) = open_tap_offload(&name, TapOffload::CsumTso).expect("again");
        assert_eq!(again, name, "the same interface, attached again");
        set_persist(&f, false).expect("let go");
        drop(f);
        assert!(!exists(&name), "gone with its last file");
    }

    #[test]
    #[ignore = "needs root: TAPs and a bridge (.ci/run runs it as root)"]
    fn a_tap_joins_its_bridge_once_and_comes_up() {
        let n = std::process::id() % 10_000;
        let (tap, br) = (format!("pvbrp{n}"), format!("pvbr{n}"));
        let ip = |args: &[&str]| {
            let ok = std::process::Command::new("ip")
                .args(args)
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "ip {args:?}");
        };
        ip(&["link", "add", "name", &br, "type", "bridge"]);
        let (f, got) = open_tap_offload(&tap, TapOffload::CsumTso).expect("tap");
        assert_eq!(bridge_of(&got), None);
        join_bridge(&got, &br).expect("joins");
        assert_eq!(bridge_of(&got).as_deref(), Some(br.as_str()));
        let flags = std::fs::read_to_string(format!("/sys/class/net/{got}/flags")).expect("flags");
        let flags =
            u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16).expect("hex flags");
        assert_eq!(flags & libc::IFF_UP as u32, libc::IFF_UP as u32, "up");
        join_bridge(&got, &br).expect("a second time (a restart's) is no error");
        assert!(join_bridge(&got, "pvnosuchbr").is_err(), "no such bridge");
        assert_eq!(
            bridge_of(&got).as_deref(),
            Some(br.as_str()),
            "still on its own"
        );
        assert!(join_bridge(&got, "bad/name").is_err());
        drop(f);
        ip(&["link", "del", &br]);
    }
}
