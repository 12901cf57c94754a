"""``dptrain env``: what a bug report about distributed training needs, in one paste.

Versions (dptrain, torch, Python, CUDA, NCCL), the backends torch.distributed offers, the
GPUs and CPU cores, every distributed environment variable that is set (a ``DPTRAIN_*`` one
with what is wrong with its value, see ``dptrain.runtime.settings``), the network
interface gloo would use, and whether shared memory, network namespaces and Slurm are there.
Nothing here starts a process group or contacts another host.
"""

from __future__ import annotations

import difflib
import os
import platform
import shutil
import socket
import subprocess
import sys
from typing import Any

from dptrain import environments
from dptrain.runtime import settings as _settings

__all__ = ["collect", "format_report"]

# Variables that change how a distributed job starts or communicates.
_PREFIXES = ("DPTRAIN_", "TORCHELASTIC_", "SLURM_", "NCCL_", "GLOO_", "TORCH_DISTRIBUTED", "TORCH_NCCL", "CUDA_VISIBLE")
_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
          "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _versions() -> dict[str, Any]:
    from importlib import metadata

    import torch

    out: dict[str, Any] = {"dptrain": _dptrain_version(metadata), "torch": torch.__version__,
                           "python": sys.version.split()[0], "platform": platform.platform()}
    out["cuda (torch built with)"] = torch.version.cuda or "none (CPU build)"
    try:
        nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (nccl or "n/a")
    except Exception:  # noqa: BLE001 - a report must never fail on one probe
        out["nccl"] = "n/a"
    return out


def _dptrain_version(metadata) -> str:
    try:
        return metadata.version("dptrain")
    except metadata.PackageNotFoundError:
        from dptrain import __version__

        return __version__


def _backends() -> dict[str, Any]:
    import torch.distributed as dist

    found = {}
    for name, probe in (("gloo", "is_gloo_available"), ("nccl", "is_nccl_available"),
                        ("mpi", "is_mpi_available"), ("ucc", "is_ucc_available")):
        fn = getattr(dist, probe, None)
        found[name] = bool(fn()) if fn is not None else False
    return {"torch.distributed": dist.is_available(), **found}


def _hardware() -> dict[str, Any]:
    import torch

    cores = os.cpu_count() or 1
    usable = environments.usable_cores()
    out: dict[str, Any] = {"cpu cores": f"{cores} ({usable} usable by this process)"}
    if torch.cuda.is_available():
        gpus = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(f"{i}: {p.name}, {p.total_memory / 2**30:.1f} GiB")
        out["gpus"] = gpus
    else:
        out["gpus"] = "none visible"
    return out


def _variables() -> dict[str, str]:
    """The variables set; a ``DPTRAIN_*`` one with what is wrong with it, if anything."""
    found = {}
    for name, value in sorted(os.environ.items()):
        if name in _NAMES or name.startswith(_PREFIXES):
            found[name] = _settings.shown(name, value) + _verdict(name, value)
    return found


def _verdict(name: str, value: str) -> str:
    if not name.startswith("DPTRAIN_"):
        return ""
    if name not in _settings.SETTINGS:
        close = difflib.get_close_matches(name, _settings.SETTINGS, n=1, cutoff=0.8)
        return f"  (not read by dptrain{f'; did you mean {close[0]}?' if close else ''})"
    wrong = _settings.problem(name, value)
    return f"  (INVALID: {wrong})" if wrong else ""


def _network() -> dict[str, Any]:
    from dptrain.launcher.rendezvous import iface_towards, loopback_ifname

    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        addr = "unresolvable"
    target = os.environ.get("MASTER_ADDR") or (addr if addr != "unresolvable" else "127.0.0.1")
    chosen = os.environ.get("GLOO_SOCKET_IFNAME")
    if chosen:
        how = f"{chosen} (GLOO_SOCKET_IFNAME)"
    else:
        iface = iface_towards(target) or loopback_ifname()
        how = f"{iface} (the route to {target}; `dptrain run` sets GLOO_SOCKET_IFNAME to it)"
    return {"hostname": f"{host} -> {addr}", "gloo interface": how}


def _facilities() -> dict[str, Any]:
    out: dict[str, Any] = {}
    if os.path.isdir("/dev/shm"):
        usage = shutil.disk_usage("/dev/shm")
        out["shared memory (/dev/shm)"] = f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB"
    else:
        out["shared memory (/dev/shm)"] = "absent"
    ip = shutil.which("ip")
    if ip is None:
        out["ip netns"] = "no `ip` command"
    else:
        try:
            ok = subprocess.run([ip, "netns", "list"], capture_output=True, timeout=5).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        root = hasattr(os, "geteuid") and os.geteuid() == 0
        out["ip netns"] = ("available" if ok else "not usable") + (" (root)" if root else " (not root: cannot create)")
    tools = [t for t in ("srun", "sbatch", "scontrol") if shutil.which(t)]
    in_job = os.environ.get("SLURM_JOB_ID")
    out["slurm"] = (", ".join(tools) if tools else "no Slurm commands") + (f"; inside job {in_job}" if in_job else "")
    return out


def collect() -> dict[str, dict[str, Any]]:
    """Every section of the report as ``{section: {item: value}}``.

    Example:
        >>> report = collect(); report["versions"]["torch"]   # doctest: +SKIP
        '2.13.0'
    """
    sections = {}
    for title, probe in (("versions", _versions), ("backends", _backends), ("hardware", _hardware),
                         ("environment variables", _variables), ("network", _network),
                         ("facilities", _facilities)):
        try:
            sections[title] = probe()
        except Exception as exc:  # noqa: BLE001 - report what failed instead of failing
            sections[title] = {"error": f"{type(exc).__name__}: {exc}"}
    return sections


def format_report(sections: dict[str, dict[str, Any]] | None = None) -> str:
    """The report as text, one ``item: value`` per line under each section."""
    sections = collect() if sections is None else sections
    lines = []
    for title, items in sections.items():
        lines.append(f"{title}:")
        if not items:
            lines.append("  (none set)")
        for key, value in items.items():
            if isinstance(value, list):
                lines.append(f"  {key}:")
                lines.extend(f"    {v}" for v in value)
            else:
                lines.append(f"  {key}: {value}")
    return "\n".join(lines) + "\n"
