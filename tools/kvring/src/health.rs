//! `kvring health`: asks a server's HTTP endpoint whether it is healthy
//! (`GET /healthz`) or ready (`GET /readyz`), prints the answer and exits 0
//! on 200, 1 otherwise: a container's health check or an exec probe, in an
//! image that has no HTTP client.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::Duration;

/// Asks `addr` for `/readyz` (`ready`) or `/healthz` within `timeout`.
pub fn run(addr: &str, ready: bool, timeout: Duration) -> ExitCode {
    let path = if ready { "/readyz" } else { "/healthz" };
    match ask(addr, path, timeout) {
        Ok((200, body)) => {
            println!("{body}");
            ExitCode::SUCCESS
        }
        Ok((code, body)) => {
            println!("{body}");
            eprintln!("kvring health: {path} answered {code}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("kvring health: GET http://{addr}{path}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One request; the status code and the body.
fn ask(addr: &str, path: &str, timeout: Duration) -> std::io::Result<(u16, String)> {
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let sa: SocketAddr = addr
        .parse()
        .map_err(|e| bad(format!("{addr:?} is not ADDR:PORT ({e})")))?;
    let mut s = TcpStream::connect_timeout(&sa, timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )?;
    let mut out = Vec::new();
    // The endpoint answers in a few kilobytes; more is not a kvring server.
    s.take(1 << 20).read_to_end(&mut out)?;
    let text = String::from_utf8_lossy(&out);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad("no HTTP answer".into()))?;
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad(format!("no status in {head:?}")))?;
    Ok((code, body.trim_end().to_string()))
}
