#![no_main]
//! `cargo +nightly fuzz run store`: pvio_fuzz::store::case driven by libFuzzer's bytes.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pvio_fuzz::store::case(&mut pvio_fuzz::Input::from_bytes(data));
});
