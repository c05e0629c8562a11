//! A model file as sdq meets it under a budget: the preflight check (ggml's
//! GGUF reader plus sdq's own range and split checks), then everything
//! `sdq inspect` and the growth plan compute from the metadata. Any input
//! must give Ok or an error, never a crash, hang or runaway allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

fn scratch() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        dir.join(format!("sdq-fuzz-{}.gguf", std::process::id()))
    })
}

fuzz_target!(|data: &[u8]| {
    let path = scratch();
    std::fs::write(path, data).expect("scratch file is writable");
    if sdq::engine::runtime::preflight::check_model(path).is_err() {
        return;
    }
    let _ = sdq::commands::inspect::inspect(path, Some(8 << 30), None).map(|r| sdq::commands::inspect::render(&r));
    if let Ok(g) = sdq::engine::model::gguf::Gguf::open(path) {
        for key in g.keys() {
            let _ = g.get(&key);
        }
        let _ = sdq::engine::memory::growth::checkpoint_bytes(&g);
    }
});
