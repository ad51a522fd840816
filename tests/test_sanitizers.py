"""kvhal's four C extensions built with AddressSanitizer and UndefinedBehaviorSanitizer, and
the tests that feed them hostile input run against those builds (issue 38): the key index's
hostile keys and slots, its LRU's and slot states' (``_slots.c``), the Redis reader's fuzzed
reply streams and timeouts, the copy planner's and the CPU kernel's buffers. Any sanitizer
report fails the test.

The sanitized build goes to a temporary directory (the normal build's .so files stay where
they are); a child Python loads it through a meta path finder placed before kvhal is
imported, with libasan preloaded (CPython is not built with it), PYTHONMALLOC=malloc (so
that ASan sees every buffer Python allocates) and leak detection off (CPython leaks by
design at exit). Marked ``sanitizers`` and ``slow``: CI's full run takes it, the quick loop
does not. Costs about a minute on two cores (most of it the fuzzing under ASan).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sanitizers, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
MODULES = ("kvhal._copyplan", "kvhal.cpu._memcpy", "kvhal.offload._keyindex", "kvhal.tiers.stores._resp")
TESTS = (
    "tests/test_keyindex.py",
    "tests/test_keyindex_hostile.py",
    "tests/test_keyindex_slots.py",
    "tests/test_resp_reader.py",
    "tests/test_copyplan_native.py",
)
# not under the sanitizers: the pure-Python index, and the crash cases' own child processes
# (they load the normal build)
SKIP = [
    "--deselect=tests/test_keyindex_hostile.py::test_hostile_keys_and_slots_are_refused_or_served[kvhal.offload.keyindex]",
    "--deselect=tests/test_keyindex_hostile.py::test_the_issues_crashes_are_refused",
    "--deselect=tests/test_keyindex.py::test_matches_a_dict_under_churn[kvhal.offload.keyindex]",
]
# float-cast-overflow is not part of GCC's -fsanitize=undefined: the reader's timeout needs it
FLAGS = "-fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1"  # noqa: E501
REPORTS = ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer", "SUMMARY: UndefinedBehavior")

# Run in the child: load the sanitized modules before anything imports kvhal, check that they
# are the ones loaded, then run the tests.
BOOT = """
import importlib.machinery, importlib.util, json, os, sys
SO = json.loads(os.environ["KVHAL_SANITIZED_SO"])

class Sanitized:
    def find_spec(self, name, path=None, target=None):
        if name not in SO:
            return None
        loader = importlib.machinery.ExtensionFileLoader(name, SO[name])
        return importlib.util.spec_from_file_location(name, SO[name], loader=loader)

sys.meta_path.insert(0, Sanitized())
for name, file in SO.items():
    module = importlib.import_module(name)
    assert module.__file__ == file, (name, module.__file__)
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def _libasan() -> str | None:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        return None
    path = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


def _build(out: Path) -> dict[str, str]:
    env = dict(os.environ, CFLAGS=FLAGS, LDFLAGS="-fsanitize=address,undefined")
    done = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(out / "lib"),
            "--build-temp",
            str(out / "tmp"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    built = {}
    for name in MODULES:
        found = sorted((out / "lib").glob(name.replace(".", "/") + ".*.so"))
        assert found, f"{name} was not built with the sanitizers:\n{done.stderr[-3000:]}"
        built[name] = str(found[0])
    return built


def test_the_c_extensions_survive_hostile_input_under_asan_and_ubsan(tmp_path):
    libasan = _libasan()
    if libasan is None:
        pytest.skip("no C compiler with AddressSanitizer's runtime (gcc -print-file-name=libasan.so)")
    import json

    built = _build(tmp_path)
    env = dict(
        os.environ,
        LD_PRELOAD=libasan,
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:allocator_may_return_null=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        PYTHONMALLOC="malloc",
        KVHAL_SANITIZED_SO=json.dumps(built),
    )
    env.pop("PYTEST_XDIST_WORKER", None)
    args = ["-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-x", "--durations=5", *TESTS, *SKIP]
    done = subprocess.run(
        [sys.executable, "-c", BOOT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540
    )
    output = done.stdout + done.stderr
    reports = [line for line in output.splitlines() if any(r in line for r in REPORTS)]
    assert not reports, "sanitizer reports:\n" + "\n".join(reports[:20]) + "\n" + output[-6000:]
    assert done.returncode == 0, f"exit {done.returncode}\n{output[-6000:]}"
    assert " passed" in done.stdout
    print(done.stdout[-1500:])  # the slowest tests, with -s
