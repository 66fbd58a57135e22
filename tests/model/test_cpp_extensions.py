"""model/cpp_extensions.py: an extension built before under the same key is loaded without building
again; a lock file left by a killed extension builder does not wedge the next load, and a live
builder is still waited for. Real processes, files and a real (tiny, C) extension module."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import sysconfig
import threading

import pytest

from model.cpp_extensions import KEY_NAME, build_directory, load_extension, sole_loader

BUILDER = """
import time
from model.cpp_extensions import build_directory, sole_loader
with sole_loader("probe"):
    (build_directory("probe") / "lock").touch()  # torch's lock, as during a build
    print("building", flush=True)
    time.sleep(600)
"""


def test_a_killed_builders_lock_goes_and_a_live_builder_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = subprocess.Popen([sys.executable, "-c", BUILDER], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert builder.stdout.readline() == "building\n"
        lock = build_directory("probe") / "lock"
        assert lock.exists()
        seen_inside = []
        loader = threading.Thread(target=lambda: seen_inside.append(enter_and_look(lock)))
        loader.start()
        loader.join(2)
        assert loader.is_alive() and not seen_inside  # the builder lives: its build is waited for
        builder.send_signal(signal.SIGKILL)  # killed mid-build: torch's lock file stays behind
        loader.join(30)
        assert seen_inside == [False]  # the next loader got in, and the stale lock was gone
    finally:
        builder.kill()


def enter_and_look(lock) -> bool:
    with sole_loader("probe"):
        return lock.exists()


EXTENSION = """
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *unused) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "probe_ext", NULL, -1, methods};
PyMODINIT_FUNC PyInit_probe_ext(void) { return PyModule_Create(&module); }
"""


def build_probe(builds: list):
    """What torch's loader does, for a module of one C function: compiles it into its build
    directory and imports it."""
    def build():
        builds.append(1)
        directory = build_directory("probe_ext")
        (directory / "probe_ext.c").write_text(EXTENSION)
        subprocess.run(["cc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "probe_ext.c",
                        "-o", "probe_ext.so"], cwd=directory, check=True)
        spec = importlib.util.spec_from_file_location("probe_ext", directory / "probe_ext.so")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return build


def test_an_extension_built_under_the_same_key_is_loaded_without_building_and_a_new_key_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds = []
    assert load_extension("probe_ext", "torch 1; cpu a", build_probe(builds)).answer() == 42
    assert builds == [1] and (build_directory("probe_ext") / KEY_NAME).read_text() == "torch 1; cpu a"

    def must_not_build():
        raise AssertionError("built again under the same key")

    assert load_extension("probe_ext", "torch 1; cpu a", must_not_build).answer() == 42
    assert load_extension("probe_ext", "torch 2; cpu a", build_probe(builds)).answer() == 42  # a new torch
    assert builds == [1, 1]


def test_a_build_that_fails_leaves_no_key_so_the_next_load_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds = []
    load_extension("probe_ext", "torch 1", build_probe(builds))

    def fails():
        raise RuntimeError("the compiler died")

    with pytest.raises(RuntimeError, match="the compiler died"):
        load_extension("probe_ext", "torch 2", fails)  # the old library is still there, under the old key
    assert not (build_directory("probe_ext") / KEY_NAME).exists()
    load_extension("probe_ext", "torch 1", build_probe(builds))
    assert builds == [1, 1]
