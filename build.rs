//! Every binary and test of this package loads libmlx at run time: give them its directory as an
//! rpath, exported by the `mlx` crate (`links = "mlx"`), so nothing needs LD_LIBRARY_PATH.
fn main() {
    let dir = std::env::var("DEP_MLX_LIB_DIR").expect("the mlx crate exports its lib dir");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
}
