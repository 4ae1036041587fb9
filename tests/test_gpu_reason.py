"""GPU-test skip reasons: "no GPU" on a machine without one, the CUDA problem only with one."""
from __future__ import annotations

from kvpage.cuda import interop


def test_no_gpu_says_so(monkeypatch):
    monkeypatch.setattr(interop.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(interop.shutil, "which", lambda name: None)
    reason = interop.gpu_unavailable_reason()
    assert reason.startswith("no GPU") and "driver" not in reason


def test_gpu_present_reports_the_cuda_problem(monkeypatch):
    monkeypatch.setattr(interop.glob, "glob", lambda pattern: ["/dev/nvidia0"])
    monkeypatch.setattr(interop, "simulator_enabled", lambda: False)
    reason = interop.gpu_unavailable_reason()
    # On this machine CuPy cannot reach a device: the reason names CUDA, never "no GPU".
    if reason is not None:
        assert not reason.startswith("no GPU") and "CUDA" in reason


def test_this_machine(monkeypatch):
    if not interop.gpu_present():
        assert interop.gpu_unavailable_reason().startswith("no GPU")
