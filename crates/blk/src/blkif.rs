//! The blkif protocol (`io/blkif.h`): entry layouts, operations, statuses, and the
//! validation a back end makes of each request.
//!
//! A request is copied off the shared ring first (the ring crate hands out copies), then
//! judged here, then used: nothing in it is trusted. What the front end can get wrong in
//! one request — an operation the back end does not offer, a segment count of zero or
//! past the maximum, a segment whose sectors run backwards or past its page, sectors past
//! the device — costs that request an error response and a count, as xen-blkback
//! answers `BLKIF_RSP_ERROR`; it does not break the interface. A request whose segments
//! live in indirect pages is judged twice: its header here, its segments once the back
//! end has copied those pages ([`check_segments`]).

use hv::counters::PerReason;
use ring::RingProtocol;

/// Bytes in a sector: blkif's unit for `sector_number`, `first_sect` and `last_sect`.
pub const SECTOR_SIZE: u64 = 512;
/// Sectors in a page (a segment names sectors `first..=last` of one page).
pub const SECTORS_PER_PAGE: u8 = 8;
/// Segments a request carries in its ring slot.
pub const BLKIF_MAX_SEGMENTS_PER_REQUEST: usize = 11;
/// Indirect pages a request may name.
pub const BLKIF_MAX_INDIRECT_PAGES_PER_REQUEST: usize = 8;
/// Segments one indirect page holds.
pub const SEGMENTS_PER_INDIRECT_PAGE: usize = 4096 / std::mem::size_of::<Segment>();

/// `BLKIF_OP_READ`.
pub const BLKIF_OP_READ: u8 = 0;
/// `BLKIF_OP_WRITE`.
pub const BLKIF_OP_WRITE: u8 = 1;
/// `BLKIF_OP_WRITE_BARRIER` (not offered here: flush instead, as Linux's blkback).
pub const BLKIF_OP_WRITE_BARRIER: u8 = 2;
/// `BLKIF_OP_FLUSH_DISKCACHE`.
pub const BLKIF_OP_FLUSH_DISKCACHE: u8 = 3;
/// `BLKIF_OP_DISCARD`.
pub const BLKIF_OP_DISCARD: u8 = 5;
/// `BLKIF_OP_INDIRECT`.
pub const BLKIF_OP_INDIRECT: u8 = 6;
/// `BLKIF_DISCARD_SECURE`.
pub const BLKIF_DISCARD_SECURE: u8 = 1;

/// `BLKIF_RSP_OKAY`.
pub const BLKIF_RSP_OKAY: i16 = 0;
/// `BLKIF_RSP_ERROR`.
pub const BLKIF_RSP_ERROR: i16 = -1;
/// `BLKIF_RSP_EOPNOTSUPP`.
pub const BLKIF_RSP_EOPNOTSUPP: i16 = -2;

// --- Layouts ----------------------------------------------------------------------

/// `struct blkif_request_segment`: sectors `first_sect..=last_sect` of a granted page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Segment {
    /// The page's grant reference.
    pub gref: u32,
    /// First sector in the page (inclusive).
    pub first_sect: u8,
    /// Last sector in the page (inclusive).
    pub last_sect: u8,
    /// The C struct's tail padding.
    pub pad: u16,
}

/// `struct blkif_request`: a read or write with its segments in the slot, or a flush.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct RawRequest {
    /// `BLKIF_OP_*`.
    pub operation: u8,
    /// Segments in `seg` (read and write).
    pub nr_segments: u8,
    /// The virtual device.
    pub handle: u16,
    /// Padding before `id`.
    pub pad: u32,
    /// The front end's, echoed in the response.
    pub id: u64,
    /// First sector on the device.
    pub sector_number: u64,
    /// The segments.
    pub seg: [Segment; BLKIF_MAX_SEGMENTS_PER_REQUEST],
}

/// `struct blkif_request_discard`, the same slot read another way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct RawDiscard {
    /// `BLKIF_OP_DISCARD`.
    pub operation: u8,
    /// `BLKIF_DISCARD_SECURE` or 0.
    pub flag: u8,
    /// The virtual device.
    pub handle: u16,
    /// Padding before `id`.
    pub pad: u32,
    /// Echoed in the response.
    pub id: u64,
    /// First sector.
    pub sector_number: u64,
    /// Sectors to discard.
    pub nr_sectors: u64,
}

/// `struct blkif_request_indirect`, the same slot read another way: the segments are in
/// pages the front end granted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct RawIndirect {
    /// `BLKIF_OP_INDIRECT`.
    pub operation: u8,
    /// `BLKIF_OP_READ` or `BLKIF_OP_WRITE`.
    pub indirect_op: u8,
    /// Segments in the indirect pages.
    pub nr_segments: u16,
    /// Padding before `id`.
    pub pad: u32,
    /// Echoed in the response.
    pub id: u64,
    /// First sector.
    pub sector_number: u64,
    /// The virtual device.
    pub handle: u16,
    /// Padding before the grants.
    pub pad2: u16,
    /// The indirect pages' grants.
    pub indirect_grefs: [u32; BLKIF_MAX_INDIRECT_PAGES_PER_REQUEST],
    /// The C struct's tail padding (to its 8-byte alignment).
    pub pad3: u32,
}

/// `struct blkif_response`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct Response {
    /// The request's id.
    pub id: u64,
    /// The request's operation.
    pub operation: u8,
    /// Padding before `status`.
    pub pad: u8,
    /// `BLKIF_RSP_*`.
    pub status: i16,
    /// The C struct's tail padding.
    pub pad2: u32,
}

const _: () = assert!(std::mem::size_of::<Segment>() == 8);
const _: () = assert!(std::mem::size_of::<RawRequest>() == 112);
const _: () = assert!(std::mem::size_of::<RawDiscard>() == 32);
const _: () = assert!(std::mem::size_of::<RawIndirect>() == 64);
const _: () = assert!(std::mem::size_of::<Response>() == 16);

impl RawRequest {
    /// The slot read as a discard.
    pub fn as_discard(&self) -> RawDiscard {
        bytemuck::pod_read_unaligned(&bytemuck::bytes_of(self)[..std::mem::size_of::<RawDiscard>()])
    }
    /// The slot read as an indirect request.
    pub fn as_indirect(&self) -> RawIndirect {
        bytemuck::pod_read_unaligned(
            &bytemuck::bytes_of(self)[..std::mem::size_of::<RawIndirect>()],
        )
    }

    /// The operation its response carries: its own, except that an indirect request is
    /// answered with the operation it carries (`indirect_op`), as Linux's blkback
    /// answers and its blkfront checks (a response saying `BLKIF_OP_INDIRECT` makes
    /// Linux's blkfront disable the disk).
    pub fn response_operation(&self) -> u8 {
        if self.operation == BLKIF_OP_INDIRECT {
            self.as_indirect().indirect_op
        } else {
            self.operation
        }
    }
}

impl RawDiscard {
    /// The slot a discard is written into.
    pub fn to_slot(&self) -> RawRequest {
        let mut r = RawRequest::default();
        bytemuck::bytes_of_mut(&mut r)[..std::mem::size_of::<Self>()]
            .copy_from_slice(bytemuck::bytes_of(self));
        r
    }
}

impl RawIndirect {
    /// The slot an indirect request is written into.
    pub fn to_slot(&self) -> RawRequest {
        let mut r = RawRequest::default();
        bytemuck::bytes_of_mut(&mut r)[..std::mem::size_of::<Self>()]
            .copy_from_slice(bytemuck::bytes_of(self));
        r
    }
}

/// The blkif ring: 32 requests of 112 bytes in a page.
#[derive(Debug)]
pub struct BlkRing;
impl RingProtocol for BlkRing {
    type Req = RawRequest;
    type Rsp = Response;
}

// --- Validation --------------------------------------------------------------------

/// What a back end offers, and the device it serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// The device's size in sectors.
    pub sectors: u64,
    /// Read-only (`mode = r`): writes, flushes and discards are refused.
    pub read_only: bool,
    /// `feature-flush-cache`.
    pub flush: bool,
    /// `feature-discard`.
    pub discard: bool,
    /// `feature-max-indirect-segments` (0: indirect requests not offered).
    pub max_indirect_segments: u16,
}

/// A request as judged: a copy the back end may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// A read or write whose segments were in the slot, checked.
    Rw {
        /// Echoed in the response.
        id: u64,
        /// A write (else a read).
        write: bool,
        /// First sector.
        sector: u64,
        /// Its segments (the first `nr` of them).
        seg: [Segment; BLKIF_MAX_SEGMENTS_PER_REQUEST],
        /// How many.
        nr: u8,
    },
    /// A read or write whose segments are in indirect pages, to be copied and checked
    /// with [`check_segments`] before use.
    Indirect {
        /// Echoed in the response.
        id: u64,
        /// A write (else a read).
        write: bool,
        /// First sector.
        sector: u64,
        /// Segments in the pages.
        nr_segments: u16,
        /// The pages' grants (the first `indirect_pages(nr_segments)` of them).
        pages: [u32; BLKIF_MAX_INDIRECT_PAGES_PER_REQUEST],
    },
    /// Write the device's cache out.
    Flush {
        /// Echoed in the response.
        id: u64,
    },
    /// Sectors no longer in use.
    Discard {
        /// Echoed in the response.
        id: u64,
        /// First sector.
        sector: u64,
        /// How many.
        nr_sectors: u64,
        /// `BLKIF_DISCARD_SECURE`.
        secure: bool,
    },
}

impl Request {
    /// Its id.
    pub fn id(&self) -> u64 {
        match *self {
            Request::Rw { id, .. }
            | Request::Indirect { id, .. }
            | Request::Flush { id }
            | Request::Discard { id, .. } => id,
        }
    }
}

/// Why a request is refused (answered with [`BadRequest::status`], counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum BadRequest {
    /// An operation the protocol does not have, or the back end did not offer
    /// (barrier, flush, discard or indirect without the feature).
    #[error("operation not offered")]
    NotOffered,
    /// A write, flush or discard to a read-only device.
    #[error("read-only device")]
    ReadOnly,
    /// A read or write of no segments.
    #[error("no segments")]
    NoSegments,
    /// More segments than the slot holds, or than the back end offered indirectly.
    #[error("too many segments")]
    TooManySegments,
    /// A segment whose sectors run backwards or past its page.
    #[error("segment sectors outside their page")]
    BadSegment,
    /// Sectors past the end of the device (or an overflowing range).
    #[error("sectors beyond the device")]
    BeyondDevice,
    /// An indirect request whose inner operation is not a read or a write.
    #[error("indirect operation not a read or a write")]
    BadIndirectOp,
}

impl BadRequest {
    /// Every reason, for counters.
    pub const ALL: [BadRequest; 7] = [
        BadRequest::NotOffered,
        BadRequest::ReadOnly,
        BadRequest::NoSegments,
        BadRequest::TooManySegments,
        BadRequest::BadSegment,
        BadRequest::BeyondDevice,
        BadRequest::BadIndirectOp,
    ];

    /// The response it gets.
    pub fn status(self) -> i16 {
        match self {
            BadRequest::NotOffered => BLKIF_RSP_EOPNOTSUPP,
            _ => BLKIF_RSP_ERROR,
        }
    }
}

hv::reason!(BadRequest);

/// Requests refused, by reason.
pub type BadRequests = PerReason<BadRequest>;

/// Indirect pages `nr_segments` segments fill.
pub fn indirect_pages(nr_segments: u16) -> usize {
    (nr_segments as usize).div_ceil(SEGMENTS_PER_INDIRECT_PAGE)
}

/// Checks `seg` (copied already) for a transfer starting at `sector`: each segment's
/// sectors lie within its page, and the whole lies within the device. Returns the
/// sectors transferred.
pub fn check_segments(seg: &[Segment], sector: u64, offer: &Offer) -> Result<u64, BadRequest> {
    let mut total = 0u64;
    for s in seg {
        if s.first_sect > s.last_sect || s.last_sect >= SECTORS_PER_PAGE {
            return Err(BadRequest::BadSegment);
        }
        total += u64::from(s.last_sect - s.first_sect) + 1;
    }
    let end = sector.checked_add(total).ok_or(BadRequest::BeyondDevice)?;
    if end > offer.sectors {
        return Err(BadRequest::BeyondDevice);
    }
    Ok(total)
}

/// Judges a request copied off the ring against what the back end offers.
pub fn read_request(raw: &RawRequest, offer: &Offer) -> Result<Request, BadRequest> {
    let writes = |w: bool| {
        if w && offer.read_only {
            Err(BadRequest::ReadOnly)
        } else {
            Ok(())
        }
    };
    match raw.operation {
        BLKIF_OP_READ | BLKIF_OP_WRITE => {
            let write = raw.operation == BLKIF_OP_WRITE;
            writes(write)?;
            let nr = raw.nr_segments;
            if nr == 0 {
                return Err(BadRequest::NoSegments);
            }
            if nr as usize > BLKIF_MAX_SEGMENTS_PER_REQUEST {
                return Err(BadRequest::TooManySegments);
            }
            check_segments(&raw.seg[..nr as usize], raw.sector_number, offer)?;
            Ok(Request::Rw {
                id: raw.id,
                write,
                sector: raw.sector_number,
                seg: raw.seg,
                nr,
            })
        }
        BLKIF_OP_FLUSH_DISKCACHE if offer.flush => {
            writes(true)?;
            Ok(Request::Flush { id: raw.id })
        }
        BLKIF_OP_DISCARD if offer.discard => {
            writes(true)?;
            let d = raw.as_discard();
            let end = d
                .sector_number
                .checked_add(d.nr_sectors)
                .ok_or(BadRequest::BeyondDevice)?;
            if end > offer.sectors {
                return Err(BadRequest::BeyondDevice);
            }
            Ok(Request::Discard {
                id: d.id,
                sector: d.sector_number,
                nr_sectors: d.nr_sectors,
                secure: d.flag & BLKIF_DISCARD_SECURE != 0,
            })
        }
        BLKIF_OP_INDIRECT if offer.max_indirect_segments > 0 => {
            let r = raw.as_indirect();
            let write = match r.indirect_op {
                BLKIF_OP_READ => false,
                BLKIF_OP_WRITE => true,
                _ => return Err(BadRequest::BadIndirectOp),
            };
            writes(write)?;
            if r.nr_segments == 0 {
                return Err(BadRequest::NoSegments);
            }
            if r.nr_segments > offer.max_indirect_segments
                || indirect_pages(r.nr_segments) > BLKIF_MAX_INDIRECT_PAGES_PER_REQUEST
            {
                return Err(BadRequest::TooManySegments);
            }
            // Even whole pages of one sector each must fit on the device.
            if r.sector_number >= offer.sectors {
                return Err(BadRequest::BeyondDevice);
            }
            Ok(Request::Indirect {
                id: r.id,
                write,
                sector: r.sector_number,
                nr_segments: r.nr_segments,
                pages: r.indirect_grefs,
            })
        }
        _ => Err(BadRequest::NotOffered),
    }
}

/// The response to request `id` of `operation`.
pub fn response(id: u64, operation: u8, status: i16) -> Response {
    Response {
        id,
        operation,
        status,
        ..Response::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OFFER: Offer = Offer {
        sectors: 1 << 20,
        read_only: false,
        flush: true,
        discard: true,
        max_indirect_segments: 256,
    };

    fn seg(first: u8, last: u8) -> Segment {
        Segment {
            gref: 9,
            first_sect: first,
            last_sect: last,
            pad: 0,
        }
    }

    fn rw(op: u8, sector: u64, segs: &[Segment]) -> RawRequest {
        let mut r = RawRequest {
            operation: op,
            nr_segments: segs.len() as u8,
            id: 77,
            sector_number: sector,
            ..RawRequest::default()
        };
        r.seg[..segs.len()].copy_from_slice(segs);
        r
    }

    #[test]
    fn a_one_page_ring_holds_32_requests_as_xens() {
        assert_eq!(
            ring::ring_size(4096, <BlkRing as RingProtocol>::SLOT_SIZE),
            32
        );
    }

    #[test]
    fn the_reasons_are_listed_in_counter_order() {
        hv::counters::check_reason_order::<BadRequest>();
    }

    #[test]
    fn a_good_read_and_write_pass_with_their_segments() {
        let r = read_request(&rw(BLKIF_OP_READ, 8, &[seg(0, 7), seg(2, 3)]), &OFFER);
        match r {
            Ok(Request::Rw {
                id: 77,
                write: false,
                sector: 8,
                nr: 2,
                seg: s,
            }) => assert_eq!(check_segments(&s[..2], 8, &OFFER), Ok(10)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            read_request(&rw(BLKIF_OP_WRITE, 0, &[seg(0, 0)]), &OFFER),
            Ok(Request::Rw { write: true, .. })
        ));
    }

    #[test]
    fn each_bad_request_gets_its_reason_and_status() {
        let mut too_many = rw(BLKIF_OP_READ, 0, &[seg(0, 0)]);
        too_many.nr_segments = 12;
        let ro = Offer {
            read_only: true,
            ..OFFER
        };
        let bare = Offer {
            flush: false,
            discard: false,
            max_indirect_segments: 0,
            ..OFFER
        };
        let mut flush = RawRequest {
            operation: BLKIF_OP_FLUSH_DISKCACHE,
            ..RawRequest::default()
        };
        flush.id = 5;
        let discard = RawDiscard {
            operation: BLKIF_OP_DISCARD,
            id: 6,
            sector_number: OFFER.sectors - 1,
            nr_sectors: 2,
            ..RawDiscard::default()
        }
        .to_slot();
        let indirect = |op: u8, n: u16, sector: u64| {
            RawIndirect {
                operation: BLKIF_OP_INDIRECT,
                indirect_op: op,
                nr_segments: n,
                id: 7,
                sector_number: sector,
                ..RawIndirect::default()
            }
            .to_slot()
        };
        for (raw, offer, want) in [
            (rw(BLKIF_OP_READ, 0, &[]), OFFER, BadRequest::NoSegments),
            (too_many, OFFER, BadRequest::TooManySegments),
            (
                rw(BLKIF_OP_READ, 0, &[seg(3, 2)]),
                OFFER,
                BadRequest::BadSegment,
            ),
            (
                rw(BLKIF_OP_READ, 0, &[seg(0, 8)]),
                OFFER,
                BadRequest::BadSegment,
            ),
            (
                rw(BLKIF_OP_READ, OFFER.sectors - 4, &[seg(0, 7)]),
                OFFER,
                BadRequest::BeyondDevice,
            ),
            (
                rw(BLKIF_OP_READ, u64::MAX - 2, &[seg(0, 7)]),
                OFFER,
                BadRequest::BeyondDevice,
            ),
            (
                rw(BLKIF_OP_WRITE, 0, &[seg(0, 0)]),
                ro,
                BadRequest::ReadOnly,
            ),
            (
                rw(BLKIF_OP_WRITE_BARRIER, 0, &[seg(0, 0)]),
                OFFER,
                BadRequest::NotOffered,
            ),
            (rw(42, 0, &[seg(0, 0)]), OFFER, BadRequest::NotOffered),
            (flush, bare, BadRequest::NotOffered),
            (flush, ro, BadRequest::ReadOnly),
            (discard, OFFER, BadRequest::BeyondDevice),
            (discard, bare, BadRequest::NotOffered),
            (indirect(BLKIF_OP_READ, 8, 0), bare, BadRequest::NotOffered),
            (
                indirect(BLKIF_OP_FLUSH_DISKCACHE, 8, 0),
                OFFER,
                BadRequest::BadIndirectOp,
            ),
            (indirect(BLKIF_OP_READ, 0, 0), OFFER, BadRequest::NoSegments),
            (
                indirect(BLKIF_OP_READ, 257, 0),
                OFFER,
                BadRequest::TooManySegments,
            ),
            (indirect(BLKIF_OP_WRITE, 8, 0), ro, BadRequest::ReadOnly),
            (
                indirect(BLKIF_OP_READ, 8, OFFER.sectors),
                OFFER,
                BadRequest::BeyondDevice,
            ),
        ] {
            assert_eq!(read_request(&raw, &offer), Err(want), "{raw:?}");
        }
        assert_eq!(BadRequest::NotOffered.status(), BLKIF_RSP_EOPNOTSUPP);
        assert_eq!(BadRequest::BeyondDevice.status(), BLKIF_RSP_ERROR);
    }

    #[test]
    fn flush_discard_and_indirect_pass_when_offered() {
        let flush = RawRequest {
            operation: BLKIF_OP_FLUSH_DISKCACHE,
            id: 5,
            ..RawRequest::default()
        };
        assert_eq!(read_request(&flush, &OFFER), Ok(Request::Flush { id: 5 }));
        let d = RawDiscard {
            operation: BLKIF_OP_DISCARD,
            flag: BLKIF_DISCARD_SECURE,
            id: 6,
            sector_number: 100,
            nr_sectors: 8,
            ..RawDiscard::default()
        };
        assert_eq!(
            read_request(&d.to_slot(), &OFFER),
            Ok(Request::Discard {
                id: 6,
                sector: 100,
                nr_sectors: 8,
                secure: true
            })
        );
        let mut ind = RawIndirect {
            operation: BLKIF_OP_INDIRECT,
            indirect_op: BLKIF_OP_WRITE,
            nr_segments: 600,
            id: 7,
            sector_number: 64,
            ..RawIndirect::default()
        };
        ind.indirect_grefs[..2].copy_from_slice(&[30, 31]);
        let offer = Offer {
            max_indirect_segments: 1024,
            ..OFFER
        };
        match read_request(&ind.to_slot(), &offer) {
            Ok(Request::Indirect {
                id: 7,
                write: true,
                sector: 64,
                nr_segments: 600,
                pages,
            }) => assert_eq!(&pages[..indirect_pages(600)], &[30, 31]),
            other => panic!("{other:?}"),
        }
        // 8 pages hold 4096 segments; more is refused whatever the back end offered.
        ind.nr_segments = 4097;
        let huge = Offer {
            max_indirect_segments: u16::MAX,
            ..OFFER
        };
        assert_eq!(
            read_request(&ind.to_slot(), &huge),
            Err(BadRequest::TooManySegments)
        );
    }

    #[test]
    fn a_refusal_is_counted_by_its_reason() {
        let mut bad = BadRequests::default();
        for raw in [
            rw(BLKIF_OP_READ, 0, &[]),
            rw(BLKIF_OP_READ, 0, &[seg(5, 1)]),
        ] {
            if let Err(e) = read_request(&raw, &OFFER) {
                bad.add(e);
            }
        }
        assert_eq!(bad.get(BadRequest::NoSegments), 1);
        assert_eq!(bad.get(BadRequest::BadSegment), 1);
        assert_eq!(bad.get(BadRequest::BeyondDevice), 0);
    }
}
