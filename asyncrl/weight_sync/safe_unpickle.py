"""Reading /update_weights_from_tensor's payload without running anyone's code.

The payload is SGLang's MultiprocessingSerializer format: base64 of torch's ForkingPickler pickle of
`[(name, tensor), ...]`, where a CUDA tensor travels as an IPC handle. `pickle.loads` on it would call
any function the pickle names (`os.system` included), so the receiver uses `load_named_tensors`:
an Unpickler whose `find_class` admits only the classes and rebuild functions torch's reductions
emit for tensors and storages (torch/multiprocessing/reductions.py), the tensor classes and dtypes;
everything else is refused before it is called. This is SGLang 0.5.23's `SafeUnpickler`
(srt/utils/common.py) narrowed to tensors: SGLang also admits stdlib helpers (functools.partial,
_codecs.encode, ...) and its own request structs, which a tensor payload never needs. The route stays
behind the token as well (asyncrl/util/auth.py): the allowlist is a second wall, not the first.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from typing import Any

import torch

_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED = frozenset({
    ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    *((_REDUCTIONS, f) for f in ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
                                 "rebuild_typed_storage_child", "rebuild_storage_fd", "rebuild_storage_filename",
                                 "rebuild_storage_empty")),
    ("multiprocessing.resource_sharer", "DupFd"),  # a CPU storage's file descriptor (same host, authkey)
    *(("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)),
})


class UnsafePayload(pickle.UnpicklingError):
    """The payload names something outside the allowlist, or is not a list of (name, tensor)."""


class TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise UnsafePayload(f"refused global {module}.{name}: a tensor payload only names torch's "
                                f"tensor and storage rebuild functions")
        if module == _REDUCTIONS:
            # lazy: torch.multiprocessing registers its reductions (CUDA-IPC included) on import; only a
            # payload that names them needs that
            import torch.multiprocessing  # noqa: F401
        return super().find_class(module, name)


def load_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """One base64 ForkingPickler payload -> [(name, tensor)]; UnsafePayload for anything else."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise UnsafePayload(f"payload is not base64: {e}") from None
    named = TensorUnpickler(io.BytesIO(raw)).load()
    if not isinstance(named, list) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named):
        raise UnsafePayload(f"payload must be a list of (name, tensor) pairs, got {type(named).__name__}")
    return named
