//! Under the `cuda` feature, compiles the crate's CUDA kernels (`src/cuda/*.cu`) to PTX with
//! `nvcc`, for the compute capability in `CUDA_COMPUTE_CAP` (default 80, as candle's kernels);
//! the driver compiles the PTX for the card at load time. Without the feature it does nothing.

use std::path::PathBuf;
use std::process::Command;

const KERNELS: &[&str] = &["attention"];

fn main() {
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo::rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    for name in KERNELS {
        let source = format!("src/cuda/{name}.cu");
        println!("cargo::rerun-if-changed={source}");
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17"])
            .arg(format!("-arch=compute_{cap}"))
            .arg(&source)
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| {
                panic!("running {nvcc} (the CUDA compiler, needed by the `cuda` feature): {e}")
            });
        assert!(status.success(), "{nvcc} failed on {source}");
    }
}
