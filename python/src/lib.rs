//! `kvring._native`: the kvring client library for Python (connect,
//! register KV caches, lookup, store, retrieve as jobs and leases whose
//! state is read from shared memory). It links only the `kvring` library,
//! as an engine does; the server is the `kvring` binary the wheel carries
//! beside it (`kvring/bin/kvring`, run by `python -m kvring`).
//! Nothing here links torch: tensors arrive as addresses, shapes and
//! strides (`kvring/tensors.py` turns them into layouts).

mod client;
mod errors;
mod handles;
mod layout;
#[cfg(feature = "cuda")]
mod stream;

use pyo3::prelude::*;

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

/// In one pass over `tokens`: the chain hash (16 bytes) of each full chunk,
/// and the key of the whole blocks of `block_tokens` past the last full
/// chunk, stored as a chunk of fewer blocks (None where there is no such
/// block, or no full chunk before it).
#[pyfunction]
#[allow(clippy::type_complexity)]
fn prompt_hashes<'py>(
    py: Python<'py>,
    tokens: Vec<u32>,
    chunk_tokens: u32,
    block_tokens: u32,
) -> PyResult<(
    Vec<Bound<'py, pyo3::types::PyBytes>>,
    Option<Bound<'py, pyo3::types::PyBytes>>,
)> {
    if block_tokens == 0 || chunk_tokens == 0 || chunk_tokens % block_tokens != 0 {
        return Err(errors::invalid(
            py,
            "block_tokens must be positive and divide chunk_tokens",
        ));
    }
    let (hs, tail) = py.detach(|| kvring::kv::prompt_keys(&tokens, chunk_tokens, block_tokens));
    let bytes = |h: &[u8; 16]| pyo3::types::PyBytes::new(py, h);
    Ok((hs.iter().map(bytes).collect(), tail.as_ref().map(bytes)))
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
    m.add_function(wrap_pyfunction!(prompt_hashes, m)?)?;
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
