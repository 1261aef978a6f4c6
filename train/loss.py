"""TTT loss and metrics: the teacher over the draft vocab, soft cross-entropy, accuracy (DESIGN section 3).

Positions whose target argmax lies outside the draft vocab are masked; each step's loss is normalised by its
mask count, not B*T (EAGLE #340). EAGLE-3 (ttt_loss) and P-EAGLE (train/parallel.py) run the fused path
(teacher_targets, HeadSoftCrossEntropy): the draft head runs only at scored positions, its gradient formed in
forward. The dense path (teacher_from_final_hidden, ttt_step_loss) is the plain reference the tests and
bench/step_speed.py compare against.
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class TeacherTargets:
    """The teacher at the positions a row scores, computed once and shared by every TTT step.

    probs [M, V_d]: softmax of the target logits over the draft vocab (divided by temperature first); argmax
    [M]: its draft id; slot [B, T]: the row of probs/argmax for position t (-1 where nothing is scored); in_vocab
    [B, T]: the target's argmax over its full vocab is a draft token (False where not computed); temperature:
    the draft logits are divided by it too before their softmax, and the loss is scaled by its square.
    """

    probs: torch.Tensor
    argmax: torch.Tensor
    slot: torch.Tensor
    in_vocab: torch.Tensor
    temperature: float = 1.0


@torch.no_grad()
def teacher_targets(final_hidden, target_lm_head_weight, t2d, needed, chunk_size: int = 1024,
                    kind: str = "distribution", temperature: float = 1.0) -> TeacherTargets:
    """The teacher of `teacher_from_final_hidden`, only where `needed` [B, T] holds (the shifted loss mask),
    as probabilities: the full-vocab product and the softmax run once per row, not once per TTT step.
    kind (train.teacher): distribution = the softmax of the logits / temperature (train.teacher_temperature);
    argmax = the one-hot of the top draft token (temperature 1 only: a one-hot has none)."""
    if kind not in ("distribution", "argmax"):
        raise ValueError(f"teacher kind must be distribution or argmax, got {kind!r}")
    if temperature <= 0 or (kind == "argmax" and temperature != 1.0):
        raise ValueError(f"teacher temperature must be > 0, and 1 for the argmax teacher; got {temperature}")
    B, T, H = final_hidden.shape
    flat_needed = needed.reshape(-1)
    where = flat_needed.nonzero().squeeze(-1)  # [M]
    states = final_hidden.reshape(B * T, H)[where]  # [M, H_t]
    weight = target_lm_head_weight.to(states.dtype)
    draft_ids = t2d.nonzero().squeeze(-1)  # [V_d]
    work = torch.promote_types(states.dtype, torch.float32)
    probs = torch.empty(where.numel(), draft_ids.numel(), dtype=work, device=states.device)
    argmax = torch.empty(where.numel(), dtype=torch.long, device=states.device)
    in_vocab = torch.zeros(B * T, dtype=torch.bool, device=states.device)
    for a in range(0, where.numel(), chunk_size):
        logits = states[a : a + chunk_size] @ weight.T  # [C, V_t]
        in_vocab[where[a : a + chunk_size]] = t2d[logits.argmax(dim=-1)]
        draft_logits = logits[:, draft_ids].to(work)  # [C, V_d]
        argmax[a : a + chunk_size] = draft_logits.argmax(dim=-1)
        if kind == "argmax":  # the scored positions' top token is a draft token (in_vocab masks the rest)
            probs[a : a + chunk_size] = 0.0
            probs[a : a + chunk_size].scatter_(1, argmax[a : a + chunk_size, None], 1.0)
        else:
            probs[a : a + chunk_size] = torch.softmax(draft_logits / temperature, dim=-1)
    slot = torch.full((B * T,), -1, dtype=torch.long, device=states.device)
    slot[where] = torch.arange(where.numel(), device=states.device)
    return TeacherTargets(probs, argmax, slot.view(B, T), in_vocab.view(B, T), temperature)


class HeadSoftCrossEntropy(torch.autograd.Function):
    """sum_i tau^2 CE(p_i, softmax(x_i W^T / tau)), the top-1 hits, and each row's rank of the teacher's argmax,
    with [n, V] logits only chunk_size rows at a time (tau = temperature; 1 is plain soft cross-entropy).

    The gradient is taken in forward, chunk by chunk (dCE/dlogits = tau (softmax - p), as each p sums to 1): no
    logits are kept for backward and no log_softmax backward runs; backward scales the stored dx, dW.
    x [n, H], weight [V, H], teacher_probs [M, V] with rows [n] picking each x_i's teacher, teacher_argmax [M].
    The tau^2 keeps the gradient's scale that of tau = 1, as in Hinton et al.'s distillation.
    ranks [n]: how many draft logits of row i exceed the one at the teacher's argmax (0 = the draft's top token).
    """

    @staticmethod
    def forward(ctx, x, weight, teacher_probs, rows, teacher_argmax, chunk_size: int, need_grad: bool,
                temperature: float = 1.0):
        work = torch.promote_types(x.dtype, torch.float32)
        ce_sum = torch.zeros((), dtype=work, device=x.device)
        hits = torch.zeros((), dtype=torch.long, device=x.device)
        ranks = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(weight.shape, dtype=work, device=x.device) if need_grad else None
        for a in range(0, x.shape[0], chunk_size):
            xc, rc = x[a : a + chunk_size], rows[a : a + chunk_size]
            z = (xc @ weight.T).to(work)  # [C, V]
            p = teacher_probs[rc].to(work)  # [C, V]
            hits += (z.argmax(dim=-1) == teacher_argmax[rc]).sum()
            ranks[a : a + chunk_size] = (z > z.gather(1, teacher_argmax[rc, None])).sum(dim=-1)
            if temperature != 1.0:
                z.div_(temperature)
            p_dot_z = torch.einsum("cv,cv->c", p, z)
            # one exp pass gives both logsumexp and softmax; z's storage is reused for exp(z - max), then dz
            z_max = z.amax(dim=-1)
            exp_sum = z.sub_(z_max[:, None]).exp_().sum(dim=-1)
            ce_sum += (z_max + exp_sum.log() - p_dot_z).sum() * temperature**2
            if need_grad:
                dz = z.div_(exp_sum[:, None]).sub_(p)  # softmax - p
                if temperature != 1.0:
                    dz.mul_(temperature)
                grad_x[a : a + chunk_size] = dz.to(x.dtype) @ weight
                if torch.is_autocast_enabled(x.device.type):
                    grad_w += dz.T @ xc  # the product in autocast's dtype, like the forward's
                else:
                    grad_w.addmm_(dz.T, xc.to(work))
        ctx.mark_non_differentiable(hits, ranks)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_x, grad_w)
        return ce_sum, hits, ranks

    @staticmethod
    def backward(ctx, grad_ce, _grad_hits, _grad_ranks):
        grad_x, grad_w = ctx.saved_tensors
        if grad_x is None:
            raise RuntimeError("HeadSoftCrossEntropy was called with need_grad=False and then differentiated")
        return ((grad_ce * grad_x).to(grad_x.dtype), (grad_ce * grad_w).to(ctx.weight_dtype),
                None, None, None, None, None, None)


def head_soft_cross_entropy(x, weight, teacher: TeacherTargets, rows, chunk_size: int = 1024):
    """(CE sum, top-1 hits, ranks [n] of the teacher's argmax) of the draft head on x [n, H] against teacher rows
    `rows` [n]."""
    need_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return HeadSoftCrossEntropy.apply(x, weight, teacher.probs, rows, teacher.argmax, chunk_size, need_grad,
                                      teacher.temperature)


def ttt_loss(head_weight, step_states, teacher: TeacherTargets, step_masks, step_weight: float,
             chunk_size: int = 1024, alignment_topk: int = 0):
    """Weighted TTT loss sum_j step_weight**j * CE_j, and per-step metrics as tensors (no host sync).

    head_weight: the draft lm_head [V_d, H]; step_states: J x [B, T, H] from ttt_forward; teacher from
    teacher_targets over the shifted final hidden; step_masks [J, B, T] from ttt_step_masks (shifted loss mask
    AND in-vocab AND same document). Step j at t is scored against the teacher at t+j, and the head runs only at
    scored positions. alignment_topk k > 0 (ttt.alignment_topk) also drops step j at t unless every earlier step
    at t was scored with the teacher's argmax in its top k: a draft that served would have been rejected there,
    so nothing after it is ever used (GRIFFIN's token-alignable training). Metrics: loss, acc, correct, count,
    each [J].
    """
    losses, correct, counts = [], [], []
    aligned = None  # [B, T] bool: every step so far kept the teacher's argmax in its top alignment_topk
    for j, states in enumerate(step_states):
        mask = step_masks[j] if aligned is None else step_masks[j] & aligned
        b, t = mask.nonzero(as_tuple=True)  # a step-j mask holds only where t + j < T
        ce_sum, hits, ranks = head_soft_cross_entropy(states[b, t], head_weight, teacher, teacher.slot[b, t + j],
                                                      chunk_size)
        if alignment_topk > 0:
            aligned = torch.zeros_like(mask)
            aligned[b, t] = ranks < alignment_topk
        count = torch.tensor(b.numel(), device=ce_sum.device)
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
