//! Finds MLX and builds the C++ shim against it.
//!
//! The engine must run the very libmlx build the Python oracle runs (docs/DESIGN.md, section 1), so the
//! MLX version is pinned here, once: `MLX_DIR` may point at an installed wheel's `mlx` folder
//! (it must hold that version); otherwise the pinned wheel (`mlx-cpu` on Linux, `mlx-metal` on
//! macOS, `mlx-cuda-13` on Linux with the `cuda` feature) is installed with pip into a cache under
//! the target directory.
//!
//! A CUDA libmlx finds its NVIDIA runtime through its own RPATH (`$ORIGIN/../../nvidia/*/lib`,
//! the pip wheels `mlx-cuda-13` depends on, installed beside it) and its NVRTC headers in the
//! wheel's `include/`; the binary only needs an rpath to the wheel's `lib/`. The driver
//! (`libcuda.so.1`) is not on a build machine without a GPU, so its symbols resolve at run time.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The one place that pins MLX. oracles/requirements.txt must name the same version.
const MLX_VERSION: &str = "0.32.4";

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    println!("cargo:rerun-if-env-changed=MLX_PYTHON");
    for f in [
        "src/ffi.rs",
        "src/shim.cc",
        "include/shim.h",
        "include/rows_attention.h",
        "include/row_products.h",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    if let Err(message) = run() {
        eprintln!("\nerror: {message}\n");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let root = match env::var_os("MLX_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => install_wheel()?,
    };
    let include = root.join("include");
    let lib = root.join("lib");
    let lib_name = if cfg!(target_os = "macos") {
        "libmlx.dylib"
    } else {
        "libmlx.so"
    };
    if !include.join("mlx/mlx.h").is_file() || !lib.join(lib_name).is_file() {
        return Err(format!(
            "{} is not an MLX wheel's `mlx` folder (expected include/mlx/mlx.h and lib/{lib_name})",
            root.display()
        ));
    }
    if env::var_os("CARGO_FEATURE_CUDA").is_some() && !is_cuda_wheel(&root) {
        return Err(format!(
            "the cuda feature is on, but {} is not the mlx-cuda-13 wheel's `mlx` folder (no \
             include/cccl); point MLX_DIR at it, or unset MLX_DIR to install it with pip",
            root.display()
        ));
    }
    let found = header_version(&include)?;
    if found != MLX_VERSION {
        return Err(format!(
            "MLX at {} is version {found}, but verity pins {MLX_VERSION} (bit-exact parity needs the \
             oracle's exact build); unset MLX_DIR to install the pinned wheel",
            root.display()
        ));
    }

    cxx_build::bridge("src/ffi.rs")
        .file("src/shim.cc")
        .include(&include)
        .include("include")
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .compile("mlx_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    if is_cuda_wheel(&root) {
        println!("cargo:rustc-link-arg=-Wl,--allow-shlib-undefined");
    }
    println!("cargo:lib_dir={}", lib.display());
    println!("cargo:version={MLX_VERSION}");
    println!("cargo:rustc-env=MLX_PINNED_VERSION={MLX_VERSION}");
    println!("cargo:rerun-if-changed={}", lib.join(lib_name).display());
    Ok(())
}

/// Only the CUDA wheel ships the CCCL headers its kernels are JIT-compiled against.
fn is_cuda_wheel(root: &Path) -> bool {
    root.join("include/cccl").is_dir()
}

/// Reads MAJOR.MINOR.PATCH from include/mlx/version.h.
fn header_version(include: &Path) -> Result<String, String> {
    let path = include.join("mlx/version.h");
    let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let part = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("#define MLX_VERSION_{name} ")))
            .map(|v| v.trim().to_string())
            .ok_or_else(|| format!("{}: no MLX_VERSION_{name}", path.display()))
    };
    Ok(format!(
        "{}.{}.{}",
        part("MAJOR")?,
        part("MINOR")?,
        part("PATCH")?
    ))
}

/// Installs the pinned wheel with pip into `<target>/mlx-wheel/<package>-<version>` once,
/// atomically (a debug and a release build may race), and returns its `mlx` folder.
fn install_wheel() -> Result<PathBuf, String> {
    let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();
    let package = match (env::var("CARGO_CFG_TARGET_OS").as_deref(), cuda) {
        (Ok("linux"), false) => "mlx-cpu",
        (Ok("linux"), true) => "mlx-cuda-13",
        (Ok("macos"), false) => "mlx-metal",
        (Ok(os), true) => return Err(format!("the cuda feature needs Linux, not {os}")),
        (Ok(os), false) => return Err(format!("no MLX wheel for target OS {os}; set MLX_DIR")),
        (Err(_), _) => return Err("CARGO_CFG_TARGET_OS is not set".into()),
    };
    let cache = target_dir()
        .join("mlx-wheel")
        .join(format!("{package}-{MLX_VERSION}"));
    let mlx = cache.join("mlx");
    if mlx.join("include/mlx/mlx.h").is_file() {
        return Ok(mlx);
    }
    let python = env::var("MLX_PYTHON").unwrap_or_else(|_| "python3".into());
    let staging = cache.with_extension(format!("tmp{}", std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    let spec = format!("{package}=={MLX_VERSION}");
    // The CUDA wheel's dependencies are the NVIDIA runtime libraries its RPATH expects beside
    // it; the CPU and Metal wheels need nothing else (their `mlx` Python package is not used).
    let deps = if cuda { None } else { Some("--no-deps") };
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(deps)
        .arg("--target")
        .arg(&staging)
        .arg(&spec)
        .status()
        .map_err(|e| {
            format!(
                "cannot run `{python} -m pip` to install {spec} ({e}). Install Python 3 with pip \
                 (e.g. `apt install python3-pip`), set MLX_PYTHON to a Python that has pip, or set \
                 MLX_DIR to an installed wheel's `mlx` folder"
            )
        })?;
    if !status.success() {
        return Err(format!(
            "`{python} -m pip install {spec}` failed ({status}); check network access to PyPI, or \
             set MLX_DIR to an installed wheel's `mlx` folder"
        ));
    }
    match fs::rename(&staging, &cache) {
        Ok(()) => {}
        // Another build finished first: use its copy.
        Err(_) if mlx.join("include/mlx/mlx.h").is_file() => {
            let _ = fs::remove_dir_all(&staging);
        }
        Err(e) => {
            return Err(format!(
                "cannot move the MLX wheel into {}: {e}",
                cache.display()
            ))
        }
    }
    Ok(mlx)
}

/// The cargo target directory: the nearest ancestor of OUT_DIR holding CACHEDIR.TAG.
fn target_dir() -> PathBuf {
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    out.ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
        .map(Path::to_path_buf)
        .unwrap_or(out)
}
