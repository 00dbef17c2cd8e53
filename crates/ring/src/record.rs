//! A back ring's record of its responses, kept in a [`Journal`] (a file in memory that
//! outlives the process) so that a back end started after this one dies, or after it
//! stops to be upgraded, takes the ring over exactly where it was left.
//!
//! **What is recorded.** Responses are staged while a batch is answered and written to
//! the ring only when it is published: first the whole batch goes to the journal (its
//! first ring index and every response), then one store of the commit word makes it the
//! record, then the ring's slots are written and `rsp_prod` published. So at every
//! instant the ring's slots past `rsp_prod` either hold requests (nothing of this batch
//! written yet) or responses the record holds, whole. A back end that answers every
//! request it takes before it publishes (blkif from a file; netif copying) has answered
//! exactly the requests before the record's end: the next one takes the rest again.
//!
//! **Torn records.** The journal has two areas; a batch goes to the one the last commit
//! did not name, and the commit word (a sequence number, whose parity names the area)
//! is stored last. A back end killed while writing an area leaves the previous record
//! as it was.
//!
//! **What it trusts.** The journal is this back end's own writing, read back after a
//! crash as any input is: a record of another shape (magic, response size, ring size)
//! or with more responses than the ring has slots is no record, and the ring checks the
//! one it takes against its own `rsp_prod` ([`crate::BackRing::resume`]).

use mem::journal::Journal;

/// "pvr1": this format.
const MAGIC: u32 = u32::from_le_bytes(*b"pvr1");
const AT_MAGIC: usize = 0;
/// Bytes of one response.
const AT_RSP_SIZE: usize = 4;
/// Slots of the ring recorded.
const AT_SLOTS: usize = 8;
/// The commit word: a sequence number whose parity names the area of the last record.
const AT_SEQ: usize = 12;
/// Where the first area starts. An area: the first ring index of its batch, the number
/// of responses, then the responses.
const AREA0: usize = 64;
const AREA_HEADER: usize = 8;

pub(crate) const fn area_len(slots: u32, rsp_size: usize) -> usize {
    (AREA_HEADER + slots as usize * rsp_size).next_multiple_of(64)
}

/// Bytes a journal needs to record a ring of `slots` slots whose responses are
/// `rsp_size` bytes.
pub const fn len_for(slots: u32, rsp_size: usize) -> usize {
    AREA0 + 2 * area_len(slots, rsp_size)
}

/// The last batch a journal recorded: the ring index of its first response, and the
/// responses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded<R> {
    /// Ring index of the first response.
    pub start: u32,
    /// The batch's responses, in ring order.
    pub responses: Vec<R>,
}

impl<R> Recorded<R> {
    /// The ring index after the batch's last response.
    pub fn end(&self) -> u32 {
        self.start.wrapping_add(self.responses.len() as u32)
    }
}

/// Records a back ring's responses, batch by batch, in a journal.
#[derive(Debug)]
pub(crate) struct Recorder<R> {
    journal: Journal,
    slots: u32,
    seq: u32,
    /// Responses answered and not yet published: at most a ring's worth (allocated
    /// once, at that size).
    pub(crate) staged: Vec<R>,
}

impl<R: bytemuck::Pod> Recorder<R> {
    /// Records a ring of `slots` slots in `journal`, starting with an empty batch at
    /// ring index `at`. `None` if the journal is too small for the ring.
    pub(crate) fn start(journal: Journal, slots: u32, at: u32) -> Option<Self> {
        let size = std::mem::size_of::<R>();
        if journal.len() < len_for(slots, size) {
            return None;
        }
        let seq = journal.load(AT_SEQ).unwrap_or(0);
        let _ = journal.store(AT_MAGIC, MAGIC);
        let _ = journal.store(AT_RSP_SIZE, size as u32);
        let _ = journal.store(AT_SLOTS, slots);
        let mut r = Self {
            journal,
            slots,
            seq,
            staged: Vec::with_capacity(slots as usize),
        };
        r.commit(at);
        Some(r)
    }

    /// The last batch `journal` recorded for a ring of `slots` slots, if it holds a
    /// whole record of that shape.
    pub(crate) fn last(journal: &Journal, slots: u32) -> Option<Recorded<R>> {
        let size = std::mem::size_of::<R>();
        if journal.len() < len_for(slots, size)
            || journal.load(AT_MAGIC).ok()? != MAGIC
            || journal.load(AT_RSP_SIZE).ok()? != size as u32
            || journal.load(AT_SLOTS).ok()? != slots
        {
            return None;
        }
        let seq = journal.load(AT_SEQ).ok()?;
        let area = AREA0 + (seq & 1) as usize * area_len(slots, size);
        let start = journal.load(area).ok()?;
        let count = journal.load(area + 4).ok()?;
        if count > slots {
            return None;
        }
        let mut responses = vec![<R as bytemuck::Zeroable>::zeroed(); count as usize];
        journal
            .read(
                area + AREA_HEADER,
                bytemuck::cast_slice_mut(&mut responses[..]),
            )
            .ok()?;
        Some(Recorded { start, responses })
    }

    /// Makes the staged responses, the first of which takes ring index `start`, the
    /// record: written to the area the last commit did not name, then named by one
    /// store. No system call: stores to mapped memory.
    pub(crate) fn commit(&mut self, start: u32) {
        let size = std::mem::size_of::<R>();
        let next = self.seq.wrapping_add(1);
        let area = AREA0 + (next & 1) as usize * area_len(self.slots, size);
        let j = &self.journal;
        let _ = j.store(area, start);
        let _ = j.store(area + 4, self.staged.len() as u32);
        let _ = j.write(area + AREA_HEADER, bytemuck::cast_slice(&self.staged[..]));
        // Release: the area before the word that names it.
        let _ = j.store(AT_SEQ, next);
        self.seq = next;
    }

    /// The journal, to read back.
    pub(crate) fn journal(&self) -> &Journal {
        &self.journal
    }
}
