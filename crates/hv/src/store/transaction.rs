//! Store transactions, as xenstored keeps them (`XS_TRANSACTION_START`, reads and writes
//! carrying the transaction's id, `XS_TRANSACTION_END`).
//!
//! A transaction reads the live store through its own writes: a path it wrote or removed
//! reads as it left it, anything else as the store holds it now. Each node it touches,
//! read or written, is remembered with the generation it had when first touched (or as
//! absent). Its writes are kept in order and applied only at its end, all of them or
//! none: the end compares every remembered node with the store, and if any changed, was
//! created or went away meanwhile, nothing is applied and the end answers
//! [`StoreError::Again`]; the caller starts the transaction over, as Linux's xenbus
//! does on `EAGAIN`. A node's generation also moves when its children come or go, so a
//! transaction that listed a directory conflicts with a child added beside it.
//!
//! Permissions are checked when the transaction reads, and again when its writes are
//! applied at its end, against the store as it is then; quotas at the end. A domain
//! may hold [`MAX_TRANSACTIONS_PER_DOMAIN`] open at once (xenstored's default), and
//! each remembers at most [`MAX_TOUCHED`] nodes and as many writes, so an unprivileged
//! domain cannot make the store hold more for it than that. A transaction's id is its domain's alone:
//! another domain naming it gets [`StoreError::NoEntry`], as an unknown id does.

use std::collections::BTreeMap;

use super::{children, is_at_or_below, put, remove, valid_path, Store, StoreError, MAX_VALUE};
use crate::types::DomId;

/// Transactions one (unprivileged) domain may have open (xenstored's
/// `quota-max-transaction`).
pub const MAX_TRANSACTIONS_PER_DOMAIN: usize = 10;
/// Nodes one transaction may read or write before it is refused with
/// [`StoreError::Quota`] (xenstored bounds a transaction's accessed nodes likewise).
pub const MAX_TOUCHED: usize = 1024;

/// A transaction's id, as `XS_TRANSACTION_START` answers it (never 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TxId(pub u32);

/// One write of a transaction, applied at its end.
#[derive(Debug, Clone)]
enum Op {
    Write(String, String),
    Rm(String),
}

/// An open transaction.
#[derive(Debug)]
pub(super) struct Txn {
    dom: DomId,
    /// Every node touched, with its generation when first touched (none: absent).
    seen: BTreeMap<String, Option<u64>>,
    /// The writes, in order.
    ops: Vec<Op>,
}

impl Txn {
    /// The value `path` has inside the transaction, if its own writes decide it: the
    /// last write to it, or the last removal of it or above it (a removal of an
    /// ancestor removes it), unless a write below it came after that removal: the end
    /// then creates it again, empty, as the store makes a missing ancestor.
    fn own(&self, path: &str) -> Option<Option<&str>> {
        let mut written_below = false;
        for op in self.ops.iter().rev() {
            match op {
                Op::Write(p, v) if p == path => return Some(Some(v.as_str())),
                Op::Write(p, _) if is_at_or_below(p, path) => written_below = true,
                Op::Rm(p) if is_at_or_below(path, p) => {
                    return Some(written_below.then_some(""));
                }
                _ => {}
            }
        }
        None
    }

    /// Whether the transaction's writes make `path` exist: it wrote `path` or a node
    /// below it (whose missing ancestors a write creates), and nothing removed it since.
    fn creates(&self, path: &str) -> bool {
        self.ops.iter().any(|op| match op {
            Op::Write(p, _) => is_at_or_below(p, path) && matches!(self.own(p), Some(Some(_))),
            Op::Rm(_) => false,
        })
    }
}

impl Store {
    /// Starts a transaction for `caller` (`XS_TRANSACTION_START`).
    pub fn transaction_start(&self, caller: DomId) -> Result<TxId, StoreError> {
        let mut g = self.lock();
        if caller != DomId::DOM0
            && g.transactions.values().filter(|t| t.dom == caller).count()
                >= MAX_TRANSACTIONS_PER_DOMAIN
        {
            return Err(StoreError::Quota);
        }
        let id = g.next_tx;
        g.next_tx = g.next_tx.wrapping_add(1).max(1);
        g.transactions.insert(
            id,
            Txn {
                dom: caller,
                seen: BTreeMap::new(),
                ops: Vec::new(),
            },
        );
        Ok(TxId(id))
    }

    /// Ends `tx` (`XS_TRANSACTION_END`): applies its writes if `commit` and nothing it
    /// touched changed since, else [`StoreError::Again`] with nothing applied; with
    /// `commit` false, drops it. A write refused at the end (a permission taken away
    /// meanwhile, a quota) refuses the whole transaction, and nothing is applied.
    pub fn transaction_end(&self, caller: DomId, tx: TxId, commit: bool) -> Result<(), StoreError> {
        let mut g = self.lock();
        let g = &mut *g;
        let t = match g.transactions.get(&tx.0) {
            Some(t) if t.dom == caller => g.transactions.remove(&tx.0),
            _ => None,
        }
        .ok_or_else(|| no_tx(tx))?;
        if !commit {
            return Ok(());
        }
        let stale = t
            .seen
            .iter()
            .any(|(path, gen)| g.nodes.get(path).map(|n| n.gen) != *gen);
        if stale {
            return Err(StoreError::Again);
        }
        // All or nothing: the writes go to a copy, which replaces the tree only if
        // every one of them was allowed.
        let (mut nodes, mut generation) = (g.nodes.clone(), g.generation);
        for op in &t.ops {
            match op {
                Op::Write(p, v) => put(&mut nodes, &mut generation, caller, p, v)?,
                Op::Rm(p) => match remove(&mut nodes, &mut generation, caller, p) {
                    // Removing what is already gone is no error inside a transaction
                    // (an earlier removal of its ancestor took it).
                    Err(StoreError::NoEntry(_)) => {}
                    r => r?,
                },
            }
        }
        (g.nodes, g.generation) = (nodes, generation);
        for op in &t.ops {
            match op {
                Op::Write(p, _) => g.notify(p),
                Op::Rm(p) => g.notify_change(p, true),
            }
        }
        Ok(())
    }

    /// Reads `path` inside `tx`.
    pub fn tx_read(&self, caller: DomId, tx: TxId, path: &str) -> Result<String, StoreError> {
        if !valid_path(path) {
            return Err(StoreError::Invalid);
        }
        let mut g = self.lock();
        let g = &mut *g;
        let t = txn(&mut g.transactions, caller, tx)?;
        match t.own(path) {
            Some(Some(v)) => return Ok(v.to_string()),
            Some(None) => return Err(StoreError::NoEntry(path.into())),
            None => {}
        }
        touch(t, path, g.nodes.get(path).map(|n| n.gen))?;
        if !g.nodes.contains_key(path) && t.creates(path) {
            // An ancestor its writes create, empty as the store makes them.
            return Ok(String::new());
        }
        Ok(g.node(caller, path, false)?.value.clone())
    }

    /// Lists `path`'s children inside `tx`: the store's, with those the transaction
    /// wrote below it added and those it removed taken away.
    pub fn tx_directory(
        &self,
        caller: DomId,
        tx: TxId,
        path: &str,
    ) -> Result<Vec<String>, StoreError> {
        if !valid_path(path) {
            return Err(StoreError::Invalid);
        }
        let mut g = self.lock();
        let g = &mut *g;
        let t = txn(&mut g.transactions, caller, tx)?;
        if t.own(path) == Some(None) {
            return Err(StoreError::NoEntry(path.into()));
        }
        let mut names = if let Some(n) = g.nodes.get(path) {
            touch(t, path, Some(n.gen))?;
            if !n.allows(caller, false) {
                return Err(StoreError::Denied(path.into()));
            }
            children(&g.nodes, path)
        } else {
            // Absent from the store, and remembered so: someone else creating it
            // meanwhile conflicts, whether or not this transaction's writes create it.
            touch(t, path, None)?;
            if !t.creates(path) {
                return Err(StoreError::NoEntry(path.into()));
            }
            Vec::new()
        };
        let prefix = if path == "/" {
            "/".to_string()
        } else {
            format!("{path}/")
        };
        for op in &t.ops {
            if let Op::Write(p, _) = op {
                if let Some(rest) = p.strip_prefix(&prefix) {
                    let child = rest.split('/').next().unwrap_or_default().to_string();
                    if !child.is_empty() && !names.contains(&child) {
                        names.push(child);
                    }
                }
            }
        }
        names.retain(|c| t.own(&format!("{prefix}{c}")) != Some(None));
        names.sort();
        Ok(names)
    }

    /// Writes `path` inside `tx` (applied at the transaction's end).
    pub fn tx_write(
        &self,
        caller: DomId,
        tx: TxId,
        path: &str,
        value: &str,
    ) -> Result<(), StoreError> {
        if !valid_path(path) || value.len() > MAX_VALUE {
            return Err(StoreError::Invalid);
        }
        let mut g = self.lock();
        let g = &mut *g;
        let t = txn(&mut g.transactions, caller, tx)?;
        touch(t, path, g.nodes.get(path).map(|n| n.gen))?;
        push(t, Op::Write(path.into(), value.into()))
    }

    /// Removes `path` and below inside `tx` (applied at the transaction's end).
    pub fn tx_rm(&self, caller: DomId, tx: TxId, path: &str) -> Result<(), StoreError> {
        if !valid_path(path) || path == "/" {
            return Err(StoreError::Invalid);
        }
        let mut g = self.lock();
        let g = &mut *g;
        let t = txn(&mut g.transactions, caller, tx)?;
        // Remembered whether or not it exists: a node created meanwhile where this
        // transaction found none conflicts at the end, as for a read.
        touch(t, path, g.nodes.get(path).map(|n| n.gen))?;
        let exists = match t.own(path) {
            Some(v) => v.is_some(),
            None => g.nodes.contains_key(path) || t.creates(path),
        };
        if !exists {
            return Err(StoreError::NoEntry(path.into()));
        }
        push(t, Op::Rm(path.into()))
    }

    /// Transactions open now (all domains').
    pub fn transactions_open(&self) -> usize {
        self.lock().transactions.len()
    }

    /// Ends every transaction of `dom` unapplied (the domain was destroyed).
    pub fn end_transactions_of(&self, dom: DomId) {
        self.lock().transactions.retain(|_, t| t.dom != dom);
    }
}

fn no_tx(tx: TxId) -> StoreError {
    StoreError::NoEntry(format!("transaction {}", tx.0))
}

/// `caller`'s open transaction `tx`.
fn txn(all: &mut BTreeMap<u32, Txn>, caller: DomId, tx: TxId) -> Result<&mut Txn, StoreError> {
    match all.get_mut(&tx.0) {
        Some(t) if t.dom == caller => Ok(t),
        _ => Err(no_tx(tx)),
    }
}

/// Adds a write to `t`, at most [`MAX_TOUCHED`] of them for an unprivileged domain
/// (writing one path over and over must not grow the store either).
fn push(t: &mut Txn, op: Op) -> Result<(), StoreError> {
    if t.dom != DomId::DOM0 && t.ops.len() >= MAX_TOUCHED {
        return Err(StoreError::Quota);
    }
    t.ops.push(op);
    Ok(())
}

/// Remembers `path` at `gen` if `t` has not touched it yet.
fn touch(t: &mut Txn, path: &str, gen: Option<u64>) -> Result<(), StoreError> {
    if !t.seen.contains_key(path) {
        if t.dom != DomId::DOM0 && t.seen.len() >= MAX_TOUCHED {
            return Err(StoreError::Quota);
        }
        t.seen.insert(path.to_string(), gen);
    }
    Ok(())
}
