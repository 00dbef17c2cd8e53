#![no_main]
//! `cargo +nightly fuzz run lro`: pvio_fuzz::lro::case driven by libFuzzer's bytes.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pvio_fuzz::lro::case(&mut pvio_fuzz::Input::from_bytes(data));
});
