"""A mode that fails on any operation that would make the host wait for the device (on CUDA).

Works on the CPU-only CI: it looks at what is called, not at where the data is. Host-side work uses
numpy (or Python), device data moves only through `genrec.staging` (`to_device` in, `fetch` out), and
request checks run inside `staging.host_side()`; everything else inside the guard must be sync-free.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from genrec import staging

aten = torch.ops.aten

# Ops whose output size or value the host must read back from the device.
SYNCING_OPS = {
    aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.isin.Tensor_Tensor,  # its sort path calls unique
    aten.isin.Tensor_Scalar,
    aten.isin.Scalar_Tensor,
    aten.equal.default,
    aten.is_nonzero.default,
}
SYNCING_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.__bool__}


class SyncError(AssertionError):
    pass


def _allowed() -> bool:
    return staging.inside_fetch() or staging.on_host()


class _Dispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _allowed():
            if func in SYNCING_OPS:
                raise SyncError(f"{func} would synchronise with the device")
            if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                raise SyncError("repeat_interleave without output_size reads its total from the device")
            if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
                indices = args[1]
                if any(i is not None and i.dtype == torch.bool for i in indices):
                    raise SyncError(f"{func} with a boolean mask calls nonzero")
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _allowed():
            if func in SYNCING_METHODS:
                raise SyncError(f"{func.__name__} reads a tensor back on the host")
            if func in (torch.tensor, torch.as_tensor) and "device" in kwargs:
                raise SyncError(f"{func.__name__}(..., device=) copies host data synchronously: use staging.to_device")
        return func(*args, **kwargs)


class no_sync:
    """`with no_sync(): ...` fails (SyncError) on the first syncing call made in this thread."""

    def __enter__(self):
        self._modes = [_Function(), _Dispatch()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False
