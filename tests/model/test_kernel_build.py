"""A kernel build killed half-way must not hang every later start.

torch's build leaves its lock file (`lock` in the build directory) behind when the process
building is killed; torch's own loader then waits on it forever. Found in practice: one
interrupted build made every later test that seeds a draft hang.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from specdec.model.formats.kernels import build

pytestmark = pytest.mark.skipif(not shutil.which("c++"), reason="no C++ compiler on this host")


def _load_in_child(cache, timeout):
    code = textwrap.dedent("""
        from specdec.model.formats.kernels import build
        build.load("seeded_race")
        print("loaded")
    """)
    env = dict(os.environ, SPECDEC_CACHE=str(cache))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path):
    build.race()  # built (or found) in the normal cache
    source_dir = next(build._cache_root().glob("seeded_race-*"))
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    cache.chmod(0o700)
    copy = cache / "kernels" / source_dir.name
    shutil.copytree(source_dir, copy)
    (copy / "lock").touch()  # what a build killed between torch's acquire and release leaves

    done = _load_in_child(cache, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "loaded" in done.stdout
    assert "left by a build that did not finish" in done.stderr
    assert not (copy / "lock").exists()


def test_builders_starting_together_wait_for_each_other(tmp_path):
    """Two loaders on one empty cache both succeed: the second waits on the first's flock
    rather than reading a half-written library."""
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    cache.chmod(0o700)
    env = dict(os.environ, SPECDEC_CACHE=str(cache))
    code = "from specdec.model.formats.kernels import build; build.load('seeded_race'); print('loaded')"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert all("loaded" in o for o, _ in outs)
