//! A sandbox's control group: its memory (the OOM killer acts inside it only), its
//! number of processes (a fork bomb stays inside) and its CPU time, on cgroup v1 (a
//! hybrid host, such as this project's CI) and v2 alike, through `cgroups-rs`. The
//! sandbox's bubblewrap joins it before it runs anything (as the spare process that
//! becomes bubblewrap, [`super::spare`], which writes itself into each
//! `cgroup.procs`), so nothing of the sandbox is ever outside.
//!
//! A server that may not make control groups (one run by a user who is not root, on a
//! host that delegates none to them) runs sandboxes without these limits; its status
//! says so (docs/middleware.md).

use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use cgroups_rs::fs::cgroup_builder::CgroupBuilder;
use cgroups_rs::fs::cpu::CpuController;
use cgroups_rs::fs::freezer::FreezerController;
use cgroups_rs::fs::{hierarchies, Cgroup, MaxValue};

/// What one sandbox may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of memory (swap included where the host accounts it).
    pub memory: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU time in thousandths of a CPU (1000: one CPU's worth).
    pub cpu_millis: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory: 1 << 30,
            pids: 512,
            cpu_millis: 2000,
        }
    }
}

/// A sandbox's control group, removed (its processes killed first) when dropped.
pub struct Group {
    cg: Cgroup,
    /// Each hierarchy's `cgroup.procs` of this group, open for writing: the first
    /// process writes itself into each before it runs bubblewrap.
    procs: Vec<OwnedFd>,
}

const PERIOD_US: u64 = 100_000;

impl Group {
    /// Makes the control group `name` with `limits`.
    pub fn make(name: &str, limits: &Limits) -> io::Result<Group> {
        let hier = hierarchies::auto();
        let v2 = hier.v2();
        let controllers: Vec<String> = if v2 {
            vec!["memory".into(), "pids".into(), "cpu".into()]
        } else {
            vec![
                "memory".into(),
                "pids".into(),
                "cpu".into(),
                "freezer".into(),
            ]
        };
        let memory = limits.memory.min(i64::MAX as u64) as i64;
        let quota = (limits.cpu_millis.saturating_mul(PERIOD_US) / 1000).max(1000) as i64;
        let named = |e: cgroups_rs::fs::error::Error| {
            io::Error::other(format!("the control group {name:?} of a sandbox: {e}"))
        };
        let mut b = CgroupBuilder::new(name)
            .set_specified_controllers(controllers)
            .memory()
            .memory_hard_limit(memory);
        if !v2 && PathBuf::from("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes").exists() {
            b = b.memory_swap_limit(memory);
        }
        let cg = b
            .done()
            .pid()
            .maximum_number_of_processes(MaxValue::Value(limits.pids.min(i64::MAX as u64) as i64))
            .done()
            .cpu()
            .period(PERIOD_US)
            .quota(quota)
            .done()
            .build(hier)
            .map_err(named)?;
        let mut procs = Vec::new();
        for sub in cg.subsystems() {
            let path = sub.to_controller().path().join("cgroup.procs");
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            procs.push(OwnedFd::from(f));
            if v2 {
                break;
            }
        }
        Ok(Group { cg, procs })
    }

    /// The `cgroup.procs` files a process writes itself into to join.
    pub fn procs(&self) -> &[OwnedFd] {
        &self.procs
    }

    /// Whether the group's processes yield the CPU to everything else (a sandbox being
    /// booted ahead, while no one waits for it), or have their fair share (its CPU
    /// limit is a quota, apart from this).
    pub fn set_background(&self, background: bool) {
        let cpu: Option<&CpuController> = self.cg.controller_of();
        let weight = match (self.cg.v2(), background) {
            // cpu.weight: 1 to 10000, 100 by default.
            (true, true) => 1,
            (true, false) => 100,
            // cpu.shares: 2 at least, 1024 by default.
            (false, true) => 2,
            (false, false) => 1024,
        };
        if let Some(Err(e)) = cpu.map(|c| c.set_shares(weight)) {
            tracing::debug!("the CPU weight of {}: {e}", self.cg.path());
        }
    }

    /// Every process in the group.
    pub fn pids(&self) -> Vec<u64> {
        self.cg.procs().into_iter().map(|p| p.pid).collect()
    }

    /// Kills every process in the group: at once on cgroup v2 (`cgroup.kill`); frozen
    /// first and then killed on v1, so that none forks meanwhile.
    pub fn kill_all(&self) {
        if self.cg.v2() && self.cg.kill().is_ok() {
            return;
        }
        let freezer: Option<&FreezerController> = self.cg.controller_of();
        if let Some(f) = freezer {
            let _ = f.freeze();
        }
        for pid in self.pids() {
            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        if let Some(f) = freezer {
            let _ = f.thaw();
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.procs.clear();
        for _ in 0..100 {
            self.kill_all();
            if self.pids().is_empty() && self.cg.delete().is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        tracing::warn!(
            "the control group {} of an ended sandbox stays",
            self.cg.path()
        );
    }
}
