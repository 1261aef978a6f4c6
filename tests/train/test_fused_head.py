"""The fused draft head + loss (train/loss.py) against the dense step it replaced: logits [T, V_d] for every
position and step, log_softmax, soft CE, masked sum. Same loss, metrics and gradients; less memory."""
from __future__ import annotations

import pytest
import torch

from draftsmith.train.loss import (
    HeadSoftCrossEntropy,
    teacher_from_final_hidden,
    teacher_targets,
    ttt_loss,
    ttt_step_loss,
)

B, T, H, H_T, V_T, V_D, J = 2, 96, 32, 24, 300, 120, 3


def random_case(seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    final = torch.randn(B, T, H_T, generator=g, dtype=dtype)
    target_head = torch.randn(V_T, H_T, generator=g, dtype=dtype) * 0.5
    t2d = torch.zeros(V_T, dtype=torch.bool)
    t2d[torch.randperm(V_T, generator=g)[:V_D]] = True
    loss_mask = torch.rand(B, T, generator=g) < 0.7
    head = (torch.randn(V_D, H, generator=g, dtype=dtype) * 0.3).requires_grad_(True)
    states = [(torch.randn(B, T, H, generator=g, dtype=dtype)).requires_grad_(True) for _ in range(J)]
    return final, target_head, t2d, loss_mask, head, states


def step_masks_of(loss_mask):
    """Step j at t scored iff the mask holds at t+j (one document per row)."""
    masks = torch.zeros(J, B, T, dtype=torch.bool)
    for j in range(J):
        masks[j, :, : T - j] = loss_mask[:, j:]
    return masks


def dense_ttt_loss(head, states, teacher_logits, step_masks, step_weight):
    """The step before the fused head: full [B, T, V_d] logits per step, then ttt_step_loss."""
    total, correct, counts = 0.0, [], []
    for j, s in enumerate(states):
        n = T - j
        logits = s @ head.T  # [B, T, V_d]
        mask = step_masks[j, :, :n]
        ce_sum, hits = ttt_step_loss(logits[:, :n], teacher_logits[:, j: j + n], mask)
        total = total + step_weight**j * ce_sum / mask.sum().clamp(min=1)
        correct.append(hits)
        counts.append(mask.sum())
    return total, torch.stack(correct), torch.stack(counts)


@pytest.mark.parametrize("chunk_size", [7, 64, 4096])
def test_fused_loss_and_gradients_equal_the_dense_step(chunk_size):
    final, target_head, t2d, loss_mask, head, states = random_case()
    teacher_logits, in_vocab = teacher_from_final_hidden(final, target_head, t2d)
    masks = step_masks_of(loss_mask & in_vocab)
    want, want_correct, want_count = dense_ttt_loss(head, states, teacher_logits, masks, 0.8)
    want_grads = torch.autograd.grad(want, [head, *states])

    teacher = teacher_targets(final, target_head, t2d, loss_mask, chunk_size=chunk_size)
    assert teacher.in_vocab.tolist() == (in_vocab & loss_mask).tolist()
    got, metrics = ttt_loss(head, states, teacher, masks, 0.8, chunk_size=chunk_size)
    got_grads = torch.autograd.grad(got, [head, *states])

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert metrics["correct"].tolist() == want_correct.tolist()
    assert metrics["count"].tolist() == want_count.tolist()
    assert min(want_count.tolist()) > 0 and 0 < sum(want_correct.tolist())
    for name, g, w in zip(["head"] + [f"states[{j}]" for j in range(J)], got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_teacher_targets_equal_the_dense_teacher():
    final, target_head, t2d, loss_mask, *_ = random_case(seed=3, dtype=torch.float64)
    teacher_logits, in_vocab = teacher_from_final_hidden(final, target_head, t2d)
    teacher = teacher_targets(final, target_head, t2d, loss_mask, chunk_size=5)
    b, t = loss_mask.nonzero(as_tuple=True)
    rows = teacher.slot[b, t]
    assert (rows >= 0).all() and (teacher.slot[~loss_mask] == -1).all()
    torch.testing.assert_close(teacher.probs[rows], torch.softmax(teacher_logits[b, t], dim=-1), rtol=1e-12, atol=1e-12)
    assert teacher.argmax[rows].tolist() == teacher_logits[b, t].argmax(-1).tolist()
    assert teacher.in_vocab[b, t].tolist() == in_vocab[b, t].tolist()


def test_no_logits_are_kept_for_backward():
    """What autograd keeps from the head + loss is O(n H + V H): the gradients, never an [n, V] tensor."""
    final, target_head, t2d, loss_mask, head, states = random_case(seed=1)
    teacher = teacher_targets(final, target_head, t2d, loss_mask)
    kept = []

    def pack(t):
        kept.append(t.numel())
        return t

    masks = step_masks_of(loss_mask & teacher.in_vocab)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_loss(head, states, teacher, masks, 0.8, chunk_size=16)
    n = int(masks.sum())
    assert kept, "the loss must keep its gradients for backward"
    assert max(kept) <= max(B * T * H, V_D * H), f"a tensor of {max(kept)} elements was kept ({n} scored x {V_D})"


def test_without_grad_the_gradient_is_not_computed():
    final, target_head, t2d, loss_mask, head, states = random_case(seed=2)
    teacher = teacher_targets(final, target_head, t2d, loss_mask)
    masks = step_masks_of(loss_mask & teacher.in_vocab)
    with torch.no_grad():
        loss, _ = ttt_loss(head, states, teacher, masks, 0.8)
    with_grad, _ = ttt_loss(head, states, teacher, masks, 0.8)
    torch.testing.assert_close(loss, with_grad.detach(), rtol=1e-6, atol=1e-6)
    x, rows = states[0][0, :4].detach(), teacher.slot[0, :4].clamp(min=0)
    ce, _, _ = HeadSoftCrossEntropy.apply(x.requires_grad_(True), head, teacher.probs, rows, teacher.argmax, 8, False)
    with pytest.raises(RuntimeError, match="need_grad=False"):
        ce.backward()


def test_the_argmax_teacher_is_cross_entropy_on_the_targets_top_token():
    """train.teacher=argmax: each step's loss is -log q(target argmax), brute force over full logits, and its
    gradients; the hits are the same as with the distribution teacher."""
    final, target_head, t2d, loss_mask, head, states = random_case(seed=4)
    teacher = teacher_targets(final, target_head, t2d, loss_mask, chunk_size=5, kind="argmax")
    masks = step_masks_of(loss_mask & teacher.in_vocab)
    got, metrics = ttt_loss(head, states, teacher, masks, 0.8, chunk_size=16)
    got_grads = torch.autograd.grad(got, [head, *states])

    draft_ids = t2d.nonzero().squeeze(-1)
    target_top = (final @ target_head.T).argmax(-1)  # [B, T] target ids over the full vocab
    want, hits = 0.0, []
    for j, s in enumerate(states):
        n = T - j
        log_q = torch.log_softmax(s[:, :n] @ head.T, dim=-1)  # [B, n, V_d]
        want_id = torch.searchsorted(draft_ids, target_top[:, j: j + n].contiguous())  # its draft id (in vocab where scored)
        mask = masks[j, :, :n]
        nll = -log_q.gather(-1, want_id.clamp(max=V_D - 1)[..., None])[..., 0]
        want = want + 0.8**j * nll[mask].sum() / mask.sum()
        hits.append(int(((log_q.argmax(-1) == want_id) & mask).sum()))
    want_grads = torch.autograd.grad(want, [head, *states])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert metrics["correct"].tolist() == hits and sum(hits) > 0
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    soft = teacher_targets(final, target_head, t2d, loss_mask, kind="distribution")
    assert (teacher.probs.sum(-1) == 1).all() and (teacher.probs.count_nonzero(-1) == 1).all()
    assert teacher.argmax.tolist() == soft.argmax.tolist() and not torch.equal(teacher.probs, soft.probs)
    with pytest.raises(ValueError, match="distribution or argmax"):
        teacher_targets(final, target_head, t2d, loss_mask, kind="hard")


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_a_teacher_temperature_is_hintons_distillation_loss(temperature):
    """train.teacher_temperature=tau: each step's loss is tau^2 sum_v softmax(t/tau) (-log softmax(s/tau)),
    brute force over full logits with autograd, and its gradients; the hits (argmax) do not depend on tau."""
    final, target_head, t2d, loss_mask, head, states = random_case(seed=4)
    teacher = teacher_targets(final, target_head, t2d, loss_mask, chunk_size=6, temperature=temperature)
    masks = step_masks_of(loss_mask & teacher.in_vocab)
    got, metrics = ttt_loss(head, states, teacher, masks, 0.8, chunk_size=16)
    got_grads = torch.autograd.grad(got, [head, *states])

    teacher_logits, _ = teacher_from_final_hidden(final, target_head, t2d)  # [B, T, V_d]
    want, hits = 0.0, []
    for j, s in enumerate(states):
        n = T - j
        logits = s[:, :n] @ head.T  # [B, n, V_d]
        t = teacher_logits[:, j: j + n]
        ce = -(torch.softmax(t / temperature, -1) * torch.log_softmax(logits / temperature, -1)).sum(-1)
        mask = masks[j, :, :n]
        want = want + 0.8**j * temperature**2 * ce[mask].sum() / mask.sum()
        hits.append(int(((logits.argmax(-1) == t.argmax(-1)) & mask).sum()))
    want_grads = torch.autograd.grad(want, [head, *states])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert metrics["correct"].tolist() == hits and sum(hits) > 0
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    plain, plain_metrics = ttt_loss(head, states, teacher_targets(final, target_head, t2d, loss_mask), masks, 0.8)
    assert plain_metrics["correct"].tolist() == hits and not torch.isclose(plain, got)
    with pytest.raises(ValueError, match="temperature"):
        teacher_targets(final, target_head, t2d, loss_mask, kind="argmax", temperature=temperature)


@pytest.mark.parametrize("topk", [1, 40])
def test_token_alignment_scores_a_step_only_after_aligned_earlier_steps(topk):
    """ttt.alignment_topk=k: step j at t is scored only where each step i < j at t was scored with the teacher's
    argmax among its k largest draft logits, brute force with torch.topk over full logits; loss and gradients."""
    final, target_head, t2d, loss_mask, head, states = random_case(seed=5)
    teacher = teacher_targets(final, target_head, t2d, loss_mask, chunk_size=9)
    masks = step_masks_of(loss_mask & teacher.in_vocab)
    got, metrics = ttt_loss(head, states, teacher, masks, 0.8, chunk_size=16, alignment_topk=topk)
    got_grads = torch.autograd.grad(got, [head, *states])

    teacher_logits, _ = teacher_from_final_hidden(final, target_head, t2d)  # [B, T, V_d]
    want, counts = 0.0, []
    aligned = torch.ones(B, T, dtype=torch.bool)
    for j, s in enumerate(states):
        n = T - j
        logits = s[:, :n] @ head.T  # [B, n, V_d]
        t = teacher_logits[:, j: j + n]
        mask = masks[j, :, :n] & aligned[:, :n]
        ce = -(torch.softmax(t, -1) * torch.log_softmax(logits, -1)).sum(-1)
        want = want + 0.8**j * ce[mask].sum() / mask.sum().clamp(min=1)
        counts.append(int(mask.sum()))
        in_topk = (logits.topk(topk, dim=-1).indices == t.argmax(-1, keepdim=True)).any(-1)  # [B, n]
        aligned = torch.zeros(B, T, dtype=torch.bool)
        aligned[:, :n] = mask & in_topk
    want_grads = torch.autograd.grad(want, [head, *states])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert metrics["count"].tolist() == counts
    assert counts[0] == int(masks[0].sum()) > counts[1] >= counts[2]  # step 0 keeps every position
    if topk == 40:  # a third of the draft vocab: later steps keep some positions
        assert counts[2] > 0
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
