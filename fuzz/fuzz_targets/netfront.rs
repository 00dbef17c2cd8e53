#![no_main]
//! `cargo +nightly fuzz run netfront`: pvio_fuzz::netfront::case driven by libFuzzer's bytes.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pvio_fuzz::netfront::case(&mut pvio_fuzz::Input::from_bytes(data));
});
