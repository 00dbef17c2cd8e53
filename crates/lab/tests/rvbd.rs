//! The host-centric remote virtual block device against a real `vblade` (Debian's) in a
//! namespace at the far end of the NIC's cable: guests' reads come back with the
//! backing file's every byte, their writes land in it, and with `vblade` killed in the
//! middle of a run and started again every request still completes, with the right
//! data, none lost or doubled.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blk::blkback::VbdStats;
use blk::disk::{pattern_fill, write_patterned};
use blk::initiator::AoeStats;
use dev::wire::Samples;
use kernel::block::{BlockJobSpec, JobCounters, JobOp, Pattern};
use kernel::driver_domain::DriverConfig;
use kernel::machine::{Above, BlockSpec, Disk, GuestSpec, Layout, Machine, MachineSpec, NicSpec};
use lab::remote_host::{self, RemoteHost, Servers, SHELF, SLOT};
use net::netfront::FrontConfig;

/// 8 MiB.
const SECTORS: u64 = 16384;

fn inverted(offset: u64, buf: &mut [u8]) {
    pattern_fill(offset, buf);
    buf.iter_mut().for_each(|b| *b = !*b);
}

fn job(
    op: JobOp,
    pattern: Pattern,
    bytes: u32,
    depth: usize,
    span: (u64, u64),
    limit: u64,
) -> (BlockJobSpec, Arc<JobCounters>) {
    let counters = Arc::new(JobCounters::default());
    (
        BlockJobSpec {
            op,
            pattern,
            bytes,
            depth,
            span,
            limit: Some(limit),
            expect: pattern_fill,
            verify: true,
            fill: inverted,
            latencies: Arc::new(Samples::new(limit as usize)),
            counters: Arc::clone(&counters),
        },
        counters,
    )
}

fn guest(name: &str, job: BlockJobSpec) -> GuestSpec {
    GuestSpec {
        weight: 1,
        name: name.into(),
        mac: [2, 0, 0, 0, 0, 9],
        above: Above::Block(Box::new(BlockSpec {
            disk: Disk::Aoe {
                major: SHELF,
                minor: SLOT,
            },
            read_only: false,
            persistent: true,
            job,
        })),
        core: None,
        front: FrontConfig::default(),
    }
}

/// A backing file on tmpfs, a remote host serving it with vblade, and a machine whose
/// NIC's cable is the host's TAP.
fn rig(name: &str, guests: Vec<GuestSpec>) -> (PathBuf, RemoteHost, Machine) {
    rig_with(
        name,
        VBLADE,
        Layout::DriverDomain {
            driver: DriverConfig::default(),
            guests,
        },
    )
}

/// The remote host serving with vblade only.
const VBLADE: Servers = Servers {
    vblade: true,
    nbd_server: false,
    nbdkit: false,
};

/// As [`rig`], the remote host running `servers`, the machine laid out as `layout`.
fn rig_with(name: &str, servers: Servers, layout: Layout) -> (PathBuf, RemoteHost, Machine) {
    remote_host::ensure_tools().expect("servers");
    let disk = PathBuf::from(format!("/dev/shm/pvio-rvbd-{}-{name}", std::process::id()));
    write_patterned(&disk, SECTORS).expect("backing file");
    let (file, ifname) =
        mem::tap::open_tap(&format!("pvrv{}", std::process::id() % 10_000)).expect("tap");
    let host = RemoteHost::start(Some(&ifname), &disk, servers).expect("remote host");
    let mut wire = dev::tap::TapPort::start(file).expect("tap port");
    let sink = wire.sink().expect("sink");
    let m = Machine::start(MachineSpec::new(
        NicSpec::new(Box::new(wire), Box::new(sink)),
        layout,
    ))
    .expect("machine");
    (disk, host, m)
}

fn wait(c: &JobCounters, n: u64, limit: Duration) {
    let t = Instant::now();
    while c.completed.load(Ordering::Relaxed) < n && t.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn guests_read_and_write_a_real_vblade_through_the_driver_domain_intact() {
    // One guest reads the first half sequentially in the paper's response size (74
    // sectors); another writes 4 KiB blocks into the second half, eight in flight.
    let (rd, rd_c) = job(
        JobOp::Read,
        Pattern::Sequential,
        74 * 512,
        1,
        (0, SECTORS / 2),
        150,
    );
    let (wr, wr_c) = job(
        JobOp::Write,
        Pattern::Sequential,
        4096,
        8,
        (SECTORS / 2, SECTORS),
        1024,
    );
    let (disk, host, m) = rig("rw", vec![guest("reader", rd), guest("writer", wr)]);
    wait(&rd_c, 150, Duration::from_secs(30));
    wait(&wr_c, 1024, Duration::from_secs(30));
    let c = m.stop().expect("stop");
    drop(host);
    for (k, n) in [(&rd_c, 150), (&wr_c, 1024)] {
        assert_eq!(k.completed.load(Ordering::Relaxed), n, "{c:?}");
        assert_eq!(k.errors.load(Ordering::Relaxed), 0);
        assert_eq!(
            k.corrupt.load(Ordering::Relaxed),
            0,
            "every byte read is the file's"
        );
    }
    assert_eq!(c.sum(|v: &VbdStats| v.reads), 150);
    assert_eq!(c.sum(|v: &VbdStats| v.writes), 1024);
    let f = std::fs::read(&disk).expect("file");
    let half = (SECTORS / 2 * 512) as usize;
    let mut want = vec![0u8; f.len()];
    pattern_fill(0, &mut want[..half]);
    inverted(half as u64, &mut want[half..]);
    assert!(
        f == want,
        "the second half holds exactly what was written, the first is untouched"
    );
    let _ = std::fs::remove_file(&disk);
}

#[test]
fn with_vblade_killed_and_started_again_every_read_completes_right_none_lost() {
    let (rd, rd_c) = job(
        JobOp::Read,
        Pattern::Random(3),
        16 * 1024,
        4,
        (0, SECTORS),
        4000,
    );
    let (disk, mut host, m) = rig("fault", vec![guest("reader", rd)]);
    wait(&rd_c, 500, Duration::from_secs(30));
    host.kill_vblade();
    let at_kill = rd_c.completed.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(300));
    let during = rd_c.completed.load(Ordering::Relaxed);
    host.start_vblade().expect("vblade again");
    wait(&rd_c, 4000, Duration::from_secs(60));
    let c = m.stop().expect("stop");
    drop(host);
    // Nothing completes while the target is away (but what was answered just before).
    assert!(during <= at_kill + 4, "{at_kill} then {during}");
    assert_eq!(rd_c.completed.load(Ordering::Relaxed), 4000, "{c:?}");
    assert_eq!(rd_c.submitted.load(Ordering::Relaxed), 4000);
    // None answered twice: the job took no completion for a request not in flight,
    // and blkfront refused no response.
    assert_eq!(rd_c.unexpected.load(Ordering::Relaxed), 0, "none doubled");
    assert_eq!(c.get("blkfront", "bad_responses"), 0, "{c:?}");
    assert_eq!(
        rd_c.errors.load(Ordering::Relaxed),
        0,
        "back within the bound: no request failed"
    );
    assert_eq!(rd_c.corrupt.load(Ordering::Relaxed), 0);
    assert!(
        c.sum(|a: &AoeStats| a.retransmits) > 0,
        "the outage's frames were sent again"
    );
    assert_eq!(c.sum(|a: &AoeStats| a.timed_out), 0);
    let _ = std::fs::remove_file(&disk);
}

#[test]
fn the_svnic_block_service_serves_a_guests_remote_disk_from_its_own_core() {
    use dev::svnic::device::{Idle, SignalMode, SvnicConfig};
    use kernel::machine::SvnicGuestSpec;
    use kernel::svnic_guest::SvnicApp;
    // The device-centric RVBD: the guest has no VIF; the device's block engine serves
    // its ring and speaks AoE to vblade. Sequential reads of the paper's size, then
    // random writes, every byte checked.
    let (rd, rd_c) = job(
        JobOp::Read,
        Pattern::Sequential,
        74 * 512,
        1,
        (0, SECTORS / 2),
        150,
    );
    let (wr, wr_c) = job(
        JobOp::Write,
        Pattern::Random(5),
        8192,
        8,
        (SECTORS / 2, SECTORS),
        400,
    );
    let spec = |name: &str, job| SvnicGuestSpec {
        name: name.into(),
        mac: [2, 0, 0, 0, 0, 7],
        app: SvnicApp::Block(Box::new(BlockSpec {
            disk: Disk::Aoe {
                major: SHELF,
                minor: SLOT,
            },
            read_only: false,
            persistent: false,
            job,
        })),
        priority: None,
        core: None,
    };
    let (disk, host, m) = rig_with(
        "svnic",
        VBLADE,
        Layout::Svnic {
            config: SvnicConfig {
                signal: SignalMode::Sidecore,
                idle: Idle::Block {
                    spin: Duration::from_micros(50),
                },
                ..SvnicConfig::default()
            },
            guests: vec![spec("reader", rd), spec("writer", wr)],
        },
    );
    wait(&rd_c, 150, Duration::from_secs(30));
    wait(&wr_c, 400, Duration::from_secs(30));
    let c = m.stop().expect("stop");
    drop(host);
    for (k, n) in [(&rd_c, 150), (&wr_c, 400)] {
        assert_eq!(k.completed.load(Ordering::Relaxed), n, "{c:?}");
        assert_eq!(k.errors.load(Ordering::Relaxed), 0);
        assert_eq!(k.corrupt.load(Ordering::Relaxed), 0);
    }
    assert_eq!(c.sum(|v: &VbdStats| v.reads), 150);
    assert_eq!(c.sum(|v: &VbdStats| v.writes), 400);
    assert!(c.get("svnic block engine", "frames_in") > 0);
    // Every write landed, at its place, and nothing else changed.
    let f = std::fs::read(&disk).expect("file");
    let half = (SECTORS / 2 * 512) as usize;
    let mut want = vec![0u8; half];
    pattern_fill(0, &mut want);
    assert!(f[..half] == want[..], "the first half is untouched");
    let mut inv = vec![0u8; 8192];
    let mut written = 0;
    for blk in (half..f.len()).step_by(8192) {
        inverted(blk as u64, &mut inv);
        let mut orig = vec![0u8; 8192];
        pattern_fill(blk as u64, &mut orig);
        let got = &f[blk..blk + 8192];
        assert!(
            got == &inv[..] || got == &orig[..],
            "each block is either written or as it was"
        );
        written += usize::from(got == &inv[..]);
    }
    // 400 random draws over 512 places: about 278 distinct.
    assert!(written > 200, "{written} blocks written");
    let _ = std::fs::remove_file(&disk);
}

/// A PV guest whose block job runs over its own NBD client and TCP, to `port`.
fn nbd_guest(name: &str, host: u8, port: u16, export: &str, job: BlockJobSpec) -> GuestSpec {
    use kernel::app::{AppCounters, AppSpec, NbdSpec, Proto};
    let mac = [2, 0, 0, 0, 0, host];
    GuestSpec {
        weight: 1,
        name: name.into(),
        mac,
        above: Above::App(AppSpec {
            flow: net::wire::UdpFlow {
                src_mac: mac,
                dst_mac: [0xff; 6],
                src_ip: smoltcp::wire::Ipv4Address::new(10, 78, 0, host),
                dst_ip: smoltcp::wire::Ipv4Address::new(10, 78, 0, 1),
                src_port: 40_000,
                dst_port: port,
                mtu: net::wire::DEFAULT_MTU,
            },
            message: 0,
            proto: Proto::Nbd,
            counters: Arc::new(AppCounters::default()),
            latency: None,
            nbd: Some(NbdSpec {
                export: export.into(),
                job,
            }),
        }),
        core: None,
        front: FrontConfig::default(),
    }
}

#[test]
fn the_guests_own_nbd_client_reads_and_writes_nbdkit_and_nbd_server_intact() {
    use lab::remote_host::{NBDKIT_PORT, NBD_SERVER_PORT};
    for (server, port, export) in [
        ("nbdkit", NBDKIT_PORT, ""),
        ("nbd-server", NBD_SERVER_PORT, "disk"),
    ] {
        let (rd, rd_c) = job(
            JobOp::Read,
            Pattern::Random(9),
            74 * 512,
            4,
            (0, SECTORS / 2),
            200,
        );
        let (wr, wr_c) = job(
            JobOp::Write,
            Pattern::Sequential,
            16384,
            4,
            (SECTORS / 2, SECTORS),
            256,
        );
        let servers = Servers {
            nbd_server: server == "nbd-server",
            nbdkit: server == "nbdkit",
            vblade: false,
        };
        let (disk, host, m) = rig_with(
            &format!("nbd-{server}"),
            servers,
            Layout::DriverDomain {
                driver: DriverConfig::default(),
                guests: vec![
                    nbd_guest("reader", 2, port, export, rd),
                    nbd_guest("writer", 3, port, export, wr),
                ],
            },
        );
        wait(&rd_c, 200, Duration::from_secs(30));
        wait(&wr_c, 256, Duration::from_secs(30));
        let c = m.stop().expect("stop");
        drop(host);
        assert_eq!(
            rd_c.completed.load(Ordering::Relaxed),
            200,
            "{server}: {c:?}"
        );
        assert_eq!(rd_c.errors.load(Ordering::Relaxed), 0, "{server}");
        assert_eq!(
            rd_c.corrupt.load(Ordering::Relaxed),
            0,
            "{server}: every byte read is the file's"
        );
        assert_eq!(c.get("nbd", "broken"), 0);
        assert_eq!(c.get("nbd", "read_bytes"), 200 * 74 * 512);
        assert_eq!(wr_c.completed.load(Ordering::Relaxed), 256, "{server}");
        assert_eq!(wr_c.errors.load(Ordering::Relaxed), 0, "{server}");
        // The writer's 4 MiB are in the file, inverted; the first half as it was.
        let f = std::fs::read(&disk).expect("file");
        let half = (SECTORS / 2 * 512) as usize;
        let mut want = vec![0u8; f.len()];
        pattern_fill(0, &mut want[..half]);
        inverted(half as u64, &mut want[half..]);
        assert!(
            f == want,
            "{server}: the file holds exactly what was written"
        );
        let _ = std::fs::remove_file(&disk);
    }
}
