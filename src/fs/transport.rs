//! Which FUSE transport serves a mount: the kernel's per-CPU io_uring queues (fuser
//! patch 0005, `third_party/fuser/src/uring.rs`), or `read`/`writev` on `/dev/fuse`.
//!
//! FUSE over io_uring is built into this kernel but off until root writes `Y` to
//! `/sys/module/fuse/parameters/enable_uring`, a host-wide setting: casfs never turns
//! it on by itself. `scripts/setup.sh --enable-fuse-uring` (which the test command
//! runs) does, on purpose; `auto` then picks io_uring for every new mount.

use std::path::Path;

const PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

/// What a mount asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FuseTransport {
    /// io_uring when the kernel has it enabled, else classic.
    #[default]
    Auto,
    IoUring,
    Classic,
}

impl FuseTransport {
    /// `auto`, `io_uring` (or `io-uring`, `uring`) or `classic`.
    pub fn parse(s: &str) -> Result<FuseTransport, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(FuseTransport::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(FuseTransport::IoUring),
            "classic" | "dev-fuse" => Ok(FuseTransport::Classic),
            other => Err(format!(
                "FUSE transport {other:?}: use auto, io_uring or classic"
            )),
        }
    }

    /// `CASFS_FUSE_TRANSPORT`, else auto.
    pub fn from_env() -> Result<FuseTransport, String> {
        match std::env::var("CASFS_FUSE_TRANSPORT") {
            Ok(v) => FuseTransport::parse(&v).map_err(|e| format!("CASFS_FUSE_TRANSPORT: {e}")),
            Err(_) => Ok(FuseTransport::Auto),
        }
    }

    /// Whether a mount asks the kernel for io_uring. An explicit `io_uring` on a kernel
    /// that has it off is an error naming the switch.
    pub fn wants_uring(self) -> Result<bool, String> {
        match self {
            FuseTransport::Classic => Ok(false),
            FuseTransport::Auto => Ok(kernel_enabled()),
            FuseTransport::IoUring if kernel_enabled() => Ok(true),
            FuseTransport::IoUring => Err(format!(
                "FUSE over io_uring is off in this kernel ({PARAM} is not Y, or absent): \
                 as root, `echo Y > {PARAM}` (host-wide) or run scripts/setup.sh \
                 --enable-fuse-uring, or mount with the classic transport"
            )),
        }
    }
}

/// What options ask for unless told: `CASFS_FUSE_TRANSPORT` (auto when unset or not
/// understood, where an explicit io_uring the kernel has off falls back too).
pub(crate) fn default_uring() -> bool {
    FuseTransport::from_env()
        .unwrap_or_default()
        .wants_uring()
        .unwrap_or(false)
}

/// In `Filesystem::init`: asks the kernel for io_uring when `want`; a kernel that does
/// not offer it leaves the mount on the classic transport, with a warning.
pub(crate) fn ask_for_uring(config: &mut fuser::KernelConfig, want: bool) {
    if want
        && config
            .add_capabilities(fuser::InitFlags::FUSE_OVER_IO_URING)
            .is_err()
    {
        tracing::warn!("FUSE over io_uring asked for, not offered by the kernel: classic");
    }
}

/// Whether the kernel offers FUSE over io_uring to new connections.
pub fn kernel_enabled() -> bool {
    std::fs::read_to_string(Path::new(PARAM)).is_ok_and(|v| v.trim() == "Y")
}

/// What serves a mounted session, as `casfs status` says it.
pub fn describe(session: &fuser::BackgroundSession) -> &'static str {
    if session.io_uring_active() {
        "io_uring"
    } else {
        "classic"
    }
}
