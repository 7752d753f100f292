//! Everything a server is started with, grouped by the part of the server
//! that uses it (the segment and its threads at the top, then the cache
//! service, the copy lanes, the HTTP endpoint and the tier below the pool),
//! and checked in one place ([`ServerConfig::validate`]).
//!
//! With the feature `cli`, the cache's and the copy lanes' settings are
//! also `kvring serve`'s flags (`clap::Args`, flattened into its command
//! line): each setting, its flag, its environment variable and its help are
//! declared once, here. [`flags`] holds the parsers of their values.

use crate::cache::DEFAULT_MAX_PINS;
use crate::http::HttpConfig;
use crate::l2::L2Config;
use kvring::shm::Geometry;
use kvring::wait::WaitPolicy;
use std::path::PathBuf;
use std::time::Duration;

/// Everything a server is started with.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Server name (one server per name and user on a host).
    pub name: String,
    /// Runtime directory for the socket and the lock file.
    pub runtime_dir: PathBuf,
    /// Segment geometry.
    pub geometry: Geometry,
    /// How the ring loop waits when idle (spin, yield, then park).
    pub ring_wait: WaitPolicy,
    /// Heartbeat and housekeeping period.
    pub tick: Duration,
    /// Start even when the segment exceeds the free space of the
    /// shared-memory mount or the pool and segment exceed available memory
    /// (refused otherwise, naming the limit).
    pub allow_oversize: bool,
    /// The cache service: chunks, the pool, leases, eviction, pins.
    pub cache: CacheConfig,
    /// The copy lanes: backend, workers, devices.
    pub copy: CopyConfig,
    /// The HTTP endpoint (metrics, health, status); `None`: none.
    pub http: Option<HttpConfig>,
    /// A tier below the pool on Valkey/Redis, if any.
    pub tier: Option<L2Config>,
    /// A tier below the pool on a local disk, if any.
    pub disk: Option<DiskConfig>,
    /// The node's KV event stream, if published.
    pub events: Option<crate::events::EventsConfig>,
}

/// The local disk tier's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct DiskConfig {
    /// The directory the tier owns (made if missing; what it holds is
    /// served after a restart).
    pub dir: PathBuf,
    /// Bytes of segment files at most.
    pub bytes: u64,
    /// Bytes of each segment file (the budget is kept by dropping the
    /// oldest one whole).
    pub segment_bytes: u64,
    /// When objects go to disk.
    pub mode: crate::tier::WriteMode,
}

impl DiskConfig {
    /// `bytes` in `dir`, written back, in segments of 256 MiB (fewer,
    /// smaller ones for a budget under 1 GiB).
    pub fn new(dir: PathBuf, bytes: u64) -> DiskConfig {
        DiskConfig {
            dir,
            bytes,
            segment_bytes: (bytes / 4).clamp(1 << 20, 256 << 20),
            mode: crate::tier::WriteMode::Back,
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.segment_bytes < 1 << 20 || self.bytes / self.segment_bytes < 2 {
            return Err(ConfigError::Disk(format!(
                "{} bytes in segments of {}: need at least two segments of at least 1 MiB",
                self.bytes, self.segment_bytes
            )));
        }
        Ok(())
    }
}

impl ServerConfig {
    /// Defaults for server `name` in the default runtime directory.
    pub fn new(name: &str) -> ServerConfig {
        ServerConfig {
            name: name.to_string(),
            runtime_dir: kvring::rundir::runtime_dir(),
            geometry: Geometry::default(),
            ring_wait: WaitPolicy {
                spin: Duration::from_micros(50),
                yield_for: Duration::from_micros(500),
                park_slice: Duration::from_millis(100),
            },
            tick: Duration::from_millis(50),
            allow_oversize: false,
            cache: CacheConfig::default(),
            copy: CopyConfig::default(),
            http: Some(HttpConfig::default_endpoint()),
            tier: None,
            disk: None,
            events: None,
        }
    }

    /// Checks every setting; the error names the one that is wrong.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.geometry
            .validate()
            .map_err(|e| ConfigError::Geometry(e.to_string()))?;
        self.cache.validate()?;
        self.copy.validate()?;
        if let Some(t) = &self.tier {
            t.validate()?;
        }
        if let Some(d) = &self.disk {
            d.validate()?;
        }
        if let Some(e) = &self.events {
            e.validate().map_err(ConfigError::Events)?;
            // Engines describe chunks in requests of one ring frame.
            let frame = self.geometry.max_frame_bytes;
            if self.cache.max_request_bytes < frame {
                return Err(ConfigError::Events(format!(
                    "--kv-events needs --max-request-bytes of at least the frame size ({frame}): engines describe chunks in requests of one frame"
                )));
            }
        }
        Ok(())
    }
}

/// The cache service's settings.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct CacheConfig {
    /// Tokens per chunk object. Every engine's block size must divide it.
    #[cfg_attr(feature = "cli", arg(long, env = "KVRING_CHUNK_TOKENS",
        default_value_t = kvring::kv::DEFAULT_CHUNK_TOKENS))]
    pub chunk_tokens: u32,
    /// Size of the host pool that holds chunk objects, allocated at start
    /// (bytes; K, M, G, KiB, MiB, GiB suffixes accepted).
    #[cfg_attr(feature = "cli", arg(long, env = "KVRING_POOL_BYTES", default_value = "2GiB",
        value_parser = kvring::units::parse_bytes))]
    pub pool_bytes: u64,
    /// Touch every pool page at start, so the first stores do not pay page
    /// faults (start-up takes longer).
    #[cfg_attr(feature = "cli", arg(long, env = "KVRING_PREFAULT"))]
    pub prefault: bool,
    /// Largest request, all frames together (a LOOKUP of N chunks takes
    /// 24 + 16 N bytes).
    #[cfg_attr(feature = "cli", arg(long, default_value = "4MiB", value_parser = flags::bytes_u32))]
    pub max_request_bytes: u32,
    /// Seconds a lookup's read leases last unless retrieved or freed.
    #[cfg_attr(feature = "cli", arg(long = "lease-ttl-s", value_name = "SECONDS", env = "KVRING_LEASE_TTL_S",
        default_value = "300", value_parser = flags::whole_seconds))]
    pub lease_ttl: Duration,
    /// Seconds a lookup waits for a chunk being written (another request's
    /// store of the same prefix, under way) before it answers without it;
    /// 0: never waits. Fractions allowed.
    #[cfg_attr(feature = "cli", arg(long = "inflight-wait-s", value_name = "SECONDS", default_value = "1",
        value_parser = flags::seconds_or_zero))]
    pub inflight_wait: Duration,
    /// Pool usage (percent) at which LRU eviction starts ...
    #[cfg_attr(feature = "cli", arg(long = "evict-at-percent", value_name = "PERCENT", default_value = "90",
        value_parser = flags::percent))]
    pub high_watermark: f64,
    /// ... and down to which it evicts.
    #[cfg_attr(feature = "cli", arg(long = "evict-to-percent", value_name = "PERCENT", default_value = "80",
        value_parser = flags::percent))]
    pub low_watermark: f64,
    /// At most this many pins held (POST /pin past it is refused, 409).
    #[cfg_attr(feature = "cli", arg(long, default_value_t = DEFAULT_MAX_PINS))]
    pub max_pins: u64,
    /// At most this many bytes of objects kept by pins (a pin call that
    /// would pin more is refused, 409; an object stored under a pin past it
    /// is cached unpinned). Default: half the pool.
    #[cfg_attr(feature = "cli", arg(long, value_parser = kvring::units::parse_bytes))]
    pub max_pinned_bytes: Option<u64>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            chunk_tokens: kvring::kv::DEFAULT_CHUNK_TOKENS,
            pool_bytes: 2 << 30,
            prefault: false,
            max_request_bytes: 4 << 20,
            lease_ttl: Duration::from_secs(300),
            inflight_wait: Duration::from_secs(1),
            high_watermark: 0.9,
            low_watermark: 0.8,
            max_pins: DEFAULT_MAX_PINS,
            max_pinned_bytes: None,
        }
    }
}

impl CacheConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.chunk_tokens == 0 || self.chunk_tokens > 1 << 20 {
            return Err(ConfigError::ChunkTokens(self.chunk_tokens));
        }
        if self.pool_bytes < 1 << 20 {
            return Err(ConfigError::PoolBytes(self.pool_bytes));
        }
        if self.max_request_bytes < 4096 || self.max_request_bytes > 1 << 30 {
            return Err(ConfigError::MaxRequestBytes(self.max_request_bytes));
        }
        if self.max_pins > MAX_PINS {
            return Err(ConfigError::MaxPins(self.max_pins));
        }
        if self.lease_ttl.is_zero() {
            return Err(ConfigError::LeaseTtl);
        }
        if !(0.0 < self.low_watermark
            && self.low_watermark <= self.high_watermark
            && self.high_watermark <= 1.0)
        {
            return Err(ConfigError::Watermarks {
                low: self.low_watermark,
                high: self.high_watermark,
            });
        }
        Ok(())
    }
}

/// The copy lanes' settings.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct CopyConfig {
    /// Copy backend: `cuda` (engines' KV caches in GPU memory; fails at
    /// start, saying why, without a usable GPU), `host` (host memory only),
    /// or `auto` (CUDA when the driver and a GPU are there).
    #[cfg_attr(
        feature = "cli",
        arg(long, env = "KVRING_BACKEND", default_value = "auto")
    )]
    pub backend: BackendChoice,
    /// Threads that copy chunks between engines' caches and the pool, per
    /// copy lane: one lane for engines with no device, one per GPU (or
    /// simulated device). Default: half the CPUs, 1 to 8, on the host
    /// backend; 4 on CUDA (four workers, each with its chunks in flight,
    /// keep the copy engines fed; more only contend for them).
    #[cfg_attr(feature = "cli", arg(long, env = "KVRING_COPY_THREADS"))]
    pub copy_threads: Option<u32>,
    /// CUDA transfer path: 0 (default) gathers into a device staging buffer
    /// and moves it with the copy engine, leaving the engine's SMs alone;
    /// N > 0 uses zero-copy kernels between GPU memory and the pinned pool
    /// with at most N CTAs.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub cuda_zero_copy_ctas: u32,
    /// CUDA: chunks each copy worker keeps in flight per device (one
    /// staging slot each), 1 to 8; default: the CUDA backend's.
    #[cfg_attr(feature = "cli", arg(long, env = "KVRING_CUDA_DEPTH",
        value_parser = clap::value_parser!(u32).range(1..=8)))]
    pub cuda_depth: Option<u32>,
    /// Host backend: give this many simulated devices their own copy lanes
    /// (workers), as a CUDA server does for each GPU; engines name device i
    /// by `simulated_device_uuid(i)` when they register. For testing
    /// multi-device scheduling without GPUs.
    #[cfg_attr(feature = "cli", arg(long, default_value_t = 0))]
    pub simulated_devices: u32,
    /// Seconds a STORE or RETRIEVE ordered after an engine's event waits
    /// for it (polled from the host: no stream of the server ever waits on
    /// the device for an engine) before it fails `engine_event_timeout`
    /// (chunks not copied by then never are). Fractions allowed.
    #[cfg_attr(feature = "cli", arg(long = "engine-event-timeout", value_name = "SECONDS", default_value = "60",
        value_parser = flags::seconds))]
    pub engine_event_timeout: Duration,
}

impl Default for CopyConfig {
    fn default() -> Self {
        CopyConfig {
            backend: BackendChoice::Auto,
            copy_threads: None,
            cuda_zero_copy_ctas: 0,
            cuda_depth: None,
            simulated_devices: 0,
            engine_event_timeout: Duration::from_secs(60),
        }
    }
}

impl CopyConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.simulated_devices > MAX_SIMULATED_DEVICES {
            return Err(ConfigError::SimulatedDevices(self.simulated_devices));
        }
        if let Some(d) = self.cuda_depth.filter(|&d| d == 0 || d > 8) {
            return Err(ConfigError::CudaDepth(d));
        }
        if let Some(n) = self
            .copy_threads
            .filter(|&n| n == 0 || n > kvring::job_words::WORD_WORKERS)
        {
            return Err(ConfigError::CopyThreads(n));
        }
        Ok(())
    }
}

/// Which copy backend a server uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when the driver and a device are there, else host (saying why).
    Auto,
    /// Host memory only (memcpy by the copy workers).
    Host,
    /// CUDA; start-up fails, saying why, when it is not usable.
    Cuda,
}

/// A backend name that is not `auto`, `host` or `cuda`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend {0:?} (auto, host or cuda)")]
pub struct UnknownBackend(pub String);

impl std::str::FromStr for BackendChoice {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "host" => Ok(BackendChoice::Host),
            "cuda" => Ok(BackendChoice::Cuda),
            o => Err(UnknownBackend(o.to_string())),
        }
    }
}

/// Most simulated devices a host server takes.
pub const MAX_SIMULATED_DEVICES: u32 = 64;

/// Most pins a server may be told to hold (about 800 MiB of its memory).
pub const MAX_PINS: u64 = 1 << 24;

/// A setting out of its bounds.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{0}")]
    Geometry(String),
    #[error("{0} simulated devices: at most {MAX_SIMULATED_DEVICES}")]
    SimulatedDevices(u32),
    #[error("chunk size {0} tokens: must be 1..=1048576")]
    ChunkTokens(u32),
    #[error("pool of {0} bytes: must be at least 1 MiB")]
    PoolBytes(u64),
    #[error("CUDA depth {0}: must be 1..=8")]
    CudaDepth(u32),
    #[error("{0} copy threads: must be 1..=32 (per copy lane)")]
    CopyThreads(u32),
    #[error("max request of {0} bytes: must be 4096..=1073741824")]
    MaxRequestBytes(u32),
    #[error("lease TTL must be positive")]
    LeaseTtl,
    #[error("watermarks {low} (low) and {high} (high): need 0 < low <= high <= 1")]
    Watermarks { low: f64, high: f64 },
    #[error("{0} pins: at most {MAX_PINS}")]
    MaxPins(u64),
    #[error("second tier: {0}")]
    Tier(String),
    #[error("disk tier: {0}")]
    Disk(String),
    #[error("KV events: {0}")]
    Events(String),
}

/// The parsers of settings given as text (flags, environment variables).
pub mod flags {
    use std::time::Duration;

    /// A positive, finite number of seconds (fractions allowed).
    pub fn seconds(s: &str) -> Result<Duration, String> {
        match s.parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 && v <= 1e9 => Ok(Duration::from_secs_f64(v)),
            _ => Err(format!(
                "{s:?} is not a number of seconds (positive, at most 1e9)"
            )),
        }
    }

    /// As [`seconds`], or 0.
    pub fn seconds_or_zero(s: &str) -> Result<Duration, String> {
        match s.parse::<f64>() {
            Ok(0.0) => Ok(Duration::ZERO),
            _ => seconds(s).map_err(|e| format!("{e}, or 0")),
        }
    }

    /// A whole number of seconds.
    pub fn whole_seconds(s: &str) -> Result<Duration, String> {
        s.parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|_| format!("{s:?} is not a whole number of seconds"))
    }

    /// A whole percentage, 0 to 100, as a fraction.
    pub fn percent(s: &str) -> Result<f64, String> {
        match s.parse::<u32>() {
            Ok(p) if p <= 100 => Ok(f64::from(p) / 100.0),
            _ => Err(format!("{s:?} is not a percentage (0 to 100)")),
        }
    }

    /// A byte count (as `kvring::units::parse_bytes`) below 4 GiB.
    pub fn bytes_u32(s: &str) -> Result<u32, String> {
        let n = kvring::units::parse_bytes(s)?;
        u32::try_from(n).map_err(|_| format!("{n} bytes is too large (below 4 GiB)"))
    }
}
