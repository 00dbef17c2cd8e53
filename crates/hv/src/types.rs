//! Identifiers and address spaces, one newtype each, with Xen's names.

pub use mem::Mfn;

/// A domain identifier (`domid_t`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DomId(pub u16);

impl DomId {
    /// The hypervisor itself, as the owner of its own frames (`DOMID_XEN`).
    pub const XEN: DomId = DomId(0x7FF2);
    /// The first domain, the toolstack's (domain 0).
    pub const DOM0: DomId = DomId(0);
}

impl std::fmt::Display for DomId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "d{}", self.0)
    }
}

/// A guest frame number: an index into one domain's P2M table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Gfn(pub u32);

/// A grant reference: an index into the granting domain's grant table (`grant_ref_t`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GrantRef(pub u32);

/// A handle on one grant mapping, returned by map and given back to unmap
/// (`grant_handle_t`): an index into the mapping domain's maptrack table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GrantHandle(pub u32);

/// An event-channel port of one domain (`evtchn_port_t`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Port(pub u32);

/// A physical interrupt vector raised by a device model at the hypervisor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Vector(pub u8);

/// An I/O virtual address: what a device puts on the bus, translated by the IOMMU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Iova(pub u64);

impl Iova {
    /// The I/O page frame number.
    pub fn pfn(self) -> u64 {
        self.0 >> mem::PAGE_SHIFT
    }
    /// Offset inside the page.
    pub fn page_offset(self) -> usize {
        (self.0 & (mem::PAGE_SIZE as u64 - 1)) as usize
    }
}

/// A device (requester) identifier, as a PCI bus/device/function.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId(pub u16);
