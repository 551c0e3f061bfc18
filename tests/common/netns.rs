//! Several hosts on one machine: each process of a test cluster in a network namespace of its
//! own, every namespace joined to one bridge (in a "switch" namespace) by a veth pair, and the
//! test itself (the root namespace) on the bridge too, so that every internal link crosses a real
//! interface. Faults act on a host's switch-side port: a partition is that port down (the host
//! neither sends nor receives), healed by bringing it up.
//!
//! Needs root and iproute2. Names carry the test process's id, so a leftover from a killed run
//! is recognisable (`ip netns list`); everything is deleted on drop (deleting a namespace
//! deletes its end of each veth pair, and with it the pair).

use std::net::Ipv4Addr;
use std::process::Command;

/// One host: its namespace, its address, and its port on the switch.
pub struct Host {
    pub ns: String,
    pub ip: Ipv4Addr,
    port: String,
}

pub struct Net {
    switch: String,
    pub hosts: Vec<Host>,
    /// The root namespace's interface on the bridge.
    root_if: String,
    /// The root namespace's address on the bridge (what the test's clients send from).
    pub root_ip: Ipv4Addr,
}

/// Whether this process can make namespaces (root, iproute2 present).
pub fn supported() -> bool {
    let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0"));
    root && Command::new("ip").arg("-V").output().is_ok_and(|o| o.status.success())
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip runs");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

impl Net {
    /// A switch and one namespace per name, addressed 10.231.X.(1..) (X from the process id).
    pub fn new(names: &[&str]) -> Net {
        let pid = std::process::id();
        let tag = format!("cv{}", pid % 100_000);
        let subnet = (pid % 200 + 20) as u8;
        let switch = format!("{tag}-sw");
        ip(&["netns", "add", &switch]);
        let mut net = Net {
            switch: switch.clone(),
            hosts: Vec::new(),
            root_if: format!("{tag}r"),
            root_ip: Ipv4Addr::new(10, 231, subnet, 254),
        };
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &switch, "link", "set", "br0", "up"]);
        ip(&["-n", &switch, "link", "set", "lo", "up"]);
        for (i, name) in names.iter().enumerate() {
            let ns = format!("{tag}-{name}");
            let (inner, port) = (format!("{tag}{i}h"), format!("{tag}{i}s"));
            ip(&["netns", "add", &ns]);
            ip(&["link", "add", &inner, "type", "veth", "peer", "name", &port]);
            ip(&["link", "set", &inner, "netns", &ns]);
            ip(&["link", "set", &port, "netns", &switch]);
            ip(&["-n", &switch, "link", "set", &port, "master", "br0", "up"]);
            let addr = Ipv4Addr::new(10, 231, subnet, i as u8 + 1);
            ip(&["-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", &inner]);
            // One wire packet per skb: with GSO a TCP "packet" at the loss rule is up to 64 KiB
            // of segments, so a 1% rule would drop far fewer of TCP's bytes than of QUIC's
            // datagrams (QUIC runs without GSO) and the comparison would flatter TCP.
            ip(&["-n", &ns, "link", "set", &inner, "gso_max_segs", "1"]);
            ip(&["-n", &ns, "link", "set", &inner, "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            net.hosts.push(Host { ns, ip: addr, port });
        }
        let root_port = format!("{tag}rs");
        ip(&["link", "add", &net.root_if, "type", "veth", "peer", "name", &root_port]);
        ip(&["link", "set", &root_port, "netns", &switch]);
        ip(&["-n", &switch, "link", "set", &root_port, "master", "br0", "up"]);
        ip(&["addr", "add", &format!("{}/24", net.root_ip), "dev", &net.root_if]);
        ip(&["link", "set", &net.root_if, "gso_max_segs", "1"]);
        ip(&["link", "set", &net.root_if, "up"]);
        net
    }

    pub fn host(&self, name: &str) -> &Host {
        self.hosts.iter().find(|h| h.ns.ends_with(&format!("-{name}"))).expect("a host of that name")
    }

    /// Cuts `name` off the network (`true`) or heals it (`false`).
    pub fn partition(&self, name: &str, cut: bool) {
        let port = &self.host(name).port;
        ip(&["-n", &self.switch, "link", "set", port, if cut { "down" } else { "up" }]);
    }
}

impl Net {
    /// Drops `percent`% of the packets `name` sends and of those it receives (nftables in its
    /// namespace; 0 removes the rule). Every protocol: QUIC's datagrams and TCP's segments alike.
    pub fn loss(&self, name: &str, percent: u32) {
        let ns = &self.host(name).ns;
        let nft = |script: &str| {
            let out = Command::new("ip")
                .args(["netns", "exec", ns, "nft", "-f", "-"])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .and_then(|mut c| {
                    use std::io::Write;
                    c.stdin.take().unwrap().write_all(script.as_bytes())?;
                    c.wait_with_output()
                })
                .expect("nft runs");
            assert!(out.status.success(), "nft: {}", String::from_utf8_lossy(&out.stderr));
        };
        nft("table inet cleave_loss\ndelete table inet cleave_loss\n");
        if percent > 0 {
            nft(&format!(
                "table inet cleave_loss {{\n\
                   chain in {{ type filter hook input priority 0; iifname != \"lo\" numgen random mod 100 < {percent} drop; }}\n\
                   chain out {{ type filter hook output priority 0; oifname != \"lo\" numgen random mod 100 < {percent} drop; }}\n\
                 }}\n"
            ));
        }
    }
}

impl Net {
    /// Caps what `name` sends at `mbit` megabits a second (a token bucket on its interface;
    /// 0 removes the cap).
    pub fn cap(&self, name: &str, mbit: u32) {
        let h = self.host(name);
        let dev = self.inner_if(h);
        let _ = Command::new("ip").args(["netns", "exec", &h.ns, "tc", "qdisc", "del", "dev", &dev, "root"]).output();
        if mbit > 0 {
            let rate = format!("{mbit}mbit");
            let out = Command::new("ip")
                .args(["netns", "exec", &h.ns, "tc", "qdisc", "add", "dev", &dev, "root", "tbf", "rate", &rate])
                .args(["burst", "64kb", "latency", "400ms"])
                .output()
                .expect("tc runs");
            assert!(out.status.success(), "tc: {}", String::from_utf8_lossy(&out.stderr));
        }
    }

    /// The host's own end of its veth pair.
    fn inner_if(&self, h: &Host) -> String {
        h.port.trim_end_matches('s').to_string() + "h"
    }
}

/// Whether nftables (for [`Net::loss`]) is here.
pub fn have_nft() -> bool {
    Command::new("nft").arg("--version").output().is_ok_and(|o| o.status.success())
}

impl Drop for Net {
    fn drop(&mut self) {
        for h in &self.hosts {
            let _ = Command::new("ip").args(["netns", "del", &h.ns]).status();
        }
        let _ = Command::new("ip").args(["link", "del", &self.root_if]).status();
        let _ = Command::new("ip").args(["netns", "del", &self.switch]).status();
    }
}
