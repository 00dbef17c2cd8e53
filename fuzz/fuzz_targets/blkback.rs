#![no_main]
//! `cargo +nightly fuzz run blkback`: pvio_fuzz::blkback::case driven by libFuzzer's bytes.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pvio_fuzz::blkback::case(&mut pvio_fuzz::Input::from_bytes(data));
});
