//! A guest that computes: the neighbour of a consolidated machine (paper 001's future
//! work), a domain that shares a pCPU with the I/O path and wants all of it.
//!
//! One process of a compute program runs over its memory through its page tables, as a
//! CPU-bound benchmark does: every pass reads the first and last word of each of its
//! pages through the hypervisor's walker, checks them against the image, and writes its
//! pid into each writable page ([`Mm::run`]). A pass is one step of the guest's vCPU and
//! it always has another, so its pCPU shares time between it and the domains beside it
//! by their weights. No device, no event channel: it is never idle.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hv::{Domain, Hypervisor, Port, Vcpu};

use crate::mm::{Mm, Process, RegionSpec};
use crate::vcpu::{Kernel, Work};
use crate::{other, BuildError, Counters};

/// What a computing guest has done.
#[derive(Debug, Clone, Default)]
pub struct ComputeStats {
    /// Passes over its heap completed.
    pub passes: u64,
    /// Passes its process could not run (a fault it did not expect).
    pub failed: u64,
}
hv::counter_set!(ComputeStats { passes, failed });

/// What the guest computes over, and where it counts its passes.
#[derive(Debug, Clone)]
pub struct ComputeSpec {
    /// Pages of the program's heap (its text, data and stack are fixed and small).
    pub heap_pages: usize,
    /// Passes done so far, readable while it runs.
    pub passes: Arc<AtomicU64>,
}

/// The program's image with a heap of `heap` pages: text, data, heap, stack.
fn image(heap: usize) -> [RegionSpec; 4] {
    [
        RegionSpec {
            va: 0x0040_0000,
            pages: 32,
            writable: false,
        },
        RegionSpec {
            va: 0x0080_0000,
            pages: 8,
            writable: true,
        },
        RegionSpec {
            va: 0x1000_0000,
            pages: heap,
            writable: true,
        },
        RegionSpec {
            va: 0x7fff_ff00_0000,
            pages: 8,
            writable: true,
        },
    ]
}

/// The guest's kernel: its memory manager and its one process.
#[derive(Debug)]
pub struct ComputeGuest {
    mm: Mm,
    process: Option<Process>,
    passes: Arc<AtomicU64>,
    /// Passes whose memory did not read back as written (each a failure of the
    /// hypervisor's walker or of the guest's tables).
    failed: u64,
}

impl ComputeGuest {
    /// Builds the process's page tables and memory in `dom` (vCPU 0).
    pub fn new(
        hv: &Arc<Hypervisor>,
        dom: &Arc<Domain>,
        spec: &ComputeSpec,
    ) -> Result<Self, BuildError> {
        let mut mm = Mm::new(Arc::clone(hv), Arc::clone(dom), 0).map_err(other)?;
        let process = mm.spawn(&image(spec.heap_pages)).map_err(other)?;
        Ok(Self {
            mm,
            process: Some(process),
            passes: Arc::clone(&spec.passes),
            failed: 0,
        })
    }
}

impl Kernel for ComputeGuest {
    const CLOCK: bool = false;

    fn event(&mut self, _v: &Vcpu, _port: Port) {}

    fn poll(&mut self, _now: Duration) -> Work {
        if let Some(p) = &self.process {
            match self.mm.run(p) {
                Ok(()) => {
                    self.passes.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => self.failed += 1,
            }
        }
        Work {
            app: 1,
            more: true,
            ..Work::default()
        }
    }

    fn counters(&self) -> Counters {
        let mut c = Counters::default();
        let stats = ComputeStats {
            passes: self.passes.load(Ordering::Relaxed),
            failed: self.failed,
        };
        c.add_set("compute", &stats);
        c
    }

    fn shutdown(mut self) -> Counters {
        let c = self.counters();
        if let Some(p) = self.process.take() {
            let _ = self.mm.exit(p);
        }
        c
    }
}
