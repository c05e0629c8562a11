//! Links the fuzz targets against the llama.cpp archives sdq's build script
//! built: its link arguments apply only to sdq's own binaries.

fn main() {
    let archives = std::env::var("DEP_SDQ_LLAMA_ARCHIVES").expect("sdq's build script reports its archives");
    println!("cargo:rustc-link-arg=-Wl,--start-group");
    for a in archives.split(';').filter(|a| !a.is_empty()) {
        println!("cargo:rustc-link-arg={a}");
    }
    println!("cargo:rustc-link-arg=-Wl,--end-group");
    for lib in ["stdc++", "m", "pthread", "dl"] {
        println!("cargo:rustc-link-arg=-l{lib}");
    }
}
