//! Profiling aid: the shared-ring benchmark alone, to be run under `perf record`.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(50_000_000);
    let bare = lab::experiments::own::core::spsc_mdesc_per_s(n);
    let shaped = lab::experiments::own::core::reqrsp_mreq_per_s(n);
    println!("ring.h-shaped bare ring {shaped:.1} Mreq/s");
    let (rate, ev) =
        lab::experiments::own::core::ring_mreq_per_s(n, lab::experiments::own::core::Idle::Poll)
            .map_err(|e| e.to_string())?;
    println!("bare {bare:.1} Mdesc/s, ring {rate:.1} Mreq/s, events {ev:?}");
    Ok(())
}
