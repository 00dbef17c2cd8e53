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

/// Creates (or attaches to) the TAP interface `name` in the calling thread's network
/// namespace, without packet-information headers: each `read` returns one Ethernet
/// frame, each `write` sends one. Returns the file and the name the kernel chose.
pub fn open_tap(name: &str) -> io::Result<(File, String)> {
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
        flags: IFF_TAP | IFF_NO_PI,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `req` is (40 bytes,
    // the name first, the flags at offset 16); `file` is an open /dev/net/tun.
    if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let len = req.name.iter().position(|&b| b == 0).unwrap_or(IFNAMSIZ);
    let chosen = String::from_utf8_lossy(&req.name[..len]).into_owned();
    Ok((file, chosen))
}

const _: () = assert!(std::mem::size_of::<IfReq>() == 40);

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
