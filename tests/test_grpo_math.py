"""GRPO math against independent references written with plain Python loops and floats."""
import math
import random
import statistics

import pytest
import torch

from train_grpo import (aggregate_loss, choose_groups, compute_advantages, high_entropy_mask, informative_groups, k3_kl,
                        overlong_penalty, per_token_policy_loss, rollout_importance_weights)


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


# ---- GSPO, two-sided clip, bias-corrected KL, surrogate weights


def reference_gspo_loss(logp, old, adv, mask, eps_low, eps_high):
    """GSPO's objective (Zheng et al. 2025, arXiv:2507.18071), one completion at a time:
    s_i = (pi(o_i) / pi_old(o_i))^(1/|o_i|), J = 1/N sum_i min(s_i A_i, clip(s_i, 1-eps, 1+eps) A_i)."""
    total = 0.0
    for i in range(len(logp)):
        tokens = [t for t in range(len(logp[i])) if mask[i][t]]
        if not tokens:
            continue
        s = math.prod(math.exp(logp[i][t] - old[i][t]) for t in tokens) ** (1 / len(tokens))
        total += min(s * adv[i], min(max(s, 1 - eps_low), 1 + eps_high) * adv[i])
    return -total / len(logp)


def test_gspo_loss_and_gradient_match_the_paper():
    logp0, old, ref, adv, mask = random_batch(seed=2)
    g = torch.Generator().manual_seed(9)  # sequence ratios inside and outside [0.9, 1.1]
    old = logp0 + torch.randn(logp0.shape, generator=g, dtype=torch.float64) * 0.05 \
        + torch.tensor([0.2, -0.15, 0.0, 0.02, -0.3, 0.25, 0.01, -0.05], dtype=torch.float64)[:, None]
    eps = 0.1
    want = reference_gspo_loss(logp0.tolist(), old.tolist(), adv.tolist(), mask.tolist(), eps, eps)
    logp = logp0.clone().requires_grad_(True)
    per_token, _, clipped = per_token_policy_loss(logp, old, adv, eps, eps, mask=mask, importance_sampling_level="sequence")
    loss = aggregate_loss(per_token, mask, "grpo", logp.shape[0], int(mask.sum()), 7)
    assert loss.item() == pytest.approx(want, rel=1e-10)
    loss.backward()
    # the paper's gradient: -1/N A_i s_i / |o_i| on each token of an unclipped completion, 0 when clipped
    n_clipped = 0
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                assert logp.grad[i, t] == 0
                continue
            s = math.exp(sum((logp0[i, u] - old[i, u]).item() for u in range(n)) / n)
            a = adv[i].item()
            active = (s < 1 - eps and a < 0) or (s > 1 + eps and a > 0)
            n_clipped += active
            assert bool(clipped[i, t]) == active
            assert logp.grad[i, t].item() == pytest.approx(0.0 if active else -a * s / n / logp.shape[0], abs=1e-12)
    assert 0 < n_clipped < int(mask.sum())  # both cases were exercised


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_gradient_equals_token_level_when_a_sequence_shares_one_ratio(loss_type, beta):
    # (not with --use_bias_correction_kl: there the sequence ratio's gradient spreads each token's KL over
    # the whole completion, as in TRL)
    bias_correction = False
    logp0, _, ref, adv, mask = random_batch(seed=3)
    shift = torch.tensor([0.05, -0.3, 0.0, 0.2, 0.12, -0.01, 0.4, -0.08], dtype=torch.float64)  # some clipped
    old = logp0 - shift[:, None]  # every token of completion i has ratio exp(shift_i)
    grads, losses = [], []
    for level in ("token", "sequence"):
        logp = logp0.clone().requires_grad_(True)
        per_token, _, _ = per_token_policy_loss(logp, old, adv, 0.2, 0.28, ref, beta, mask=mask,
                                                importance_sampling_level=level, use_bias_correction_kl=bias_correction)
        loss = aggregate_loss(per_token, mask, loss_type, 8, int(mask.sum()), 10)
        loss.backward()
        grads.append(logp.grad)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-14)
    assert grads[0].abs().sum() > 0


def test_delta_is_the_dual_clip():
    """delta (TRL; INTELLECT-2) against the dual-clip objective written out (Ye et al. 2020,
    arXiv:1912.09729): A < 0: max(min(r A, clip(r) A), c A); A >= 0: the clipped surrogate."""
    g = torch.Generator().manual_seed(4)
    logp = torch.randn(6, 20, generator=g, dtype=torch.float64)
    old = logp - torch.randn(6, 20, generator=g, dtype=torch.float64)  # ratios from 0.05 to 20
    adv = torch.tensor([-2.0, -0.5, 1.0, 1.5, -1.0, 0.3], dtype=torch.float64)
    eps, c = 0.2, 3.0
    loss, _, clipped = per_token_policy_loss(logp, old, adv, eps, eps, delta=c)
    n_capped = 0
    for i in range(6):
        a = adv[i].item()
        for t in range(20):
            r = math.exp((logp[i, t] - old[i, t]).item())
            surrogate = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            objective = max(surrogate, c * a) if a < 0 else surrogate
            assert loss[i, t].item() == pytest.approx(-objective, rel=1e-12)
            n_capped += a < 0 and r > c
            assert bool(clipped[i, t]) == ((r < 1 - eps and a < 0) or (r > 1 + eps and a > 0) or (r > c and a < 0))
    assert n_capped > 3
    # without delta the same tokens' losses grow with the ratio
    plain, _, _ = per_token_policy_loss(logp, old, adv, eps, eps)
    assert (plain > loss + 1e-9).sum() == n_capped


def test_bias_corrected_kl_is_k3_times_the_ratio_with_the_reverse_kl_gradient():
    logp0, old, ref, adv, mask = random_batch(seed=5)
    _, kl, _ = per_token_policy_loss(logp0, old, adv, 0.2, 0.2, ref, 0.1, use_bias_correction_kl=True)
    for i, t in [(0, 0), (2, 3), (7, 6), (5, 1)]:
        r = math.exp((logp0[i, t] - old[i, t]).item())
        d = (ref[i, t] - logp0[i, t]).item()
        assert kl[i, t].item() == pytest.approx(r * (math.exp(d) - d - 1), rel=1e-12)
    # on-policy (old = logp, detached; zero advantage): d/d logp of beta * k3 * ratio is beta * (logp - ref)
    logp = logp0.clone().requires_grad_(True)
    loss, _, _ = per_token_policy_loss(logp, logp.detach(), torch.zeros(8, dtype=torch.float64), 0.2, 0.2, ref, 0.1,
                                       use_bias_correction_kl=True)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, 0.1 * (logp0 - ref), rtol=1e-12, atol=1e-14)
    logp.grad = None  # without the correction it is beta * (1 - pi_ref / pi): another estimator
    loss, _, _ = per_token_policy_loss(logp, logp.detach(), torch.zeros(8, dtype=torch.float64), 0.2, 0.2, ref, 0.1)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, 0.1 * (1 - torch.exp(ref - logp0)), rtol=1e-12, atol=1e-14)


def test_weights_scale_the_surrogate_and_not_the_kl():
    logp, old, ref, adv, mask = random_batch(seed=6)
    weights = torch.rand(logp.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weighted, kl, _ = per_token_policy_loss(logp, old, adv, 0.2, 0.28, ref, 0.04, weights=weights)
    plain, _, _ = per_token_policy_loss(logp, old, adv, 0.2, 0.28)
    torch.testing.assert_close(weighted, weights * plain + 0.04 * kl, rtol=1e-12, atol=1e-15)


# ---- top-entropy tokens, rollout correction, overlong penalty, dynamic sampling


def reference_quantile(values, q):
    """The q-quantile with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.77, 1.0])
def test_high_entropy_mask_keeps_the_top_rho_of_the_steps_tokens(rho):
    g = torch.Generator().manual_seed(7)
    entropy = torch.rand(8, 9, generator=g) * 5
    _, _, _, _, mask = random_batch(C=9)
    mask = mask.float()
    values = [entropy[i, t].item() for i in range(8) for t in range(9) if mask[i, t]]
    threshold = reference_quantile(values, 1 - rho)
    assert threshold == pytest.approx(torch.quantile(torch.tensor(values), 1 - rho).item(), rel=1e-6)
    got = high_entropy_mask(entropy, mask, rho)
    for i in range(8):
        for t in range(9):
            assert bool(got[i, t]) == (bool(mask[i, t]) and entropy[i, t].item() >= threshold - 1e-6)
    kept = int(got.sum())
    assert kept == len(values) - math.ceil((1 - rho) * (len(values) - 1) - 1e-9)  # distinct values: rho 0 keeps 1
    # two processes, each half of the rows: each one's mask with the other's tokens gathered is the whole step's
    halves = (slice(0, 4), slice(4, 8))
    for mine, other in (halves, halves[::-1]):
        gather = lambda t, o=other: torch.cat([t, entropy[o][mask[o].bool()]])  # noqa: E731
        assert torch.equal(high_entropy_mask(entropy[mine], mask[mine], rho, gather), got[mine])


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_rollout_importance_weights_match_a_loop(mode):
    g = torch.Generator().manual_seed(8)
    train = -torch.rand(5, 6, generator=g, dtype=torch.float64) * 3
    rollout = train + torch.randn(5, 6, generator=g, dtype=torch.float64) * 0.6
    rollout[4, :] = train[4, :] - 200.0  # a sequence whose product overflows: masked to 0, not nan
    mask = torch.ones(5, 6, dtype=torch.float64)
    mask[1, 3:] = 0
    clip = 2.0
    weights, cut = rollout_importance_weights(train.requires_grad_(True), rollout, mask, mode, clip)
    assert not weights.requires_grad and torch.isfinite(weights).all()
    for i in range(5):
        sequence_log = sum((train[i, t] - rollout[i, t]).item() for t in range(6) if mask[i, t])
        for t in range(6):
            if not mask[i, t] and mode.startswith("token"):
                continue
            log_rho = sequence_log if mode.startswith("sequence") else (train[i, t] - rollout[i, t]).item()
            rho = math.exp(min(log_rho, 700))
            want = min(rho, clip) if mode.endswith("truncate") else (rho if rho <= clip else 0.0)
            assert weights[i, t].item() == pytest.approx(want, rel=1e-12), (i, t)
            assert bool(cut[i, t]) == (rho > clip)
    assert cut.any() and (~cut).any()


def test_overlong_penalty_is_daPOs_piecewise_reward():
    """DAPO (arXiv:2503.14476): 0 for |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to
    L_max, -1 beyond; times the penalty factor."""
    L_max, L_cache, factor = 20, 6, 0.5
    lengths = torch.arange(0, L_max + 1)
    got = overlong_penalty(lengths, L_max, L_cache, factor).tolist()
    for y, value in zip(lengths.tolist(), got):
        want = 0.0 if y <= L_max - L_cache else ((L_max - L_cache) - y) / L_cache if y <= L_max else -1.0
        assert value == pytest.approx(factor * want, abs=1e-7)
    assert got[-1] == pytest.approx(-factor) and got[0] == 0 and str(got[0]) == "0.0"


def test_dynamic_sampling_keeps_informative_groups_in_order_then_fills():
    G = 3
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.2, 2, 2, 2, 1, 0, 1], dtype=torch.float32)
    informative = informative_groups(rewards, G)
    groups = [rewards[i:i + G].tolist() for i in range(0, len(rewards), G)]
    assert informative.tolist() == [len(set(g)) > 1 for g in groups] == [False, True, False, True, False, True]
    assert choose_groups(informative, 2).tolist() == [1, 3]  # the first two whose rewards differ
    assert choose_groups(informative, 3).tolist() == [1, 3, 5]
    assert choose_groups(informative, 5).tolist() == [0, 1, 2, 3, 5]  # short: the first others fill, in order
    assert choose_groups(torch.zeros(4, dtype=torch.bool), 2).tolist() == [0, 1]
