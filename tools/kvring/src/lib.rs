//! The `kvring` and `kvring-inspect` command lines, as a library: the
//! binaries of this package call them, and so does the Python package
//! (`python -m kvring`, the `kvring` and `kvring-inspect` scripts of its
//! wheel), so one command line serves both and no Rust toolchain is needed
//! to run a server from Python.

mod demo;
pub mod inspect_cmd;
pub mod kvring_cmd;
mod render;
