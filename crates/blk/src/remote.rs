//! A remote virtual block device's back end through its life: it finds its disk on the
//! wire (the initiator's discovery), publishes what it found to the store, waits for
//! the guest's front end to publish its ring, and then serves it ([`Blkback`] over an
//! AoE store). Whoever runs it (the driver domain's kernel, or the SV-NIC's device
//! cores) calls [`RemoteVbd::poll`] from its loop and hands it the AoE frames its link
//! receives; each step is what a xenbus watch would set off.

use std::sync::Arc;
use std::time::Instant;

use hv::store::{XenStore, XenbusState};
use hv::{DomId, Domain, Hypervisor, Port};

use crate::aoe::BadFrame;
use crate::blkback::{self, Blkback, FrameAt};
use crate::initiator::{AoeIo, Initiator, InitiatorConfig, Phase};
use crate::xenbus;

/// Where a remote device is in its life.
#[derive(Debug)]
enum State {
    /// Looking for its disk.
    Finding(Box<Initiator>),
    /// Published (`InitWait`); waiting for the front end.
    Offered(Box<Initiator>),
    /// Connected.
    Serving(Box<Blkback>),
    /// The handshake failed; the reason.
    Failed(String),
}

/// One remote virtual block device's back end.
#[derive(Debug)]
pub struct RemoteVbd {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
    fe: DomId,
    devid: u32,
    slot_base: u32,
    persistent: bool,
    state: State,
}

/// An initiator's link during discovery: no request, so only sends.
struct Discovery<S>(S);

impl<S: FnMut(&[u8]) -> bool> AoeIo for Discovery<S> {
    fn send(&mut self, frame: &[u8]) -> bool {
        (self.0)(frame)
    }
    fn fetch(&mut self, _req: u16, _offset: usize, _buf: &mut [u8]) -> bool {
        false
    }
    fn place(&mut self, _req: u16, _offset: usize, _at: usize, _len: usize) -> bool {
        false
    }
    fn done(&mut self, _req: u16, _ok: bool) {}
}

impl RemoteVbd {
    /// A device for guest `fe`'s `devid` (the toolstack has made both directories),
    /// mapping at window slots from `slot_base` of `dom` once connected, its disk the
    /// target `cfg` names; `persistent` offers persistent grants.
    pub fn new(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        fe: DomId,
        devid: u32,
        slot_base: u32,
        cfg: InitiatorConfig,
        persistent: bool,
    ) -> Self {
        Self {
            hv: Arc::clone(hv),
            dom: Arc::clone(dom),
            fe,
            devid,
            slot_base,
            persistent,
            state: State::Finding(Box::new(Initiator::new(cfg, blkback::RING_REQUESTS))),
        }
    }

    /// Whether it serves its front end.
    pub fn is_serving(&self) -> bool {
        matches!(self.state, State::Serving(_))
    }
    /// Why the handshake failed, if it did.
    pub fn failed(&self) -> Option<&str> {
        match &self.state {
            State::Failed(e) => Some(e),
            _ => None,
        }
    }
    /// The back end, once connected.
    pub fn backend(&self) -> Option<&Blkback> {
        match &self.state {
            State::Serving(b) => Some(b),
            _ => None,
        }
    }
    /// The front end's domain.
    pub fn frontend(&self) -> DomId {
        self.fe
    }
    /// Its event channel, once connected.
    pub fn port(&self) -> Option<Port> {
        self.backend().map(Blkback::port)
    }
    /// The initiator's counters.
    pub fn aoe_stats(&self) -> Option<&crate::initiator::AoeStats> {
        match &self.state {
            State::Finding(i) | State::Offered(i) => Some(i.stats()),
            State::Serving(b) => b.aoe_stats(),
            State::Failed(_) => None,
        }
    }

    /// When [`RemoteVbd::poll`] next has something to do on its own (a resend, a
    /// bound), if anything; while waiting for the front end, soon.
    pub fn next_due(&self) -> Option<Instant> {
        match &self.state {
            State::Finding(i) => i.next_due(),
            State::Offered(_) => Some(Instant::now() + std::time::Duration::from_millis(1)),
            State::Serving(b) => b.net_due(),
            State::Failed(_) => None,
        }
    }

    /// One step at `now`: discovery's sends; once found, publishing; once the front end
    /// is there, connecting; then the initiator's sends. Returns the work done.
    pub fn poll(&mut self, now: Instant, mut send: impl FnMut(&[u8]) -> bool) -> usize {
        match &mut self.state {
            State::Finding(ini) => {
                let n = ini.poll(now, &mut Discovery(&mut send));
                if ini.phase() == Phase::Ready {
                    let r = blkback::probe_remote(
                        self.hv.store(),
                        self.dom.id(),
                        self.fe,
                        self.devid,
                        ini,
                        self.persistent,
                    );
                    self.state = match (
                        r,
                        std::mem::replace(&mut self.state, State::Failed(String::new())),
                    ) {
                        (Ok(()), State::Finding(i)) => State::Offered(i),
                        (Err(e), _) => State::Failed(e.to_string()),
                        (_, s) => s,
                    };
                    return n + 1;
                }
                n
            }
            State::Offered(_) => {
                let fdir = xenbus::frontend_dir(self.fe, self.devid);
                let st = self.hv.store().xenbus_state(self.dom.id(), &fdir);
                if !matches!(st, XenbusState::Initialised | XenbusState::Connected) {
                    return 0;
                }
                let State::Offered(ini) =
                    std::mem::replace(&mut self.state, State::Failed(String::new()))
                else {
                    return 0;
                };
                self.state = match Blkback::connect_remote(
                    hv::Pvio::new(&self.hv, &self.dom),
                    self.fe,
                    self.devid,
                    self.slot_base,
                    *ini,
                ) {
                    // Requests the front end put on the ring before the channel was
                    // bound sent an event no one took: look at the ring once now.
                    Ok(mut b) => {
                        b.serve();
                        State::Serving(Box::new(b))
                    }
                    Err(e) => State::Failed(e.to_string()),
                };
                1 + self.poll(now, send)
            }
            State::Serving(b) => b.net_poll(now, send),
            State::Failed(_) => 0,
        }
    }

    /// Serves the front end's requests (its event), at most [`blkback::SERVE_BUDGET`].
    pub fn serve(&mut self) -> usize {
        match &mut self.state {
            State::Serving(b) => b.serve(),
            _ => 0,
        }
    }

    /// Whether requests wait that the last `serve` left for its budget.
    pub fn pending(&mut self) -> bool {
        match &mut self.state {
            State::Serving(b) => b.pending(),
            _ => false,
        }
    }

    /// Takes an AoE frame from the link (see [`Blkback::net_input`]).
    pub fn input(
        &mut self,
        head: &[u8],
        len: usize,
        at: FrameAt<'_>,
        now: Instant,
        mut send: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), BadFrame> {
        match &mut self.state {
            State::Finding(ini) | State::Offered(ini) => {
                ini.input(head, len, now, &mut Discovery(&mut send))
            }
            State::Serving(b) => b.net_input(head, len, at, now, send),
            State::Failed(_) => Err(BadFrame::UnknownTag),
        }
    }

    /// Disconnects (if connected) and closes the back end's directory.
    pub fn disconnect(self) {
        if let State::Serving(b) = self.state {
            b.disconnect();
        } else {
            let dir = xenbus::backend_dir(self.dom.id(), self.fe, self.devid);
            let _ = self
                .hv
                .store()
                .switch_state(self.dom.id(), &dir, XenbusState::Closed);
        }
    }
}
