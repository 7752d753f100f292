//! kvring's errors as Python exceptions: one class per kind of failure a
//! caller handles differently, all under `KvringError`.

use pyo3::exceptions::{PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyType;

pyo3::create_exception!(
    kvring,
    KvringError,
    PyException,
    "Base of every kvring error."
);
pyo3::create_exception!(
    kvring,
    ServerGone,
    KvringError,
    "The server exited or closed the connection."
);
pyo3::create_exception!(
    kvring,
    NoServer,
    KvringError,
    "No server of that name is running."
);
pyo3::create_exception!(
    kvring,
    RegistrationRefused,
    KvringError,
    "The server refused to register a KV cache; the message says why."
);
pyo3::create_exception!(
    kvring,
    StatusError,
    KvringError,
    "The server answered with an error status; `.status` is its stable name."
);
pyo3::create_exception!(
    kvring,
    ClientClosed,
    KvringError,
    "A handle was used after its client closed."
);
pyo3::create_exception!(
    kvring,
    CopiesInFlight,
    KvringError,
    "A given-up job still had a copy under way at the quiesce bound."
);
pyo3::create_exception!(
    kvring,
    ProtocolError,
    KvringError,
    "The peer broke the protocol, or this library and the server differ."
);

/// `ServerTimeout(KvringError, TimeoutError)` and
/// `InvalidArgument(KvringError, ValueError)`: kvring errors that are also
/// the standard exceptions callers already catch. Made once per module.
pub struct Dual {
    pub timeout: Py<PyType>,
    pub invalid: Py<PyType>,
}

static DUAL: pyo3::sync::PyOnceLock<Dual> = pyo3::sync::PyOnceLock::new();

fn subclass(
    py: Python<'_>,
    name: &str,
    doc: &str,
    std: &Bound<'_, PyType>,
) -> PyResult<Py<PyType>> {
    let bases = (py.get_type::<KvringError>(), std.clone());
    let ns = pyo3::types::PyDict::new(py);
    ns.set_item("__doc__", doc)?;
    ns.set_item("__module__", "kvring")?;
    let t = py
        .get_type::<PyType>()
        .call1((name, bases, ns))?
        .cast_into::<PyType>()?;
    Ok(t.unbind())
}

pub fn dual(py: Python<'_>) -> PyResult<&Dual> {
    DUAL.get_or_try_init(py, || {
        Ok(Dual {
            timeout: subclass(
                py,
                "ServerTimeout",
                "A wait or call reached its deadline.",
                &py.get_type::<PyTimeoutError>(),
            )?,
            invalid: subclass(
                py,
                "InvalidArgument",
                "Refused by the library before anything was sent.",
                &py.get_type::<PyValueError>(),
            )?,
        })
    })
}

/// The Python exception for `e`.
pub fn to_py(e: kvring::Error) -> PyErr {
    use kvring::Error as E;
    let text = e.to_string();
    match e {
        E::ServerGone => ServerGone::new_err(text),
        E::NoServer { .. } => NoServer::new_err(text),
        E::ClientClosed => ClientClosed::new_err(text),
        E::CopiesInFlight(_) => CopiesInFlight::new_err(text),
        E::Registration { .. } => RegistrationRefused::new_err(text),
        E::Protocol(_) | E::UnknownStatus(_) | E::Ring(_) | E::LayoutVersion { .. } => {
            ProtocolError::new_err(text)
        }
        E::Status(s) => Python::attach(|py| {
            let err = StatusError::new_err(text);
            let _ = err
                .value(py)
                .setattr("status", kvring::wire::WireEnum::wire_name(s));
            err
        }),
        E::Timeout(_) => Python::attach(|py| match dual(py) {
            Ok(d) => PyErr::from_type(d.timeout.bind(py).clone(), text),
            Err(e) => e,
        }),
        E::InvalidArgument(_) | E::InvalidName(_) | E::Config(_) => {
            Python::attach(|py| invalid(py, text))
        }
        _ => KvringError::new_err(text),
    }
}

/// An `InvalidArgument` saying `text`.
pub fn invalid(py: Python<'_>, text: impl Into<String>) -> PyErr {
    match dual(py) {
        Ok(d) => PyErr::from_type(d.invalid.bind(py).clone(), text.into()),
        Err(e) => e,
    }
}

/// Adds the exception classes to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvringError", py.get_type::<KvringError>())?;
    m.add("ServerGone", py.get_type::<ServerGone>())?;
    m.add("NoServer", py.get_type::<NoServer>())?;
    m.add("RegistrationRefused", py.get_type::<RegistrationRefused>())?;
    m.add("StatusError", py.get_type::<StatusError>())?;
    m.add("ClientClosed", py.get_type::<ClientClosed>())?;
    m.add("CopiesInFlight", py.get_type::<CopiesInFlight>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    let d = dual(py)?;
    m.add("ServerTimeout", d.timeout.bind(py))?;
    m.add("InvalidArgument", d.invalid.bind(py))?;
    Ok(())
}
