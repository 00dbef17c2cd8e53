//! Linux's devices for a real Xen's grant tables and event channels, as a dom0 (or
//! driver-domain) process uses them: `/dev/xen/gntdev` and `/dev/xen/evtchn`, with the
//! structures of Linux's `include/uapi/xen/{gntdev,evtchn}.h`.
//!
//! Each call is one ioctl (a hypercall made by the kernel for this process). What comes
//! back from the kernel is checked before use: a map's index must be page-aligned, a
//! pending port must be a plain number; a copy's local side is a frame of this process's
//! [`MachineMemory`], bounds-checked like every other access to it.
//!
//! Nothing here is reachable without those devices: opening one on a machine that is not
//! running on Xen fails with the device's own error, and nothing else happens.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use crate::{check_in_page, MachineMemory, MemError, Mfn, PAGE_SHIFT, PAGE_SIZE};

/// `_IOC(_IOC_NONE, ty, nr, size)`: no direction bits, as Linux's Xen devices declare
/// every request.
const fn ioc_none(ty: u8, nr: u8, size: usize) -> libc::c_ulong {
    ((size as libc::c_ulong) << 16) | ((ty as libc::c_ulong) << 8) | nr as libc::c_ulong
}

#[repr(C)]
struct GntdevGrantRef {
    domid: u32,
    gref: u32,
}

#[repr(C)]
struct GntdevMapGrantRef {
    count: u32,
    pad: u32,
    index: u64,
    refs: [GntdevGrantRef; 1],
}

#[repr(C)]
struct GntdevUnmapGrantRef {
    index: u64,
    count: u32,
    pad: u32,
}

/// `struct gntdev_grant_copy_segment`'s `foreign` side (the other is a `void *`).
#[repr(C)]
#[derive(Clone, Copy)]
struct CopyForeign {
    gref: u32,
    offset: u16,
    domid: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
union CopySide {
    virt: *mut libc::c_void,
    foreign: CopyForeign,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CopySegment {
    source: CopySide,
    dest: CopySide,
    len: u16,
    flags: u16,
    status: i16,
}

#[repr(C)]
struct GntdevGrantCopy {
    count: libc::c_uint,
    segments: *mut CopySegment,
}

const IOCTL_GNTDEV_MAP_GRANT_REF: libc::c_ulong =
    ioc_none(b'G', 0, std::mem::size_of::<GntdevMapGrantRef>());
const IOCTL_GNTDEV_UNMAP_GRANT_REF: libc::c_ulong =
    ioc_none(b'G', 1, std::mem::size_of::<GntdevUnmapGrantRef>());
const IOCTL_GNTDEV_GRANT_COPY: libc::c_ulong =
    ioc_none(b'G', 8, std::mem::size_of::<GntdevGrantCopy>());

const GNTCOPY_SOURCE_GREF: u16 = 1 << 0;
const GNTCOPY_DEST_GREF: u16 = 1 << 1;

/// Segments per `IOCTL_GNTDEV_GRANT_COPY` (Linux's gntdev takes any number and batches
/// them itself; this bounds the stack array each call builds).
pub const GRANT_COPY_BATCH: usize = 32;

/// `GNTST_general_error`: what a segment that was never tried reports.
const GNTST_GENERAL_ERROR: i16 = -1;
/// `GNTST_bad_copy_arg`: what Xen answers for a side that crosses its page.
const GNTST_BAD_COPY_ARG: i16 = -10;

fn ioctl<T>(fd: RawFd, req: libc::c_ulong, arg: &mut T) -> io::Result<libc::c_int> {
    // SAFETY: `arg` is a live, exclusively borrowed `#[repr(C)]` structure of the size
    // encoded in `req`, which is what the device reads and writes for that request.
    let r = unsafe { libc::ioctl(fd, req, arg as *mut T) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

fn open_device(path: &str) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))
}

/// `/dev/xen/gntdev`: maps other domains' grants into this process and copies through
/// them (`GNTTABOP_map_grant_ref`, `_unmap_grant_ref`, `_copy`).
#[derive(Debug)]
pub struct Gntdev {
    file: File,
}

/// One side of a grant copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyAt {
    /// A page domain `dom` granted as `gref`, from `offset`.
    Grant { dom: u16, gref: u32, offset: u16 },
    /// A frame of this process's machine memory, from `offset`.
    Local { mfn: Mfn, offset: u16 },
}

/// One grant copy: `len` bytes, each side within its page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantCopyOp {
    /// Where from.
    pub source: CopyAt,
    /// Where to.
    pub dest: CopyAt,
    /// Bytes.
    pub len: u16,
}

impl Gntdev {
    /// Opens the device.
    pub fn open() -> io::Result<Self> {
        Ok(Self {
            file: open_device("/dev/xen/gntdev")?,
        })
    }

    /// `IOCTL_GNTDEV_MAP_GRANT_REF` for one page: reserves the mapping of `dom`'s grant
    /// `gref` and returns the offset at which `mmap` of this device maps it. The grant
    /// itself is mapped (and checked by Xen) when that `mmap` happens.
    pub(crate) fn reserve(&self, dom: u16, gref: u32) -> io::Result<u64> {
        let mut op = GntdevMapGrantRef {
            count: 1,
            pad: 0,
            index: 0,
            refs: [GntdevGrantRef {
                domid: u32::from(dom),
                gref,
            }],
        };
        ioctl(self.file.as_raw_fd(), IOCTL_GNTDEV_MAP_GRANT_REF, &mut op)?;
        if !op.index.is_multiple_of(PAGE_SIZE as u64)
            || op.index >> PAGE_SHIFT > u64::from(u32::MAX)
        {
            // Not an offset this device hands out: give it back and refuse.
            let _ = self.release(op.index);
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(op.index)
    }

    /// `IOCTL_GNTDEV_UNMAP_GRANT_REF` for the page at `index` (after its `mmap` is gone:
    /// Linux unmaps the grant when the last mapping of it goes).
    pub(crate) fn release(&self, index: u64) -> io::Result<()> {
        let mut op = GntdevUnmapGrantRef {
            index,
            count: 1,
            pad: 0,
        };
        ioctl(self.file.as_raw_fd(), IOCTL_GNTDEV_UNMAP_GRANT_REF, &mut op).map(|_| ())
    }

    /// `IOCTL_GNTDEV_GRANT_COPY`: performs `ops`, whose local sides are frames of `mem`,
    /// writing one `GNTST_*` status per operation into `status` (0 is success). An
    /// operation with a side out of bounds is refused here with `GNTST_bad_copy_arg`, one
    /// that names no grant at all with `GNTST_general_error`; neither reaches the kernel. Returns how
    /// many succeeded, or the ioctl's own error (every status then says general error).
    pub fn copy(
        &self,
        mem: &MachineMemory,
        ops: &[GrantCopyOp],
        status: &mut [i16],
    ) -> io::Result<usize> {
        let n = ops.len().min(status.len());
        let mut ok = 0;
        for (o, s) in ops[..n]
            .chunks(GRANT_COPY_BATCH)
            .zip(status[..n].chunks_mut(GRANT_COPY_BATCH))
        {
            ok += self.copy_batch(mem, o, s)?;
        }
        Ok(ok)
    }

    fn copy_batch(
        &self,
        mem: &MachineMemory,
        ops: &[GrantCopyOp],
        status: &mut [i16],
    ) -> io::Result<usize> {
        let empty = CopySegment {
            source: CopySide {
                foreign: CopyForeign {
                    gref: 0,
                    offset: 0,
                    domid: 0,
                },
            },
            dest: CopySide {
                foreign: CopyForeign {
                    gref: 0,
                    offset: 0,
                    domid: 0,
                },
            },
            len: 0,
            flags: 0,
            status: 0,
        };
        let mut segs = [empty; GRANT_COPY_BATCH];
        // Which operation each segment carries (refused ones carry none).
        let mut which = [0usize; GRANT_COPY_BATCH];
        let mut k = 0;
        for (i, op) in ops.iter().enumerate() {
            status[i] = GNTST_GENERAL_ERROR;
            let side = |at: CopyAt| -> Result<(CopySide, u16), MemError> {
                match at {
                    CopyAt::Grant { dom, gref, offset } => {
                        check_in_page(usize::from(offset), usize::from(op.len))?;
                        Ok((
                            CopySide {
                                foreign: CopyForeign {
                                    gref,
                                    offset,
                                    domid: dom,
                                },
                            },
                            1,
                        ))
                    }
                    CopyAt::Local { mfn, offset } => {
                        let p = mem.ptr(mfn, usize::from(offset), usize::from(op.len))?;
                        Ok((CopySide { virt: p.cast() }, 0))
                    }
                }
            };
            let (Ok((source, sg)), Ok((dest, dg))) = (side(op.source), side(op.dest)) else {
                // Outside its page (or outside machine memory): as Xen refuses it.
                status[i] = GNTST_BAD_COPY_ARG;
                continue;
            };
            if sg + dg == 0 {
                // Local to local is no grant copy.
                continue;
            }
            segs[k] = CopySegment {
                source,
                dest,
                len: op.len,
                flags: if sg == 1 { GNTCOPY_SOURCE_GREF } else { 0 }
                    | if dg == 1 { GNTCOPY_DEST_GREF } else { 0 },
                status: GNTST_GENERAL_ERROR,
            };
            which[k] = i;
            k += 1;
        }
        if k == 0 {
            return Ok(0);
        }
        let mut arg = GntdevGrantCopy {
            count: k as libc::c_uint,
            segments: segs.as_mut_ptr(),
        };
        // The local pointers stay valid throughout: `mem` is borrowed for the call and
        // its mapping lives as long as it does.
        ioctl(self.file.as_raw_fd(), IOCTL_GNTDEV_GRANT_COPY, &mut arg)?;
        let mut ok = 0;
        for (seg, &i) in segs[..k].iter().zip(&which[..k]) {
            status[i] = seg.status;
            ok += usize::from(seg.status == 0);
        }
        Ok(ok)
    }
}

impl AsFd for Gntdev {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

#[repr(C)]
struct EvtchnBindInterdomain {
    remote_domain: libc::c_uint,
    remote_port: libc::c_uint,
}

#[repr(C)]
struct EvtchnPort {
    port: libc::c_uint,
}

const IOCTL_EVTCHN_BIND_INTERDOMAIN: libc::c_ulong =
    ioc_none(b'E', 1, std::mem::size_of::<EvtchnBindInterdomain>());
const IOCTL_EVTCHN_UNBIND: libc::c_ulong = ioc_none(b'E', 3, std::mem::size_of::<EvtchnPort>());
const IOCTL_EVTCHN_NOTIFY: libc::c_ulong = ioc_none(b'E', 4, std::mem::size_of::<EvtchnPort>());

/// `/dev/xen/evtchn`: this process's event channels. A port bound here fires by becoming
/// readable from the device (and masked until [`Evtchn::unmask`]).
#[derive(Debug)]
pub struct Evtchn {
    file: File,
}

impl Evtchn {
    /// Opens the device.
    pub fn open() -> io::Result<Self> {
        Ok(Self {
            file: open_device("/dev/xen/evtchn")?,
        })
    }

    /// `EVTCHNOP_bind_interdomain`: a local port bound to `remote`'s unbound `port`.
    pub fn bind_interdomain(&self, remote: u16, port: u32) -> io::Result<u32> {
        let mut op = EvtchnBindInterdomain {
            remote_domain: libc::c_uint::from(remote),
            remote_port: port,
        };
        let local = ioctl(
            self.file.as_raw_fd(),
            IOCTL_EVTCHN_BIND_INTERDOMAIN,
            &mut op,
        )?;
        Ok(local as u32)
    }

    /// `EVTCHNOP_close` of a port bound here.
    pub fn unbind(&self, port: u32) -> io::Result<()> {
        let mut op = EvtchnPort { port };
        ioctl(self.file.as_raw_fd(), IOCTL_EVTCHN_UNBIND, &mut op).map(|_| ())
    }

    /// `EVTCHNOP_send` on a port bound here.
    pub fn notify(&self, port: u32) -> io::Result<()> {
        let mut op = EvtchnPort { port };
        ioctl(self.file.as_raw_fd(), IOCTL_EVTCHN_NOTIFY, &mut op).map(|_| ())
    }

    /// Makes [`Evtchn::pending`] answer `WouldBlock` instead of waiting when no port
    /// fired (for a reader that looks only when woken).
    pub fn set_nonblocking(&self) -> io::Result<()> {
        crate::poll::set_nonblocking(&self.file)
    }

    /// Waits for ports to fire and writes them into `ports`; how many. Each stays masked
    /// until unmasked. Blocks unless the device was made non-blocking.
    pub fn pending(&self, ports: &mut [u32]) -> io::Result<usize> {
        let mut buf = [0u8; 4 * 64];
        let want = ports.len().min(64) * 4;
        let n = {
            use std::io::Read;
            (&self.file).read(&mut buf[..want])?
        };
        let k = n / 4;
        for (p, b) in ports.iter_mut().zip(buf[..k * 4].chunks_exact(4)) {
            *p = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(k)
    }

    /// Unmasks `port` (writes it to the device), so that it can fire again.
    pub fn unmask(&self, port: u32) -> io::Result<()> {
        use std::io::Write;
        (&self.file).write_all(&port.to_ne_bytes())
    }
}

impl AsRawFd for Evtchn {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_encode_as_linuxs_headers_do() {
        // _IOC(_IOC_NONE, 'G', 0, 24) and friends, as the uapi headers compute them on
        // x86-64.
        assert_eq!(IOCTL_GNTDEV_MAP_GRANT_REF, 0x0018_4700);
        assert_eq!(IOCTL_GNTDEV_UNMAP_GRANT_REF, 0x0010_4701);
        assert_eq!(IOCTL_GNTDEV_GRANT_COPY, 0x0010_4708);
        assert_eq!(IOCTL_EVTCHN_BIND_INTERDOMAIN, 0x0008_4501);
        assert_eq!(IOCTL_EVTCHN_UNBIND, 0x0004_4503);
        assert_eq!(IOCTL_EVTCHN_NOTIFY, 0x0004_4504);
        assert_eq!(std::mem::size_of::<CopySegment>(), 24);
    }

    #[test]
    fn without_xen_opening_fails_with_the_devices_name() {
        if std::path::Path::new("/dev/xen/gntdev").exists() {
            return;
        }
        let e = Gntdev::open().expect_err("no Xen here");
        assert!(e.to_string().contains("/dev/xen/gntdev"), "{e}");
        let e = Evtchn::open().expect_err("no Xen here");
        assert!(e.to_string().contains("/dev/xen/evtchn"), "{e}");
    }
}
