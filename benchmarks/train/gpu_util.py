"""The GPU's utilisation while steps run (``benchmarks.train.gpu_bench``): sampled in a
thread through NVML, or nvidia-smi where NVML is missing; nothing on a CPU."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from typing import Any

import torch

log = logging.getLogger(__name__)
SAMPLE_PERIOD_S = 0.2


class UtilSampler:
    """Samples the GPU's utilisation every 0.2 s in a daemon thread; ``mean(t0, t1)`` over
    a window of ``time.perf_counter()`` times. ``mean`` is ``None`` without samples."""

    def __init__(self, device: torch.device) -> None:
        self.samples: list[tuple[float, float]] = []
        self._read = _nvml_reader(device) or _nvidia_smi_reader(device)
        self._stop = threading.Event()
        self._thread = None
        if self._read is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-util", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            value = self._read()
            if value is not None:
                self.samples.append((time.perf_counter(), value))

    def mean(self, start: float, end: float) -> float | None:
        window = [value for t, value in self.samples if start <= t <= end]
        return round(sum(window) / len(window), 1) if window else None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _nvml_reader(device: torch.device) -> Any:
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(_pci_bus_id(device))
    except Exception as exc:  # no pynvml, or no NVML: nvidia-smi is the fallback
        log.info("NVML unavailable (%s); trying nvidia-smi", exc)
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)


def _nvidia_smi_reader(device: torch.device) -> Any:
    exe = shutil.which("nvidia-smi")
    if device.type != "cuda" or exe is None:
        return None
    command = [exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
    command += ["-i", _pci_bus_id(device)]

    def read() -> float | None:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=5)
            return float(done.stdout.strip().splitlines()[0])
        except (subprocess.SubprocessError, ValueError, IndexError):
            return None  # counted as no sample, never as 0 %

    return read


def _pci_bus_id(device: torch.device) -> str:
    """The device's PCI bus id, which NVML and nvidia-smi accept whatever
    ``CUDA_VISIBLE_DEVICES`` renumbered."""
    props = torch.cuda.get_device_properties(device)
    return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
