"""How far the randomized and sampled searches go: their whole budget under HEXRL_FULL_SEARCH=1 (.ci/run sets it, so
every CI run searches as far as written), a fifth of it otherwise, which keeps tests/unit a quick inner loop."""

import os

FULL_SEARCH = os.environ.get("HEXRL_FULL_SEARCH") == "1"


def budget(n: int) -> int:
    return n if FULL_SEARCH else max(2, n // 5)  # two cases at least (test_buffer: the odd seeds drop a rank)
