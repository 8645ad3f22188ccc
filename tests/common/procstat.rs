//! A child process's resources from `/proc/<pid>` (the benches' RSS and CPU figures of the
//! guard and `admission-check`, measured from outside as an operator's `top` would).

/// Resident memory now and at its peak, and CPU used so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
    pub cpu_seconds: f64,
}

impl Usage {
    pub fn mib(bytes: u64) -> f64 {
        bytes as f64 / (1024.0 * 1024.0)
    }
}

/// `pid`'s [`Usage`]; zeros once it is gone.
pub fn usage(pid: u32) -> Usage {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    Usage {
        rss_bytes: kib("VmRSS:"),
        peak_rss_bytes: kib("VmHWM:"),
        cpu_seconds: (ticks(11) + ticks(12)) / 100.0,
    }
}
