#![no_main]
//! `cargo +nightly fuzz run netback`: pvio_fuzz::netback::case driven by libFuzzer's bytes.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pvio_fuzz::netback::case(&mut pvio_fuzz::Input::from_bytes(data));
});
