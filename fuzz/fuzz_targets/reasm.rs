#![no_main]
//! `cargo +nightly fuzz run reasm`: pvio_fuzz::reasm::case driven by libFuzzer's bytes.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pvio_fuzz::reasm::case(&mut pvio_fuzz::Input::from_bytes(data));
});
