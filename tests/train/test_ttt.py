"""TTT unroll, masks and loss against a brute-force reference written here (float64, element-by-element masks)."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig

from draftsmith.data.config import DrafterConfig
from draftsmith.train.drafter import Drafter
from draftsmith.train.loss import (
    simulated_acceptance_length,
    teacher_from_final_hidden,
    teacher_targets,
    ttt_loss,
)
from draftsmith.train.spec import spec_for_target
from draftsmith.train.ttt import (
    TTTAttention,
    blockwise_ttt_attention,
    query_chunks,
    shift_for_ttt,
    ttt_forward,
    ttt_step_masks,
)

H, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, V, V_D, N_AUX = 64, 4, 2, 16, 96, 48, 3
EPS, THETA = 1e-6, 10000.0
J = 3


def tiny_drafter(seed: int = 0, **cfg_fields) -> Drafter:
    target = LlamaConfig(hidden_size=H, intermediate_size=128, num_attention_heads=NUM_HEADS,
                         num_key_value_heads=NUM_KV_HEADS, vocab_size=V, num_hidden_layers=4,
                         max_position_embeddings=256, rms_norm_eps=EPS)
    cfg = DrafterConfig(**cfg_fields)
    torch.manual_seed(seed)
    drafter = Drafter(spec_for_target(target, cfg, method="eagle3", aux_layer_ids=range(1, N_AUX + 1),
                                      draft_vocab_size=V_D))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:  # norm weights: away from 1 so a missing norm shows up
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return drafter


def packed_batch(seed: int = 1):
    """Row 0: two packed documents; row 1: one document then padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    T = 10
    document_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, -1, -1, -1]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 0, 0]])
    input_ids = torch.randint(0, V, (2, T), generator=g)
    aux = torch.randn(2, T, N_AUX * H, generator=g, dtype=torch.float64)
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 0, 0, 0]]).bool()
    final_hidden = torch.randn(2, T, H, generator=g, dtype=torch.float64)
    lm_head = torch.randn(V, H, generator=g, dtype=torch.float64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:V_D]] = True
    return {"input_ids": input_ids, "aux": aux, "position_ids": position_ids, "document_ids": document_ids,
            "loss_mask": loss_mask, "final_hidden": final_hidden, "lm_head": lm_head, "t2d": t2d}


# ---- brute-force reference ------------------------------------------------------------------------------


def ref_rms(x, w):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)


def ref_rope(x, pos: int):
    """x [..., d] rotated to position `pos` (neox halves, theta 10000)."""
    d = x.shape[-1]
    inv = THETA ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cos(pos * inv), torch.sin(pos * inv)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ref_visible(doc, b, t, i, s) -> bool:
    """Step-i key at position s for the query at t: step 0 causal in-document (padding: itself), else diagonal."""
    if i == 0:
        return s <= t and doc[b][s] == doc[b][t] and (doc[b][t] >= 0 or s == t)
    return s == t


def ref_attention(q, cache, doc, j):
    """q [B, T, heads, d]; cache: (j+1) x (k, v) [B, T, kv_heads, d]; one softmax over all (step, position)."""
    B, T = q.shape[:2]
    mask = torch.zeros(B, T, j + 1, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for i in range(j + 1):
                for s in range(T):
                    mask[b, t, i, s] = ref_visible(doc, b, t, i, s)
    kv_head_of = [h // (NUM_HEADS // NUM_KV_HEADS) for h in range(NUM_HEADS)]
    keys = torch.cat([k for k, _ in cache], dim=1)[:, :, kv_head_of]  # [B, (j+1) T, heads, d], step-major
    vals = torch.cat([v for _, v in cache], dim=1)[:, :, kv_head_of]
    scores = torch.einsum("bthd,bshd->bhts", q, keys) / math.sqrt(HEAD_DIM)  # [B, heads, T, (j+1) T]
    scores = scores.masked_fill(~mask.flatten(2)[:, None], float("-inf"))
    out = torch.einsum("bhts,bshd->bthd", torch.softmax(scores, dim=-1), vals)  # [B, T, heads, d]
    return out.reshape(B, T, NUM_HEADS * HEAD_DIM)


def ref_layer(p, cfg, l, x, e, pos, doc, j, cache):
    pre = f"layers.{l}."
    if l == 0:
        normed = ref_rms(x, p[pre + "hidden_norm.weight"])
        residual = normed if cfg.norm_before_residual else x
        inp = torch.cat([ref_rms(e, p[pre + "input_layernorm.weight"]), normed], dim=-1)
    else:
        residual, inp = x, ref_rms(x, p[pre + "input_layernorm.weight"])
    B, T = x.shape[:2]
    q = (inp @ p[pre + "self_attn.q_proj.weight"].T).view(B, T, NUM_HEADS, HEAD_DIM)
    k = (inp @ p[pre + "self_attn.k_proj.weight"].T).view(B, T, NUM_KV_HEADS, HEAD_DIM)
    v = (inp @ p[pre + "self_attn.v_proj.weight"].T).view(B, T, NUM_KV_HEADS, HEAD_DIM)
    if cfg.arch == "qwen3":
        q, k = ref_rms(q, p[pre + "self_attn.q_norm.weight"]), ref_rms(k, p[pre + "self_attn.k_norm.weight"])
    # queries and this step's keys sit at position t + j; earlier steps' keys keep their own rotation
    q = torch.stack([torch.stack([ref_rope(q[b, t], pos[b][t] + j) for t in range(T)]) for b in range(B)])
    k = torch.stack([torch.stack([ref_rope(k[b, t], pos[b][t] + j) for t in range(T)]) for b in range(B)])
    cache.append((k, v))
    x = residual + ref_attention(q, cache, doc, j) @ p[pre + "self_attn.o_proj.weight"].T
    y = ref_rms(x, p[pre + "post_attention_layernorm.weight"])
    gate, up = y @ p[pre + "mlp.gate_proj.weight"].T, y @ p[pre + "mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T


def ref_combine(p, cfg, aux):
    if cfg.norm_before_fc:
        aux = ref_rms(aux, p["input_norm.weight"])
    if cfg.fc_norm:
        aux = torch.cat([ref_rms(aux[..., i * H : (i + 1) * H], p[f"fc_norm.{i}.weight"]) for i in range(N_AUX)], -1)
    return aux @ p["fc.weight"].T


def reference_ttt_logits(p, cfg, aux, input_ids, position_ids, document_ids, num_steps):
    """Unshifted data in: step j at t reads token x[t+j+1] (0 past the end) and predicts x[t+j+2]."""
    B, T = input_ids.shape
    ids, pos, doc = input_ids.tolist(), position_ids.tolist(), document_ids.tolist()
    h = ref_combine(p, cfg, aux)
    caches = [[] for _ in range(cfg.num_hidden_layers)]
    out = []
    for j in range(num_steps):
        tokens = torch.tensor([[ids[b][t + j + 1] if t + j + 1 < T else 0 for t in range(T)] for b in range(B)])
        e = p["embed_tokens.weight"][tokens]
        x = h
        for l in range(cfg.num_hidden_layers):
            x = ref_layer(p, cfg, l, x, e, pos, doc, j, caches[l])
        normed = ref_rms(x, p["norm.weight"])
        out.append(normed @ p["lm_head.weight"].T)
        h = normed if cfg.norm_output else x
    return out


def reference_loss(step_logits, batch, step_weight):
    """Soft CE per step over positions t whose target x[t+j+2] is trained; teacher = target logits at t+j+1."""
    full = batch["final_hidden"] @ batch["lm_head"].T  # [B, T, V] dense
    t2d, doc, lm = batch["t2d"], batch["document_ids"].tolist(), batch["loss_mask"].tolist()
    B, T = batch["input_ids"].shape
    total, counts = 0.0, []
    for j, logits in enumerate(step_logits):
        ce_sum, count = 0.0, 0
        for b in range(B):
            for t in range(T):
                src = t + j + 1
                if src >= T or not lm[b][src] or doc[b][t] < 0 or doc[b][src] != doc[b][t]:
                    continue
                if not t2d[full[b, src].argmax()]:
                    continue
                teacher = torch.softmax(full[b, src][t2d], dim=0)
                ce_sum = ce_sum - (teacher * torch.log_softmax(logits[b, t], dim=0)).sum()
                count += 1
        counts.append(count)
        total = total + step_weight**j * ce_sum / max(count, 1)
    return total, counts


# ---- the optimised path -----------------------------------------------------------------------------------


def run_pipeline(drafter, batch, impl="blockwise", chunk_size=4, num_steps=J, head_chunk_size=3):
    """The trainer's path; returns each step's logits (the head applied everywhere, for comparison) and the loss."""
    ids, final_hidden, loss_mask = shift_for_ttt(batch["input_ids"], batch["final_hidden"], batch["loss_mask"],
                                                 batch["document_ids"])
    aux = batch["aux"].to(drafter.fc.weight.dtype)
    teacher = teacher_targets(final_hidden.to(aux.dtype), batch["lm_head"], batch["t2d"], loss_mask, chunk_size=7)
    masks = ttt_step_masks(loss_mask & teacher.in_vocab, batch["document_ids"], num_steps)
    states = ttt_forward(drafter, aux, ids, batch["position_ids"], batch["document_ids"], num_steps, impl,
                         chunk_size=chunk_size)
    loss = ttt_loss(drafter.lm_head.weight, states, teacher, masks, 0.8, chunk_size=head_chunk_size)
    return [drafter.lm_head(s) for s in states], loss


def float64_params(drafter):
    return {k: v.detach().double().clone() for k, v in drafter.state_dict().items()}


CASES = [
    {"num_layers": 1},
    {"num_layers": 2},
    {"num_layers": 2, "fc_norm": True, "norm_output": True},
    {"num_layers": 1, "norm_before_fc": True, "norm_before_residual": True, "arch": "qwen3"},
]


@pytest.mark.parametrize("cfg_fields", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_ttt_forward_and_loss_match_bruteforce(cfg_fields):
    drafter = tiny_drafter(**cfg_fields).double()
    batch = packed_batch()
    logits, (loss, metrics) = run_pipeline(drafter, batch)
    with torch.no_grad():
        expected = reference_ttt_logits(float64_params(drafter), drafter.spec, batch["aux"], batch["input_ids"],
                                        batch["position_ids"], batch["document_ids"], J)
    for j in range(J):
        torch.testing.assert_close(logits[j], expected[j], rtol=1e-9, atol=1e-9, msg=lambda m, j=j: f"step {j}: {m}")
    expected_loss, expected_counts = reference_loss(expected, batch, 0.8)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-9, atol=1e-9)
    assert metrics["count"].tolist() == expected_counts
    assert min(expected_counts) > 0, "the batch must score every step"


def test_float32_run_matches_bruteforce():
    drafter = tiny_drafter(num_layers=2)
    batch = packed_batch()
    logits, _ = run_pipeline(drafter, batch, chunk_size=3)
    expected = reference_ttt_logits(float64_params(drafter), drafter.spec, batch["aux"], batch["input_ids"],
                                    batch["position_ids"], batch["document_ids"], J)
    for j in range(J):
        torch.testing.assert_close(logits[j].double(), expected[j], rtol=1e-4, atol=1e-4)


def test_gradients_match_bruteforce():
    drafter = tiny_drafter(num_layers=2, fc_norm=True, norm_output=True).double()
    batch = packed_batch()
    _, (loss, _) = run_pipeline(drafter, batch, chunk_size=3)
    loss.backward()
    params = float64_params(drafter)
    trained = [k for k, p in drafter.named_parameters() if p.requires_grad]
    for k in trained:
        params[k].requires_grad_(True)
    expected = reference_ttt_logits(params, drafter.spec, batch["aux"], batch["input_ids"], batch["position_ids"],
                                    batch["document_ids"], J)
    reference_loss(expected, batch, 0.8)[0].backward()
    assert "embed_tokens.weight" not in trained
    for name, p in drafter.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, params[name].grad, rtol=1e-8, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


def test_flex_matches_blockwise():
    drafter = tiny_drafter(num_layers=2)
    batch = packed_batch()
    with torch.no_grad():  # flex_attention has no CPU backward
        flex, (flex_loss, _) = run_pipeline(drafter, batch, impl="flex")
        block, (block_loss, _) = run_pipeline(drafter, batch, impl="blockwise", chunk_size=4)
    for j in range(J):
        torch.testing.assert_close(flex[j], block[j], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex_loss, block_loss, rtol=1e-5, atol=1e-5)


def test_chunk_size_does_not_change_the_result():
    drafter = tiny_drafter(num_layers=1).double()
    batch = packed_batch()
    with torch.no_grad():
        whole, _ = run_pipeline(drafter, batch, chunk_size=512)
        for chunk_size in (1, 3, 7):
            chunked, _ = run_pipeline(drafter, batch, chunk_size=chunk_size)
            for j in range(J):
                torch.testing.assert_close(chunked[j], whole[j], rtol=1e-12, atol=1e-12)


def test_norm_output_changes_only_later_steps():
    plain = tiny_drafter(num_layers=1)
    normed = tiny_drafter(num_layers=1, norm_output=True)
    normed.load_state_dict(plain.state_dict())
    batch = packed_batch()
    with torch.no_grad():
        a, _ = run_pipeline(plain, batch)
        b, _ = run_pipeline(normed, batch)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    for j in range(1, J):
        assert (a[j] - b[j]).abs().max() > 1e-3, f"norm_output left step {j} unchanged"


# ---- shift, masks and loss on literals ----------------------------------------------------------------------


def test_shift_for_ttt_on_literals():
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
    input_ids = torch.tensor([[10, 11, 12, 20, 21, 22, 23, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0]])
    teacher = torch.arange(8.0).view(1, 8, 1) + 100
    ids, shifted_teacher, mask = shift_for_ttt(input_ids, teacher, loss_mask, document_ids)
    assert ids.tolist() == [[11, 12, 20, 21, 22, 23, 0, 0]]
    assert shifted_teacher.flatten().tolist() == [101, 102, 103, 104, 105, 106, 107, 0]
    # t=2: x[3] opens document 1, so document 0's last position is not scored; t=6: x[7] is padding
    assert mask.int().tolist() == [[1, 1, 0, 1, 1, 1, 0, 0]]
    masks = ttt_step_masks(mask, document_ids, 3)
    assert masks.int().tolist() == [
        [[1, 1, 0, 1, 1, 1, 0, 0]],
        [[1, 0, 0, 1, 1, 0, 0, 0]],
        [[0, 0, 0, 1, 0, 0, 0, 0]],
    ]


def test_loss_on_literals():
    # T=2, one row; only t=0 is scored at both steps, so each step's loss is one CE (divided by 1, not B*T=2).
    # Identity heads (target and draft, V = V_d = H = 2) make the hidden states the logits.
    eye, t2d = torch.eye(2), torch.tensor([True, True])
    final = torch.tensor([[[0.0, math.log(3.0)], [5.0, 0.0]]])  # t=0: p=[1/4, 3/4]; t=1: p=softmax([5, 0])
    teacher = teacher_targets(final, eye, t2d, torch.tensor([[True, True]]))
    step0 = torch.tensor([[[0.0, math.log(3.0)], [9.0, 9.0]]])  # t=0 equals the teacher: CE = entropy
    step1 = torch.tensor([[[1.0, 0.0], [9.0, 9.0]]])  # t=0 scored against the teacher at t=1
    masks = torch.tensor([[[True, False]], [[True, False]]])
    loss, metrics = ttt_loss(eye, [step0, step1], teacher, masks, 0.8)
    entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    p1 = [math.exp(5) / (math.exp(5) + 1), 1 / (math.exp(5) + 1)]
    q1 = [math.e / (math.e + 1), 1 / (math.e + 1)]
    ce1 = -(p1[0] * math.log(q1[0]) + p1[1] * math.log(q1[1]))
    torch.testing.assert_close(loss, torch.tensor(entropy + 0.8 * ce1), rtol=1e-6, atol=1e-6)
    assert metrics["count"].tolist() == [1, 1]
    assert metrics["correct"].tolist() == [1, 1]
    torch.testing.assert_close(metrics["loss"], torch.tensor([entropy, ce1]), rtol=1e-6, atol=1e-6)


def test_simulated_acceptance_length():
    torch.testing.assert_close(simulated_acceptance_length([0.8, 0.5, 0.25]),
                               torch.tensor(1 + 0.8 + 0.4 + 0.1, dtype=torch.float64))


def test_teacher_from_final_hidden_matches_dense():
    batch = packed_batch()
    teacher, in_vocab = teacher_from_final_hidden(batch["final_hidden"], batch["lm_head"], batch["t2d"], chunk_size=3)
    full = batch["final_hidden"] @ batch["lm_head"].T  # [B, T, V]
    torch.testing.assert_close(teacher, full[..., batch["t2d"]], rtol=1e-12, atol=1e-12)
    assert in_vocab.tolist() == batch["t2d"][full.argmax(-1)].tolist()
    assert 0 < int(in_vocab.sum()) < in_vocab.numel(), "the batch must have in- and out-of-vocab targets"


# ---- memory ----------------------------------------------------------------------------------------------


def saved_bytes_for_backward(T: int, chunk_size: int, num_steps: int = 3) -> int:
    """Bytes of distinct storages autograd keeps for one layer's J steps of blockwise attention."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    g = torch.Generator().manual_seed(0)
    document_ids = torch.zeros(1, T, dtype=torch.long)
    chunks = query_chunks(document_ids, chunk_size)
    keys, values = [], []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(num_steps):
            q = torch.randn(1, NUM_HEADS, T, HEAD_DIM, generator=g, requires_grad=True)
            keys.append(torch.randn(1, NUM_KV_HEADS, T, HEAD_DIM, generator=g, requires_grad=True))
            values.append(torch.randn(1, NUM_KV_HEADS, T, HEAD_DIM, generator=g, requires_grad=True))
            blockwise_ttt_attention(q, keys, values, document_ids, chunks)
    return sum(storages.values())


def test_blockwise_keeps_memory_linear_in_T():
    small, large = saved_bytes_for_backward(128, 16), saved_bytes_for_backward(512, 16)
    # a dense T x T score map would grow 16x; linear storage grows ~4x
    assert large / small < 6, f"saved bytes grew {large / small:.1f}x for 4x T ({small} -> {large})"


def test_tttattention_rejects_split_documents():
    with pytest.raises(ValueError, match="contiguous"):
        TTTAttention(torch.tensor([[0, 0, 1, 1, 0, -1]]), "blockwise")


def test_loss_tokens_all_scores_every_real_token_in_training_and_the_assistant_mask_in_evaluation():
    """train.loss_tokens=all: training scores every position whose next token lies in the same document (prompt
    tokens too, padding never), brute force over that mask; evaluation keeps the assistant loss mask."""
    from types import SimpleNamespace

    from draftsmith.train.eagle3 import ttt_row_loss

    drafter = tiny_drafter(num_layers=1)
    batch = packed_batch()
    row = {"input_ids": batch["input_ids"], "final_hidden_states": batch["final_hidden"].float(),
           "loss_mask": batch["loss_mask"].long(), "document_ids": batch["document_ids"],
           "aux_hidden_states": batch["aux"].float(), "position_ids": batch["position_ids"], "row_seed": 0}
    cfg = SimpleNamespace(train=SimpleNamespace(teacher="distribution", teacher_temperature=1.0, hidden_noise_std=0.0,
                                                loss_tokens="all"),
                          ttt=SimpleNamespace(num_steps=J, step_weight=0.8, alignment_topk=0))
    expected = reference_ttt_logits(float64_params(drafter), drafter.spec, batch["aux"], batch["input_ids"],
                                    batch["position_ids"], batch["document_ids"], J)
    every_token = batch | {"loss_mask": batch["document_ids"] >= 0}
    for training, scored_batch in ((True, every_token), (False, batch)):
        drafter.train(training)
        with torch.no_grad():
            loss, metrics = ttt_row_loss(drafter, row, batch["lm_head"].float(), batch["t2d"], cfg, "blockwise")
        expected_loss, expected_counts = reference_loss(expected, scored_batch, 0.8)
        assert metrics["count"].tolist() == expected_counts
        torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-4, atol=1e-4)
    assert reference_loss(expected, every_token, 0.8)[1] != reference_loss(expected, batch, 0.8)[1]
