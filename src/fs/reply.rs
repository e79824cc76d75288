//! Answers to the kernel's extended-attribute requests, shared by the read-only view
//! and the writable workspace.

/// Answers a getxattr from a node's sorted attribute list (`size` 0 asks for the length).
pub(crate) fn reply_getxattr(
    xattrs: &[(Vec<u8>, Vec<u8>)],
    name: &std::ffi::OsStr,
    size: u32,
    reply: fuser::ReplyXattr,
) {
    use std::os::unix::ffi::OsStrExt;
    match xattrs.iter().find(|(k, _)| k.as_slice() == name.as_bytes()) {
        Some((_, v)) => reply_xattr(reply, size, v),
        None => reply.error(fuser::Errno::NO_XATTR),
    }
}

/// Answers a listxattr: the names, each NUL-terminated.
pub(crate) fn reply_listxattr(xattrs: &[(Vec<u8>, Vec<u8>)], size: u32, reply: fuser::ReplyXattr) {
    let mut names = Vec::new();
    for (k, _) in xattrs {
        names.extend_from_slice(k);
        names.push(0);
    }
    reply_xattr(reply, size, &names);
}

fn reply_xattr(reply: fuser::ReplyXattr, size: u32, data: &[u8]) {
    if size == 0 {
        reply.size(data.len() as u32);
    } else if data.len() > size as usize {
        reply.error(fuser::Errno::ERANGE);
    } else {
        reply.data(data);
    }
}
