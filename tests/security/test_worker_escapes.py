"""A confined worker reaches nothing outside itself: paths beyond its workspace, /proc
and /sys, its own cgroups, the kernel's process (signals, ``CLONE_PARENT``), or another
system-call ABI (i386, x32).

Each test is one attempt made from inside a real confined worker, with the widest
policy that matters for it; each must be refused.
"""

from __future__ import annotations

import platform

import pytest
from kit import Arena

from sandbox import Policy

pytestmark = [
    pytest.mark.usefixtures("confined"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86-64 syscall numbers"),
]


_WIDE = Policy(subprocess=True)


_LEAVE_CGROUP = """
errors = []
for path in ('/sys/fs/cgroup/freezer/cgroup.procs', '/sys/fs/cgroup/memory/cgroup.procs',
             '/sys/fs/cgroup/pids/cgroup.procs', '/sys/fs/cgroup/unified/cgroup.procs',
             '/sys/fs/cgroup/cgroup.procs'):
    try:
        with open(path, 'w') as f:
            f.write('0')
    except OSError as exc:
        errors.append(exc.errno)
        continue
    result = 'moved via ' + path
    break
else:
    if errors and all(e in (errno.EACCES, errno.EPERM, errno.ENOENT) for e in errors):
        raise OSError(errors[0], 'refused')
"""


async def test_a_worker_cannot_move_itself_out_of_its_cgroups(arena: Arena) -> None:
    result = await arena.attack(_LEAVE_CGROUP, policy=_WIDE)
    arena.assert_refused(result)
