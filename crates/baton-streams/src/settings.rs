//! [`StreamStoreSettings`]: the settings of a [`StreamStore`](crate::StreamStore), read by the store and
//! by both backends (so below `backend.rs`).

use std::time::Duration;

use crate::limits::RunLimits;

/// Store-wide settings, one set per [`StreamStore`](crate::StreamStore). Only the run limits can
/// be overridden per stream (`default_limits` apply when a stream is created without its own).
#[derive(Clone, Debug)]
pub struct StreamStoreSettings {
    /// Run limits applied when [`CreateOptions::limits`](crate::CreateOptions::limits) is `None`.
    pub default_limits: RunLimits,
    /// Largest read chunk in bytes (at least one record is always returned). Default 1 MiB.
    pub max_read_bytes: usize,
    /// Records kept in memory per tailed stream for live readers (Redis). Default 4,096.
    pub live_window: usize,
    /// Longest `XREAD BLOCK` slice (Redis); deletion, expiry and silence are noticed at least this
    /// often by a tail loop. Default 500 ms.
    pub live_slice: Duration,
    /// How often the silence sweeper looks for silent streams (ended as `producer_lost` even when
    /// nobody reads them, within `silence_timeout` + this). Default 1 s. The in-memory backend
    /// sweeps at least every 200 ms.
    pub sweep_interval: Duration,
}

impl Default for StreamStoreSettings {
    fn default() -> Self {
        Self {
            default_limits: RunLimits::default(),
            max_read_bytes: 1 << 20,
            live_window: 4096,
            live_slice: Duration::from_millis(500),
            sweep_interval: Duration::from_secs(1),
        }
    }
}
