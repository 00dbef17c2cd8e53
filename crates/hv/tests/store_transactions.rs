//! The store's transactions as xenstored's: all or nothing, `EAGAIN` on a conflict and
//! the caller starting over, bounded for an unprivileged domain.

use std::sync::Arc;

use hv::store::transaction::{TxId, MAX_TOUCHED, MAX_TRANSACTIONS_PER_DOMAIN};
use hv::store::{Perm, Store, StoreError};
use hv::DomId;

const D1: DomId = DomId(1);
const D2: DomId = DomId(2);
const HOME: &str = "/local/domain/1";

/// A store where domain 1 owns its home.
fn store() -> Store {
    let s = Store::new();
    s.write(DomId::DOM0, HOME, "").expect("toolstack");
    s.set_perms(DomId::DOM0, HOME, D1, &[]).expect("perms");
    s
}

fn at(leaf: &str) -> String {
    format!("{HOME}/{leaf}")
}

#[test]
fn a_transaction_sees_its_own_writes_and_commits_them_all_at_once() {
    let s = store();
    s.write(D1, &at("old"), "1").expect("old");
    let watch = s.watch(D1, HOME, "t").expect("watch");
    assert!(watch.try_recv().is_ok(), "a new watch fires once");
    let tx = s.transaction_start(D1).expect("start");
    s.tx_write(D1, tx, &at("dev/vif/0/state"), "4")
        .expect("write");
    s.tx_write(D1, tx, &at("dev/vif/0/mac"), "02:00")
        .expect("write");
    s.tx_rm(D1, tx, &at("old")).expect("rm");
    // Inside: its own writes. Outside: nothing yet, and no watch fired.
    assert_eq!(s.tx_read(D1, tx, &at("dev/vif/0/state")), Ok("4".into()));
    assert!(matches!(
        s.tx_read(D1, tx, &at("old")),
        Err(StoreError::NoEntry(_))
    ));
    assert_eq!(
        s.tx_directory(D1, tx, &at("dev/vif/0")),
        Ok(vec!["mac".to_string(), "state".to_string()])
    );
    assert_eq!(s.tx_directory(D1, tx, HOME), Ok(vec!["dev".to_string()]));
    assert!(matches!(
        s.read(D1, &at("dev/vif/0/state")),
        Err(StoreError::NoEntry(_))
    ));
    assert_eq!(s.read(D1, &at("old")), Ok("1".into()));
    assert!(watch.try_recv().is_err());
    s.transaction_end(D1, tx, true).expect("commit");
    assert_eq!(s.read(D1, &at("dev/vif/0/state")), Ok("4".into()));
    assert_eq!(s.read(D1, &at("dev/vif/0/mac")), Ok("02:00".into()));
    assert!(matches!(
        s.read(D1, &at("old")),
        Err(StoreError::NoEntry(_))
    ));
    assert_eq!(watch.try_iter().count(), 3, "one event a write, at the end");
    assert_eq!(s.transactions_open(), 0);
}

#[test]
fn a_change_to_what_it_read_answers_again_and_applies_nothing_and_a_retry_commits() {
    let s = store();
    s.write(D1, &at("x"), "1").expect("x");
    let tx = s.transaction_start(D1).expect("start");
    assert_eq!(s.tx_read(D1, tx, &at("x")), Ok("1".into()));
    s.tx_write(D1, tx, &at("y"), "from x = 1").expect("y");
    // Someone else changes x meanwhile.
    s.write(DomId::DOM0, &at("x"), "2").expect("other writer");
    assert_eq!(s.transaction_end(D1, tx, true), Err(StoreError::Again));
    assert!(
        matches!(s.read(D1, &at("y")), Err(StoreError::NoEntry(_))),
        "nothing applied"
    );
    // The caller starts over, and this time nothing moves under it.
    let tx = s.transaction_start(D1).expect("again");
    let x = s.tx_read(D1, tx, &at("x")).expect("x");
    s.tx_write(D1, tx, &at("y"), &format!("from x = {x}"))
        .expect("y");
    s.transaction_end(D1, tx, true).expect("commit");
    assert_eq!(s.read(D1, &at("y")), Ok("from x = 2".into()));
}

#[test]
fn a_node_created_or_removed_under_it_or_a_child_added_beside_a_listing_conflicts() {
    let s = store();
    // Read as absent, then created by another.
    let tx = s.transaction_start(D1).expect("start");
    assert!(s.tx_read(D1, tx, &at("late")).is_err());
    s.write(D1, &at("late"), "here").expect("created");
    assert_eq!(s.transaction_end(D1, tx, true), Err(StoreError::Again));
    // Listed, then a child added beside.
    s.write(D1, &at("dir/a"), "").expect("a");
    let tx = s.transaction_start(D1).expect("start");
    assert_eq!(
        s.tx_directory(D1, tx, &at("dir")),
        Ok(vec!["a".to_string()])
    );
    s.tx_write(D1, tx, &at("seen"), "only a").expect("write");
    s.write(D1, &at("dir/b"), "").expect("b");
    assert_eq!(s.transaction_end(D1, tx, true), Err(StoreError::Again));
    // Written, then removed by another.
    let tx = s.transaction_start(D1).expect("start");
    s.tx_write(D1, tx, &at("dir/a"), "mine").expect("write");
    s.rm(D1, &at("dir")).expect("removed");
    assert_eq!(s.transaction_end(D1, tx, true), Err(StoreError::Again));
    assert!(s.read(D1, &at("dir/a")).is_err() && s.read(D1, &at("seen")).is_err());
    // A change to a node it never touched is no conflict.
    let tx = s.transaction_start(D1).expect("start");
    s.tx_write(D1, tx, &at("q"), "1").expect("write");
    s.write(D1, &at("elsewhere"), "1").expect("unrelated");
    s.transaction_end(D1, tx, true).expect("no conflict");
}

/// Writers on both cores incrementing one counter, each by read, write and end, and
/// starting over on `EAGAIN`: every increment lands exactly once.
#[test]
fn concurrent_writers_retrying_on_again_lose_no_increment() {
    const THREADS: u16 = 4;
    const EACH: u32 = 200;
    let s = Arc::new(Store::new());
    s.write(DomId::DOM0, "/counter", "0").expect("counter");
    let perms: Vec<(DomId, Perm)> = (1..=THREADS).map(|d| (DomId(d), Perm::Both)).collect();
    s.set_perms(DomId::DOM0, "/counter", DomId::DOM0, &perms)
        .expect("share");
    let handles: Vec<_> = (1..=THREADS)
        .map(|d| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                let me = DomId(d);
                let mut retries = 0u32;
                for _ in 0..EACH {
                    loop {
                        let tx = s.transaction_start(me).expect("start");
                        let n: u32 = s
                            .tx_read(me, tx, "/counter")
                            .expect("read")
                            .parse()
                            .expect("a number");
                        s.tx_write(me, tx, "/counter", &(n + 1).to_string())
                            .expect("write");
                        match s.transaction_end(me, tx, true) {
                            Ok(()) => break,
                            Err(StoreError::Again) => retries += 1,
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                retries
            })
        })
        .collect();
    let _retries: u32 = handles.into_iter().map(|h| h.join().expect("writer")).sum();
    assert_eq!(
        s.read(DomId::DOM0, "/counter"),
        Ok((u32::from(THREADS) * EACH).to_string())
    );
    assert_eq!(s.transactions_open(), 0);
}

#[test]
fn an_abort_applies_nothing_and_an_end_refused_at_commit_applies_nothing_either() {
    let s = store();
    let tx = s.transaction_start(D1).expect("start");
    s.tx_write(D1, tx, &at("a"), "1").expect("write");
    s.transaction_end(D1, tx, false).expect("abort");
    assert!(s.read(D1, &at("a")).is_err());
    // Domain 2 may write one node of domain 1's; it writes that and another it may
    // not, in one transaction: the end refuses both.
    s.write(D1, &at("shared"), "0").expect("shared");
    s.set_perms(D1, &at("shared"), D1, &[(D2, Perm::Both)])
        .expect("share");
    let tx = s.transaction_start(D2).expect("start");
    s.tx_write(D2, tx, &at("shared"), "2").expect("write");
    s.tx_write(D2, tx, &at("private"), "2").expect("queued");
    assert!(matches!(
        s.transaction_end(D2, tx, true),
        Err(StoreError::Denied(_))
    ));
    assert_eq!(s.read(D1, &at("shared")), Ok("0".into()), "all or nothing");
    assert!(s.read(D1, &at("private")).is_err());
}

#[test]
fn a_hostile_domain_cannot_use_anothers_transaction_or_hold_more_than_its_quota() {
    let s = store();
    let tx = s.transaction_start(D1).expect("start");
    // Another domain naming it: as if it did not exist; the owner's stays whole.
    assert!(matches!(
        s.tx_write(D2, tx, &at("x"), "evil"),
        Err(StoreError::NoEntry(_))
    ));
    assert!(matches!(
        s.transaction_end(D2, tx, true),
        Err(StoreError::NoEntry(_))
    ));
    assert!(matches!(
        s.tx_read(D1, TxId(9999), HOME),
        Err(StoreError::NoEntry(_))
    ));
    s.transaction_end(D1, tx, false).expect("still the owner's");
    // At most so many open at once.
    let open: Vec<TxId> = (0..MAX_TRANSACTIONS_PER_DOMAIN)
        .map(|_| s.transaction_start(D2).expect("within quota"))
        .collect();
    assert_eq!(s.transaction_start(D2), Err(StoreError::Quota));
    assert!(
        s.transaction_start(D1).is_ok(),
        "another domain's quota is its own"
    );
    // So many nodes touched, and so many writes, in one.
    let tx = open[0];
    s.write(DomId::DOM0, "/open", "").expect("open");
    s.set_perms(DomId::DOM0, "/open", D2, &[]).expect("give");
    let mut refused = None;
    for i in 0..=MAX_TOUCHED {
        if let Err(e) = s.tx_write(D2, tx, &format!("/open/n{i}"), "v") {
            refused = Some((i, e));
            break;
        }
    }
    assert_eq!(refused, Some((MAX_TOUCHED, StoreError::Quota)));
    let tx = open[1];
    let mut refused = None;
    for i in 0..=MAX_TOUCHED {
        if let Err(e) = s.tx_write(D2, tx, "/open/same", &i.to_string()) {
            refused = Some((i, e));
            break;
        }
    }
    assert_eq!(refused, Some((MAX_TOUCHED, StoreError::Quota)));
    // A destroyed domain's transactions end unapplied.
    s.end_transactions_of(D2);
    assert_eq!(s.transactions_open(), 1, "domain 1's alone");
}

/// Listing or removing a node that is absent remembers the absence, as reading it
/// does: a node created meanwhile makes the end answer `EAGAIN` and apply nothing.
#[test]
fn listing_or_removing_an_absent_node_remembers_it_absent() {
    let s = store();
    let tx = s.transaction_start(D1).expect("start");
    assert!(matches!(
        s.tx_directory(D1, tx, &at("later")),
        Err(StoreError::NoEntry(_))
    ));
    s.tx_write(D1, tx, &at("mine"), "1").expect("write");
    s.write(D1, &at("later"), "").expect("created meanwhile");
    assert_eq!(s.transaction_end(D1, tx, true), Err(StoreError::Again));
    assert!(matches!(
        s.read(D1, &at("mine")),
        Err(StoreError::NoEntry(_))
    ));
    let tx = s.transaction_start(D1).expect("start");
    assert!(matches!(
        s.tx_rm(D1, tx, &at("gone")),
        Err(StoreError::NoEntry(_))
    ));
    s.tx_write(D1, tx, &at("mine"), "1").expect("write");
    s.write(D1, &at("gone"), "").expect("created meanwhile");
    assert_eq!(s.transaction_end(D1, tx, true), Err(StoreError::Again));
    assert!(matches!(
        s.read(D1, &at("mine")),
        Err(StoreError::NoEntry(_))
    ));
}

/// A node removed and then written below in one transaction reads and lists, inside
/// it, as its end leaves it: present, empty, with only the new children.
#[test]
fn a_node_removed_then_written_below_reads_as_the_end_makes_it() {
    let s = store();
    s.write(D1, &at("dev/old"), "x").expect("old");
    s.write(D1, &at("dev"), "v").expect("value");
    let tx = s.transaction_start(D1).expect("start");
    s.tx_rm(D1, tx, &at("dev")).expect("rm");
    s.tx_write(D1, tx, &at("dev/new"), "1")
        .expect("write below");
    assert_eq!(s.tx_read(D1, tx, &at("dev")), Ok(String::new()));
    assert_eq!(
        s.tx_directory(D1, tx, &at("dev")),
        Ok(vec!["new".to_string()])
    );
    assert!(matches!(
        s.tx_read(D1, tx, &at("dev/old")),
        Err(StoreError::NoEntry(_))
    ));
    s.transaction_end(D1, tx, true).expect("commit");
    assert_eq!(s.read(D1, &at("dev")), Ok(String::new()));
    assert_eq!(s.directory(D1, &at("dev")), Ok(vec!["new".to_string()]));
}
