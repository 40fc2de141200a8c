//! How much memory this process may still use. On Linux: the smaller of the machine's
//! `MemAvailable` and what its memory cgroup (v1 or v2) allows beyond the memory it charges that
//! is not page cache; on macOS: the kernel's available share of physical memory (`sysctl`).
//! Page cache counts as free here because the kernel reclaims it; the caller subtracts what must
//! stay resident (the mapped non-expert weights, the KV cache).
//! Also the size of the expert cache a user asks for ([`CacheSize`], [`parse_size`]).

/// How big the expert cache is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CacheSize {
    /// What fits in available memory after the resident weights, `reserve_bytes` and a margin.
    #[default]
    Auto,
    Bytes(u64),
    /// A number of expert slots.
    Count(usize),
}

/// Bytes this process could still use, if known.
pub fn available_memory() -> Option<u64> {
    platform::available_memory()
}

#[cfg(target_os = "linux")]
mod platform {
    use std::path::PathBuf;

    fn read(path: impl AsRef<std::path::Path>) -> Option<String> {
        std::fs::read_to_string(path).ok()
    }

    fn meminfo_available() -> Option<u64> {
        let s = read("/proc/meminfo")?;
        let kb: u64 = s
            .lines()
            .find(|l| l.starts_with("MemAvailable:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        Some(kb * 1024)
    }

    fn stat_field(stat: &str, name: &str) -> Option<u64> {
        stat.lines().find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next()? == name).then(|| it.next()?.parse().ok())?
        })
    }

    /// Free memory under this process's memory cgroup, if it has a limit.
    fn cgroup_available() -> Option<u64> {
        let cg = read("/proc/self/cgroup")?;
        // cgroup v1: "N:memory:/path".
        if let Some(path) = cg.lines().find_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
            ctrl.split(',')
                .any(|c| c == "memory")
                .then(|| path.to_string())
        }) {
            let dir = PathBuf::from("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
            let stat = read(dir.join("memory.stat"))?;
            // The tightest limit on the way to the root.
            let limit = stat_field(&stat, "hierarchical_memory_limit")
                .or_else(|| read(dir.join("memory.limit_in_bytes"))?.trim().parse().ok())?;
            if limit >= 1 << 60 {
                return None;
            }
            let usage: u64 = read(dir.join("memory.usage_in_bytes"))?
                .trim()
                .parse()
                .ok()?;
            let cache = stat_field(&stat, "total_cache")
                .or_else(|| stat_field(&stat, "cache"))
                .unwrap_or(0);
            return Some(limit.saturating_sub(usage.saturating_sub(cache)));
        }
        // cgroup v2: "0::/path".
        let path = cg.lines().find_map(|l| l.strip_prefix("0::"))?;
        for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
            let dir = PathBuf::from(root).join(path.trim_start_matches('/'));
            let Some(max) = read(dir.join("memory.max")) else {
                continue;
            };
            let limit: u64 = max.trim().parse().ok()?; // "max": no limit
            let current: u64 = read(dir.join("memory.current"))?.trim().parse().ok()?;
            let file = read(dir.join("memory.stat"))
                .and_then(|s| stat_field(&s, "file"))
                .unwrap_or(0);
            return Some(limit.saturating_sub(current.saturating_sub(file)));
        }
        None
    }

    pub fn available_memory() -> Option<u64> {
        match (meminfo_available(), cgroup_available()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// macOS has neither `/proc` nor cgroups. `kern.memorystatus_level` is the share of memory
/// (percent) the kernel's memory-pressure logic counts as available — free, inactive and
/// purgeable pages, the figure Activity Monitor's pressure graph follows — so available memory
/// is that share of `hw.memsize`.
#[cfg(target_os = "macos")]
mod platform {
    /// An integer `sysctl` by name, of the size of `T`.
    fn sysctl<T: Copy + Default>(name: &std::ffi::CStr) -> Option<T> {
        let mut value = T::default();
        let mut len = std::mem::size_of::<T>();
        // SAFETY: `name` is NUL-terminated; `value` is a live local of `len` bytes that the call
        // writes at most `len` bytes of (it reports the length it wrote, checked below); no new
        // value is set (null pointer, length 0).
        let rc = unsafe {
            libc::sysctlbyname(
                name.as_ptr(),
                (&raw mut value).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        (rc == 0 && len == std::mem::size_of::<T>()).then_some(value)
    }

    pub fn available_memory() -> Option<u64> {
        let total: u64 = sysctl(c"hw.memsize")?;
        let percent: u32 = sysctl(c"kern.memorystatus_level")?;
        Some(total / 100 * u64::from(percent.min(100)))
    }
}

/// Parses a cache size: a count of experts (`300`) or bytes with a unit (`6GiB`, `512MiB`,
/// `1.5GB`, `800M`; K/M/G/T, decimal with `B`, binary with `iB` or a bare letter).
pub fn parse_size(s: &str) -> Result<CacheSize, String> {
    let t = s.trim();
    if let Ok(n) = t.parse::<usize>() {
        return Ok(CacheSize::Count(n));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("bad size {s:?}"))?;
    let (num, unit) = t.split_at(split);
    let x: f64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let unit = unit.trim();
    let (letter, rest) = unit.split_at(1.min(unit.len()));
    let power = match letter.to_ascii_uppercase().as_str() {
        "K" => 1,
        "M" => 2,
        "G" => 3,
        "T" => 4,
        _ => return Err(format!("bad size unit in {s:?} (use K, M, G, T)")),
    };
    let base: f64 = match rest {
        "" | "i" | "iB" | "ib" => 1024.0,
        "B" | "b" => 1000.0,
        _ => return Err(format!("bad size unit in {s:?}")),
    };
    Ok(CacheSize::Bytes((x * base.powi(power)) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("300"), Ok(CacheSize::Count(300)));
        assert_eq!(parse_size("6GiB"), Ok(CacheSize::Bytes(6 << 30)));
        assert_eq!(parse_size("512M"), Ok(CacheSize::Bytes(512 << 20)));
        assert_eq!(parse_size("1.5GB"), Ok(CacheSize::Bytes(1_500_000_000)));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("GiB").is_err());
    }

    #[test]
    fn available_memory_is_plausible() {
        let a = available_memory().expect("Linux and macOS report available memory");
        assert!(a > 0);
    }
}
