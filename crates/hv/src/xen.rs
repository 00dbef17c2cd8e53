//! The hypervisor as a back end reaches it: grants, event channels and the store, from
//! one domain's side.
//!
//! netback and blkback (and the xenbus helpers they use) go through [`Xen`] and never
//! name [`Hypervisor`] directly, so the same back end runs against pvio's hypervisor
//! ([`Pvio`], a domain of this process's machine) or against a real Xen from a dom0
//! process (Linux's `/dev/xen/gntdev`, `/dev/xen/evtchn` and xenstored), as QEMU's
//! `xen_nic` and `xen_disk` run over either real Xen or its emulation of it through one
//! table of operations.
//!
//! What stays the back end's own either way is its memory: [`Xen::domain`] is a pvio
//! [`Domain`] whose pages hold the back end's packet buffers and whose window holds its
//! grant mappings. Under pvio that is the driver domain itself; against real Xen it is a
//! domain of a private, local machine standing for the dom0 process's own memory, with
//! a window whose slots the grant device maps into.
//!
//! Every method is a hypercall (or, against real Xen, the ioctl that makes one) and the
//! caller is always [`Xen::domain`]: a back end cannot act as another domain through
//! this interface.

use std::sync::Arc;

pub mod dom0;

pub use dom0::{Dom0, Dom0Config};

use crate::store::{Store, XenStore};
use crate::{
    DomId, Domain, EvtchnError, GrantCopy, GrantError, GrantHandle, GrantStatus, Hypervisor, MapOp,
    Port,
};

/// Grants, event channels and the store, as the back-end domain [`Xen::domain`] calls
/// them. Each batch call writes one result per operation into its output (which must be
/// at least as long) and returns how many succeeded; a failed operation does not stop
/// the others.
pub trait Xen: Send + Sync + 'static {
    /// The store this back end talks to.
    type Store: XenStore;

    /// The back end's own domain: its id, its memory and the window its maps land in.
    fn domain(&self) -> &Arc<Domain>;

    /// The store.
    fn store(&self) -> &Self::Store;

    /// The back end's id as the other side knows it (the id its store paths and the
    /// front ends' grants name).
    fn id(&self) -> DomId;

    /// `GNTTABOP_map_grant_ref`: maps each grant at its window slot.
    fn grant_map(&self, ops: &[MapOp], out: &mut [Result<GrantHandle, GrantError>]) -> usize;

    /// `GNTTABOP_unmap_grant_ref`: unmaps each mapping; one shoot-down per call.
    fn grant_unmap(&self, handles: &[GrantHandle], out: &mut [GrantStatus]) -> usize;

    /// `GNTTABOP_copy`.
    fn grant_copy(&self, ops: &[GrantCopy], status: &mut [GrantStatus]) -> usize;

    /// `EVTCHNOP_bind_interdomain`: binds a local port to `remote`'s unbound `port`.
    fn evtchn_bind_interdomain(&self, remote: DomId, port: Port) -> Result<Port, EvtchnError>;

    /// `EVTCHNOP_send` on a local port.
    fn evtchn_send(&self, port: Port) -> Result<(), EvtchnError>;

    /// `EVTCHNOP_close` on a local port.
    fn evtchn_close(&self, port: Port) -> Result<(), EvtchnError>;
}

/// A domain of pvio's own hypervisor: every call is the [`Hypervisor`] method of the
/// same name, made by that domain, so a back end over `Pvio` costs what it did when it
/// called the hypervisor directly.
#[derive(Clone)]
pub struct Pvio {
    hv: Arc<Hypervisor>,
    dom: Arc<Domain>,
}

impl Pvio {
    /// `dom`, a domain of `hv`, as a back end.
    pub fn new(hv: &Arc<Hypervisor>, dom: &Arc<Domain>) -> Self {
        Pvio {
            hv: Arc::clone(hv),
            dom: Arc::clone(dom),
        }
    }

    /// The hypervisor.
    pub fn hv(&self) -> &Arc<Hypervisor> {
        &self.hv
    }
}

impl std::fmt::Debug for Pvio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pvio").field("dom", &self.dom.id()).finish()
    }
}

impl Xen for Pvio {
    type Store = Store;

    #[inline]
    fn domain(&self) -> &Arc<Domain> {
        &self.dom
    }

    #[inline]
    fn store(&self) -> &Store {
        self.hv.store()
    }

    #[inline]
    fn id(&self) -> DomId {
        self.dom.id()
    }

    #[inline]
    fn grant_map(&self, ops: &[MapOp], out: &mut [Result<GrantHandle, GrantError>]) -> usize {
        self.hv.grant_map(&self.dom, ops, out)
    }

    #[inline]
    fn grant_unmap(&self, handles: &[GrantHandle], out: &mut [GrantStatus]) -> usize {
        self.hv.grant_unmap(&self.dom, handles, out)
    }

    #[inline]
    fn grant_copy(&self, ops: &[GrantCopy], status: &mut [GrantStatus]) -> usize {
        self.hv.grant_copy(&self.dom, ops, status)
    }

    #[inline]
    fn evtchn_bind_interdomain(&self, remote: DomId, port: Port) -> Result<Port, EvtchnError> {
        self.hv.evtchn_bind_interdomain(&self.dom, remote, port)
    }

    #[inline]
    fn evtchn_send(&self, port: Port) -> Result<(), EvtchnError> {
        self.hv.evtchn_send(&self.dom, port)
    }

    #[inline]
    fn evtchn_close(&self, port: Port) -> Result<(), EvtchnError> {
        self.hv.evtchn_close(&self.dom, port)
    }
}

/// Several back ends share one hypervisor connection (a real dom0 process has one set
/// of devices for all its vifs and vbds).
impl<T: Xen> Xen for Arc<T> {
    type Store = T::Store;

    #[inline]
    fn domain(&self) -> &Arc<Domain> {
        (**self).domain()
    }

    #[inline]
    fn store(&self) -> &T::Store {
        (**self).store()
    }

    #[inline]
    fn id(&self) -> DomId {
        (**self).id()
    }

    #[inline]
    fn grant_map(&self, ops: &[MapOp], out: &mut [Result<GrantHandle, GrantError>]) -> usize {
        (**self).grant_map(ops, out)
    }

    #[inline]
    fn grant_unmap(&self, handles: &[GrantHandle], out: &mut [GrantStatus]) -> usize {
        (**self).grant_unmap(handles, out)
    }

    #[inline]
    fn grant_copy(&self, ops: &[GrantCopy], status: &mut [GrantStatus]) -> usize {
        (**self).grant_copy(ops, status)
    }

    #[inline]
    fn evtchn_bind_interdomain(&self, remote: DomId, port: Port) -> Result<Port, EvtchnError> {
        (**self).evtchn_bind_interdomain(remote, port)
    }

    #[inline]
    fn evtchn_send(&self, port: Port) -> Result<(), EvtchnError> {
        (**self).evtchn_send(port)
    }

    #[inline]
    fn evtchn_close(&self, port: Port) -> Result<(), EvtchnError> {
        (**self).evtchn_close(port)
    }
}
