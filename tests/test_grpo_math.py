"""GRPO math against independent references written with plain Python loops and floats."""
import math
import random
import statistics

import pytest
import torch

from train_grpo import aggregate_loss, compute_advantages, k3_kl, per_token_policy_loss


def reference_advantages(rewards, G, scale, eps=1e-4):
    groups = [rewards[i:i + G] for i in range(0, len(rewards), G)]
    batch_std = statistics.stdev(rewards)
    out = []
    for g in groups:
        mean = sum(g) / len(g)
        for r in g:
            if scale == "group":
                out.append((r - mean) / (statistics.stdev(g) + eps))
            elif scale == "batch":
                out.append((r - mean) / (batch_std + eps))
            else:
                out.append(r - mean)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_loop_reference(scale):
    rng = random.Random(0)
    G = 4
    rewards = [rng.choice([0.0, 1.0, 0.5, 2.0]) for _ in range(6 * G)]
    rewards[:G] = [1.0] * G  # a group with zero std: advantage 0, not nan
    got = compute_advantages(torch.tensor(rewards, dtype=torch.float64), G, scale).tolist()
    want = reference_advantages(rewards, G, scale)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert got[:G] == [0.0] * G


def test_k3_kl_matches_ratio_form():
    # k3 = r - log r - 1 with r = pi_ref / pi (Schulman, "Approximating KL divergence")
    torch.manual_seed(0)
    logp, ref = torch.randn(50, dtype=torch.float64) - 2, torch.randn(50, dtype=torch.float64) - 2
    got = k3_kl(logp, ref).tolist()
    for g, lp, rf in zip(got, logp.tolist(), ref.tolist()):
        r = math.exp(rf) / math.exp(lp)
        assert g == pytest.approx(r - math.log(r) - 1, rel=1e-9, abs=1e-12)
        assert g >= 0
    assert k3_kl(logp, logp).abs().max() == 0  # zero when the policies agree


def reference_loss(logp, old, ref, adv, mask, eps_low, eps_high, beta, loss_type, max_len):
    """The step loss of the whole batch written from the papers' formulas, one token at a time."""
    per_seq, total_tokens, total = [], 0, 0.0
    for i in range(len(logp)):
        seq_sum, seq_tokens = 0.0, 0
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            ratio = math.exp(logp[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            term = -min(ratio * adv[i], clipped * adv[i])
            if beta:
                d = ref[i][t] - logp[i][t]
                term += beta * (math.exp(d) - d - 1)
            seq_sum += term
            seq_tokens += 1
        per_seq.append(seq_sum / seq_tokens if seq_tokens else 0.0)
        total += seq_sum
        total_tokens += seq_tokens
    n = len(logp)
    if loss_type == "grpo":
        return sum(per_seq) / n
    if loss_type == "dr_grpo":
        return total / (n * max_len)
    return total / total_tokens


def random_batch(B=8, C=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, C, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.3  # ratios well outside the clip range too
    ref = logp + torch.randn(B, C, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    mask = (torch.arange(C)[None] < lengths[:, None]).double()  # right padding, varied lengths
    mask[3] = 0  # a fully masked completion (e.g. --mask_truncated_completions)
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_matches_reference_and_micro_batches_add_up(loss_type, beta):
    logp, old, ref, adv, mask = random_batch()
    eps_low, eps_high, max_len = 0.2, 0.28, 10
    want = reference_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(),
                          eps_low, eps_high, beta, loss_type, max_len)
    n_seq, n_tok = logp.shape[0], int(mask.sum())
    full, _, _ = per_token_policy_loss(logp, old, adv, eps_low, eps_high, ref, beta)
    assert aggregate_loss(full, mask, loss_type, n_seq, n_tok, max_len).item() == pytest.approx(want, rel=1e-9)
    # micro-batches of 3, 3, 2 rows with the step's global normaliser add up to the same loss
    total = 0.0
    for rows in (slice(0, 3), slice(3, 6), slice(6, 8)):
        part, _, _ = per_token_policy_loss(logp[rows], old[rows], adv[rows], eps_low, eps_high, ref[rows], beta)
        total += aggregate_loss(part, mask[rows], loss_type, n_seq, n_tok, max_len).item()
    assert total == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_accumulated_gradients_equal_full_batch_gradients(loss_type):
    logp0, old, ref, adv, mask = random_batch(seed=1)
    n_seq, n_tok = logp0.shape[0], int(mask.sum())
    full = logp0.clone().requires_grad_(True)
    loss, _, _ = per_token_policy_loss(full, old, adv, 0.2, 0.2, ref, 0.1)
    aggregate_loss(loss, mask, loss_type, n_seq, n_tok, 10).backward()
    parts = logp0.clone().requires_grad_(True)
    for rows in (slice(0, 5), slice(5, 8)):
        loss, _, _ = per_token_policy_loss(parts[rows], old[rows], adv[rows], 0.2, 0.2, ref[rows], 0.1)
        aggregate_loss(loss, mask[rows], loss_type, n_seq, n_tok, 10).backward()
    torch.testing.assert_close(parts.grad, full.grad, rtol=1e-12, atol=1e-15)


def test_loss_types_differ_on_unequal_lengths():
    logp, old, ref, adv, mask = random_batch()
    per_token, _, _ = per_token_policy_loss(logp, old, adv, 0.2, 0.2)
    values = {t: aggregate_loss(per_token, mask, t, 8, int(mask.sum()), 7).item() for t in ("grpo", "dr_grpo", "dapo")}
    assert len({round(v, 9) for v in values.values()}) == 3


def test_clip_higher_and_clip_indicator():
    logp = torch.log(torch.tensor([[1.25, 1.25, 0.7, 0.9]], dtype=torch.float64))  # ratios vs old = 0 logprob
    old = torch.zeros_like(logp)
    # positive advantage: ratio 1.25 is clipped with eps_high 0.2, not with clip-higher 0.28
    for eps_high, expect_clipped in ((0.2, True), (0.28, False)):
        loss, _, clipped = per_token_policy_loss(logp[:, :1], old[:, :1], torch.tensor([1.0], dtype=torch.float64),
                                                 0.2, eps_high)
        assert bool(clipped[0, 0]) is expect_clipped
        assert loss.item() == pytest.approx(-min(1.25, 1 + eps_high))
    # negative advantage: ratio 0.7 < 1 - 0.2 is clipped (loss uses 0.8); 0.9 is not
    loss, _, clipped = per_token_policy_loss(logp[:, 2:], old[:, 2:], torch.tensor([-1.0], dtype=torch.float64), 0.2, 0.28)
    assert clipped.tolist() == [[True, False]]
    assert loss.tolist()[0] == pytest.approx([0.8, 0.9])
    # a large ratio with a negative advantage is never clipped (pessimistic bound keeps the gradient)
    _, _, clipped = per_token_policy_loss(logp[:, :1], old[:, :1], torch.tensor([-1.0], dtype=torch.float64), 0.2, 0.2)
    assert not clipped.any()


def test_gradient_is_zero_where_clipped():
    logp = torch.log(torch.tensor([[1.5, 1.1]], dtype=torch.float64)).requires_grad_(True)
    loss, _, _ = per_token_policy_loss(logp, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), 0.2, 0.2)
    loss.sum().backward()
    assert logp.grad[0, 0] == 0  # ratio 1.5 > 1.2 with A > 0: clipped, no gradient
    assert logp.grad[0, 1] == pytest.approx(-1.1)  # d(-ratio * A)/d logp = -ratio * A
