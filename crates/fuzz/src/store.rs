//! Store operations by a hostile domain: writes, reads, removals, directory listings,
//! permission changes and watches on any path, with values and tokens of every size,
//! and transactions (its own, and ids it guesses) opened, used and ended in any order.
//!
//! Oracle: the hostile domain never owns more than its quota of nodes, never holds
//! more watch events than the bound nor more transactions than its quota; a
//! bystander's nodes keep their values and their permissions, the bystander can still
//! write (its quota was not spent by the other), its own transaction, open throughout,
//! commits with its write, and the toolstack's tree is intact.

use hv::store::transaction::{TxId, MAX_TRANSACTIONS_PER_DOMAIN};
use hv::store::{Perm, Store, MAX_NODES_PER_DOMAIN, MAX_VALUE, MAX_WATCH_EVENTS};
use hv::DomId;

use crate::Input;

const EVIL: DomId = DomId(5);
const CALM: DomId = DomId(6);

fn paths(inp: &mut Input<'_>) -> String {
    let base = inp.pick(&[
        "/local/domain/5",
        "/local/domain/5/device/vif/0",
        "/local/domain/6",
        "/local/domain/6/data",
        "/local/domain/0/backend/vif/5/0",
        "/local/domain",
        "/tool",
        "",
        "relative/path",
    ]);
    match inp.below(4) {
        0 => base.to_string(),
        1 => format!("{base}/k{}", inp.below(50)),
        2 => format!("{base}/{}", "d/".repeat(inp.below(40) as usize)),
        _ => format!(
            "{base}/{}",
            "x".repeat(inp.pick(&[1usize, 100, 3000, 5000]))
        ),
    }
}

/// One case.
pub fn case(inp: &mut Input<'_>) {
    let store = Store::new();
    for d in [EVIL, CALM] {
        let home = format!("/local/domain/{}", d.0);
        store.write(DomId::DOM0, &home, "").expect("home");
        store.set_perms(DomId::DOM0, &home, d, &[]).expect("owner");
    }
    store
        .write(DomId::DOM0, "/tool/config", "keep")
        .expect("tool");
    store
        .write(CALM, "/local/domain/6/data", "calm's")
        .expect("calm writes");
    // The bystander's transaction, open while the hostile domain works.
    let calm_tx = store.transaction_start(CALM).expect("calm's transaction");
    store
        .tx_write(CALM, calm_tx, "/local/domain/6/txn", "calm's txn")
        .expect("calm's transactional write");
    let mut watches = Vec::new();
    let mut txs: Vec<TxId> = Vec::new();
    let ops = 1 + inp.below(64);
    for _ in 0..ops {
        if inp.exhausted() {
            break;
        }
        let path = paths(inp);
        let _ = match inp.below(11) {
            0 | 1 => {
                let v = "v".repeat(inp.pick(&[0usize, 1, 64, MAX_VALUE, MAX_VALUE + 1]));
                store.write(EVIL, &path, &v)
            }
            2 => store.read(EVIL, &path).map(|_| ()),
            3 => store.rm(EVIL, &path),
            4 => store.directory(EVIL, &path).map(|_| ()),
            5 => {
                let owner = inp.pick(&[EVIL, CALM, DomId::DOM0, DomId(99)]);
                let n = inp.pick(&[0usize, 1, 5, 6, 1000]);
                let perms: Vec<(DomId, Perm)> = (0..n)
                    .map(|_| {
                        (
                            inp.pick(&[EVIL, CALM, DomId(99)]),
                            inp.pick(&[Perm::Read, Perm::Write, Perm::Both]),
                        )
                    })
                    .collect();
                store.set_perms(EVIL, &path, owner, &perms)
            }
            6 => {
                let token = "t".repeat(inp.pick(&[0usize, 8, 4000, 1 << 20]));
                store.watch(EVIL, &path, &token).map(|rx| watches.push(rx))
            }
            8 => store.transaction_start(EVIL).map(|t| txs.push(t)),
            9 => {
                // One of its own, or an id it guesses (the bystander's among them).
                let tx = match txs.len() {
                    n if n > 0 && inp.below(4) > 0 => txs[inp.below(n as u64) as usize],
                    _ => TxId(inp.below(16) as u32),
                };
                match inp.below(4) {
                    0 => store.tx_write(EVIL, tx, &path, "t"),
                    1 => store.tx_read(EVIL, tx, &path).map(|_| ()),
                    2 => store.tx_rm(EVIL, tx, &path),
                    _ => store.tx_directory(EVIL, tx, &path).map(|_| ()),
                }
            }
            10 => {
                let tx = match txs.len() {
                    0 => TxId(inp.below(16) as u32),
                    n => txs.swap_remove(inp.below(n as u64) as usize),
                };
                store.transaction_end(EVIL, tx, inp.below(2) == 0)
            }
            _ => {
                // A burst of writes that fires the watches nobody reads.
                for k in 0..inp.below(200) {
                    let _ = store.write(EVIL, &format!("/local/domain/5/burst{}", k % 7), "x");
                }
                Ok(())
            }
        };
    }
    for rx in &watches {
        assert!(
            rx.try_iter().count() <= MAX_WATCH_EVENTS,
            "a watcher that never reads holds at most the bound"
        );
    }
    assert!(
        store.nodes_owned(EVIL) <= MAX_NODES_PER_DOMAIN,
        "the hostile domain stays within its quota"
    );
    assert!(
        store.transactions_open() <= MAX_TRANSACTIONS_PER_DOMAIN + 1,
        "the hostile domain holds at most its quota of transactions"
    );
    store.transaction_end(CALM, calm_tx, true).expect(
        "the bystander's transaction commits: nothing it touched was the other's to change",
    );
    assert_eq!(
        store.read(CALM, "/local/domain/6/txn").as_deref(),
        Ok("calm's txn"),
        "and its write is applied"
    );
    assert_eq!(
        store.read(CALM, "/local/domain/6/data").as_deref(),
        Ok("calm's"),
        "the bystander's node keeps its value"
    );
    store
        .write(CALM, "/local/domain/6/after", "still")
        .expect("the bystander can still write");
    assert_eq!(
        store.read(DomId::DOM0, "/tool/config").as_deref(),
        Ok("keep"),
        "the toolstack's nodes are intact"
    );
    assert!(
        store.read(EVIL, "/tool/config").is_err()
            || store.write(EVIL, "/tool/config", "x").is_err(),
        "the hostile domain did not take the toolstack's nodes"
    );
}
