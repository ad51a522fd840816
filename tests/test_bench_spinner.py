"""``kvhal bench chat --spin``: a process keeping a share of a core busy, gone with the run."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil
import pytest

from kvhal.bench.chat import spinner
from kvhal.bench.chat.spinner import share_of_a_core, spinning


def test_a_share_of_a_core_is_more_than_nothing_and_less_than_the_core():
    assert share_of_a_core("0.07") == 0.07
    for bad in ("0", "1", "1.5", "-0.1"):
        with pytest.raises(argparse.ArgumentTypeError, match="more than 0 and less than 1"):
            share_of_a_core(bad)


def spinners() -> list[psutil.Process]:
    """This process's spinner children (a test worker has others: a fork server, servers)."""
    found = []
    for child in psutil.Process().children():
        try:
            if any(part.endswith("spinner.py") for part in child.cmdline()):
                found.append(child)
        except psutil.Error:  # ended meanwhile
            continue
    return found


def test_the_spinner_spins_while_the_block_runs_and_is_gone_after():
    with spinning(0.2):
        (child,) = spinners()
        before = child.cpu_times()
        time.sleep(1.0)
        after = child.cpu_times()
        busy = after.user + after.system - before.user - before.system
        assert 0.05 < busy < 0.6, f"spun {busy:.2f} s of CPU in 1 s at a share of 0.2"
    assert not spinners(), "the spinner outlived its block"
    with spinning(None):
        assert not spinners()


def test_the_spinner_ends_when_the_process_that_started_it_is_gone():
    # a parent killed outright (SIGKILL: no finally runs) starts a spinner and dies
    script = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {spinner.__file__!r}, '0.05', str(os.getpid())])\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 10
    while not psutil.Process(parent.pid).children():
        assert time.monotonic() < deadline, "no spinner started"
        time.sleep(0.05)
    (child,) = psutil.Process(parent.pid).children()
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5

    def ended() -> bool:  # (an orphan that exited may wait as a zombie for its new parent)
        try:
            return child.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    while not ended():
        assert time.monotonic() < deadline, "the spinner outlived the process that started it"
        time.sleep(0.05)
