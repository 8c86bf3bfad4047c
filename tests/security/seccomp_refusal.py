"""Attempt code shared by the seccomp attempts.

``ONLY_THE_FILTER`` defines ``filtered(nr, *args)`` inside the worker: a raw
system call that counts as refused only when the filter answered (``EPERM`` or
``ENOSYS``). Another error (``EFAULT`` for a NULL pointer, ``EINVAL``) means the
call reached the kernel, which the attempt reports as getting through.
"""

from __future__ import annotations

ONLY_THE_FILTER = """
def filtered(nr, *args):
    try:
        syscall(nr, *args)
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.ENOSYS):
            raise
        return f'reached the kernel: {errno.errorcode.get(exc.errno, exc.errno)}'
    return 'ran'
"""
