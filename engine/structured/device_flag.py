"""DeviceFlag: a counter in pinned host memory that a CUDA stream waits on.

The grammar masks of a step are filled by a host thread while the device runs the
forward. Rather than the engine thread waiting for them before it launches the
sampler (which would leave the device idle while the host catches up), the
stream itself waits: `wait(n)` queues a `cuStreamWaitValue32` (the driver's
stream memory operation) that holds back everything queued after it until a
host thread's `set(n)`; the host runs on. No PyTorch API queues such a wait, so
the driver is called through ctypes.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

logger = logging.getLogger("pagoda.engine")
_WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
_SUCCESS = 0


class DeviceFlag:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.value = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.np = self.value.numpy().view(np.uint32)
        # PyDLL keeps the GIL through the calls: a wait is only queued, and letting the
        # GIL go would make the engine thread take it back behind the grammar worker.
        cuda = ctypes.PyDLL("libcuda.so.1")
        self._wait = cuda.cuStreamWaitValue32_v2
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._wait.restype = ctypes.c_int
        pointer = ctypes.c_uint64()
        get_pointer = cuda.cuMemHostGetDevicePointer_v2
        get_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        get_pointer.restype = ctypes.c_int
        torch.cuda.init()  # the device's context current on this thread
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()
            rc = get_pointer(ctypes.byref(pointer), self.value.data_ptr(), 0)
        if rc != _SUCCESS:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed ({rc})")
        self.address = pointer.value

    @classmethod
    def create(cls, device: torch.device) -> DeviceFlag | None:
        """A flag on a CUDA device whose driver takes stream waits; else None (the
        host waits instead)."""
        if device.type != "cuda":
            return None
        try:
            flag = cls(device)
            flag.wait(0)  # satisfied at once: proves the driver takes it
            torch.cuda.current_stream(device).synchronize()
        except (OSError, AttributeError, RuntimeError) as exc:
            logger.warning("grammar masks: no device-side wait (%s); the host waits", exc)
            return None
        return flag

    def set(self, n: int) -> None:
        """From any host thread: the stream's waits for n or less go on."""
        self.np[0] = n & 0xFFFFFFFF

    def wait(self, n: int) -> None:
        """Queue on the current stream: hold what follows until the flag reaches n."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        rc = self._wait(stream, self.address, n & 0xFFFFFFFF, _WAIT_VALUE_GEQ)
        if rc != _SUCCESS:
            raise RuntimeError(f"cuStreamWaitValue32 failed ({rc})")
