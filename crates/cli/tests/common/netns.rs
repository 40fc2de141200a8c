//! Test hosts in network namespaces: `n` "machines" (10.77.0.1…n) on a bridge that lives in a
//! namespace of its own, no loopback between them. Needs root (CI and the development machines
//! run as root); where namespaces cannot be made, `Net::setup` says why and returns `None`.

use std::process::Command;

/// Namespaces `h1..hn` joined by a bridge in one more namespace; all removed on drop.
pub struct Net {
    pub hosts: Vec<String>,
    /// Each host's end of its veth pair (inside the host's namespace).
    links: Vec<String>,
    bridge: String,
}

pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

impl Net {
    /// `n` hosts; `tag` keeps the names of concurrently running tests apart.
    pub fn new(tag: &str, n: usize) -> Result<Net, String> {
        let id = format!("{}{tag}", std::process::id() % 100_000);
        let mut net = Net {
            hosts: Vec::new(),
            links: Vec::new(),
            bridge: format!("ms{id}br"),
        };
        let br = net.bridge.clone();
        ip(&["netns", "add", &br])?;
        ip(&["-n", &br, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &br, "link", "set", "br0", "up"])?;
        for i in 0..n {
            let h = format!("ms{id}h{}", i + 1);
            let (v, p) = (format!("v{id}{i}"), format!("p{id}{i}"));
            ip(&["netns", "add", &h])?;
            net.hosts.push(h.clone());
            ip(&["link", "add", &v, "type", "veth", "peer", "name", &p])?;
            ip(&["link", "set", &v, "netns", &h])?;
            ip(&["link", "set", &p, "netns", &br])?;
            ip(&["-n", &br, "link", "set", &p, "master", "br0", "up"])?;
            ip(&[
                "-n",
                &h,
                "addr",
                "add",
                &format!("{}/24", Net::addr(i)),
                "dev",
                &v,
            ])?;
            ip(&["-n", &h, "link", "set", &v, "up"])?;
            ip(&["-n", &h, "link", "set", "lo", "up"])?;
            net.links.push(v);
        }
        Ok(net)
    }

    /// `Net::new`, or `None` (with the reason on stderr) where namespaces are not available.
    pub fn setup(tag: &str, n: usize) -> Option<Net> {
        match Net::new(tag, n) {
            Ok(n) => Some(n),
            Err(e) => {
                eprintln!("network namespaces are not available here ({e}); nothing tested");
                None
            }
        }
    }

    /// Host `i`'s address (0-based).
    pub fn addr(i: usize) -> String {
        format!("10.77.0.{}", i + 1)
    }

    /// Takes host `i`'s only link down (`up: false`) or back up: a partition of that host.
    pub fn set_link(&self, i: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.hosts[i], "link", "set", &self.links[i], state])
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Moves the calling thread into host `i`'s namespace (sockets it opens afterwards live
    /// there), so a test thread can be a client on that host. Network namespaces are Linux's;
    /// elsewhere (the macOS type-check of `scripts/cross`) this does not exist.
    #[cfg(target_os = "linux")]
    pub fn enter(&self, i: usize) {
        let path = format!("/var/run/netns/{}", self.hosts[i]);
        let f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: setns on a valid namespace descriptor only changes this thread's network
        // namespace; the descriptor stays open for the duration of the call.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&f), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for n in self.hosts.iter().chain([&self.bridge]) {
            let _ = ip(&["netns", "del", n]);
        }
    }
}
