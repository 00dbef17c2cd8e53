//! xenstore's wire protocol between pvio's client (what a back end in a real dom0 uses)
//! and pvio's store answering it: every request a back end makes, its errors, watches,
//! transactions, and a hostile peer.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hv::store::wire::{self, Client, XS_TRANSACTION_END, XS_TRANSACTION_START, XS_WRITE};
use hv::store::{Store, StoreError, XenStore, XenbusState};
use hv::DomId;

/// A store, and a client connected to it as `dom` through a socket pair.
fn connect(
    store: &Arc<Store>,
    dom: DomId,
) -> (
    Client<UnixStream>,
    std::thread::JoinHandle<std::io::Result<()>>,
) {
    let (a, b) = UnixStream::pair().expect("pair");
    let s = Arc::clone(store);
    let server = std::thread::spawn(move || {
        let w = a.try_clone()?;
        wire::serve(&s, dom, a, w)
    });
    (Client::new(b, dom), server)
}

#[test]
fn a_back_end_reads_writes_lists_and_removes_through_the_protocol() {
    let store = Arc::new(Store::new());
    let (c, _server) = connect(&store, DomId::DOM0);
    let me = DomId::DOM0;
    c.write(me, "/local/domain/0/backend/vif/1/0/feature-sg", "1")
        .expect("write");
    c.write(
        me,
        "/local/domain/0/backend/vif/1/0/mac",
        "00:16:3e:00:00:01",
    )
    .expect("write");
    assert_eq!(
        c.read(me, "/local/domain/0/backend/vif/1/0/feature-sg")
            .expect("answered"),
        "1"
    );
    // What the client wrote is in pvio's store, byte for byte.
    assert_eq!(
        store
            .read(me, "/local/domain/0/backend/vif/1/0/mac")
            .expect("answered"),
        "00:16:3e:00:00:01"
    );
    let mut names = c
        .directory(me, "/local/domain/0/backend/vif/1/0")
        .expect("dir");
    names.sort();
    assert_eq!(names, ["feature-sg", "mac"]);
    // An empty value reads back empty, not missing.
    c.write(me, "/local/domain/0/backend/vif/1/0/empty", "")
        .expect("write");
    assert_eq!(
        c.read(me, "/local/domain/0/backend/vif/1/0/empty")
            .expect("answered"),
        ""
    );
    c.switch_state(me, "/local/domain/0/backend/vif/1/0", XenbusState::InitWait)
        .expect("state");
    assert_eq!(
        store.xenbus_state(me, "/local/domain/0/backend/vif/1/0"),
        XenbusState::InitWait
    );
    c.rm(me, "/local/domain/0/backend/vif/1").expect("rm");
    assert!(matches!(
        c.read(me, "/local/domain/0/backend/vif/1/0/mac"),
        Err(StoreError::NoEntry(_))
    ));
    assert_eq!(
        c.domain_path(DomId(7)).expect("answered"),
        "/local/domain/7"
    );
}

#[test]
fn errors_come_back_as_the_stores_errors() {
    let store = Arc::new(Store::new());
    store.write(DomId::DOM0, "/secret", "x").expect("answered");
    store
        .set_perms(DomId::DOM0, "/secret", DomId::DOM0, &[])
        .expect("answered");
    let guest = DomId(5);
    let (c, _server) = connect(&store, guest);
    assert!(matches!(
        c.read(guest, "/secret"),
        Err(StoreError::Denied(_))
    ));
    assert!(matches!(
        c.read(guest, "/nothing"),
        Err(StoreError::NoEntry(_))
    ));
    assert!(matches!(
        c.read(guest, "no-slash"),
        Err(StoreError::Invalid)
    ));
    // A connection is one domain's: it does not act as another.
    assert!(matches!(
        c.read(DomId::DOM0, "/secret"),
        Err(StoreError::Denied(_))
    ));
}

#[test]
fn a_watch_fires_at_once_and_on_each_change_below_it() {
    let store = Arc::new(Store::new());
    let (c, _server) = connect(&store, DomId::DOM0);
    let me = DomId::DOM0;
    c.watch("/local/domain/0/backend", "be").expect("watch");
    store
        .write(me, "/local/domain/0/backend/vbd/3/51728/state", "1")
        .expect("answered");
    // Events travel on the same connection: a request made meanwhile keeps them.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = Vec::new();
    while seen.len() < 2 && Instant::now() < deadline {
        let _ = c.read(me, "/local/domain/0/backend/vbd/3/51728/state");
        while let Some(ev) = c.take_event() {
            assert_eq!(ev.token, "be");
            seen.push(ev.path);
        }
    }
    assert_eq!(seen[0], "/local/domain/0/backend");
    assert!(
        seen.iter()
            .any(|p| p == "/local/domain/0/backend/vbd/3/51728/state"),
        "{seen:?}"
    );
    c.unwatch("/local/domain/0/backend", "be").expect("unwatch");
}

#[test]
fn a_transaction_over_the_wire_commits_or_answers_eagain() {
    let store = Arc::new(Store::new());
    let me = DomId::DOM0;
    store.write(me, "/counter", "0").expect("answered");
    let (c, _server) = connect(&store, me);
    let start = |c: &Client<UnixStream>| -> u32 {
        let m = c
            .request(XS_TRANSACTION_START, 0, &[b""], true, "")
            .expect("start");
        m.strings().expect("answered")[0].parse().expect("id")
    };
    let t = start(&c);
    c.request(wire::XS_READ, t, &[b"/counter"], true, "/counter")
        .expect("read");
    c.request(XS_WRITE, t, &[b"/counter", b"1"], false, "/counter")
        .expect("write");
    c.request(XS_TRANSACTION_END, t, &[b"T"], true, "")
        .expect("commit");
    assert_eq!(store.read(me, "/counter").expect("answered"), "1");
    // A change meanwhile: the end answers EAGAIN and applies nothing.
    let t = start(&c);
    c.request(wire::XS_READ, t, &[b"/counter"], true, "/counter")
        .expect("read");
    store.write(me, "/counter", "5").expect("answered");
    c.request(XS_WRITE, t, &[b"/counter", b"2"], false, "/counter")
        .expect("write");
    assert_eq!(
        c.request(XS_TRANSACTION_END, t, &[b"T"], true, "")
            .expect_err("an error"),
        StoreError::Again
    );
    assert_eq!(store.read(me, "/counter").expect("answered"), "5");
}

#[test]
fn a_hostile_peer_breaks_only_its_own_connection() {
    let store = Arc::new(Store::new());
    let (a, mut b) = UnixStream::pair().expect("pair");
    let s = Arc::clone(&store);
    let server = std::thread::spawn(move || {
        let w = a.try_clone()?;
        wire::serve(&s, DomId(9), a, w)
    });
    // A header that claims more than the protocol's 4096 bytes.
    let mut h = Vec::new();
    for v in [XS_WRITE, 1, 0, 1 << 20] {
        h.extend_from_slice(&u32::to_ne_bytes(v));
    }
    b.write_all(&h).expect("answered");
    let r = server.join().expect("server thread");
    assert!(
        r.is_err(),
        "an oversized message must end the connection with an error"
    );
    // Garbage strings: not UTF-8, no NUL terminator; answered EINVAL, connection kept.
    let (c, _server) = connect(&store, DomId(9));
    assert!(matches!(
        c.request(wire::XS_READ, 0, &[&[0xff, 0xfe]], true, "?"),
        Err(StoreError::Invalid)
    ));
    assert!(matches!(
        c.request(99, 0, &[b"/x"], true, "/x"),
        Err(StoreError::Invalid)
    ));
    // ...and the same connection still works.
    c.write(DomId(9), "/local/domain/9/ok", "1")
        .expect_err("dom 9 owns nothing yet");
    store
        .write(DomId::DOM0, "/local/domain/9", "")
        .expect("answered");
    store
        .set_perms(DomId::DOM0, "/local/domain/9", DomId(9), &[])
        .expect("answered");
    c.write(DomId(9), "/local/domain/9/ok", "1")
        .expect("write in its own directory");
}

/// `XS_MKDIR` carrying a transaction's id is done inside that transaction: nobody sees
/// it before the end, an abort takes it away, and an id that names no transaction of
/// this domain's is refused rather than carried out at once.
#[test]
fn a_mkdir_inside_a_transaction_waits_for_its_end_and_a_stranger_id_is_refused() {
    let store = Arc::new(Store::new());
    let me = DomId::DOM0;
    let (c, _server) = connect(&store, me);
    let start = || -> u32 {
        let m = c
            .request(XS_TRANSACTION_START, 0, &[b""], true, "")
            .expect("start");
        m.strings().expect("answered")[0].parse().expect("id")
    };
    let t = start();
    c.request(wire::XS_MKDIR, t, &[b"/made"], true, "/made")
        .expect("mkdir in the transaction");
    assert!(
        matches!(store.read(me, "/made"), Err(StoreError::NoEntry(_))),
        "not visible before the end"
    );
    c.request(XS_TRANSACTION_END, t, &[b"F"], true, "")
        .expect("abort");
    assert!(
        matches!(store.read(me, "/made"), Err(StoreError::NoEntry(_))),
        "an abort takes it away"
    );
    let t = start();
    c.request(wire::XS_MKDIR, t, &[b"/made"], true, "/made")
        .expect("mkdir");
    c.request(XS_TRANSACTION_END, t, &[b"T"], true, "")
        .expect("commit");
    assert_eq!(store.read(me, "/made"), Ok(String::new()));
    assert!(matches!(
        c.request(wire::XS_MKDIR, 4242, &[b"/other"], true, "/other"),
        Err(StoreError::NoEntry(_))
    ));
    assert!(matches!(
        store.read(me, "/other"),
        Err(StoreError::NoEntry(_))
    ));
}

/// A directory whose children's names add up to more than a message holds (a domain
/// can make such under its home) is answered `E2BIG`, as xenstored answers it; the
/// connection and its watches go on.
#[test]
fn an_answer_too_long_for_a_message_is_refused_and_the_connection_goes_on() {
    let store = Arc::new(Store::new());
    let me = DomId::DOM0;
    for i in 0..80 {
        store
            .write(me, &format!("/big/{:060}", i), "")
            .expect("child");
    }
    let (c, _server) = connect(&store, me);
    c.watch("/big", "w").expect("watch");
    let r = c.request(wire::XS_DIRECTORY, 0, &[b"/big"], true, "/big");
    assert_eq!(r.expect_err("refused"), StoreError::Quota, "E2BIG");
    // The same connection answers again.
    c.write(me, "/after", "1").expect("the connection goes on");
    assert_eq!(c.read(me, "/after").expect("answered"), "1");
}

/// Watching and unwatching in a loop grows nothing: an unwatch removes the
/// connection's watch; a second watch of the same path and token is refused, as is an
/// unwatch of one never set; and a connection holds a bounded number of watches.
#[test]
fn watching_and_unwatching_in_a_loop_grows_nothing() {
    let store = Arc::new(Store::new());
    let me = DomId::DOM0;
    store.write(me, "/w", "").expect("node");
    let (c, _server) = connect(&store, me);
    for _ in 0..500 {
        c.watch("/w", "t").expect("watch");
        c.unwatch("/w", "t").expect("unwatch");
    }
    assert_eq!(store.watches_open(), 0);
    c.watch("/w", "t").expect("watch");
    assert_eq!(c.watch("/w", "t"), Err(StoreError::Invalid), "EEXIST");
    assert!(matches!(
        c.unwatch("/w", "never"),
        Err(StoreError::NoEntry(_))
    ));
    assert_eq!(store.watches_open(), 1);
    for i in 1..wire::MAX_WATCHES_PER_CONNECTION {
        c.watch("/w", &format!("t{i}")).expect("within the bound");
    }
    assert_eq!(c.watch("/w", "one-too-many"), Err(StoreError::Quota));
    assert_eq!(store.watches_open(), wire::MAX_WATCHES_PER_CONNECTION);
}
