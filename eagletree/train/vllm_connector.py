"""vLLM's hidden-states connector for its CPU build (imported by vLLM's engine processes, by module path).

`eagletree features --engine vllm` has vLLM write each request's hidden states through the KV-transfer connector
`ExampleHiddenStatesConnector`. In vLLM 0.32 its write path copies the states off the device with a CUDA stream, a
CUDA event and pinned host memory, each of which raises on a CPU-only torch ("pin_memory=True requires a CUDA or
other accelerator backend"), on the engine step after the first request finishes. On a CPU the cache is already in
host memory: `CpuHiddenStatesConnector` copies a finished request's rows synchronously (a clone: its blocks are
freed and reused once the request is reported done) and keeps the rest as vLLM has it (file names, lock files,
safetensors keys, the threaded write). On a device it is vLLM's own path.

The class is built on first access (a module `__getattr__`), so this module imports without vLLM.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch

CONNECTOR = "CpuHiddenStatesConnector"


class _Done:
    """An event that has already happened (the copy above is synchronous)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _connector_class():
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as upstream

    class CpuHiddenStatesConnector(upstream.ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            if self._kv_cache.is_cuda:  # a device: vLLM's own asynchronous copy
                return super()._submit_async_write(pending)
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
            rows = pending.token_ids.shape[0]
            hidden = upstream.extract_from_kv_cache(self._kv_cache, slots, rows).clone()
            tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock = self._lock_fds.pop(pending.req_id, None)
            if lock is None and self.use_lock:
                lock = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock, fcntl.LOCK_EX)
            done = _Done()
            future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock)
            self._req_copy_events[pending.req_id] = done
            self._req_futures[pending.req_id] = future
            future.add_done_callback(partial(self._on_write_done, pending.req_id))

    return CpuHiddenStatesConnector


def __getattr__(name: str):
    if name == CONNECTOR:
        cls = _connector_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
