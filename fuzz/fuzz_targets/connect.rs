#![no_main]
//! `cargo +nightly fuzz run connect`: pvio_fuzz::connect::case driven by libFuzzer's bytes.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pvio_fuzz::connect::case(&mut pvio_fuzz::Input::from_bytes(data));
});
