//! `kvring._native`: the kvring client library for Python (connect,
//! register KV caches, lookup, store, retrieve as jobs and leases whose
//! state is read from shared memory) and the `kvring` / `kvring-inspect`
//! command lines, so a wheel runs a server without a Rust toolchain.
//! Nothing here links torch: tensors arrive as addresses, shapes and
//! strides (`kvring/tensors.py` turns them into layouts).

mod client;
mod errors;
mod handles;
mod layout;
#[cfg(feature = "cuda")]
mod stream;

use pyo3::prelude::*;
use std::ffi::OsString;

/// The 64-bit id of a model name (nonzero), the same in every process.
#[pyfunction]
fn model_id(name: &str) -> u64 {
    kvring::kv::model_id(name)
}

/// The 64-bit id of a tenant salt; None is 0.
#[pyfunction]
#[pyo3(signature = (salt = None))]
fn salt_id(salt: Option<&str>) -> u64 {
    kvring::kv::salt_id(salt)
}

/// The chain hash (16 bytes) of each full chunk of `tokens`.
#[pyfunction]
fn chunk_hashes<'py>(
    py: Python<'py>,
    tokens: Vec<u32>,
    chunk_tokens: u32,
) -> PyResult<Vec<Bound<'py, pyo3::types::PyBytes>>> {
    if chunk_tokens == 0 {
        return Err(errors::invalid(py, "chunk_tokens must be positive"));
    }
    let hs = py.detach(|| kvring::kv::chunk_hashes(&tokens, chunk_tokens));
    Ok(hs
        .iter()
        .map(|h| pyo3::types::PyBytes::new(py, h))
        .collect())
}

/// How a child process runs this command line again: this interpreter
/// with `-m kvring`.
fn this_command(py: Python<'_>) -> PyResult<Vec<OsString>> {
    let exe: OsString = py
        .import("sys")?
        .getattr("executable")?
        .extract::<std::path::PathBuf>()?
        .into();
    Ok(vec![exe, "-m".into(), "kvring".into()])
}

/// Runs the `kvring` command line (argv[0] is the program name) without
/// the GIL; returns its exit status.
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<OsString>) -> PyResult<u8> {
    let this = this_command(py)?;
    let code = py.detach(|| kvring_cli::kvring_cmd::main(argv, this));
    Ok(exit_status(code))
}

/// Runs the `kvring-inspect` command line; returns its exit status.
#[pyfunction]
fn inspect_main(py: Python<'_>, argv: Vec<OsString>) -> u8 {
    exit_status(py.detach(|| kvring_cli::inspect_cmd::main(argv)))
}

fn exit_status(code: std::process::ExitCode) -> u8 {
    if code == std::process::ExitCode::SUCCESS {
        0
    } else if code == std::process::ExitCode::from(2) {
        2
    } else {
        1
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("DEFAULT_CHUNK_TOKENS", kvring::kv::DEFAULT_CHUNK_TOKENS)?;
    m.add(
        "DEFAULT_JOB_TIMEOUT",
        kvring::client::DEFAULT_JOB_TIMEOUT.as_secs_f64(),
    )?;
    m.add(
        "LAYOUT_PRESETS",
        kvring::kv::LayoutPreset::ALL
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>(),
    )?;
    errors::add(m)?;
    m.add_function(wrap_pyfunction!(model_id, m)?)?;
    m.add_function(wrap_pyfunction!(salt_id, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(inspect_main, m)?)?;
    m.add_class::<layout::PyLayout>()?;
    m.add_class::<client::PyClient>()?;
    m.add_class::<handles::PyJob>()?;
    m.add_class::<handles::PyJobStatus>()?;
    m.add_class::<handles::PyLease>()?;
    m.add_class::<handles::PyPendingLookup>()?;
    m.add_class::<handles::PyRegistration>()?;
    #[cfg(feature = "cuda")]
    m.add_class::<stream::PyEngineStream>()?;
    Ok(())
}
