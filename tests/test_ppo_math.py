"""PPO math against independent references written with plain Python loops and floats."""
import math

import pytest
import torch

from train_ppo import compute_gae, per_token_kl, policy_loss, token_rewards, update_kl_coef, value_loss
from utils.ops import masked_whiten


def gae_reference(rewards, values, gamma, lam):
    """One sequence (no padding), textbook recursion written forwards: A_t = sum_l (gamma lam)^l delta_{t+l}."""
    n = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)]
    return [sum((gamma * lam) ** (l - t) * deltas[l] for l in range(t, n)) for t in range(n)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.0, 0.5), (0.7, 0.0), (1.0, 0.0)])
def test_gae_matches_reference_with_padding(gamma, lam):
    g = torch.Generator().manual_seed(0)
    B, C = 5, 9
    rewards = torch.randn(B, C, generator=g, dtype=torch.float64)
    values = torch.randn(B, C, generator=g, dtype=torch.float64)
    lengths = [9, 1, 4, 7, 2]
    mask = (torch.arange(C)[None] < torch.tensor(lengths)[:, None]).double()
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    for i, n in enumerate(lengths):
        want = gae_reference(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
        assert advantages[i, :n].tolist() == pytest.approx(want, rel=1e-10, abs=1e-12)
        assert advantages[i, n:].abs().sum() == 0  # nothing leaks into padding
        assert returns[i, :n].tolist() == pytest.approx([a + v for a, v in zip(want, values[i, :n].tolist())])


def test_gae_edge_cases():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.2, 0.5, 0.7]], dtype=torch.float64)
    mask = torch.ones_like(rewards)
    adv, ret = compute_gae(rewards, values, mask, 1.0, 1.0)  # Monte Carlo: returns are the reward-to-go
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0])
    adv, ret = compute_gae(rewards, values, mask, 1.0, 0.0)  # TD(0): A_t = r_t + V_{t+1} - V_t
    assert adv[0].tolist() == pytest.approx([0.3, 0.2, 0.3])
    adv, _ = compute_gae(rewards, values, mask, 0.0, 0.95)  # gamma 0: A_t = r_t - V_t
    assert adv[0].tolist() == pytest.approx([-0.2, -0.5, 0.3])


def test_score_lands_on_last_non_pad_token_and_kl_everywhere_else():
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]).float()
    kl = torch.full((3, 5), 2.0)
    scores = torch.tensor([10.0, 20.0, 30.0])
    rewards = token_rewards(scores, kl * mask, mask, kl_coef=0.1)
    assert rewards.flatten().tolist() == pytest.approx([-0.2, -0.2, 9.8, 0, 0, 19.8, 0, 0, 0, 0,
                                                        -0.2, -0.2, -0.2, -0.2, 29.8])


def test_kl_estimators():
    logp = torch.log(torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64))
    ref = torch.log(torch.tensor([0.25, 0.2, 0.9], dtype=torch.float64))
    assert per_token_kl(logp, ref, "k1").tolist() == pytest.approx([math.log(2), math.log(0.5), 0.0])
    r = [0.5, 2.0, 1.0]  # pi_ref / pi
    assert per_token_kl(logp, ref, "k3").tolist() == pytest.approx([x - math.log(x) - 1 for x in r])


def test_policy_and_value_losses_against_loops():
    g = torch.Generator().manual_seed(1)
    B, C = 4, 6
    logp = -torch.rand(B, C, generator=g, dtype=torch.float64)
    old = logp + 0.4 * torch.randn(B, C, generator=g, dtype=torch.float64)
    adv = torch.randn(B, C, generator=g, dtype=torch.float64)
    values = torch.randn(B, C, generator=g, dtype=torch.float64)
    old_values = values + 0.5 * torch.randn(B, C, generator=g, dtype=torch.float64)
    returns = torch.randn(B, C, generator=g, dtype=torch.float64)
    mask = (torch.arange(C)[None] < torch.tensor([6, 3, 1, 5])[:, None]).double()
    n = int(mask.sum())
    eps, eps_v = 0.2, 0.3
    pg, pg_clip, vf, vf_clip, akl = 0.0, 0, 0.0, 0, 0.0
    for i in range(B):
        for t in range(C):
            if not mask[i, t]:
                continue
            ratio = math.exp(logp[i, t] - old[i, t])
            a = adv[i, t].item()
            pg += max(-a * ratio, -a * min(max(ratio, 1 - eps), 1 + eps))
            pg_clip += -a * min(max(ratio, 1 - eps), 1 + eps) > -a * ratio
            akl += 0.5 * (logp[i, t] - old[i, t]).item() ** 2
            v, v0, R = values[i, t].item(), old_values[i, t].item(), returns[i, t].item()
            vc = v0 + min(max(v - v0, -eps_v), eps_v)
            vf += 0.5 * max((v - R) ** 2, (vc - R) ** 2)
            vf_clip += (vc - R) ** 2 > (v - R) ** 2
    loss, clipped, approx_kl = policy_loss(logp, old, adv, mask, eps, n)
    assert loss.item() == pytest.approx(pg / n) and clipped.item() == pg_clip and approx_kl.item() == pytest.approx(akl)
    v_loss, v_clipped = value_loss(values, old_values, returns, mask, eps_v, n)
    assert v_loss.item() == pytest.approx(vf / n) and v_clipped.item() == vf_clip
    # micro-batches with the mini-batch's token count add up to the same loss
    parts = sum(policy_loss(logp[r], old[r], adv[r], mask[r], eps, n)[0].item() for r in (slice(0, 1), slice(1, 4)))
    assert parts == pytest.approx(pg / n)


def test_masked_whiten_uses_only_masked_entries():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    kept = [1.0, 2.0, 3.0, 4.0, 5.0]
    mean = sum(kept) / 5
    std = math.sqrt(sum((k - mean) ** 2 for k in kept) / 4)  # Bessel-corrected
    out = masked_whiten(x, mask)
    assert out[mask.bool()].tolist() == pytest.approx([(k - mean) / std for k in kept], rel=1e-6)
    assert out[~mask.bool()].abs().sum() == 0
    kept_mean = masked_whiten(x, mask, shift_mean=False)
    assert kept_mean[mask.bool()].tolist() == pytest.approx([(k - mean) / std + mean for k in kept], rel=1e-6)
    # two "processes" holding one row each whiten with the global statistics (all_reduce adds
    # the other process's share), so each row comes out as in the whole-batch whitening
    halves = [(x[:1], mask[:1]), (x[1:], mask[1:])]
    for i, (xi, mi) in enumerate(halves):
        other = halves[1 - i]
        got = masked_whiten(xi, mi, all_reduce=lambda t: t + _stats_like(t, other, xi, mi))
        assert got.flatten().tolist() == pytest.approx(out[i].tolist(), rel=1e-6)


def _stats_like(t, other, xi, mi):
    """The other process's contribution to the same statistic (first the [sum, count] pair, then
    the centered square sum around the global mean)."""
    ox, om = other
    if t.numel() == 2:
        return torch.stack([(ox * om).sum(), om.sum()]).to(t.dtype)
    total = (xi * mi).sum() + (ox * om).sum()
    mean = total / (mi.sum() + om.sum())
    return (((ox - mean) ** 2) * om).sum().reshape(1).to(t.dtype)


def test_adaptive_kl_controller():
    # Ziegler et al.: error clipped to +-0.2, coefficient scaled by 1 + error * n / horizon
    assert update_kl_coef(0.1, 12.0, 6.0, 100, 1000) == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    assert update_kl_coef(0.1, 6.6, 6.0, 100, 1000) == pytest.approx(0.1 * (1 + 0.1 * 0.1))
    assert update_kl_coef(0.1, 0.0, 6.0, 100, 1000) == pytest.approx(0.1 * (1 - 0.2 * 0.1))


def test_policy_loss_dual_clip_and_weights_match_a_loop():
    """--delta (dual clip, Ye et al. 2020, arXiv:1912.09729) and per-token weights (rollout correction)
    against the objective written out token by token: A < 0: max(min(r A, clip(r) A), c A)."""
    g = torch.Generator().manual_seed(11)
    logp = torch.randn(4, 12, generator=g, dtype=torch.float64)
    old = logp - torch.randn(4, 12, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 12, generator=g, dtype=torch.float64)
    weights = torch.rand(4, 12, generator=g, dtype=torch.float64)
    mask = torch.ones(4, 12, dtype=torch.float64)
    mask[2, 5:] = 0
    eps, c, num_tokens = 0.2, 2.5, 40.0
    loss, clipfrac, _ = policy_loss(logp, old, adv, mask, eps, num_tokens, delta=c, weights=weights)
    total, clipped = 0.0, 0
    for i in range(4):
        for t in range(12):
            if not mask[i, t]:
                continue
            r, a = math.exp((logp[i, t] - old[i, t]).item()), adv[i, t].item()
            surrogate = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            objective = max(surrogate, c * a) if a < 0 else surrogate
            total += -objective * weights[i, t].item()
            clipped += (r < 1 - eps and a < 0) or (r > 1 + eps and a > 0) or (r > c and a < 0)
    assert loss.item() == pytest.approx(total / num_tokens, rel=1e-12)
    assert clipfrac.item() == clipped
    plain, _, _ = policy_loss(logp, old, adv, mask, eps, num_tokens)
    assert plain.item() != pytest.approx(loss.item())


def test_rollout_weights_and_overlong_penalty_are_grpos():
    """The copies in train_ppo.py compute what train_grpo.py's do (tested there against loops)."""
    import train_grpo
    import train_ppo

    g = torch.Generator().manual_seed(12)
    train = -torch.rand(6, 7, generator=g) * 4
    rollout = train + torch.randn(6, 7, generator=g)
    mask = (torch.rand(6, 7, generator=g) > 0.2).float()
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        for a, b in zip(train_ppo.rollout_importance_weights(train, rollout, mask, mode, 2.0),
                        train_grpo.rollout_importance_weights(train, rollout, mask, mode, 2.0)):
            assert torch.equal(a, b), mode
    lengths = torch.arange(0, 33)
    assert torch.equal(train_ppo.overlong_penalty(lengths, 32, 8, 0.7), train_grpo.overlong_penalty(lengths, 32, 8, 0.7))
