//! ATA over Ethernet (AoE, revision 11): the lean protocol a remote virtual block
//! device speaks to its disk, as Linux's `aoe` driver speaks it to `vblade`.
//!
//! A frame is an Ethernet header with EtherType `0x88A2`, the AoE header (version and
//! flags, error, the target's major (shelf) and minor (slot) address, the command, a
//! 32-bit tag the target echoes), and then the command's own header: for an ATA command
//! the ATA registers (flags, feature/error, sector count, command/status, a 48-bit
//! LBA) and the sectors; for a config query the target's buffer count, firmware
//! version, the most sectors one ATA command may carry, and a config string.
//!
//! Building is for requests this end sends; [`parse`] is for what the wire brings, and
//! is hostile-input code: every length is checked before a byte past the headers is
//! looked at, and anything that is not a well-formed AoE response is an error with its
//! reason, never a panic.

/// AoE's EtherType.
pub const ETHERTYPE: u16 = 0x88A2;
/// The protocol version this end speaks.
pub const VERSION: u8 = 1;
/// Flag: a response (set by the target).
pub const FLAG_RESPONSE: u8 = 0x08;
/// Flag: the target reports an AoE-level error in the error field.
pub const FLAG_ERROR: u8 = 0x04;
/// Command: issue an ATA command.
pub const CMD_ATA: u8 = 0;
/// Command: query the target's configuration.
pub const CMD_CONFIG: u8 = 1;
/// The broadcast major address (every shelf).
pub const MAJOR_ANY: u16 = 0xffff;
/// The broadcast minor address (every slot).
pub const MINOR_ANY: u8 = 0xff;

/// ATA flag: the LBA is 48-bit (an `EXT` command).
pub const AFLAG_EXT: u8 = 0x40;
/// ATA flag: the device/head register's bit.
pub const AFLAG_DEVICE: u8 = 0x10;
/// ATA flag: the target may answer a write before it is on the medium.
pub const AFLAG_ASYNC: u8 = 0x02;
/// ATA flag: the frame carries data to write.
pub const AFLAG_WRITE: u8 = 0x01;

/// `READ SECTORS EXT`.
pub const ATA_READ_EXT: u8 = 0x24;
/// `WRITE SECTORS EXT`.
pub const ATA_WRITE_EXT: u8 = 0x34;
/// `FLUSH CACHE EXT`.
pub const ATA_FLUSH_EXT: u8 = 0xEA;
/// `IDENTIFY DEVICE`.
pub const ATA_IDENTIFY: u8 = 0xEC;
/// ATA status: an error (the error register says which).
pub const ATA_STATUS_ERR: u8 = 0x01;
/// ATA status: the device faulted.
pub const ATA_STATUS_DF: u8 = 0x20;
/// ATA status: busy.
pub const ATA_STATUS_BSY: u8 = 0x80;

/// Bytes of the Ethernet header.
pub const ETH_HEADER: usize = 14;
/// Where the command's header starts (after the Ethernet and AoE headers).
pub const AOE_HEADER_END: usize = ETH_HEADER + 10;
/// Where an ATA command's sectors start.
pub const ATA_DATA: usize = AOE_HEADER_END + 12;
/// The config query's header ends here (its string follows).
pub const CONFIG_END: usize = AOE_HEADER_END + 8;
/// The shortest frame Ethernet carries (without its FCS): shorter ones are padded.
pub const MIN_FRAME: usize = 60;
/// Sector size.
pub const SECTOR: usize = 512;

/// The most sectors an ATA command's frame carries at an MTU of `mtu` bytes.
pub fn sectors_per_frame(mtu: usize) -> u8 {
    (mtu.saturating_sub(ATA_DATA - ETH_HEADER) / SECTOR).min(255) as u8
}

/// A target's address on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Its MAC (from its config reply).
    pub mac: [u8; 6],
    /// Its major (shelf) address.
    pub major: u16,
    /// Its minor (slot) address.
    pub minor: u8,
}

/// An ATA command as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtaCmd {
    /// `count` sectors from `lba`.
    Read {
        /// First sector.
        lba: u64,
        /// Sectors (1 to 255).
        count: u8,
    },
    /// `count` sectors to `lba`; the frame carries them.
    Write {
        /// First sector.
        lba: u64,
        /// Sectors (1 to 255).
        count: u8,
    },
    /// `IDENTIFY DEVICE`: one sector of the device's description.
    Identify,
    /// `FLUSH CACHE EXT`.
    Flush,
}

impl AtaCmd {
    /// The ATA command byte.
    pub fn opcode(self) -> u8 {
        match self {
            AtaCmd::Read { .. } => ATA_READ_EXT,
            AtaCmd::Write { .. } => ATA_WRITE_EXT,
            AtaCmd::Identify => ATA_IDENTIFY,
            AtaCmd::Flush => ATA_FLUSH_EXT,
        }
    }
    /// Sectors the reply carries (a read's, identify's one) or the request carries (a
    /// write's).
    pub fn data_sectors(self) -> usize {
        match self {
            AtaCmd::Read { count, .. } | AtaCmd::Write { count, .. } => usize::from(count),
            AtaCmd::Identify => 1,
            AtaCmd::Flush => 0,
        }
    }
}

/// Writes the Ethernet and AoE headers of a request into `f[..AOE_HEADER_END]`.
fn aoe_header(f: &mut [u8], src: [u8; 6], dst: [u8; 6], major: u16, minor: u8, cmd: u8, tag: u32) {
    f[..6].copy_from_slice(&dst);
    f[6..12].copy_from_slice(&src);
    f[12..14].copy_from_slice(&ETHERTYPE.to_be_bytes());
    f[14] = VERSION << 4;
    f[15] = 0;
    f[16..18].copy_from_slice(&major.to_be_bytes());
    f[18] = minor;
    f[19] = cmd;
    f[20..24].copy_from_slice(&tag.to_be_bytes());
}

/// A config query for `major`/`minor` (possibly the broadcast addresses) to `dst`
/// (broadcast to find a target) into `f` (at least [`MIN_FRAME`] bytes); its length.
pub fn config_query(
    f: &mut [u8],
    src: [u8; 6],
    dst: [u8; 6],
    major: u16,
    minor: u8,
    tag: u32,
) -> usize {
    f[..MIN_FRAME].fill(0);
    aoe_header(f, src, dst, major, minor, CMD_CONFIG, tag);
    // Buffer count, firmware, sector count 0; version/CCmd 0 (read); no string.
    MIN_FRAME
}

/// An ATA request's headers into `f` (at least [`ATA_DATA`] bytes; a write's sectors go
/// from [`ATA_DATA`] on, which the caller fills); the frame's length, padded to
/// [`MIN_FRAME`].
pub fn ata_request(f: &mut [u8], src: [u8; 6], t: &Target, tag: u32, cmd: AtaCmd) -> usize {
    f[..ATA_DATA].fill(0);
    aoe_header(f, src, t.mac, t.major, t.minor, CMD_ATA, tag);
    let a = &mut f[AOE_HEADER_END..ATA_DATA];
    let (flags, count, lba) = match cmd {
        AtaCmd::Read { lba, count } => (AFLAG_EXT, count, lba),
        AtaCmd::Write { lba, count } => (AFLAG_EXT | AFLAG_WRITE, count, lba),
        AtaCmd::Identify => (0, 1, 0),
        AtaCmd::Flush => (AFLAG_EXT, 0, 0),
    };
    a[0] = flags;
    a[1] = 0;
    a[2] = count;
    a[3] = cmd.opcode();
    a[4..10].copy_from_slice(&lba.to_le_bytes()[..6]);
    let len = ATA_DATA
        + if matches!(cmd, AtaCmd::Write { .. }) {
            usize::from(count) * SECTOR
        } else {
            0
        };
    if len < MIN_FRAME {
        f[len..MIN_FRAME].fill(0);
        MIN_FRAME
    } else {
        len
    }
}

/// A target's answer to a config query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// Frames it takes in flight at once.
    pub buffers: u16,
    /// Its firmware version.
    pub firmware: u16,
    /// The most sectors one ATA command may carry (0: the protocol's default, 2).
    pub sectors: u8,
}

/// An ATA command's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AtaReply<'a> {
    /// The ATA status register.
    pub status: u8,
    /// The ATA error register.
    pub error: u8,
    /// The LBA as echoed.
    pub lba: u64,
    /// Bytes after the ATA header in the frame (a read's sectors, maybe Ethernet
    /// padding), from [`ATA_DATA`] on.
    pub data_len: usize,
    /// As many of them as the caller copied out ([`parse_head`]).
    pub data: &'a [u8],
}

impl AtaReply<'_> {
    /// Whether the device reports the command failed.
    pub fn failed(&self) -> bool {
        self.status & (ATA_STATUS_ERR | ATA_STATUS_DF | ATA_STATUS_BSY) != 0
    }
}

/// A well-formed AoE response, not yet matched against anything sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply<'a> {
    /// Who sent it.
    pub src: [u8; 6],
    /// To whom.
    pub dst: [u8; 6],
    /// The target's major address.
    pub major: u16,
    /// Its minor address.
    pub minor: u8,
    /// The echoed tag.
    pub tag: u32,
    /// The AoE error, if the target set the error flag.
    pub aoe_error: Option<u8>,
    /// What it answers.
    pub body: Body<'a>,
}

/// A response's command part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body<'a> {
    /// An ATA command's.
    Ata(AtaReply<'a>),
    /// A config query's.
    Config(Config),
}

/// Why a frame from the wire is not a usable AoE response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum BadFrame {
    /// Shorter than its headers.
    #[error("short frame")]
    Short,
    /// Not EtherType `0x88A2`.
    #[error("not AoE")]
    NotAoe,
    /// A protocol version this end does not speak.
    #[error("AoE version")]
    Version,
    /// A request, not a response (another initiator's, or our own echoed).
    #[error("not a response")]
    NotResponse,
    /// A command this end never sends.
    #[error("unknown command")]
    Command,
    /// From a MAC or address other than the target's.
    #[error("not from the target")]
    WrongSource,
    /// A tag that names no frame this end has on the wire, or a command other than the
    /// one sent under it.
    #[error("unknown tag")]
    UnknownTag,
    /// A tag of an earlier send of a frame that was sent again or already answered (a
    /// duplicate, or a late answer).
    #[error("stale or duplicate")]
    Stale,
    /// A reply whose echoed LBA or length does not fit the request it names.
    #[error("does not fit its request")]
    Mismatch,
}

impl BadFrame {
    /// Every reason, for counters.
    pub const ALL: [BadFrame; 9] = [
        BadFrame::Short,
        BadFrame::NotAoe,
        BadFrame::Version,
        BadFrame::NotResponse,
        BadFrame::Command,
        BadFrame::WrongSource,
        BadFrame::UnknownTag,
        BadFrame::Stale,
        BadFrame::Mismatch,
    ];
}

hv::reason!(BadFrame);

/// Bytes of a frame a receiver copies out to judge it: the headers and one sector
/// (an identify's). A read's sectors past them are placed straight from the frame.
pub const HEAD: usize = ATA_DATA + SECTOR;

/// Parses a frame from the wire as an AoE response.
pub fn parse(f: &[u8]) -> Result<Reply<'_>, BadFrame> {
    parse_head(f, f.len())
}

/// Parses a frame of `len` bytes of which the caller copied out `head` (its first
/// `min(len, HEAD)` bytes, or all of them).
pub fn parse_head(f: &[u8], len: usize) -> Result<Reply<'_>, BadFrame> {
    if f.len() < len.min(HEAD) || f.len() > len {
        return Err(BadFrame::Short);
    }
    if len < AOE_HEADER_END {
        return Err(BadFrame::Short);
    }
    if u16::from_be_bytes([f[12], f[13]]) != ETHERTYPE {
        return Err(BadFrame::NotAoe);
    }
    if f[14] >> 4 != VERSION {
        return Err(BadFrame::Version);
    }
    let flags = f[14] & 0x0f;
    if flags & FLAG_RESPONSE == 0 {
        return Err(BadFrame::NotResponse);
    }
    let mac = |at: usize| {
        let mut m = [0u8; 6];
        m.copy_from_slice(&f[at..at + 6]);
        m
    };
    let body = match f[19] {
        CMD_ATA => {
            if len < ATA_DATA {
                return Err(BadFrame::Short);
            }
            let a = &f[AOE_HEADER_END..ATA_DATA];
            let mut lba = [0u8; 8];
            lba[..6].copy_from_slice(&a[4..10]);
            Body::Ata(AtaReply {
                status: a[3],
                error: a[1],
                lba: u64::from_le_bytes(lba),
                data_len: len - ATA_DATA,
                data: &f[ATA_DATA..],
            })
        }
        CMD_CONFIG => {
            if len < CONFIG_END {
                return Err(BadFrame::Short);
            }
            let c = &f[AOE_HEADER_END..CONFIG_END];
            Body::Config(Config {
                buffers: u16::from_be_bytes([c[0], c[1]]),
                firmware: u16::from_be_bytes([c[2], c[3]]),
                sectors: c[4],
            })
        }
        _ => return Err(BadFrame::Command),
    };
    Ok(Reply {
        dst: mac(0),
        src: mac(6),
        major: u16::from_be_bytes([f[16], f[17]]),
        minor: f[18],
        tag: u32::from_be_bytes([f[20], f[21], f[22], f[23]]),
        aoe_error: (flags & FLAG_ERROR != 0).then_some(f[15]),
        body,
    })
}

/// The device's size in sectors from its `IDENTIFY DEVICE` sector (words 100–103 if it
/// has 48-bit addresses, else words 60–61), and whether it takes `FLUSH CACHE EXT`
/// (word 83, bit 13). `None` if the sector is short.
pub fn identify(sector: &[u8]) -> Option<(u64, bool)> {
    if sector.len() < SECTOR {
        return None;
    }
    let w = |i: usize| u64::from(u16::from_le_bytes([sector[2 * i], sector[2 * i + 1]]));
    let lba48 = w(83) & (1 << 10) != 0;
    let sectors = if lba48 {
        w(100) | w(101) << 16 | w(102) << 32 | w(103) << 48
    } else {
        w(60) | w(61) << 16
    };
    Some((sectors, w(83) & (1 << 13) != 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: [u8; 6] = [2, 0, 0, 0, 0, 1];
    const T: Target = Target {
        mac: [2, 0, 0, 0, 0, 9],
        major: 1,
        minor: 2,
    };

    /// The target's answer to `req` as vblade frames it: the request's headers with the
    /// response flag, its status, and `data`.
    fn answer(req: &[u8], status: u8, data: &[u8]) -> Vec<u8> {
        let mut f = req[..ATA_DATA].to_vec();
        let (dst, src) = (req[6..12].to_vec(), req[..6].to_vec());
        f[..6].copy_from_slice(&dst);
        f[6..12].copy_from_slice(&src);
        f[14] |= FLAG_RESPONSE;
        f[AOE_HEADER_END + 3] = status;
        f.extend_from_slice(data);
        f
    }

    #[test]
    fn requests_carry_their_registers_where_rev11_puts_them() {
        let mut f = [0u8; 1100];
        let n = ata_request(
            &mut f,
            ME,
            &T,
            0xdead_beef,
            AtaCmd::Read {
                lba: 0x0102_0304_0506,
                count: 2,
            },
        );
        assert_eq!(n, MIN_FRAME, "a read is padded to Ethernet's minimum");
        assert_eq!(&f[12..14], &[0x88, 0xa2]);
        assert_eq!(f[14], 0x10);
        assert_eq!(&f[16..20], &[0, 1, 2, CMD_ATA]);
        assert_eq!(&f[20..24], &0xdead_beefu32.to_be_bytes());
        assert_eq!(&f[24..28], &[AFLAG_EXT, 0, 2, ATA_READ_EXT]);
        assert_eq!(&f[28..34], &[6, 5, 4, 3, 2, 1], "LBA little-endian");
        let n = ata_request(&mut f, ME, &T, 1, AtaCmd::Write { lba: 9, count: 2 });
        assert_eq!(n, ATA_DATA + 1024);
        assert_eq!(f[24], AFLAG_EXT | AFLAG_WRITE);
        assert_eq!(sectors_per_frame(1500), 2);
        assert_eq!(sectors_per_frame(9000), 17);
    }

    #[test]
    fn responses_parse_and_anything_else_is_refused_with_its_reason() {
        let mut f = [0u8; 128];
        ata_request(&mut f, ME, &T, 7, AtaCmd::Read { lba: 3, count: 1 });
        let r = answer(&f, 0x40, &[0xab; 512]);
        let p = parse(&r).expect("a response");
        assert_eq!((p.src, p.major, p.minor, p.tag), (T.mac, 1, 2, 7));
        match p.body {
            Body::Ata(a) => {
                assert_eq!((a.lba, a.data_len, a.failed()), (3, 512, false));
            }
            Body::Config(_) => panic!("an ATA reply"),
        }
        // Our own request seen on the wire, a short one, another EtherType, another
        // version, an unknown command.
        assert_eq!(parse(&f[..MIN_FRAME]), Err(BadFrame::NotResponse));
        assert_eq!(parse(&r[..30]), Err(BadFrame::Short));
        assert_eq!(parse(&r[..10]), Err(BadFrame::Short));
        let mut x = r.clone();
        x[13] = 0xa3;
        assert_eq!(parse(&x), Err(BadFrame::NotAoe));
        let mut x = r.clone();
        x[14] = 0x28;
        assert_eq!(parse(&x), Err(BadFrame::Version));
        let mut x = r.clone();
        x[19] = 3;
        assert_eq!(parse(&x), Err(BadFrame::Command));
        // An error flag and a failed status are reported, not hidden.
        let mut x = r.clone();
        x[14] |= FLAG_ERROR;
        x[15] = 2;
        assert_eq!(parse(&x).map(|p| p.aoe_error), Ok(Some(2)));
        let x = answer(&f, 0x41, &[]);
        assert!(matches!(parse(&x).map(|p| p.body), Ok(Body::Ata(a)) if a.failed()));
    }

    #[test]
    fn identify_gives_the_size_and_the_flush_bit() {
        let mut s = [0u8; 512];
        s[83 * 2 + 1] = 0x04; // bit 10: 48-bit addresses
        s[100 * 2..100 * 2 + 2].copy_from_slice(&0x2000u16.to_le_bytes());
        s[101 * 2..101 * 2 + 2].copy_from_slice(&1u16.to_le_bytes());
        assert_eq!(identify(&s), Some((0x1_2000, false)));
        s[83 * 2 + 1] |= 0x20;
        assert_eq!(identify(&s), Some((0x1_2000, true)));
        assert_eq!(identify(&s[..100]), None);
    }
}
