//! The tier's connection: one multiplexed connection to a standalone server
//! (redis-rs's `ConnectionManager`, which reconnects by itself) or a cluster
//! connection (routing each key to its slot's node). Either is cloned per
//! operation; every command has a deadline of its own on top of the
//! client's response timeout.

use super::L2Config;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::RedisResult;
use std::time::Duration;

#[derive(Clone)]
pub(super) enum Conn {
    One(ConnectionManager),
    Cluster(ClusterConnection),
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
    /// Connects (the cluster: reads its slots from the seeds).
    pub async fn connect(cfg: &L2Config) -> RedisResult<Conn> {
        let deadline = cfg.connect_timeout * 2 + cfg.response_timeout;
        let attempt = async {
            if cfg.cluster {
                let c = redis::cluster::ClusterClientBuilder::new(cfg.urls.clone())
                    .connection_timeout(cfg.connect_timeout)
                    .response_timeout(cfg.response_timeout)
                    .retries(1)
                    .build()?;
                Ok(Conn::Cluster(c.get_async_connection().await?))
            } else {
                let client = redis::Client::open(cfg.urls[0].as_str())?;
                let mc = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(cfg.connect_timeout))
                    .set_response_timeout(Some(cfg.response_timeout))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                Ok(Conn::One(ConnectionManager::new_with_config(client, mc).await?))
            }
        };
        tokio::time::timeout(deadline, attempt)
            .await
            .map_err(|_| late("connect", deadline))?
    }

    async fn run<T: redis::FromRedisValue>(&mut self, cmd: &redis::Cmd, deadline: Duration) -> RedisResult<T> {
        let q = async {
            match self {
                Conn::One(c) => cmd.query_async(c).await,
                Conn::Cluster(c) => cmd.query_async(c).await,
            }
        };
        tokio::time::timeout(deadline, q)
            .await
            .map_err(|_| late("command", deadline))?
    }

    pub async fn get(&mut self, key: &str, deadline: Duration) -> RedisResult<Option<Vec<u8>>> {
        self.run(redis::cmd("GET").arg(key), deadline).await
    }

    pub async fn set(
        &mut self,
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

    pub async fn ping(&mut self, deadline: Duration) -> RedisResult<()> {
        let _: String = self.run(&redis::cmd("PING"), deadline).await?;
        Ok(())
    }
}
