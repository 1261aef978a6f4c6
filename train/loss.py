"""TTT loss and metrics: teacher logits over the draft vocab, soft cross-entropy, accuracy (DESIGN section 3).

Positions whose target argmax lies outside the draft vocab are masked; each step's loss is normalised by its
mask count, not B*T (EAGLE #340).
"""
from __future__ import annotations

import torch


@torch.no_grad()
def teacher_from_final_hidden(final_hidden, target_lm_head_weight, t2d, chunk_size: int = 1024):
    """Target logits restricted to the draft vocab, and the mask of positions whose target argmax is in it.

    final_hidden [B, T, H_t] is already after the target's final norm, so the teacher is just lm_head.
    target_lm_head_weight [V_t, H_t]; t2d [V_t] bool. Full-vocab logits exist only for chunk_size positions
    at a time. Draft id i is the i-th marked target id in ascending order, as d2t encodes it.
    Returns teacher_logits [B, T, V_d] (dtype of final_hidden) and in_vocab [B, T] bool.
    """
    B, T, H = final_hidden.shape
    flat = final_hidden.reshape(B * T, H)  # [N, H_t]
    weight = target_lm_head_weight.to(flat.dtype)
    draft_ids = t2d.nonzero().squeeze(-1)  # [V_d] ascending target ids
    teacher = flat.new_empty(B * T, draft_ids.numel())  # [N, V_d]
    in_vocab = torch.empty(B * T, dtype=torch.bool, device=flat.device)
    for a in range(0, B * T, chunk_size):
        logits = flat[a : a + chunk_size] @ weight.T  # [C, V_t]
        in_vocab[a : a + chunk_size] = t2d[logits.argmax(dim=-1)]
        teacher[a : a + chunk_size] = logits[:, draft_ids]
    return teacher.view(B, T, -1), in_vocab.view(B, T)


def ttt_step_loss(logits, teacher_logits, mask):
    """Soft cross-entropy of one step, summed over masked positions; plus the top-1 hit count.

    logits and teacher_logits [B, n, V_d] are aligned (teacher already offset by the step), mask [B, n] bool.
    """
    work = torch.promote_types(logits.dtype, torch.float32)  # at least fp32; float64 stays float64
    log_q = torch.log_softmax(logits.to(work), dim=-1)  # [B, n, V_d]
    teacher = teacher_logits.to(work)
    ce = -(torch.softmax(teacher, dim=-1) * log_q).sum(-1)  # [B, n]
    ce_sum = torch.where(mask, ce, 0.0).sum()
    correct = ((log_q.argmax(-1) == teacher.argmax(-1)) & mask).sum()
    return ce_sum, correct


def ttt_loss(step_logits, teacher_logits, step_masks, step_weight: float):
    """Weighted TTT loss sum_j step_weight**j * CE_j, and per-step metrics as tensors (no host sync).

    step_logits: J x [B, T, V_d] from ttt_forward; teacher_logits [B, T, V_d] from the shifted final hidden;
    step_masks [J, B, T] from ttt_step_masks (shifted loss mask AND in-vocab AND same document).
    Step j at t is scored against the teacher at t+j. Metrics: loss, acc, correct, count, each [J].
    """
    T = teacher_logits.shape[1]
    losses, correct, counts = [], [], []
    for j, logits in enumerate(step_logits):
        n = max(T - j, 0)
        mask = step_masks[j, :, :n]
        ce_sum, hits = ttt_step_loss(logits[:, :n], teacher_logits[:, j : j + n], mask)
        count = mask.sum()
        losses.append(ce_sum / count.clamp(min=1))
        correct.append(hits)
        counts.append(count)
    losses_t = torch.stack(losses)  # [J]
    weights = step_weight ** torch.arange(len(losses), device=losses_t.device, dtype=losses_t.dtype)
    counts_t, correct_t = torch.stack(counts), torch.stack(correct)
    metrics = {
        "loss": losses_t.detach(),
        "acc": correct_t / counts_t.clamp(min=1),
        "correct": correct_t,
        "count": counts_t,
    }
    return (weights * losses_t).sum(), metrics


def simulated_acceptance_length(accs) -> torch.Tensor:
    """1 + sum_k prod_{i<=k} acc_i: the expected accepted length if step k's hit rate were independent."""
    accs = torch.as_tensor(accs, dtype=torch.float64)
    return 1 + torch.cumprod(accs, dim=0).sum()
