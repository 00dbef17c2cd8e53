//! Each configuration carries the sender's messages to the application intact, with
//! nothing lost at a modest rate, and its CPU lands in the right domains.

use std::time::Duration;

use lab::platform::{Config, Options, Running};
use net::netfront::RxBuffers;

#[test]
fn every_configuration_delivers_every_message_intact() {
    // pv twice: with netfront's original page fragments and without them.
    let variants = Config::ALL
        .iter()
        .map(|&c| (c, RxBuffers::Fragments))
        .chain([(Config::Pv, RxBuffers::Linear)]);
    for (config, rx_buffers) in variants {
        for message in [52usize, 1472, 48000] {
            let mut o = Options::paper(config, message);
            o.rate = 20_000.0;
            o.rx_buffers = rx_buffers;
            let m = Running::start(o).expect("machine");
            std::thread::sleep(Duration::from_millis(150));
            let s = m.snapshot();
            let f = m.finish(Duration::from_secs(2)).expect("finish");
            assert!(
                f.messages_sent > 10,
                "{config:?} {rx_buffers:?} {message}: sent {}",
                f.messages_sent
            );
            assert_eq!(
                f.messages_received, f.messages_sent,
                "{config:?} {rx_buffers:?} {message}: every message arrives ({:?})",
                f.counters
            );
            assert_eq!(f.corrupt, 0);
            assert!(s.domains.iter().all(|d| d.2.cpu > Duration::ZERO));
        }
    }
}
