//! Waiting on the host's file descriptors: the only "interrupt lines" a user-space
//! machine has from the world outside it (a TAP's queue), and a doorbell that wakes a
//! thread sleeping on them.
//!
//! A pCPU that has lines to watch sleeps in `ppoll` on its [`EventFd`] and the lines,
//! and looks at them now and then with a zero timeout while it spins. Everything here is
//! a system call: that is what such a wait costs on a host, and it is only paid at the
//! machine's edge.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// An eventfd: a counter the kernel wakes pollers on.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A non-blocking eventfd, closed on exec.
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes two integers and returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nothing else.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Adds one to the counter: a poller on it wakes.
    pub fn signal(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live local buffer to an open eventfd.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Takes the counter back to zero (it is non-blocking: nothing to take is fine).
    pub fn drain(&self) {
        let mut v = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live local buffer from an open eventfd.
        let _ = unsafe { libc::read(self.0.as_raw_fd(), v.as_mut_ptr().cast(), v.len()) };
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// One descriptor to wait on for input, and what the wait saw.
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub struct PollFd(libc::pollfd);

impl PollFd {
    /// Waits for `fd` to have input.
    pub fn readable(fd: RawFd) -> Self {
        Self(libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
    }

    /// Whether the last wait saw input (or an error or hang-up, which a read reports).
    pub fn ready(&self) -> bool {
        self.0.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0
    }
}

/// Waits until one of `fds` is ready, or `timeout` (none: forever; zero: only look).
/// Returns how many are ready; an interrupted wait is zero.
pub fn wait(fds: &mut [PollFd], timeout: Option<Duration>) -> io::Result<usize> {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(d.subsec_nanos() as i32),
    });
    let tp = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `fds` is a live slice of `pollfd` (PollFd is transparent over it) of the
    // length given; `tp` is null or points at a timespec that outlives the call; no
    // signal mask is changed.
    let r = unsafe {
        libc::ppoll(
            fds.as_mut_ptr().cast::<libc::pollfd>(),
            fds.len() as libc::nfds_t,
            tp,
            std::ptr::null(),
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(0)
        } else {
            Err(e)
        };
    }
    Ok(r as usize)
}

/// Makes reads of `file` (and of every handle to the same open file) return
/// `WouldBlock` instead of waiting.
pub fn set_nonblocking(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on an open descriptor with commands that take an int or nothing.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_eventfd_signalled_makes_a_wait_on_it_return_and_drained_does_not() {
        let e = EventFd::new().expect("eventfd");
        let mut fds = [PollFd::readable(e.as_raw_fd())];
        assert_eq!(wait(&mut fds, Some(Duration::ZERO)).expect("poll"), 0);
        assert!(!fds[0].ready());
        e.signal();
        assert_eq!(
            wait(&mut fds, Some(Duration::from_secs(5))).expect("poll"),
            1
        );
        assert!(fds[0].ready());
        e.drain();
        let mut fds = [PollFd::readable(e.as_raw_fd())];
        assert_eq!(
            wait(&mut fds, Some(Duration::from_millis(1))).expect("poll"),
            0
        );
    }
}
