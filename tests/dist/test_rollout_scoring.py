"""The rollout rank's overlapped scoring (rollout.GroupScorer) gives exactly the trajectories that inline
score() gives, timeouts included, never holds more than max_pending requests unscored, and collect() does not
wait for math-verify."""

import pytest
import torch

import reward_math as rm
from buffer import Trajectory
from generator import RequestOutput
from reward_math import ScoreLimits, score
from rollout import GroupScorer

torch.set_num_threads(1)
PATIENT = ScoreLimits(timeout_s=30.0)  # the equivalence test judges verdicts, not speed: no timeouts under load
POWER_TOWER = "\\boxed{10^{10^{10^{10}}}}"  # sympy evaluates integer powers eagerly: never finishes
G, CORRECT, WRONG = 4, 5.0, -5.0

# group_id -> (gold, G responses): fast path, no answer, math-verify (right and wrong), repeats (cache hits)
GROUPS = {
    10: ("18", ["#### 18", "\\boxed{19}", "no idea", "The answer is 18."]),
    11: ("\\frac{1}{2}", ["\\boxed{0.5}", "\\boxed{\\frac{2}{4}}", "\\boxed{\\frac{1}{3}}", "\\boxed{\\frac{2}{4}}"]),
    12: ("x^2+2x+1", ["\\boxed{(x+1)^2}", "\\boxed{x^2+1}", "\\boxed{\\{1,2\\}}", "\\boxed{((((x))))}"]),
    13: ("[0,1)", ["\\boxed{[0,1)}", "\\boxed{[0,1]}", "\\boxed{" + "{" * 40 + "}" * 40 + "}", "#### 1"]),
}


def finished(group_id: int, sample_idx: int, response: str) -> RequestOutput:
    """A finished request as the generator returns it; the response text stands in for its decoded tokens."""
    tokens = [ord(c) % 97 for c in response[:16]]
    return RequestOutput(
        request_id=(group_id, sample_idx),
        prompt_ids=[1, group_id],
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),
        versions=[3] * len(tokens),
        finish_reason="stop",
    )


def inline_group(group_id: int, prompt_id: int, gold: str, responses: list[str], limits: ScoreLimits) -> list[dict]:
    """The reference: score() on each finished request, as a loop scoring inline would."""
    trajs = []
    for s, response in enumerate(responses):
        out = finished(group_id, s, response)
        correct = score(response, gold, limits) > 0
        trajs.append(
            Trajectory(
                prompt_id=prompt_id,
                sample_idx=s,
                prompt_ids=list(out.prompt_ids),
                response_ids=list(out.token_ids),
                behav_logprobs=list(out.logprobs),
                versions=list(out.versions),
                reward=CORRECT if correct else WRONG,
                finish_reason=out.finish_reason,
                group_id=group_id,
                correct=correct,
            ).to_dict()
        )
    return trajs


def overlapped(groups: dict, limits: ScoreLimits, max_pending: int = 64) -> dict[int, list[dict]]:
    """Samples finish interleaved across groups, as from one decode batch; groups are collected as they complete."""
    results: dict[int, list[dict]] = {}

    def take(done):
        for group_id, trajs in done:
            assert group_id not in results, f"group {group_id} sent twice"
            results[group_id] = [t.to_dict() for t in trajs]

    scorer = GroupScorer(G, CORRECT, WRONG, max_pending, limits=limits)
    try:
        scorer.pool.wait_ready()
        for group_id in groups:
            scorer.open(group_id, prompt_id=group_id + 100)
        for s in range(G):
            for group_id, (gold, responses) in groups.items():
                scorer.submit(finished(group_id, s, responses[s]), responses[s], gold)
            take(scorer.collect())
        take(scorer.drain())
        assert scorer.pending == 0 and not scorer.groups
    finally:
        scorer.close()
    return results


def test_overlapped_scoring_equals_inline(monkeypatch):
    monkeypatch.setattr(rm, "_cache", rm._ResultCache())  # each path pays its own math-verify calls
    got = overlapped(GROUPS, PATIENT)
    monkeypatch.setattr(rm, "_cache", rm._ResultCache())
    want = {gid: inline_group(gid, gid + 100, gold, responses, PATIENT) for gid, (gold, responses) in GROUPS.items()}
    assert got == want
    assert [t["reward"] for t in got[11]] == [CORRECT, CORRECT, WRONG, CORRECT]  # the slow path really ran


def test_timeout_scores_as_inline(monkeypatch):
    groups = {20: ("5", [POWER_TOWER, "\\boxed{5}", "\\boxed{6}", "\\boxed{\\frac{10}{2}}"])}
    limits = ScoreLimits(timeout_s=1.0)
    monkeypatch.setattr(rm, "_cache", rm._ResultCache())
    got = overlapped(groups, limits)
    want = {20: inline_group(20, 120, *groups[20], limits)}
    assert got == want
    assert [t["correct"] for t in got[20]] == [False, True, False, True]
    assert got[20][0]["reward"] == WRONG


def test_collect_never_waits_for_math_verify(monkeypatch):
    """A group scored on the fast path is collected while another's math-verify job is still running (one that
    never finishes within its limit), so the decode loop goes on."""
    monkeypatch.setattr(rm, "_cache", rm._ResultCache())  # no verdict cached by an earlier test
    scorer = GroupScorer(2, CORRECT, WRONG, max_pending=8, limits=PATIENT)
    try:
        scorer.pool.wait_ready()
        scorer.open(1, 0)
        scorer.open(2, 0)
        scorer.submit(finished(2, 0, "s"), POWER_TOWER, "5")  # math-verify: busy for PATIENT's 30 s
        scorer.submit(finished(1, 0, "a"), "#### 4", "4")  # fast path: scored inline
        scorer.submit(finished(1, 1, "b"), "#### 5", "4")
        first = scorer.collect()
        assert [gid for gid, _ in first] == [1] and [t.reward for t in first[0][1]] == [CORRECT, WRONG]
        assert scorer.pending == 1  # the power tower is still being scored
    finally:
        scorer.close()


def test_pending_scores_are_bounded():
    waits = []
    scorer = GroupScorer(5, CORRECT, WRONG, max_pending=2, limits=PATIENT, on_wait=lambda: waits.append(1))
    pending_at_submit = []
    real_submit = scorer.pool.submit

    def submit(*args):
        pending_at_submit.append(scorer.pending)
        real_submit(*args)

    scorer.pool.submit = submit
    try:
        scorer.pool.wait_ready()
        scorer.open(7, 0)
        for k in range(1, 6):  # distinct math-verify jobs: no cache hits, each takes a worker round trip
            scorer.submit(finished(7, k - 1, str(k)), f"\\boxed{{\\frac{{{k}}}{{{3 * k}}}}}", "\\frac{1}{3}")
            assert scorer.pending <= 2
        assert max(pending_at_submit) <= 1 and waits  # the third submit onwards waited for a score first
        [(group_id, trajs)] = scorer.drain()
        assert group_id == 7 and [t.correct for t in trajs] == [True] * 5
    finally:
        scorer.close()
    with pytest.raises(ValueError, match="max_pending_scores"):
        GroupScorer(5, CORRECT, WRONG, max_pending=0)
