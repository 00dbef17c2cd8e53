//! Beyond the paper (c): the SV-NIC's DMA through the IOMMU with a context per VIF (the
//! paper's "device domain per VIF"). Each VIF's region is a memory domain of its own,
//! its receive buffers mapped in its own requester id's context, and the ingress
//! engine places every frame by DMA through it: a frame sent to the wrong VIF's memory
//! faults (shown in `dev`'s tests). Measured here: what the translation costs, as the
//! round trip and the ingress engine's stage times beside the same design writing its
//! own memory directly.

use std::time::Duration;

use dev::svnic::device::{Idle, SignalMode};
use dev::svnic::engine::Stage;

use super::{measure, quantile, Design};
use crate::{Error, Mode, Report};

/// Adds the IOMMU rows and checks to `rep`.
pub fn iommu(rep: &mut Report, cx: &crate::Context) -> Result<(), Error> {
    let (n, secs, gap_ms): (usize, f64, u64) = match cx.mode {
        Mode::Full => (4, 10.0, 100),
        Mode::Quick => (4, 1.0, 2),
        Mode::Smoke => (2, 0.3, 1),
    };
    rep.setup.push_str(&format!(
        " An IOMMU context per VIF (beyond the paper): Figure 7's probes, {n} pairs, {secs} s, \
         the sidecore design polling, its VIFs in the device's memory written directly \
         against each VIF in a memory domain of its own written by DMA through its own \
         IOMMU context (IOTLB, page walks on a miss)."
    ));
    let designs = [
        Design::SvNic(SignalMode::Sidecore, Idle::Poll),
        Design::SvNicIommu,
    ];
    let mut pts = Vec::new();
    for d in designs {
        crate::progress::step(format_args!("IOMMU per VIF: {}", d.name()));
        let mut p = measure(
            cx.idle,
            d,
            n,
            Duration::from_secs_f64(secs),
            Duration::from_millis(gap_ms),
        )?;
        p.rtts.sort_by(f64::total_cmp);
        let g = format!("IOMMU context per VIF, {n} VIFs");
        rep.row(&g, &format!("{}: round trip", d.name()), "µs", &p.rtts);
        let scale = hv::time::tsc_scale();
        for (k, st) in Stage::ALL.into_iter().enumerate() {
            if matches!(st, Stage::ChnlDemux | Stage::MsgSend) {
                let (t, c) = p.stages[k];
                let per = scale.ns(t) as f64 / c.max(1) as f64;
                rep.row(
                    &g,
                    &format!("{}: {}", d.name(), st.name()),
                    "ns/packet",
                    &[per],
                );
            }
        }
        pts.push(p);
    }
    let x = quantile(&pts[1].rtts, 0.5) / quantile(&pts[0].rtts, 0.5);
    rep.row(
        "IOMMU context per VIF: median round trip against direct writes",
        "per-VIF IOMMU",
        "×",
        &[x],
    );
    let bad: u64 = pts.iter().map(|p| p.lost + p.corrupt).sum();
    rep.check(
        "IOMMU context per VIF: probes lost or corrupt",
        bad as f64,
        "probes",
        "0",
        bad == 0 && pts.iter().all(|p| !p.rtts.is_empty()),
    );
    Ok(())
}
