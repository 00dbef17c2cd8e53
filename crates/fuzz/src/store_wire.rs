//! xenstore's wire protocol from a hostile peer: pvio's store answering one domain's
//! connection (`hv::store::wire::serve`) fed requests of every type, with strings cut
//! anywhere, NULs and bytes that are not UTF-8 inside them, transaction ids it guesses,
//! and headers that lie about their length.
//!
//! Oracle: the server answers every message it reads, in order, each reply naming the
//! request it answers and within the protocol's 4096 bytes, with the request's type or
//! `XS_ERROR` (watch events aside); it ends when the peer closes or breaks the framing,
//! never hangs (the watches the peer set end with its connection, or their forwarding
//! threads would hold it open and the case would time out); the peer owns no more
//! nodes than its quota, and a bystander's node keeps its value and stays unreadable
//! to it.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use hv::store::wire::{self, Msg, XS_ERROR, XS_WATCH_EVENT};
use hv::store::{Store, MAX_NODES_PER_DOMAIN, MAX_VALUE};
use hv::DomId;

use crate::Input;

const EVIL: DomId = DomId(9);

fn string(inp: &mut Input<'_>) -> Vec<u8> {
    let base: &[u8] = inp.pick(&[
        b"/local/domain/9".as_slice(),
        b"/local/domain/9/device/vif/0/state",
        b"/local/domain/0/secret",
        b"/local/domain",
        b"relative",
        b"",
        b"T",
        b"F",
        b"7",
    ]);
    let mut s = base.to_vec();
    match inp.below(5) {
        0 => {}
        1 => s.extend_from_slice(format!("/k{}", inp.below(40)).as_bytes()),
        2 => s.push(0),
        3 => s.extend_from_slice(&[0xff, 0xc3]),
        _ => s.extend(std::iter::repeat_n(b'x', inp.pick(&[10usize, 3000, 5000]))),
    }
    s
}

/// One case: a bystander's node, then a hostile connection's messages.
pub fn case(inp: &mut Input<'_>) {
    let store = Arc::new(Store::new());
    store
        .write(DomId::DOM0, "/local/domain/0/secret", "kept")
        .expect("bystander");
    store
        .set_perms(DomId::DOM0, "/local/domain/0/secret", DomId::DOM0, &[])
        .expect("perms");
    store
        .write(DomId::DOM0, "/local/domain/9", "")
        .expect("home");
    store
        .set_perms(DomId::DOM0, "/local/domain/9", EVIL, &[])
        .expect("owner");

    let (a, mut b) = UnixStream::pair().expect("pair");
    let s = Arc::clone(&store);
    let server = std::thread::spawn(move || {
        let w = a.try_clone().expect("clone");
        wire::serve(&s, EVIL, a, w)
    });

    // The messages, and the ids of those framed honestly (each answered, in order).
    let mut bytes = Vec::new();
    let mut asked = Vec::new();
    for id in 1..=inp.below(48) as u32 + 1 {
        if inp.below(16) == 0 {
            // A header that lies: more than the protocol allows, or a length the
            // bytes after it do not fill (the connection then ends mid-message).
            let len = inp.pick(&[MAX_VALUE as u32 + 1, 1 << 20, u32::MAX, 3]);
            for v in [inp.below(25) as u32, id, 0, len] {
                bytes.extend_from_slice(&v.to_ne_bytes());
            }
            break;
        }
        let ty = inp.pick(&[1u32, 2, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 99]);
        let tx = inp.pick(&[0u32, 0, 1, 2, u32::MAX]);
        let parts: Vec<Vec<u8>> = (0..inp.below(3) + 1).map(|_| string(inp)).collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let m = Msg::new(ty, id, tx, &refs, inp.coin());
        if m.body.len() > MAX_VALUE {
            continue;
        }
        m.send(&mut bytes).expect("encode");
        asked.push((id, ty));
    }
    let mut w = b.try_clone().expect("clone");
    let writer = std::thread::spawn(move || {
        let _ = w.write_all(&bytes);
        let _ = w.shutdown(std::net::Shutdown::Write);
    });

    let mut replies = Vec::new();
    while let Ok(m) = Msg::recv(&mut b) {
        replies.push(m);
    }
    writer.join().expect("writer");
    let _ = server.join().expect("server thread");
    let mut rest = Vec::new();
    let _ = b.read_to_end(&mut rest);

    let answers: Vec<&Msg> = replies.iter().filter(|m| m.ty != XS_WATCH_EVENT).collect();
    assert_eq!(answers.len(), asked.len(), "one answer per message read");
    for (m, &(id, ty)) in answers.iter().zip(&asked) {
        assert_eq!(m.req_id, id, "answers in order, naming their request");
        assert!(
            m.ty == ty || m.ty == XS_ERROR,
            "type {} for a request of {ty}",
            m.ty
        );
        assert!(m.body.len() <= MAX_VALUE);
    }
    assert!(store.nodes_owned(EVIL) <= MAX_NODES_PER_DOMAIN);
    assert_eq!(
        store.read(DomId::DOM0, "/local/domain/0/secret").as_deref(),
        Ok("kept")
    );
    assert!(store.read(EVIL, "/local/domain/0/secret").is_err());
}
