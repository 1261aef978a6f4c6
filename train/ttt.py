"""The EAGLE-3 training-time test (TTT): input shift, J unrolled draft steps and their attention (DESIGN section 3).

Two attention kernels give identical results: "blockwise" (plain PyTorch, memory linear in T, CPU) and
"flex" (flex_attention with a BlockMask, GPU). Documents are contiguous runs of one id; -1 is padding.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from draftsmith.data.errors import UserError
from draftsmith.train.attention import attend_shared_and_own_keys

ATTENTION_IMPLS = ("blockwise", "flex")


def shift_for_ttt(input_ids, teacher, loss_mask, document_ids):
    """Shift left by one so position t holds token x[t+1] and the teacher and loss mask of t+1.

    input_ids [B, T], teacher [B, T, ...] (final hidden states or logits), loss_mask [B, T], document_ids [B, T].
    The aux features are not shifted. The loss mask is also cleared where t+1 leaves t's document and at the
    last position (SpecForge #885: the mask must move with the inputs).
    """
    ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)  # [B, T]
    teacher = torch.cat([teacher[:, 1:], torch.zeros_like(teacher[:, :1])], dim=1)  # [B, T, ...]
    same_doc = (document_ids[:, 1:] == document_ids[:, :-1]) & (document_ids[:, :-1] >= 0)  # [B, T-1]
    mask = torch.cat([loss_mask[:, 1:].bool() & same_doc, torch.zeros_like(same_doc[:, :1])], dim=1)  # [B, T]
    return ids, teacher, mask


def ttt_step_masks(loss_mask, document_ids, num_steps: int) -> torch.Tensor:
    """[J, B, T] bool: step j at t is scored iff the shifted mask holds at t+j and t+j is in t's document."""
    B, T = loss_mask.shape
    masks = torch.zeros(num_steps, B, T, dtype=torch.bool, device=loss_mask.device)
    for j in range(min(num_steps, T)):
        same_doc = document_ids[:, j:] == document_ids[:, : T - j]  # [B, T-j]
        masks[j, :, : T - j] = loss_mask[:, j:].bool() & same_doc & (document_ids[:, : T - j] >= 0)
    return masks


def shift_tokens(input_ids: torch.Tensor, j: int) -> torch.Tensor:
    """input_ids shifted left j more (step j's ground-truth tokens); the tail is padded with id 0, never scored."""
    if j == 0:
        return input_ids
    pad = torch.zeros_like(input_ids[:, : min(j, input_ids.shape[1])])
    return torch.cat([input_ids[:, j:], pad], dim=1)  # [B, T]


def ttt_forward(drafter, aux_hidden, input_ids, position_ids, document_ids, num_steps: int,
                attention_impl: str = "blockwise", chunk_size: int = 512) -> list[torch.Tensor]:
    """Unroll J draft steps over already-shifted inputs; returns each step's lm_head input, J x [B, T, H].

    Step j reads tokens shifted j more, the draft's own hidden output of step j-1 (h^0 = fc(F)) at the same
    position, and rotates its queries and new keys at position t+j (step-0 keys keep t). The draft lm_head is
    left to the loss, which applies it only where a step is scored (`drafter.lm_head(states[j])` gives the
    step's logits [B, T, V_d]).
    """
    attention = TTTAttention(document_ids, attention_impl, chunk_size)
    hidden = drafter.combine_aux_hidden_states(aux_hidden)  # [B, T, H]
    step_states = []
    for j in range(num_steps):
        hidden, head_input = drafter(shift_tokens(input_ids, j), hidden, position_ids + j, attention,
                                     apply_lm_head=False)
        step_states.append(head_input)
    return step_states


def pick_attention_impl(setting: str, device: torch.device) -> str:
    """Resolve train.attention: auto is flex on CUDA (flex has no CPU backward) and blockwise elsewhere."""
    if setting == "auto":
        return "flex" if device.type == "cuda" else "blockwise"
    return setting


class TTTAttention:
    """Keeps every step's keys/values per layer; the drafter calls it as attention(layer_idx, q, k, v).

    A query at t sees step-0 keys s <= t of its document and its own step-1..j keys at t (the diagonal).
    A padding query (document -1) sees only its own keys, so every softmax row is finite.
    """

    def __init__(self, document_ids: torch.Tensor, impl: str, chunk_size: int = 512):
        if impl not in ATTENTION_IMPLS:
            raise UserError(f"TTT attention {impl!r} is not one of {ATTENTION_IMPLS}")
        check_document_ids(document_ids)
        self.document_ids, self.impl, self.chunk_size = document_ids, impl, chunk_size
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}
        self.block_masks: dict[int, object] = {}
        self.chunks = query_chunks(document_ids, chunk_size) if impl == "blockwise" else None

    def __call__(self, layer_idx: int, q, k, v) -> torch.Tensor:
        keys = self.keys.setdefault(layer_idx, [])
        values = self.values.setdefault(layer_idx, [])
        keys.append(k)
        values.append(v)
        if self.impl == "blockwise":
            return blockwise_ttt_attention(q, keys, values, self.document_ids, self.chunks)
        step = len(keys) - 1
        if step not in self.block_masks:
            self.block_masks[step] = ttt_block_mask(self.document_ids, step)
        return flex_ttt_attention(q, keys, values, self.block_masks[step])


def check_document_ids(document_ids: torch.Tensor) -> None:
    """Each real document id must form one contiguous run per row (the packer's contract)."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    num_runs = (starts & (document_ids >= 0)).sum(1)  # [B]
    for row in range(document_ids.shape[0]):
        ids = document_ids[row]
        num_docs = ids[ids >= 0].unique().numel()
        if int(num_runs[row]) != num_docs:
            raise UserError(f"row {row}: a document id appears in more than one run; packed documents must be contiguous")


def query_chunks(document_ids: torch.Tensor, chunk_size: int) -> list[tuple[int, int, int]]:
    """(start, end, first_key) per query chunk: no query in [start, end) sees a step-0 key before first_key."""
    B, T = document_ids.shape
    positions = torch.arange(T, device=document_ids.device).expand(B, T)
    is_start = torch.ones_like(document_ids, dtype=torch.bool)
    is_start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    run_start = torch.where(is_start, positions, 0).cummax(dim=1).values  # [B, T] first index of t's run
    first_keys = run_start[:, ::chunk_size].min(dim=0).values.tolist()
    return [(a, min(a + chunk_size, T), lo) for a, lo in zip(range(0, T, chunk_size), first_keys)]


def blockwise_ttt_attention(q, keys, values, document_ids, chunks) -> torch.Tensor:
    """Exact TTT attention in query chunks; each chunk is recomputed in backward, so memory is linear in T.

    q [B, heads, T, d]; keys/values: (j+1) x [B, kv_heads, T, d] (step 0 first) -> [B, heads, T, d].
    """
    B, num_heads, T, d = q.shape
    kv_heads = keys[0].shape[1]
    q5 = q.view(B, kv_heads, num_heads // kv_heads, T, d)  # [B, kvh, g, T, d]; head h uses kv head h // g
    k_diag = torch.stack(keys[1:], dim=-2) if len(keys) > 1 else None  # [B, kvh, T, j, d]
    v_diag = torch.stack(values[1:], dim=-2) if len(values) > 1 else None
    outs = []
    for a, b, lo in chunks:
        args = (q5[..., a:b, :], keys[0][:, :, lo:b], values[0][:, :, lo:b],
                document_ids[:, a:b], document_ids[:, lo:b], a, lo,
                None if k_diag is None else k_diag[:, :, a:b], None if v_diag is None else v_diag[:, :, a:b])
        if torch.is_grad_enabled():
            outs.append(checkpoint(attend_query_chunk, *args, use_reentrant=False))
        else:
            outs.append(attend_query_chunk(*args))
    return torch.cat(outs, dim=-2).view(B, num_heads, T, d)


def attend_query_chunk(q, k0, v0, doc_q, doc_k, q_start: int, k_start: int, k_diag, v_diag) -> torch.Tensor:
    """One softmax over [visible step-0 keys | own diagonal keys] for queries q [B, kvh, g, C, d]."""
    return attend_shared_and_own_keys(q, k0, v0, context_mask(doc_q, doc_k, q_start, k_start), k_diag, v_diag)


def context_mask(doc_q, doc_k, q_start: int, k_start: int) -> torch.Tensor:
    """[B, C, S] bool: step-0 key s is visible to query t iff s <= t, same document; padding sees only itself."""
    t = torch.arange(q_start, q_start + doc_q.shape[1], device=doc_q.device)[:, None]  # [C, 1]
    s = torch.arange(k_start, k_start + doc_k.shape[1], device=doc_q.device)[None, :]  # [1, S]
    same_doc = doc_q[:, :, None] == doc_k[:, None, :]  # [B, C, S]
    return (s <= t) & same_doc & ((doc_q[:, :, None] >= 0) | (s == t))


@functools.cache
def flex_functions(device_type: str):
    """(create_block_mask, flex_attention), compiled on CUDA; eager elsewhere (CPU: forward only)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if device_type == "cuda":
        return torch.compile(create_block_mask), torch.compile(flex_attention)
    return create_block_mask, flex_attention


def ttt_block_mask(document_ids: torch.Tensor, step: int):
    """BlockMask over a KV axis of (step+1)*T: block 0 holds step-0 keys, block i the step-i keys."""
    B, T = document_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):
        s = kv_idx % T
        doc_q, doc_k = document_ids[b, q_idx], document_ids[b, s]
        context = (kv_idx < T) & (s <= q_idx) & (doc_q == doc_k) & ((doc_q >= 0) | (s == q_idx))
        return context | ((kv_idx >= T) & (s == q_idx))

    create_block_mask, _ = flex_functions(document_ids.device.type)
    return create_block_mask(mask_mod, B, None, T, (step + 1) * T, device=document_ids.device)


def flex_ttt_attention(q, keys, values, block_mask) -> torch.Tensor:
    """q [B, heads, T, d] against all steps' keys concatenated on the KV axis -> [B, heads, T, d]."""
    _, flex_attention = flex_functions(q.device.type)
    k = torch.cat(keys, dim=2)  # [B, kvh, (j+1) T, d]
    v = torch.cat(values, dim=2)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=keys[0].shape[1] != q.shape[1])
