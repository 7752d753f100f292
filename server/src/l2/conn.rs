//! The tier's connections: a pool of `L2Config::connections` links, each a
//! multiplexed connection to a standalone server (redis-rs's
//! `ConnectionManager`, which reconnects by itself) or a cluster connection
//! (one per node, routing each key to its slot's node). Commands take the
//! links in turn, so replies are read and parsed on several of the
//! runtime's tasks at once; every command has a deadline of its own on top
//! of the client's response timeout.
//!
//! Small commands (`STRLEN`, `EXISTS`, `PING`) go on a link of their own:
//! replies on a connection come in order, so on a link carrying values
//! one would wait behind every value ahead of it (a 32 MiB GET takes
//! milliseconds to arrive), and each read's length check would cost a
//! value's transfer time.

use super::L2Config;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::RedisResult;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The pool (cloned per operation: the clones share the links).
#[derive(Clone)]
pub(super) struct Conn {
    /// For values (GET, SET), taken in turn.
    links: Arc<[Link]>,
    next: Arc<AtomicUsize>,
    /// For small commands, never behind a value.
    control: Link,
}

#[derive(Clone)]
enum Link {
    One(ConnectionManager),
    Cluster(ClusterConnection),
}

/// What [`Conn::get_sized`] found at a key.
pub(super) enum Sized {
    /// No value (or an empty string).
    Missing,
    /// A value of this many bytes, not the size asked for: not read.
    Other(u64),
    /// The value, read (its length as asked when it was measured; a writer
    /// may have replaced it since, so its size is checked again).
    Value(Vec<u8>),
}

/// A command that did not answer in time (on top of the client's own
/// timeout: no wait of the tier is unbounded).
fn late(what: &str, d: Duration) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Io,
        "no answer in time",
        format!("{what}: more than {d:?}"),
    ))
}

impl Conn {
    /// Makes the pool's links (a cluster's: each reads the slots from the
    /// seeds).
    pub async fn connect(cfg: &L2Config) -> RedisResult<Conn> {
        let mut links = Vec::new();
        for _ in 0..cfg.connections.max(1) {
            links.push(Link::connect(cfg).await?);
        }
        Ok(Conn {
            links: links.into(),
            next: Arc::new(AtomicUsize::new(0)),
            control: Link::connect(cfg).await?,
        })
    }

    /// The next link in turn.
    fn link(&self) -> Link {
        // Relaxed: spreads commands over the links; no access pairs.
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.links[i % self.links.len()].clone()
    }

    /// `cmd` on the next value link.
    async fn run<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        deadline: Duration,
    ) -> RedisResult<T> {
        Self::run_on(self.link(), cmd, deadline).await
    }

    /// `cmd` (a small one) on the control link.
    async fn control<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        deadline: Duration,
    ) -> RedisResult<T> {
        Self::run_on(self.control.clone(), cmd, deadline).await
    }

    async fn run_on<T: redis::FromRedisValue>(
        mut link: Link,
        cmd: &redis::Cmd,
        deadline: Duration,
    ) -> RedisResult<T> {
        let q = async {
            match &mut link {
                Link::One(c) => cmd.query_async(c).await,
                Link::Cluster(c) => cmd.query_async(c).await,
            }
        };
        tokio::time::timeout(deadline, q)
            .await
            .map_err(|_| late("command", deadline))?
    }

    /// The string at `key` if it has `len` bytes: its length first
    /// (`STRLEN`), and the value (`GET`) only when that is `len`, so a
    /// value of another size is never read. (`GETRANGE key 0 len` would
    /// bound the read in one command, but the store copies a range into
    /// its reply, where it sends a whole value from the object itself: on
    /// 16 cores it cost Valkey 3.5 times the CPU of a GET and cut loads to
    /// 0.3x.)
    pub async fn get_sized(&self, key: &str, len: u64, deadline: Duration) -> RedisResult<Sized> {
        let at = tokio::time::Instant::now();
        let n: u64 = self
            .control(redis::cmd("STRLEN").arg(key), deadline)
            .await?;
        if n == 0 {
            return Ok(Sized::Missing);
        }
        if n != len {
            return Ok(Sized::Other(n));
        }
        let left = deadline.saturating_sub(at.elapsed());
        let v: Option<Vec<u8>> = self.run(redis::cmd("GET").arg(key), left).await?;
        Ok(v.map_or(Sized::Missing, Sized::Value))
    }

    pub async fn exists(&self, key: &str, deadline: Duration) -> RedisResult<bool> {
        let n: u64 = self
            .control(redis::cmd("EXISTS").arg(key), deadline)
            .await?;
        Ok(n > 0)
    }

    pub async fn set(
        &self,
        key: &str,
        value: impl redis::ToRedisArgs,
        ttl: Option<Duration>,
        deadline: Duration,
    ) -> RedisResult<()> {
        let mut c = redis::cmd("SET");
        c.arg(key).arg(value);
        if let Some(t) = ttl {
            c.arg("PX").arg(t.as_millis().max(1) as u64);
        }
        self.run(&c, deadline).await
    }

    /// A PING on every link (each reconnects, if it must, on its way):
    /// whether the whole pool answers.
    pub async fn ping(&self, deadline: Duration) -> RedisResult<()> {
        let at = tokio::time::Instant::now();
        for link in self.links.iter().chain([&self.control]) {
            let left = deadline.saturating_sub(at.elapsed());
            let _: String = Self::run_on(link.clone(), &redis::cmd("PING"), left).await?;
        }
        Ok(())
    }
}

impl Link {
    /// Connects one link (a cluster's: reads its slots from the seeds).
    async fn connect(cfg: &L2Config) -> RedisResult<Link> {
        let deadline = cfg.connect_timeout * 2 + cfg.response_timeout;
        let attempt = async {
            if cfg.cluster {
                let c = redis::cluster::ClusterClientBuilder::new(cfg.urls.clone())
                    .connection_timeout(cfg.connect_timeout)
                    .response_timeout(cfg.response_timeout)
                    .retries(1)
                    .build()?;
                Ok(Link::Cluster(c.get_async_connection().await?))
            } else {
                let client = redis::Client::open(cfg.urls[0].as_str())?;
                let mc = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(cfg.connect_timeout))
                    .set_response_timeout(Some(cfg.response_timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                Ok(Link::One(
                    ConnectionManager::new_with_config(client, mc).await?,
                ))
            }
        };
        tokio::time::timeout(deadline, attempt)
            .await
            .map_err(|_| late("connect", deadline))?
    }
}
