//! The binding's error type.

/// An MLX call failed. `Mlx` carries MLX's own exception message unchanged, so a shape error
/// reads exactly as it would in Python.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Mlx(String),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<cxx::Exception> for Error {
    fn from(e: cxx::Exception) -> Self {
        Error::Mlx(e.what().to_string())
    }
}
