"""P-EAGLE training against brute force written here: the mask vs vLLM's causal KV-cache view, COD counts,
the attention kernels vs a dense float64 reference, exact partitioned gradients, and a tiny training run."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from draftsmith.data.config import DrafterConfig
from draftsmith.train import peagle
from draftsmith.train.checkpoint import load_drafter_bundle
from draftsmith.train.drafter import Drafter
from draftsmith.train.loss import TeacherTargets
from draftsmith.train.parallel import (
    ParallelSetup,
    PEagleAttention,
    ShiftedRow,
    all_chain_elements,
    cod_depth_size,
    cod_sample,
    element_inputs,
    parallel_loss,
    peagle_visible,
    plan_partitions,
)
from draftsmith.train.spec import spec_for_target

H, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, V, V_D, N_AUX, EPS = 64, 4, 2, 16, 96, 48, 3, 1e-6
MASK_ID, D = 95, 4


def packed_row(seed: int = 0) -> dict:
    """Two packed documents (8 and 6 positions) then 2 padding positions; the loss mask is already shifted."""
    g = torch.Generator().manual_seed(seed)
    document_ids = torch.tensor([0] * 8 + [1] * 6 + [-1] * 2)
    position_ids = torch.tensor(list(range(8)) + list(range(6)) + [0, 0])
    loss_mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0]).bool()
    return {"document_ids": document_ids, "position_ids": position_ids, "loss_mask": loss_mask,
            "input_ids": torch.randint(0, MASK_ID, (1, 16), generator=g)}


# ---- brute force: what vLLM's causal drafter KV cache shows each slot --------------------------------------


def inference_view(a: int, d: int, row: dict) -> set:
    """The KV entries mask slot d (0 = bonus) of the draft from anchor a attends to, in vLLM's causal cache.

    Accepted context s < a of the document was written as (x[s+1], F[s]) at position p[s]; this step appends
    the bonus slot (x[a+1], F[a]) at p[a] and mask slots k = 1..K-1 at p[a] + k; slot d sees up to itself.
    """
    ids, doc, pos = row["input_ids"][0].tolist(), row["document_ids"].tolist(), row["position_ids"].tolist()
    start = min(s for s in range(a + 1) if all(doc[u] == doc[a] for u in range(s, a + 1)))
    cache = [("context", ids[s], f"F[{s}]", pos[s]) for s in range(start, a)]
    cache.append(("context", ids[a], f"F[{a}]", pos[a]))  # the bonus slot
    cache += [("mask", MASK_ID, f"mask_hidden of draft {a}", pos[a] + k) for k in range(1, d + 1)]
    return set(cache)


def training_descriptors(tokens, positions, anchor, depth) -> list[tuple]:
    """What each training element is computed from, in the same terms as inference_view."""
    out = []
    for t, p, a, d in zip(tokens.tolist(), positions.tolist(), anchor.tolist(), depth.tolist()):
        out.append(("context", t, f"F[{a}]", p) if d == 0 else ("mask", t, f"mask_hidden of draft {a}", p))
    return out


def brute_force_mask(row, anchor, depth, descriptors) -> torch.Tensor:
    """[N, N] bool from inference_view; a padding element sees only itself."""
    N, doc = anchor.numel(), row["document_ids"].tolist()
    mask = torch.zeros(N, N, dtype=torch.bool)
    for i, (a, d) in enumerate(zip(anchor.tolist(), depth.tolist())):
        if doc[a] < 0:
            mask[i, i] = True
            continue
        view = inference_view(a, d, row)
        for j in range(N):
            mask[i, j] = descriptors[j] in view
        assert int(mask[i].sum()) == len(view), f"element ({a}, {d}): part of its view is missing"
    return mask


def first_bad(a: torch.Tensor, b: torch.Tensor) -> str:
    bad = (a != b).nonzero()
    return f"{len(bad)} mismatches, first at {bad[0].tolist()}" if len(bad) else "equal"


def tiny_drafter(num_layers: int = 2, seed: int = 0, **cfg_fields) -> Drafter:
    target = LlamaConfig(hidden_size=H, intermediate_size=128, num_attention_heads=NUM_HEADS,
                         num_key_value_heads=NUM_KV_HEADS, vocab_size=V, num_hidden_layers=4,
                         max_position_embeddings=256, rms_norm_eps=EPS)
    cfg = DrafterConfig(num_layers=num_layers, **cfg_fields)
    torch.manual_seed(seed)
    drafter = Drafter(spec_for_target(target, cfg, method="peagle", aux_layer_ids=range(1, N_AUX + 1),
                                      draft_vocab_size=V_D, mask_token_id=V - 1))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 1:  # norm weights away from 1 so a skipped norm shows up
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return drafter.double()


# ---- the mask ----------------------------------------------------------------------------------------------


def test_training_mask_equals_vllm_kv_cache_view():
    row = packed_row()
    anchor, depth = all_chain_elements(row["loss_mask"], row["document_ids"], D)
    assert int(depth.max()) == D - 1  # deep chains in both documents are covered
    aux = torch.zeros(1, 16, N_AUX * H, dtype=torch.float64)
    tokens, _, positions = element_inputs(tiny_drafter(1), row["input_ids"], aux, row["position_ids"][None],
                                          anchor, depth, MASK_ID)
    descriptors = training_descriptors(tokens[0], positions[0], anchor, depth)
    expected = brute_force_mask(row, anchor, depth, descriptors)
    doc = row["document_ids"][anchor]
    got = peagle_visible(doc[:, None], anchor[:, None], depth[:, None], doc[None], anchor[None], depth[None])
    assert torch.equal(got, expected), first_bad(got, expected)


def cod_row():
    """Two documents; seed 30 opens document 1, so its would-be anchor 29 (document 0) must start no chain."""
    T = 48
    document_ids = torch.tensor([0] * 30 + [1] * 18)
    loss_mask = torch.zeros(T, dtype=torch.bool)
    loss_mask[4:29] = True  # shifted: the last position of a document is never masked
    loss_mask[30:47] = True
    return loss_mask, document_ids


def assert_chains_valid(anchor, depth, loss_mask, document_ids):
    T = loss_mask.numel()
    assert torch.equal(anchor[:T], torch.arange(T)) and not depth[:T].any()
    assert torch.equal(depth, depth.sort(stable=True).values), "elements are not depth-major"
    pairs = list(zip(anchor.tolist(), depth.tolist()))
    assert len(set(pairs)) == len(pairs)
    for a, d in pairs:
        assert d == 0 or (a, d - 1) in set(pairs), f"chain {a} skips depth {d - 1}"
        assert d == 0 or (loss_mask[a + d] and document_ids[a + d] == document_ids[a]), f"({a}, {d}) is dead"


def test_all_chains_are_every_live_chain():
    loss_mask, document_ids = cod_row()
    anchor, depth = all_chain_elements(loss_mask, document_ids, 6)
    assert_chains_valid(anchor, depth, loss_mask, document_ids)
    T, doc = loss_mask.numel(), document_ids.tolist()
    want = {(a, d) for a in range(T) for d in range(1, 6)
            if all(a + j < T and loss_mask[a + j] and doc[a + j] == doc[a] for j in range(1, d + 1))}
    assert set(zip(anchor[T:].tolist(), depth[T:].tolist())) == want


def test_cod_counts_follow_the_formula_and_chains_are_contiguous():
    loss_mask, document_ids = cod_row()
    T = loss_mask.numel()
    for max_anchors in (0, 20):
        anchor, depth = cod_sample(loss_mask, document_ids, 6, 0.7, 0.2, max_anchors,
                                   torch.Generator().manual_seed(max_anchors))
        assert_chains_valid(anchor, depth, loss_mask, document_ids)
        n_seed = min(int(loss_mask.sum()), max_anchors or T)
        alive = {p - 1 for p in range(1, T) if loss_mask[p] and document_ids[p - 1] == document_ids[p]}
        hit_formula = 0
        for d in range(1, 6):
            chosen = anchor[depth == d].tolist()
            assert chosen == sorted(chosen)
            want = cod_depth_size(n_seed, d, 0.7, 0.2)
            assert want == max(int((n_seed - d) * max(0.7**d, 0.2)), 0)
            if max_anchors and d == 1:  # capped seeds are a random subset: only the count is known
                assert len(chosen) <= want
            else:
                assert set(chosen) <= alive, f"depth {d} drew a dead chain"
                assert len(chosen) == min(want, len(alive)), (d, len(chosen), want, len(alive))
            hit_formula += len(chosen) == want
            alive = {a for a in chosen if a + d + 1 < T and loss_mask[a + d + 1]
                     and document_ids[a + d + 1] == document_ids[a]}
        assert hit_formula >= 3


# ---- the attention kernels ---------------------------------------------------------------------------------


def dense_attention(q, k, v, mask):
    """Float64 reference: q [1, heads, N, d], k/v [1, kv_heads, N, d], mask [N, N] bool."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def random_qkv(N: int, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, NUM_HEADS, N, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, NUM_KV_HEADS, N, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, NUM_KV_HEADS, N, HEAD_DIM, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


def reference_elements():
    row = packed_row()
    anchor, depth = cod_sample(row["loss_mask"], row["document_ids"], D, 0.9, 0.5, 0,
                               torch.Generator().manual_seed(1))
    tokens = torch.where(depth > 0, MASK_ID, row["input_ids"][0, anchor])
    positions = row["position_ids"][anchor] + depth
    mask = brute_force_mask(row, anchor, depth, training_descriptors(tokens, positions, anchor, depth))
    return row, anchor, depth, mask


@pytest.mark.parametrize("chunk_size", [1, 3, 512])
def test_blockwise_attention_equals_dense_float64_reference(chunk_size):
    row, anchor, depth, mask = reference_elements()
    q, k, v = random_qkv(anchor.numel())
    att = PEagleAttention(anchor, depth, row["document_ids"], "blockwise", "cpu", chunk_size)
    got, want = att(0, q, k, v), dense_attention(q, k, v, mask)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    w = torch.randn_like(want)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    for name, a, b in zip("qkv", grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_equals_dense_reference():
    row, anchor, depth, mask = reference_elements()
    q, k, v = (t.detach().float() for t in random_qkv(anchor.numel()))
    with torch.no_grad():  # flex_attention has no CPU backward
        got = PEagleAttention(anchor, depth, row["document_ids"], "flex", "cpu")(0, q, k, v)
    torch.testing.assert_close(got, dense_attention(q, k, v, mask), rtol=1e-5, atol=1e-5)


# ---- inputs, loss and partitions ---------------------------------------------------------------------------


def test_mask_slots_get_the_mask_token_and_mask_hidden_before_fc():
    row = packed_row()
    drafter = tiny_drafter(1, fc_norm=True)
    anchor, depth = all_chain_elements(row["loss_mask"], row["document_ids"], D)
    aux = torch.randn(1, 16, N_AUX * H, dtype=torch.float64)
    tokens, hidden, positions = element_inputs(drafter, row["input_ids"], aux, row["position_ids"][None],
                                               anchor, depth, MASK_ID)
    p = dict(drafter.named_parameters())

    def ref_combine(x):  # fc_norm: one RMSNorm per aux chunk, then fc
        chunks = [x[..., i * H:(i + 1) * H] for i in range(N_AUX)]
        normed = [p[f"fc_norm.{i}.weight"] * c / torch.sqrt((c * c).mean(-1, keepdim=True) + EPS)
                  for i, c in enumerate(chunks)]
        return torch.cat(normed, -1) @ p["fc.weight"].T

    for i, (a, d) in enumerate(zip(anchor.tolist(), depth.tolist())):
        assert int(tokens[0, i]) == (MASK_ID if d else int(row["input_ids"][0, a]))
        assert int(positions[0, i]) == int(row["position_ids"][a]) + d
        want = ref_combine(p["mask_hidden"][0] if d else aux[0, a])
        torch.testing.assert_close(hidden[0, i], want, rtol=1e-10, atol=1e-10)


def shifted_row(seed: int = 2) -> ShiftedRow:
    row, g = packed_row(), torch.Generator().manual_seed(seed)
    T = 16
    in_vocab = torch.rand(T, generator=g) > 0.2
    aux = torch.randn(1, T, N_AUX * H, generator=g, dtype=torch.float64)
    logits = 3 * torch.randn(T, V_D, generator=g, dtype=torch.float64)
    teacher = TeacherTargets(probs=torch.softmax(logits, -1), argmax=logits.argmax(-1), slot=torch.arange(T)[None],
                             in_vocab=in_vocab[None])
    return ShiftedRow(input_ids=row["input_ids"], aux_hidden=aux, position_ids=row["position_ids"][None],
                      document_ids=row["document_ids"], loss_mask=row["loss_mask"], teacher=teacher,
                      scored=row["loss_mask"] & in_vocab)


def reference_loss(drafter, row: ShiftedRow, anchor, depth, mask, weighting: str) -> torch.Tensor:
    """Dense-mask forward and a plain soft-CE mean (teacher at a + d): over the scored elements, or over depths of
    each depth's mean."""
    tokens, hidden, positions = element_inputs(drafter, row.input_ids, row.aux_hidden, row.position_ids,
                                               anchor, depth, MASK_ID)
    _, logits = drafter(tokens, hidden, positions, lambda layer, q, k, v: dense_attention(q, k, v, mask))
    total, count = {}, {}
    for i, (a, d) in enumerate(zip(anchor.tolist(), depth.tolist())):
        if row.scored[a + d]:
            teacher = row.teacher.probs[a + d]
            total[d] = total.get(d, 0.0) - (teacher * torch.log_softmax(logits[0, i], -1)).sum()
            count[d] = count.get(d, 0) + 1
    if weighting == "elements":
        return sum(total.values()) / sum(count.values())
    return sum(total[d] / count[d] for d in total) / len(total)


@pytest.mark.parametrize("weighting", ["elements", "depths"])
def test_partitioned_gradients_equal_unpartitioned_and_the_dense_reference(weighting):
    row = shifted_row()
    packed = packed_row()
    anchor, depth = cod_sample(row.loss_mask, row.document_ids, D, 0.9, 0.5, 0,
                               torch.Generator().manual_seed(1))
    assert len(plan_partitions(anchor, depth, row.document_ids, 7)) >= 3
    drafter = tiny_drafter(2)
    results = []
    for partition_elements in (0, 7):
        setup = ParallelSetup(mask_token_id=MASK_ID, num_depths=D, partition_elements=partition_elements,
                              chunk_size=4, loss_weighting=weighting)
        drafter.zero_grad()
        loss, metrics = parallel_loss(drafter, row, anchor, depth, setup)
        loss.backward()
        results.append((loss.detach(), metrics, {n: p.grad.clone() for n, p in drafter.named_parameters()}))
    drafter.zero_grad()
    descriptors = training_descriptors(torch.where(depth > 0, MASK_ID, row.input_ids[0, anchor]),
                                       row.position_ids[0, anchor] + depth, anchor, depth)
    want = reference_loss(drafter, row, anchor, depth, brute_force_mask(packed, anchor, depth, descriptors),
                          weighting)
    want.backward()
    (whole, m0, g0), (parts, m1, g1) = results
    torch.testing.assert_close(whole, want.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(parts, whole, rtol=1e-10, atol=1e-12)
    assert torch.equal(m0["count"], m1["count"]) and torch.equal(m0["correct"], m1["correct"])
    scored = sum(bool(row.scored[a + d]) for a, d in zip(anchor.tolist(), depth.tolist()))
    assert int(m0["count"].sum()) == scored
    for name, p in drafter.named_parameters():
        for got in (g0[name], g1[name]):
            torch.testing.assert_close(got, p.grad, rtol=1e-8, atol=1e-11,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert g0["mask_hidden"].abs().sum() > 0 and g0["embed_tokens.weight"][MASK_ID].abs().sum() > 0


def test_mask_token_choice_prefers_unused_special_tokens():
    counts = torch.ones(10, dtype=torch.long)
    counts[[3, 7, 9]] = 0
    assert peagle.pick_mask_token_id(counts, 5, [1, 2])[0] == 5  # the tokenizer's own mask token
    assert peagle.pick_mask_token_id(counts, None, [1, 3, 2])[0] == 3  # unused special beats a plain id
    assert peagle.pick_mask_token_id(counts, None, [1, 2])[0] == 9  # else the highest unused id
    assert peagle.pick_mask_token_id(torch.ones(10, dtype=torch.long), None, [])[0] == 9


# ---- a real run --------------------------------------------------------------------------------------------


def test_twenty_steps_lower_the_loss(tiny_run, tmp_path):
    cfg = tiny_run(tmp_path, extra={"peagle": {"num_depths": 4}, "drafter": {"num_layers": 2}})
    peagle.main(["--config", cfg])
    train_dir = tmp_path / "run" / "train"
    records = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.85 * losses[0], losses
    assert all(len(r["acc"]) == 4 for r in records if "acc" in r)
    _, spec, progress = load_drafter_bundle(train_dir / "best")
    assert spec.method == "peagle" and spec.num_hidden_layers == 2
    assert set(progress["eval"]["simulated_acceptance_length"]) == {"1", "2", "3", "4"}
    used = set()
    for shard in (tmp_path / "run" / "dataset").glob("shard-*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            used |= set(f.get_tensor("input_ids").tolist())
    assert spec.mask_token_id not in used
