"""P-EAGLE parallel drafting in training: COD sampling, the element attention mask (CPU blockwise and flex),
element inputs, loss and sequence partitioning (DESIGN section 5; reference/parallel-drafting.md 1.3-1.6, 6).

An element (a, d) is anchor a (shifted index: token x[a+1], aux F[a]) at depth d; it predicts x[a+d+2].
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from draftsmith.data.errors import UserError
from draftsmith.train.attention import attend_shared_and_own_keys
from draftsmith.train.loss import TeacherTargets, head_soft_cross_entropy, teacher_targets
from draftsmith.train.ttt import ATTENTION_IMPLS, check_document_ids, flex_functions, shift_for_ttt

# ---- COD sampling (PARD's COnditional Drop-token) ----------------------------------------------------------


def cod_depth_size(num_seeds: int, depth: int, r: float, r_min: float) -> int:
    """Elements kept at depth d >= 1: int((n_seed - d) * max(r**d, r_min)), never negative."""
    return max(int((num_seeds - depth) * max(r**depth, r_min)), 0)


def seed_positions(loss_mask: torch.Tensor, max_anchors: int, generator=None) -> torch.Tensor:
    """Sorted positions whose shifted loss mask is 1, randomly capped at max_anchors (0 = no cap)."""
    seeds = loss_mask.nonzero().squeeze(-1)
    if 0 < max_anchors < seeds.numel():
        seeds = seeds[torch.randperm(seeds.numel(), generator=generator)[:max_anchors]].sort().values
    return seeds


def alive_anchors(anchors: torch.Tensor, depth: int, loss_mask, document_ids) -> torch.Tensor:
    """The chains among `anchors` that may grow to `depth`: a+depth is in a's document and loss-masked."""
    T = loss_mask.numel()
    at = (anchors + depth).clamp(max=T - 1)
    ok = (anchors + depth < T) & loss_mask[at] & (document_ids[at] == document_ids[anchors])
    return anchors[ok & (document_ids[anchors] >= 0)]


def grow_chains(loss_mask, document_ids, seeds, num_depths: int, pick) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth 0 = every position; depth d = pick(alive chains, d) (sorted); seed p starts the chain at p-1.

    Returns anchor [N], depth [N] (long, depth-major, sorted by anchor within a depth). Every chain is a
    contiguous prefix of depths because depth d only draws from chains kept at depth d-1.
    """
    T = loss_mask.numel()
    anchors, depths = [torch.arange(T)], [torch.zeros(T, dtype=torch.long)]
    chains = alive_anchors(seeds[seeds >= 1] - 1, 1, loss_mask, document_ids)
    for d in range(1, num_depths):
        chosen = pick(chains, d)
        if chosen.numel() == 0:
            break
        anchors.append(chosen)
        depths.append(torch.full_like(chosen, d))
        chains = alive_anchors(chosen, d + 1, loss_mask, document_ids)
    return torch.cat(anchors), torch.cat(depths)


def cod_sample(loss_mask, document_ids, num_depths: int, r: float, r_min: float, max_anchors: int,
               generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """COD elements of one packed row: loss_mask [T] (shifted, bool), document_ids [T] (-1 = padding), on CPU.

    Depth d keeps cod_depth_size(n_seed, d) chains (fewer if fewer are alive), uniformly without replacement.
    """
    loss_mask = loss_mask.bool()
    seeds = seed_positions(loss_mask, max_anchors, generator)

    def pick(chains, d):
        size = min(cod_depth_size(seeds.numel(), d, r, r_min), chains.numel())
        return chains[torch.randperm(chains.numel(), generator=generator)[:size]].sort().values

    return grow_chains(loss_mask, document_ids, seeds, num_depths, pick)


def all_chain_elements(loss_mask, document_ids, num_depths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every chain grown as deep as it stays alive (deterministic; used for held-out evaluation)."""
    loss_mask = loss_mask.bool()
    return grow_chains(loss_mask, document_ids, seed_positions(loss_mask, 0), num_depths, lambda c, d: c)


# ---- the attention mask ------------------------------------------------------------------------------------


def peagle_visible(doc_q, anchor_q, depth_q, doc_k, anchor_k, depth_k) -> torch.Tensor:
    """Key element k is visible to query element q (broadcasting; speculators create_peagle_mask_mod).

    q = (a, d) sees the depth-0 elements of anchors <= a in its document (the real context and, at a itself,
    the bonus slot) and its own chain at depths <= d. A padding query (document -1) sees only itself.
    """
    context = (depth_k == 0) & (anchor_k <= anchor_q) & ((doc_q >= 0) | (anchor_k == anchor_q))
    own_chain = (anchor_k == anchor_q) & (depth_k <= depth_q)
    return (doc_q == doc_k) & (context | own_chain)


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[T] index of the first position of each position's document run."""
    T = document_ids.numel()
    is_start = torch.ones(T, dtype=torch.bool, device=document_ids.device)
    is_start[1:] = document_ids[1:] != document_ids[:-1]
    return torch.where(is_start, torch.arange(T, device=document_ids.device), 0).cummax(0).values


def chain_index(anchor: torch.Tensor, depth: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[N, max depth]: column j-1 holds the index of element (a, j) for (a, d) when j <= d, else -1."""
    max_depth = int(depth.max()) if depth.numel() else 0
    out = torch.full((anchor.numel(), max_depth), -1, dtype=torch.long)
    index = torch.arange(anchor.numel())
    for j in range(1, max_depth + 1):
        table = torch.full((num_positions,), -1, dtype=torch.long)
        table[anchor[depth == j]] = index[depth == j]
        out[:, j - 1] = torch.where(depth >= j, table[anchor], -1)
    return out


def element_chunks(anchor, depth, document_ids, chunk_size: int) -> list[tuple[int, int, int, int, int]]:
    """(start, end, key_lo, key_hi, depth) per query chunk; no query of a chunk sees a depth-0 key outside
    [key_lo, key_hi) (anchors sorted per depth, documents contiguous). Chunks never straddle depths, and a
    chunk of sparse deep anchors ends at a document boundary once its key window passes 2 * chunk_size."""
    starts = document_starts(document_ids).tolist()
    anchors = anchor.tolist()
    out, s = [], 0
    for d, n in enumerate(torch.bincount(depth).tolist()):
        first = s
        for i in range(s + 1, s + n + 1):
            new_doc = i < s + n and starts[anchors[i]] != starts[anchors[i - 1]]
            wide = i < s + n and anchors[i] - starts[anchors[first]] > 2 * chunk_size
            if i == s + n or i - first == chunk_size or (new_doc and wide):
                out.append((first, i, starts[anchors[first]], anchors[i - 1] + 1, d))
                first = i
        s += n
    return out


class PEagleAttention:
    """attention(layer_idx, q, k, v) over N elements, depth-major: elements[:T] are depth 0 at anchors 0..T-1.

    anchor, depth [N] and document_ids [T] come on the CPU (planning); `device` is where the forward runs.
    """

    def __init__(self, anchor, depth, document_ids, impl: str, device, chunk_size: int = 512):
        if impl not in ATTENTION_IMPLS:
            raise UserError(f"P-EAGLE attention {impl!r} is not one of {ATTENTION_IMPLS}")
        check_document_ids(document_ids[None])
        T = document_ids.numel()
        if not torch.equal(anchor[:T], torch.arange(T)) or bool(depth[:T].any()):
            raise UserError("elements must start with depth 0 at every anchor 0..T-1, in order")
        self.impl, self.block_mask = impl, None
        self.anchor, self.depth = anchor.to(device), depth.to(device)
        self.document_ids = document_ids.to(device)
        self.doc_q = self.document_ids[self.anchor]
        if impl == "blockwise":
            self.chunks = element_chunks(anchor, depth, document_ids, chunk_size)
            self.chains = chain_index(anchor, depth, T).to(device)

    def __call__(self, layer_idx: int, q, k, v) -> torch.Tensor:
        if self.impl == "blockwise":
            return blockwise_peagle_attention(q, k, v, self)
        if self.block_mask is None:  # one mask for every layer
            self.block_mask = peagle_block_mask(self.anchor, self.depth, self.document_ids)
        _, flex_attention = flex_functions(q.device.type)
        return flex_attention(q, k, v, block_mask=self.block_mask, enable_gqa=k.shape[1] != q.shape[1])


def blockwise_peagle_attention(q, k, v, att: PEagleAttention) -> torch.Tensor:
    """Exact P-EAGLE attention in query chunks, each recomputed in backward: memory ~ chunk x T per layer.

    q [B, heads, N, d], k/v [B, kv_heads, N, d] -> [B, heads, N, d].
    """
    B, num_heads, N, d = q.shape
    kv_heads = k.shape[1]
    q5 = q.view(B, kv_heads, num_heads // kv_heads, N, d)  # [B, kvh, g, N, d]; head h uses kv head h // g
    outs = []
    for s, e, lo, hi, depth in att.chunks:
        chain = att.chains[s:e, :depth]  # [C, depth] own chain (a, 1..depth), all present
        args = (q5[..., s:e, :], k[:, :, lo:hi], v[:, :, lo:hi], att.doc_q[s:e], att.anchor[s:e],
                att.depth[s:e], att.document_ids[lo:hi], lo,
                k[:, :, chain] if depth else None, v[:, :, chain] if depth else None)  # [B, kvh, C, depth, d]
        if torch.is_grad_enabled():
            outs.append(checkpoint(attend_element_chunk, *args, use_reentrant=False))
        else:
            outs.append(attend_element_chunk(*args))
    return torch.cat(outs, dim=-2).view(B, num_heads, N, d)


def attend_element_chunk(q, k0, v0, doc_q, anchor_q, depth_q, doc_k, k_start: int, k_chain, v_chain):
    """One softmax over [depth-0 keys k_start.. | own chain keys] for queries q [B, kvh, g, C, d]."""
    anchor_k = torch.arange(k_start, k_start + doc_k.numel(), device=q.device)
    visible = peagle_visible(doc_q[:, None], anchor_q[:, None], depth_q[:, None], doc_k[None], anchor_k[None],
                             torch.zeros_like(anchor_k)[None])  # [C, S]
    return attend_shared_and_own_keys(q, k0, v0, visible[None], k_chain, v_chain)


def peagle_block_mask(anchor, depth, document_ids):
    """flex BlockMask [1, 1, N, N] of peagle_visible over the elements (GPU training path)."""
    N = anchor.numel()
    doc = document_ids[anchor]

    def mask_mod(b, h, q_idx, kv_idx):
        return peagle_visible(doc[q_idx], anchor[q_idx], depth[q_idx],
                              doc[kv_idx], anchor[kv_idx], depth[kv_idx])

    create_block_mask, _ = flex_functions(anchor.device.type)
    return create_block_mask(mask_mod, 1, None, N, N, device=anchor.device)


# ---- element inputs and loss -------------------------------------------------------------------------------


@dataclass
class ShiftedRow:
    """One packed row after the EAGLE shift: index t holds x[t+1], F[t] and the teacher for x[t+2]."""

    input_ids: torch.Tensor  # [1, T]
    aux_hidden: torch.Tensor  # [1, T, n_aux * H_t]
    position_ids: torch.Tensor  # [1, T]
    document_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool, shifted: drives COD
    teacher: TeacherTargets  # at the shifted loss mask's positions (slot [1, T])
    scored: torch.Tensor  # [T] bool: shifted loss mask and the target argmax is in the draft vocab


def shift_parallel_row(row: dict, teacher_weight, t2d, teacher_kind: str = "distribution",
                       teacher_temperature: float = 1.0) -> ShiftedRow:
    """A packed row (data/ + packing.py, batch 1) -> ShiftedRow; the aux states are not shifted. teacher_kind
    and teacher_temperature are train.teacher and train.teacher_temperature."""
    ids, final, mask = shift_for_ttt(row["input_ids"], row["final_hidden_states"], row["loss_mask"],
                                     row["document_ids"])
    teacher = teacher_targets(final.float(), teacher_weight, t2d, needed=mask, kind=teacher_kind,
                              temperature=teacher_temperature)
    return ShiftedRow(input_ids=ids, aux_hidden=row["aux_hidden_states"].float(),
                      position_ids=row["position_ids"], document_ids=row["document_ids"][0],
                      loss_mask=mask[0], teacher=teacher, scored=(mask & teacher.in_vocab)[0])


def element_inputs(drafter, input_ids, aux_hidden, position_ids, anchor, depth, mask_token_id: int):
    """(tokens [1, N], hidden [1, N, H], positions [1, N]) of the elements over a row window [1, T, ...].

    Depth 0 at a: (x[a+1], fc(F[a])) at position p[a]; depth d >= 1: (mask token, fc(mask_hidden)) at
    p[a] + d.
    mask_hidden goes through the same norms + fc as F, like vLLM's combine_hidden_states(mask_hidden).
    """
    T = input_ids.shape[1]
    tokens = torch.where(depth > 0, mask_token_id, input_ids[0, anchor])[None]  # [1, N]
    context = drafter.combine_aux_hidden_states(aux_hidden)  # [1, T, H]; elements[:T] are depth 0 in order
    mask_hidden = drafter.combine_aux_hidden_states(drafter.mask_hidden[None])  # [1, 1, H]
    hidden = torch.cat([context, mask_hidden.expand(1, anchor.numel() - T, -1)], dim=1)  # [1, N, H]
    return tokens, hidden, (position_ids[0, anchor] + depth)[None]


def depth_loss_sums(head_inputs, head_weight, teacher: TeacherTargets, target, scored, depth_sizes: list[int]):
    """Soft-CE sums, top-1 hits and counts, each per depth [D], over scored elements. Elements are depth-major.

    head_inputs [N, H] (the draft head's input, norm(h)); target [N]: the shifted index each element is scored
    at; scored [N] bool; depth_sizes: elements per depth (summing to N). The head runs only at scored elements,
    fused with its loss (train/loss.py).
    """
    ce_sums, correct, count = [], [], []
    pieces = zip(head_inputs.split(depth_sizes), target.split(depth_sizes), scored.split(depth_sizes))
    for depth_inputs, depth_target, depth_scored in pieces:
        rows = teacher.slot[0, depth_target[depth_scored]]
        ce, hits, _ = head_soft_cross_entropy(depth_inputs[depth_scored], head_weight, teacher, rows)
        ce_sums.append(ce)
        correct.append(hits)
        count.append(depth_scored.sum())
    return torch.stack(ce_sums), torch.stack(correct), torch.stack(count)


# ---- sequence partitioning ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ParallelSetup:
    mask_token_id: int
    """Token id fed to every mask slot (exported as mask_token_id)."""
    num_depths: int
    """Depths D trained (metrics have D entries)."""
    partition_elements: int = 4096
    """Scored elements per forward; more are split into partitions (0 = never split)."""
    loss_weighting: str = "elements"
    """elements (mean over scored elements) or depths (mean over depths of each depth's mean)."""
    attention_impl: str = "blockwise"
    """blockwise (CPU) or flex (GPU)."""
    chunk_size: int = 512
    """Queries per blockwise attention chunk."""


def plan_partitions(anchor, depth, document_ids, max_elements: int) -> list[tuple[int, int, int]]:
    """(start, lo, end) per partition: it scores the elements with anchors in [lo, end) (at most max_elements
    unless one anchor alone has more) and re-runs the depth-0 context [start, lo) of lo's document."""
    T = document_ids.numel()
    if max_elements <= 0 or anchor.numel() <= max_elements:
        return [(0, 0, T)]
    starts = document_starts(document_ids).tolist()
    parts, lo, used = [], 0, 0
    for a, n in enumerate(torch.bincount(anchor, minlength=T).tolist()):
        if used + n > max_elements and a > lo:
            parts.append((starts[lo], lo, a))
            lo, used = a, 0
        used += n
    return parts + [(starts[lo], lo, T)]


def partition_loss_sums(drafter, row: ShiftedRow, anchor, depth, part, setup: ParallelSetup):
    """(ce_sum [D], correct [D], count [D]) of one partition; exact: its window holds all keys its queries see."""
    start, lo, end = part
    keep = (anchor >= start) & (anchor < end) & ((depth == 0) | (anchor >= lo))  # order stays depth-major
    a, d = anchor[keep], depth[keep]  # CPU
    device = row.input_ids.device
    attention = PEagleAttention(a - start, d, row.document_ids[start:end].cpu(), setup.attention_impl, device,
                                setup.chunk_size)
    window = slice(start, end)
    a_dev, d_dev = a.to(device), d.to(device)
    tokens, hidden, positions = element_inputs(drafter, row.input_ids[:, window], row.aux_hidden[:, window],
                                               row.position_ids[:, window], a_dev - start, d_dev,
                                               setup.mask_token_id)
    _, head_inputs = drafter(tokens, hidden, positions, attention, apply_lm_head=False)  # [1, n, H]
    target = a_dev + d_dev  # element (a, d) is scored against the teacher at shifted index a + d
    scored = row.scored[target] & (a_dev >= lo)
    sizes = torch.bincount(d, minlength=setup.num_depths).tolist()
    return depth_loss_sums(head_inputs[0], drafter.lm_head.weight, row.teacher, target, scored, sizes)


def parallel_loss(drafter, row: ShiftedRow, anchor, depth, setup: ParallelSetup):
    """The soft CE weighted per setup.loss_weighting, and per-depth metrics [D] as tensors: elements = the mean
    over all scored elements (a depth weighs by its COD count), depths = the mean over the depths that have
    scored elements of each one's mean.

    With several partitions each one is checkpointed: backward re-runs them one at a time, so the returned
    loss has the exact unpartitioned gradient while only one partition's activations live at once.
    """
    parts = plan_partitions(anchor, depth, row.document_ids.cpu(), setup.partition_elements)
    use_checkpoint = len(parts) > 1 and torch.is_grad_enabled()
    ce_sum, correct, count = 0.0, 0, 0
    for part in parts:
        fn = functools.partial(partition_loss_sums, drafter, row, anchor, depth, part, setup)
        ce, hits, n = checkpoint(fn, use_reentrant=False) if use_checkpoint else fn()
        ce_sum, correct, count = ce_sum + ce, correct + hits, count + n
    if setup.loss_weighting == "depths":
        loss = (ce_sum / count.clamp(min=1)).sum() / (count > 0).sum().clamp(min=1)
    else:
        loss = ce_sum.sum() / count.sum().clamp(min=1)
    metrics = {"loss": loss.detach(), "acc": correct / count.clamp(min=1), "correct": correct, "count": count}
    return loss, metrics
