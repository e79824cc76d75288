//! The system-call filter of every sandbox process, built with `seccompiler` (the
//! filter compiler of Firecracker) and handed to bubblewrap (`--add-seccomp-fd`), which
//! installs it, with `no_new_privs`, just before it starts the sandbox's init.
//!
//! It refuses (`EPERM`) every call Docker's default profile leaves out for a container
//! without extra capabilities: kernel modules, kexec, reboot, swap, clocks, accounting,
//! quotas, keyrings, `ptrace` and cross-process memory access, `bpf`, `perf_event_open`,
//! `userfaultfd`, `mount` and the new mount API, `pivot_root`, `chroot`, `unshare`,
//! `setns` and a `clone` that asks for a namespace, file handles (`open_by_handle_at`,
//! the "shocker" escape), NUMA memory policy, `personality`, io_uring, `fanotify`,
//! `syslog`, `vhangup` and the obsolete calls. `clone3` answers `ENOSYS`, as in Docker,
//! so that the C library falls back to `clone`, whose flags a filter can read. A
//! call of another architecture's ABI kills the process.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::OwnedFd;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Calls refused outright.
const DENIED: &[libc::c_long] = &[
    libc::SYS_acct,
    libc::SYS_add_key,
    libc::SYS_bpf,
    libc::SYS_chroot,
    libc::SYS_clock_adjtime,
    libc::SYS_clock_settime,
    libc::SYS_delete_module,
    libc::SYS_fanotify_init,
    libc::SYS_finit_module,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fsopen,
    libc::SYS_fspick,
    libc::SYS_get_mempolicy,
    libc::SYS_init_module,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_io_uring_setup,
    libc::SYS_ioperm,
    libc::SYS_iopl,
    libc::SYS_kcmp,
    libc::SYS_kexec_file_load,
    libc::SYS_kexec_load,
    libc::SYS_keyctl,
    libc::SYS_lookup_dcookie,
    libc::SYS_mbind,
    libc::SYS_migrate_pages,
    libc::SYS_mount,
    libc::SYS_mount_setattr,
    libc::SYS_move_mount,
    libc::SYS_move_pages,
    libc::SYS_name_to_handle_at,
    libc::SYS_nfsservctl,
    libc::SYS_open_by_handle_at,
    libc::SYS_open_tree,
    libc::SYS_perf_event_open,
    libc::SYS_personality,
    libc::SYS_pidfd_getfd,
    libc::SYS_pivot_root,
    libc::SYS_process_madvise,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_ptrace,
    libc::SYS_quotactl,
    libc::SYS_quotactl_fd,
    libc::SYS_reboot,
    libc::SYS_request_key,
    libc::SYS_set_mempolicy,
    libc::SYS_setns,
    libc::SYS_settimeofday,
    libc::SYS_swapoff,
    libc::SYS_swapon,
    libc::SYS_syslog,
    libc::SYS_sysfs,
    libc::SYS__sysctl,
    libc::SYS_umount2,
    libc::SYS_unshare,
    libc::SYS_uselib,
    libc::SYS_userfaultfd,
    libc::SYS_ustat,
    libc::SYS_vhangup,
];

/// `clone` flags that make a namespace.
const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWCGROUP as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
];

fn arch() -> TargetArch {
    #[cfg(target_arch = "aarch64")]
    return TargetArch::aarch64;
    #[cfg(not(target_arch = "aarch64"))]
    TargetArch::x86_64
}

fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>, errno: i32) -> io::Result<BpfProgram> {
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno as u32),
        arch(),
    )
    .map_err(|e| io::Error::other(format!("the sandbox's seccomp filter: {e}")))?;
    filter.try_into().map_err(|e: seccompiler::BackendError| {
        io::Error::other(format!("the sandbox's seccomp filter: {e}"))
    })
}

/// A filter that kills a process calling through the x32 ABI (system call numbers
/// with bit 30 set), which the x86-64 filters' architecture check lets through.
fn no_x32() -> BpfProgram {
    use seccompiler::sock_filter;
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    const KILL_PROCESS: u32 = 0x8000_0000;
    const ALLOW: u32 = 0x7fff_0000;
    let f = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    vec![
        f(LD_W_ABS, 0, 0, 0), // seccomp_data.nr
        f(JGE_K, 0, 1, 0x4000_0000),
        f(RET_K, 0, 0, KILL_PROCESS),
        f(RET_K, 0, 0, ALLOW),
    ]
}

/// The filters, compiled: the refusals (`EPERM`), `clone3`'s `ENOSYS`, and the end of
/// a process that calls through the x32 ABI.
pub fn programs() -> io::Result<Vec<BpfProgram>> {
    let mut deny: BTreeMap<i64, Vec<SeccompRule>> =
        DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|&flag| {
            SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(flag),
                flag,
            )
            .and_then(|c| SeccompRule::new(vec![c]))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| io::Error::other(format!("the sandbox's seccomp filter: {e}")))?;
    deny.insert(libc::SYS_clone, clone_rules);
    let clone3 = BTreeMap::from([(libc::SYS_clone3, Vec::new())]);
    let mut all = vec![compile(deny, libc::EPERM)?, compile(clone3, libc::ENOSYS)?];
    if cfg!(target_arch = "x86_64") {
        all.push(no_x32());
    }
    Ok(all)
}

/// `program` as bubblewrap reads it: the raw `sock_filter` array, in a sealed memory
/// file read from its start.
pub fn to_fd(program: &BpfProgram) -> io::Result<OwnedFd> {
    let mut bytes = Vec::with_capacity(program.len() * 8);
    for f in program {
        bytes.extend_from_slice(&f.code.to_ne_bytes());
        bytes.push(f.jt);
        bytes.push(f.jf);
        bytes.extend_from_slice(&f.k.to_ne_bytes());
    }
    super::memfile::data_fd("casfs-seccomp", &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_filters_compile_and_reach_bubblewrap_whole() {
        let p = programs().unwrap();
        assert!(p.len() >= 2);
        assert!(p[0].len() > DENIED.len(), "{} instructions", p[0].len());
        let fd = to_fd(&p[0]).unwrap();
        let mut f = std::fs::File::from(fd);
        let mut all = Vec::new();
        io::Read::read_to_end(&mut f, &mut all).unwrap();
        assert_eq!(all.len(), p[0].len() * 8);
    }
}
