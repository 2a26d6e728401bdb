"""Compile-only checks of ptxtrain's Triton kernels for sm_90a, on a machine without a GPU.

:func:`run_sm90_script` runs a script body in a fresh Python without ``TRITON_INTERPRET`` (so
the kernels are decorated for compilation, not interpretation) after :data:`PREAMBLE`, which
probes the toolchain and gives the body ``target`` (sm_90a), :func:`emit` (its one result) and
:func:`sass_info` (SASS instructions and register use through the wheel's ``cuobjdump``).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from tests._spawn import run_python

PREAMBLE = '''
import json, os, re, subprocess, sys, tempfile
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

target = GPUTarget("cuda", 90, 32)


def emit(result):
    print("RESULT" + json.dumps(result))


@triton.jit
def _probe(x_ptr):
    tl.store(x_ptr, 1.0)


try:  # the toolchain itself: if this fails, the environment can't compile for sm_90a
    triton.compile(ASTSource(_probe, {"x_ptr": "*fp32"}), target=target)
except Exception as e:
    emit({"env_error": repr(e)[-500:]})
    sys.exit(0)

_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                          "cuobjdump")


def sass_info(cubin):
    """{"sass_qgmma": [...], "regs", "stack", "local"} of a cubin; {} without cuobjdump."""
    if not os.access(_CUOBJDUMP, os.X_OK):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        run = lambda *a: subprocess.run([_CUOBJDUMP, *a, f.name], capture_output=True,
                                        text=True, timeout=120).stdout
        info = {"sass_qgmma": sorted(set(re.findall(r"QGMMA\\.[\\w.]+", run("-sass"))))}
        use = re.search(r"REG:(\\d+) STACK:(\\d+) SHARED:\\d+ LOCAL:(\\d+)", run("-res-usage"))
        if use:
            info["regs"], info["stack"], info["local"] = map(int, use.groups())
        return info
    finally:
        os.unlink(f.name)

'''


def run_sm90_script(body: str, tmp_path: Path, *argv: str) -> dict:
    """Run ``PREAMBLE + body`` (written to a file: ``triton.jit`` reads sources) with ``argv``.

    Returns the object the body passed to ``emit``. Skips the test when Triton cannot compile
    for sm_90a here at all; fails when the body itself fails or emits nothing.
    """
    script = tmp_path / "compile_sm90.py"
    script.write_text(PREAMBLE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_python([str(script), *argv], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((s for s in reversed(proc.stdout.splitlines()) if s.startswith("RESULT")), None)
    assert line is not None, f"the script emitted no result: {proc.stdout[-2000:]}"
    result = json.loads(line.removeprefix("RESULT"))
    if "env_error" in result:
        pytest.skip(f"Triton cannot compile for sm_90a here: {result['env_error']}")
    return result
